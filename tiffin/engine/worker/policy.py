"""What a model runner does beyond prepare -> forward -> sample, decided once at start by one pure function of
the device, dtype, kernel backend, CPU features and engine settings."""

from dataclasses import dataclass

import torch

from tiffin.engine.config import EngineConfig


@dataclass(frozen=True)
class RunnerPolicy:
    size_threads: bool  # follow the CPU left to this process between steps (`ThreadSizer`)
    pad_prefills: bool  # steps with a prefill run `padded_tokens` rows, each size's GEMMs built at start
    warm_up_triton: bool  # launch every Triton variant a step can, before the engine reports ready
    capture_graphs: bool  # decode-only steps padded to captured sizes and replayed as CUDA graphs
    int8_quantized: bool  # quantized layers run the native int8 kernels (`cpu_quant_compute`)
    native_decode: bool  # decode-only steps of int8 models run natively, all layers in one call (`cpu_decode`)


def choose_policy(
    device: torch.device, dtype: torch.dtype, backend: str, has_amx: bool, config: EngineConfig, native: bool = True
) -> RunnerPolicy:
    """`native`: whether the native CPU kernels are built (a machine without a compiler runs the torch ones)."""
    cpu, single = device.type == "cpu", config.tensor_parallel_size == config.pipeline_parallel_size == 1
    int8 = cpu and backend == "torch" and native and config.cpu_quant_compute != "exact"
    return RunnerPolicy(
        int8_quantized=int8,
        # adapters add their deltas between the kernels; a tensor-parallel layer all-reduces between them
        native_decode=int8 and single and not config.enable_lora,
        # tensor-parallel and pipeline ranks keep their even split of the CPUs
        size_threads=cpu and single,
        # oneDNN builds an AMX kernel per new row count of a bf16/fp16 linear; LoRA maps adapters per real token
        pad_prefills=cpu and backend == "torch" and dtype != torch.float32 and has_amx and not config.enable_lora,
        # the interpreter compiles nothing; tensor-parallel ranks warm up in step (their forwards are collective)
        warm_up_triton=device.type == "cuda" and backend == "triton",
        # graphs pay where launches dominate; the torch attention (and LoRA) builds per-step host tensors
        capture_graphs=device.type == "cuda" and backend == "triton" and not config.enforce_eager,
    )

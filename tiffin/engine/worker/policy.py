"""What a model runner does beyond prepare -> forward -> sample, decided once at start by one pure function of
the device, dtype, kernel backend, CPU features and engine settings."""

from dataclasses import dataclass

import torch

from tiffin.engine.config import EngineConfig


@dataclass(frozen=True)
class RunnerPolicy:
    size_threads: bool  # follow the CPU left to this process between steps (`ThreadSizer`)
    pad_rows: bool  # every step and logits pass runs `padded_tokens` rows, every size's GEMMs built at start
    warm_up_triton: bool  # launch every Triton variant a step can, before the engine reports ready
    capture_graphs: bool  # decode-only steps padded to captured sizes and replayed as CUDA graphs
    int8_quantized: bool  # quantized layers run the native int8 kernels (`cpu_quant_compute`)
    native_decode: bool  # decode-only steps of int8 models run natively, all layers in one call (`cpu_decode`)


def choose_policy(
    device: torch.device, dtype: torch.dtype, backend: str, onednn: bool, config: EngineConfig, native: bool = True
) -> RunnerPolicy:
    """`onednn`: whether the model's plain CPU linears of `dtype` run through oneDNN (bf16/fp16, or fp32 where it
    beats MKL: `quant.base.prepacks_for_onednn`); `native`: whether the native CPU kernels are built (a machine
    without a compiler runs the torch ones)."""
    cpu, single = device.type == "cpu", config.tensor_parallel_size == config.pipeline_parallel_size == 1
    int8 = cpu and backend == "torch" and native and config.cpu_quant_compute != "exact"
    return RunnerPolicy(
        int8_quantized=int8,
        # adapters add their deltas between the kernels; a tensor-parallel layer all-reduces between them
        native_decode=int8 and single and not config.enable_lora,
        # tensor-parallel and pipeline ranks keep their even split of the CPUs
        size_threads=cpu and single,
        # oneDNN builds and keeps a kernel per new row count of a linear: memory that grows with the load's variety
        # (a pipeline stage computes its logits in `pipeline_stage`, unpadded)
        pad_rows=cpu and backend == "torch" and onednn and config.pipeline_parallel_size == 1,
        # the interpreter compiles nothing; tensor-parallel ranks warm up in step (their forwards are collective)
        warm_up_triton=device.type == "cuda" and backend == "triton",
        # graphs pay where launches dominate; the torch attention (and LoRA) builds per-step host tensors
        capture_graphs=device.type == "cuda" and backend == "triton" and not config.enforce_eager,
    )

"""How many kernels one decode layer launches in a captured decode graph, recorded by the CUDA emulation (every
aten op and Triton launch of the capture): a replay costs the GPU one launch each, and a small model's decode
step is bound by them (issue #25). A bf16-shaped llama run in fp16 (the interpreter computes bf16 wrongly; the
kernels launched are the same): llama plain and AWQ, and qwen3 (q/k RMSNorm).

Before the fused kernels: 33 plain (RMSNorm 8 ops twice, rotary 7, two residual adds, SiLU and mul), 39 AWQ (a
`sum` and `copy_` after each split-K GEMM). With them: 9 each (two norms, rotary + KV write, attention, SiLU-and-
mul, four GEMMs). Qwen3 took 12 (its q and k norms and their `cat` before the rotary) until the norms moved into
the rotary KV write: 9 as llama. A quantized (int8) cache took 26 (llama) and 29 (qwen3), its power-of-two
head dims roped and normed in torch, keys and queries rotated by the Hadamard matrix (`kv_quant`) in torch, then
the write kernel, until the fused kernel rotated them too: 9 as the plain cache."""

from pathlib import Path

import pytest

from tiffin import LLM
from tiffin.engine.worker.cuda_graphs import DecodeGraphs

QUANT = Path(__file__).parents[1] / "fixtures" / "quant"


def decode_layer_kernels(path, emu, size: int = 1, kv_cache_dtype: str = "auto") -> list[str]:
    """The kernels of the second decoder layer (the first also gathers the step's rotary rows for all layers) in
    the captured decode graph of `size` sequences."""
    options = dict(num_kv_blocks=16, max_model_len=64, kv_cache_dtype=kv_cache_dtype)
    llm = LLM(str(path), device="cuda", dtype="float16", enforce_eager=True, **options)
    runner = llm.llm_engine.model_runner
    layer = runner.model.model.layers[1]
    marks = []
    mark = lambda *_: marks.append(len(emu.capturing.nodes)) if emu.capturing is not None else None
    hooks = [layer.register_forward_pre_hook(mark), layer.register_forward_hook(mark)]
    graphs = DecodeGraphs([size], runner.device, runner.block_size, runner.num_blocks, runner.max_blocks_per_seq)
    try:
        graphs.capture(runner.model)
    finally:
        for hook in hooks:
            hook.remove()
    graph, _ = graphs.graphs[size]
    start, end = marks
    return graph.kernels()[start:end]


@pytest.mark.parametrize("model", ["llama", "qwen3", "awq"])
def test_decode_layer_kernel_count(tiny_model, cuda_emulation, no_warm_up, model):
    path = QUANT / "awq-g64" if model == "awq" else tiny_model(model)
    kernels = decode_layer_kernels(path, cuda_emulation)
    assert len(kernels) <= 12, kernels
    assert kernels.count("_paged_attention_kernel") == 1  # the window is one whole layer
    assert kernels.count("_rms_norm_kernel") == 2 and "aten.cat.default" not in kernels  # qwen3: q/k norm fused


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_quantized_cache_decode_layer_kernel_count(tiny_model, cuda_emulation, no_warm_up, model):
    """An int8 cache at the tiny models' power-of-two head dims: no more launches than the plain cache's 9."""
    plain = decode_layer_kernels(tiny_model(model), cuda_emulation)
    kernels = decode_layer_kernels(tiny_model(model), cuda_emulation, kv_cache_dtype="int8")
    assert len(kernels) <= len(plain) == 9, kernels
    assert kernels.count("_rotary_write_kv_kernel") == 1 and "aten.matmul.default" not in kernels

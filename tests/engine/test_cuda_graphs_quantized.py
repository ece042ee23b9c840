"""Decode graphs of quantized models under the CUDA emulation (`tiffin.testing.cuda_emulation`, Triton kernels
under the interpreter): quantized KV caches, AWQ/GPTQ, GGUF (legacy and K-quants), compressed-tensors and FP8
weights, captured and replayed, give the eager engine's tokens and logprobs; no size from the dense path's
DENSE_MIN_TOKENS on is captured. The unquantized half: test_cuda_graphs."""

from pathlib import Path

import pytest
from compressed_checkpoints import write_compressed
from gguf import GGMLQuantizationType as QType
from gguf_files import K_QUANT_MIX, K_SHAPES, write_gguf
from graph_runs import PROMPTS, assert_same, build, graphed_equals_eager

from tiffin import SamplingParams
from tiffin.engine.worker import cuda_graphs
from tiffin.kernels import triton_common as tc
from tiffin.kernels import triton_quant
from tiffin.kernels.quant import DENSE_MIN_TOKENS
from tiffin.tiny import make_tiny_model

QUANT = Path(__file__).parents[1] / "fixtures" / "quant"


@pytest.mark.parametrize("kv_cache_dtype", ["int8", pytest.param("fp8_e4m3", marks=pytest.mark.slow)])
def test_graphed_decode_equals_eager_quantized_kv_cache(tiny_model, cuda_emulation, no_warm_up, kv_cache_dtype):
    """Quantized KV caches (#28): the graphs replay the Triton kernels that write codes and scales (keys rotated
    after rope, in the fused rotary kernel) and read them back, through the scale tensors the layers held at
    capture."""
    with tc.recording_launches() as launched:
        graphed_equals_eager(tiny_model("llama"), cuda_emulation, dtype="float16", kv_cache_dtype=kv_cache_dtype)
    quantized = {name for name, kwargs, _ in launched if dict(kwargs).get("KV_CODES") or dict(kwargs).get("CODES")}
    assert quantized == {"_paged_attention_kernel", "_rotary_write_kv_kernel"}


@pytest.mark.slow
def test_graphed_decode_equals_eager_gptq(cuda_emulation, no_warm_up):
    """`_quant_gemm_kernel` captured and replayed with GPTQ's act-order permutation, the one format whose launch
    reads an extra index tensor (AWQ's zero points and Q8_0's codes are the same kernel's other constexprs, each
    checked against the reference in test_quant_kernels; one replay per kernel keeps the interpreter's time)."""
    graphed_equals_eager(QUANT / "gptq-4bit-g64-actorder-sym", cuda_emulation, dtype="float16")


@pytest.mark.slow
def test_graphed_decode_equals_eager_gguf_q4_0(cuda_emulation, no_warm_up, tmp_path):
    # a vocabulary of 512: the quantized lm_head's GEMM launches a quarter of the tiny model's programs
    path = write_gguf(make_tiny_model(tmp_path / "tiny", vocab_size=512), tmp_path / "Q4_0.gguf", QType.Q4_0)
    graphed_equals_eager(path, cuda_emulation)


@pytest.mark.slow
def test_graphed_decode_equals_eager_gguf_k_quants(cuda_emulation, no_warm_up, tmp_path):
    """The block layout's Triton GEMM, captured and replayed: one layer of K_QUANT_MIX's (Q4_K, Q5_K and Q6_K, both
    super-block kinds; Q5_0 beside Q5_1; q/k and v, gate and up of different types) and its Q6_K embedding. An
    intermediate size of one super-block (256, not K_SHAPES' 512), at 4/5 of the CPU: gate, up and down, the GEMMs
    it shapes, have 8 or more output tiles either way, so split K as with 512 (not at all); decoding a second
    super-block, which graphed and eager share, is test_block_gemm's (the Triton kernel at K=512)."""
    shapes = K_SHAPES | dict(intermediate_size=256)
    hf = make_tiny_model(tmp_path / "tiny", vocab_size=512, num_hidden_layers=1, **shapes)
    types = {name: qtype for name, qtype in K_QUANT_MIX.items() if not name.startswith("blk.1.")}
    graphed_equals_eager(write_gguf(hf, tmp_path / "mixed.gguf", QType.Q4_K, types=types), cuda_emulation)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w4a16-asym-channel", "w8a8-int", "fp8-block", "fp8 at load"])
def test_graphed_decode_equals_eager_compressed_tensors_and_fp8(cuda_emulation, no_warm_up, tmp_path, name):
    """compressed-tensors' integer weights (zero points) and FP8 weights (a compressed-tensors block checkpoint,
    `quantization="fp8"`) in the block layout's Triton GEMM, captured and replayed."""
    hf = make_tiny_model(tmp_path / "tiny", vocab_size=512, num_hidden_layers=1, hidden_size=128, intermediate_size=192)
    if name == "fp8 at load":
        graphed_equals_eager(hf, cuda_emulation, quantization="fp8")
    else:
        graphed_equals_eager(write_compressed(hf, tmp_path / name, name), cuda_emulation)


@pytest.mark.slow
def test_quantized_graphs_stop_below_the_dense_path(cuda_emulation, no_warm_up, monkeypatch):
    """A quantized model captures no size from DENSE_MIN_TOKENS on: there its GEMMs dequantize whole weights (a
    GGUF lm_head's is gigabytes), which a graph would keep in its pool. With DENSE_MIN_TOKENS at 8 here (256 in
    serving: the same code path, 32 times fewer rows under the interpreter), max_num_seqs=8 captures 1, 2 and 4;
    the decode step of 8 sequences runs eagerly, unpadded, through the one-pass dequantize, and gives the eager
    engine's tokens. Before, size DENSE_MIN_TOKENS was captured with the torch dequantizers inside (and failed to
    start once: `torch.tensor(AWQ_NIBBLE, device=...)`, a pageable upload, inside the capture)."""
    assert DENSE_MIN_TOKENS == 256
    dense = 8
    monkeypatch.setattr(cuda_graphs, "DENSE_MIN_TOKENS", dense)
    monkeypatch.setattr(triton_quant, "DENSE_MIN_TOKENS", dense)
    kwargs = dict(max_num_seqs=dense)  # fp32: the dense and fused GEMMs agree to rounding
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=2, ignore_eos=True)
    prompts = PROMPTS + ["a"] * (dense - len(PROMPTS))
    run = lambda llm: [
        (c.token_ids, c.logprobs) for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs
    ]
    want = run(build(QUANT / "awq-g64", eager=True, **kwargs))
    llm = build(QUANT / "awq-g64", eager=False, **kwargs)
    graphs = llm.llm_engine.model_runner.decode_graphs
    assert sorted(graphs.graphs) == graphs.sizes == [1, 2, 4]
    replays = cuda_emulation.replays
    with tc.recording_launches() as launched:
        assert_same(run(llm), want)
    assert cuda_emulation.replays == replays
    assert "_dequantize_kernel" in {name for name, _, _ in launched}

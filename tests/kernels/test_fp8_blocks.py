"""FP8 weights (kind FP8: e4m3 codes, an fp32 scale a row and block) on the native CPU kernels: the bf16 GEMM against
`block_gemm_reference` (the same bf16 roundings of weight and activations: only the order of the fp32 sums differs),
with every finite e4m3 code, subnormals and negatives included; the embedding lookup exactly; the fused decode step
of a model with FP8 projections against its torch step; the fallbacks where the CPU has no AVX-512 BF16."""

import itertools

import pytest
import torch
from decode_steps import decode_inputs
from gguf import GGMLQuantizationType as QType
from gguf_files import write_gguf

from tiffin.kernels import block_gemm as ig
from tiffin.kernels import cpu_native

native = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler: the native kernels are not built")
bf16 = pytest.mark.skipif(
    cpu_native.library() is None or cpu_native.bf16_min_rows() is None,
    reason="no native bf16 GEMM (no C++ compiler, or a CPU without AVX-512 BF16): FP8 runs the reference",
)
FINITE = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7f / 0xff: NaN
SUBNORMAL = torch.tensor([c for c in range(256) if c & 0x78 == 0], dtype=torch.uint8)  # exponent 0: m 2^-9, +-0
SHAPES = [(k, n) for k in (32, 96, 1024) for n in (37, 100)]


def fp8_weight(n: int, k: int, seed: int, subnormal_rows: int = 0) -> ig.BlockWeights:
    """Every finite e4m3 code somewhere (where N * K holds them all), the rest random finite ones; the first
    `subnormal_rows` rows of subnormal codes only (their outputs made of nothing else); scales varying by row and
    block over 2^-10..2^-2."""
    g = torch.Generator().manual_seed(seed)
    codes = FINITE[torch.randint(0, len(FINITE), (n, k), generator=g)]
    flat = codes.view(-1)
    flat[torch.randperm(len(flat), generator=g)[: len(FINITE)]] = FINITE[: len(flat)]
    codes[:subnormal_rows] = SUBNORMAL[torch.randint(0, len(SUBNORMAL), (subnormal_rows, k), generator=g)]
    scales = torch.exp2(torch.rand(n, k // 32, generator=g) * 8 - 10) * (1 + torch.rand(n, k // 32, generator=g))
    return ig.pack_fp8(codes, scales)


def assert_reference(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """`got` is bf16(x) @ bf16(weight).T up to the order of fp32 sums, element by element: two orders of K terms
    differ by at most 2 K 2^-24 of the sum of their magnitudes (so a row of tiny weights, subnormal codes, is held
    to its own size, not the largest output's), plus the rounding to got's dtype."""
    xb, wb = x.bfloat16().float(), weight.bfloat16().float()
    want = xb @ wb.T
    bound = 2 * x.shape[1] * 2**-24 * (xb.abs() @ wb.abs().T)
    if got.dtype != torch.float32:
        info = torch.finfo(got.dtype)
        bound += info.eps * want.abs() + info.smallest_normal * info.eps  # an ulp (of a subnormal too)
    err = (got.float() - want).abs()
    assert (err <= bound).all(), f"{int((err > bound).sum())} outputs off, worst {float((err - bound).max())}"


@pytest.fixture
def threads():
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


@bf16
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_native_kernel_is_the_reference_arithmetic(dtype, num_threads, threads):
    threads(num_threads)
    for (k, n), m in itertools.product(SHAPES, [1, 3, 7, 64, 130]):  # 1..4 rows in registers, 64 and 130 staged
        w = fp8_weight(n, k, seed=k + n, subnormal_rows=3)
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 3).to(dtype)
        x[0, :32] = 0
        got = ig.block_gemm(x, w)
        assert got.dtype == dtype and got.shape == (m, n)
        assert_reference(got, x, ig.dequantize_blocks(w))
        if dtype == torch.float32:  # block_gemm_reference is that arithmetic
            want = ig.block_gemm_reference(x, w)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


@bf16
def test_the_check_catches_misdecoded_subnormals(threads):
    """The tolerance is tight enough that subnormal codes decoded as zero, or as normals (an implicit leading one),
    fail it: rows of subnormal codes only, held to their own size."""
    threads(1)
    w = fp8_weight(37, 1024, seed=5, subnormal_rows=16)
    x = torch.randn(7, 1024, generator=torch.Generator().manual_seed(1))
    got, weight = ig.block_gemm(x, w)[:, :16], ig.dequantize_blocks(w)[:16]
    assert_reference(got, x, weight)
    d = ig.factors(w)[0][:16].repeat_interleave(32, 1)
    codes = ig.unpack_codes(w)[:16].int()
    mantissa, sign = (codes & 7).float(), 1 - 2 * (codes >> 7).float()
    for wrong in (torch.zeros_like(weight), sign * (8 + mantissa) * 2**-10 * d):  # flushed; with a leading one
        with pytest.raises(AssertionError):
            assert_reference(got, x, wrong)


@bf16
def test_subnormals_hold_with_denormals_flushed(threads):
    """The process may run with DAZ / FTZ (torch.set_flush_denormal): the decoding never passes e4m3's subnormals
    through fp32 denormals. One thread: the kernel runs on this thread, under its MXCSR."""
    threads(1)
    codes = SUBNORMAL.repeat(16, 2)  # [16, 32]: each subnormal code (and +-0) in every row
    w = ig.pack_fp8(codes, torch.ones(16, 1))
    exact = codes.view(torch.float8_e4m3fn).float()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = ig.block_gemm(torch.eye(32), w)  # row i: input i's weights, exactly (bf16 holds them)
        rows = cpu_native.dequantize_rows(ig.native_weights(w), 32, torch.arange(16))
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got.T, exact) and torch.equal(rows, exact)


@native
def test_dequantize_rows_is_exact():
    w = fp8_weight(37, 1024, seed=3, subnormal_rows=2)
    rows = torch.tensor([0, 1, 36, 5, 16, 0])
    got = cpu_native.dequantize_rows(ig.native_weights(w), 1024, rows)
    assert torch.equal(got, ig.dequantize_blocks(w)[rows])  # the torch path: float8_e4m3fn's own conversion
    every = ig.pack_fp8(torch.arange(256, dtype=torch.uint8).view(1, 256), torch.full((1, 8), 0.375))
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float() * 0.375
    got = cpu_native.dequantize_rows(ig.native_weights(every), 256, torch.tensor([0]))[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # 0x7f, 0xff: NaN


@native
def test_without_bf16_dot_products_fp8_runs_the_reference(monkeypatch):
    """Where the CPU has no AVX-512 BF16 the kernels refuse FP8 (no integer kernels read e4m3): block_gemm takes the
    reference for its FP8 parts, the native kernels for the others."""
    w8 = fp8_weight(37, 96, seed=1)
    g = torch.Generator().manual_seed(2)
    q8 = ig.pack_codes(torch.randint(0, 256, (20, 96), dtype=torch.uint8, generator=g), torch.rand(20, 3) * 0.01,
                       torch.rand(20, 3) * -1, 8)  # fmt: skip
    stacked = ig.StackedBlocks([w8, q8])
    x = torch.randn(3, 96, generator=g).bfloat16()
    native_q8 = ig.block_gemm(x, q8)
    monkeypatch.setattr(cpu_native, "bf16_min_rows", lambda: None)
    got = ig.block_gemm(x, stacked)
    assert torch.equal(got[:, :37], ig.block_gemm_reference(x, w8).bfloat16())
    assert torch.equal(got[:, 37:], native_q8)


def fp8_from(weight: torch.Tensor) -> ig.BlockWeights:
    """A float weight `[N, K]` as FP8: an e4m3 code a weight, scaled to 448 a row and block."""
    n, k = weight.shape
    blocks = weight.view(n, k // 32, 32)
    scales = (blocks.abs().amax(-1) / 448).clamp_min(2**-20)
    return ig.pack_fp8((blocks / scales[..., None]).view(n, k).to(torch.float8_e4m3fn), scales)


@pytest.fixture(scope="module")
def fp8_llm(tiny_model, tmp_path_factory):
    """A tiny Llama whose q/k/v (three FP8 parts), gate/up and down projections are FP8, o_proj Q8_0 on the integer
    kernels; the engine's fused decode step built for it again."""
    from tiffin import LLM
    from tiffin.engine.worker.cpu_decode import CpuDecoder

    path = write_gguf(tiny_model("llama"), tmp_path_factory.mktemp("fp8") / "llama.gguf", QType.Q8_0)
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=16)
    runner = llm.llm_engine.model_runner
    for layer in runner.model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        qkv = ig.dequantize_blocks(a.qkv_proj.blocks).split([q, kv, kv])
        a.qkv_proj.blocks = ig.StackedBlocks([fp8_from(rows) for rows in qkv])
        for linear in (mlp.gate_up_proj, mlp.down_proj):
            linear.blocks = fp8_from(ig.dequantize_blocks(linear.blocks))
    runner.cpu_decoder = CpuDecoder.build(runner.model, runner.block_size)
    return llm


@bf16
def test_fused_decode_step_with_fp8_layers_is_the_torch_step(fp8_llm):
    """The fused batch-1 step (cpu_decode.cpp) calls the same block GEMM per part: bit for bit the torch step."""
    runner = fp8_llm.llm_engine.model_runner
    assert runner.cpu_decoder is not None
    for prompts in ([[5, 9, 300, 17, 1200, 44, 8]], [[5, 9, 300, 17], [1, 2, 3, 4], list(range(100, 140))]):
        inputs = decode_inputs(fp8_llm, prompts)
        with torch.inference_mode():
            want = runner.model(inputs.input_ids, inputs.positions, inputs.attn)
            got = runner.cpu_decoder(inputs.input_ids, inputs.positions, inputs.attn)
        assert torch.equal(got, want)


@native
def test_fused_decode_step_declines_fp8_without_bf16(fp8_llm, monkeypatch):
    from tiffin.engine.worker.cpu_decode import CpuDecoder

    runner = fp8_llm.llm_engine.model_runner
    monkeypatch.setattr(cpu_native, "bf16_min_rows", lambda: None)
    assert CpuDecoder.build(runner.model, runner.block_size) is None

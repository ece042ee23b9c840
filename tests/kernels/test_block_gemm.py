"""The block GEMMs of quantized layers on CPU: the native kernels against the torch reference of the same
arithmetic (exact integer block dot products at one or two activation levels, or bf16 dot products; fp32 sums), the
reference against float64 algebra on the dequantized weight and activations, and the repacking of GGUF / AWQ /
GPTQ weights against each format's own dequantization."""

import itertools
import os
import platform
import shutil
import subprocess

import pytest
import torch

from tiffin.kernels import block_gemm as ig
from tiffin.kernels import cpu_native
from tiffin.kernels.quant import awq_dequantize, gguf_dequantize, gptq_dequantize, unpack_awq, unpack_cols, unpack_rows

native = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler: the native kernels are not built")
# (M, K, N); 50 and 300 rows leave AMX a partial tile
SHAPES = [(1, 64, 1), (1, 576, 960), (3, 96, 17), (7, 1056, 33), (50, 1088, 100), (64, 1536, 40), (300, 544, 7)]
# the super-block kinds' K: whole super-blocks of 256
SUPER_SHAPES = [(1, 256, 1), (1, 1536, 576), (3, 512, 17), (7, 768, 33), (50, 256, 100), (300, 512, 7)]
FORMATS = sorted(f for f in ig.FORMATS if f[1] != ig.FP8)  # (bits, kind) of integer codes; FP8: test_fp8_blocks*.py
KIND_NAMES = ["blocks", "mins", "centred", "fp8", "codebook", "super-codebook", "mins16"]
FORMAT_IDS = [f"{bits}bit-{KIND_NAMES[kind]}" for bits, kind in FORMATS]


def random_blocks(n: int, k: int, bits: int, seed: int, levels: int = 1, kind: int = ig.BLOCKS) -> ig.BlockWeights:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    if kind == ig.SUPER_MINS:
        sub = lambda: torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=g)
        d, dmin = (
            (torch.rand(n, k // 256, generator=g) * 1e-3).half(),
            (torch.rand(n, k // 256, generator=g) * 1e-3).half(),
        )
        return ig.pack_super(codes, sub(), sub(), d, dmin, bits, levels)
    if kind in (ig.SUPER_CENTRED, ig.SUPER_CODEBOOK):
        per = 16 if kind == ig.SUPER_CENTRED else 32
        sub = torch.randint(-128, 128, (n, k // per), dtype=torch.int8, generator=g)
        d = (torch.rand(n, k // 256, generator=g) * 1e-3).half()
        return ig.pack_super(codes, sub, None, d, None, bits, levels, kind)
    if kind == ig.SUPER_MINS16:
        sub = torch.randint(0, 256, (n, k // 16), dtype=torch.uint8, generator=g)
        d, dmin = (torch.rand(2, n, k // 256, generator=g) * 1e-3).half()
        return ig.pack_super(codes, sub, None, d, dmin, bits, levels, kind)
    if kind == ig.CODEBOOK:
        return ig.pack_codebook(codes, (torch.rand(n, k // 32, generator=g) * 0.02).half(), levels)
    scales = torch.rand(n, k // 32, generator=g) * 0.02
    offsets = -(2 ** (bits - 1)) * scales * torch.rand(n, k // 32, generator=g)
    return ig.pack_codes(codes, scales, offsets, bits, levels)


def shapes(kind: int) -> list[tuple[int, int, int]]:
    return SHAPES if kind in (ig.BLOCKS, ig.CODEBOOK) else SUPER_SHAPES


@native
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("bits, kind", FORMATS, ids=FORMAT_IDS)
def test_native_kernel_is_the_reference_arithmetic(bits, kind, levels):
    for m, k, n in shapes(kind):
        w = random_blocks(n, k, bits, seed=m + k + n, levels=levels, kind=kind)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3
        x[0, :32] = 0  # a block of zeros: scale 0
        want = ig.block_gemm_reference(x, w)
        # the kernels sum partial dot products in fp32 where the reference sums exact totals, or in another order:
        # the two differ by fp32 roundings of terms as large as the largest output
        torch.testing.assert_close(ig.block_gemm(x, w), want, rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("bits, kind", FORMATS, ids=FORMAT_IDS)
def test_layout_round_trips_codes_and_factors(bits, kind):
    """What the packers take is what the unpackers give back: codes, and each sub-block's d and m."""
    n, k, g = 37, 512, torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=g)
    if kind == ig.BLOCKS:
        d, m = torch.rand(n, k // 32, generator=g).half(), -torch.rand(n, k // 32, generator=g).half()
        w = ig.pack_codes(codes, d, m, bits)
        want_d, want_m = d.float(), m.float()
    elif kind == ig.SUPER_MINS:
        sc, mn = torch.randint(0, 64, (2, n, k // 32), dtype=torch.uint8, generator=g)
        d, dmin = torch.rand(2, n, k // 256, generator=g).half()
        w = ig.pack_super(codes, sc, mn, d, dmin, bits)
        want_d = d.float().repeat_interleave(8, 1) * sc.float()
        want_m = -dmin.float().repeat_interleave(8, 1) * mn.float()
    elif kind == ig.CODEBOOK:
        d = torch.rand(n, k // 32, generator=g).half()
        w = ig.pack_codebook(codes, d)
        want_d, want_m = d.float(), -128 * d.float()
    elif kind == ig.SUPER_MINS16:
        sub = torch.randint(0, 256, (n, k // 16), dtype=torch.uint8, generator=g)
        d, dmin = torch.rand(2, n, k // 256, generator=g).half()
        w = ig.pack_super(codes, sub, None, d, dmin, bits, kind=kind)
        want_d = d.float().repeat_interleave(16, 1) * (sub & 15).float()
        want_m = -dmin.float().repeat_interleave(16, 1) * (sub >> 4).float()
    else:  # a signed scale a half-block (SUPER_CENTRED) or block (SUPER_CODEBOOK)
        sub = 16 if kind == ig.SUPER_CENTRED else 32
        sc, d = torch.randint(-128, 128, (n, k // sub), dtype=torch.int8, generator=g), torch.rand(n, k // 256).half()
        w = ig.pack_super(codes, sc, None, d, None, bits, kind=kind)
        want_d = d.float().repeat_interleave(256 // sub, 1) * sc.float()
        want_m = (-128 if kind == ig.SUPER_CODEBOOK else -(2 ** (bits - 1))) * want_d
    assert torch.equal(ig.unpack_codes(w), codes)
    rows = torch.tensor([36, 0, 17, 17])
    assert torch.equal(ig.unpack_codes(w, rows), codes[rows])
    got_d, got_m = ig.factors(w)
    assert torch.equal(got_d, want_d) and torch.equal(got_m, want_m)


@native
@pytest.mark.parametrize("bits, kind", FORMATS, ids=FORMAT_IDS)
def test_prompt_sized_inputs_take_bf16_dot_products_at_two_levels(bits, kind):
    w2, w1 = (
        random_blocks(40, 1536, bits, seed=3, levels=2, kind=kind),
        random_blocks(40, 1536, bits, seed=3, kind=kind),
    )
    rows = cpu_native.bf16_min_rows() or 32
    small, large = torch.randn(rows - 1, 1536), torch.randn(rows + 19, 1536)
    assert ig.in_bf16(large, w2) == (cpu_native.bf16_min_rows() is not None)
    assert not ig.in_bf16(small, w2) and not ig.in_bf16(large, w1)
    assert_kernel_arithmetic(large, w2)


def assert_kernel_arithmetic(x: torch.Tensor, w) -> None:
    """`block_gemm(x, w)` against its arithmetic in float64: bf16 operands where it takes bf16 dot products (fp32
    roundings apart), else the integer dot products of 15-bit activations (`block_gemm_reference`, fp32)."""
    if ig.in_bf16(x, w):
        want = x.bfloat16().double() @ ig.dequantize_blocks(w).bfloat16().double().T
    else:  # a CPU without AVX-512 BF16
        want = ig.block_gemm_reference(x, w).double()
    got = ig.block_gemm(x, w).double()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


@native
@pytest.mark.parametrize("threads", [1, 2])
def test_prompt_sized_inputs_with_a_short_last_chunk(threads):
    """K = 3072 is 96 AMX steps, chunks of 64 then 32: the chunk decoded during the longer one must not be fed as if
    it were the longer (it wrote twice its blocks past its buffer: heap corruption, an abort a few calls later)."""
    w, before = random_blocks(200, 3072, 4, seed=1, levels=2), torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for m in (16, 20, 40, 20, 16):
            x = torch.randn(m, 3072, generator=torch.Generator().manual_seed(m))
            assert_kernel_arithmetic(x, w)
            garbage = [torch.empty(1000) for _ in range(50)]  # fresh allocations, where a corrupt heap aborts
            del garbage
    finally:
        torch.set_num_threads(before)


@native
@pytest.mark.parametrize("bits, kind", FORMATS, ids=FORMAT_IDS)
def test_native_row_lookup_is_the_dequantized_weight(bits, kind):
    w, rows = random_blocks(40, 256, bits, seed=5, kind=kind), torch.tensor([0, 17, 39, 17])
    want = ig.dequantize_blocks(w)[rows]  # the whole weight, in torch
    # `q * d + m` fused or not: one rounding apart (GGUF's blocks are exact either way)
    torch.testing.assert_close(ig.dequantize_blocks(w, rows), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


@native
def test_prompt_sized_steps_take_the_matrix_units_where_the_cpu_has_them():
    amx = cpu_native.library().tiffin_quant_kernels().decode().count("AMX") == 1
    wanted = os.environ.get("TIFFIN_CPU_AMX") != "0"
    assert amx == (wanted and cpu_native.bf16_min_rows() is not None and torch.cpu._is_amx_tile_supported())


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_activations_in_and_out(dtype):
    w, x = random_blocks(48, 320, 4, seed=1), torch.randn(5, 320).to(dtype)
    got, want = ig.block_gemm(x, w), ig.block_gemm_reference(x, w)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=torch.finfo(dtype).eps, atol=1e-5 * float(want.abs().max()))


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_activation_quantization_is_bit_exact(dtype):
    x = (torch.randn(9, 352) * torch.logspace(-3, 3, 352)).to(dtype)
    x[1, 32:64] = 0
    for levels in (1, 2):
        q, q2, dx, sx, sxh = cpu_native.quantize_acts(x, levels)
        want_q, want_dx = ig.quantize_activations(x, levels)
        assert torch.equal(127 * q.int() + q2 if levels == 2 else q, want_q) and torch.equal(dx, want_dx)
        assert torch.equal(sx, want_dx * want_q.view(9, -1, 32).sum(-1).float())
        assert torch.equal(sxh, want_dx.repeat_interleave(2, 1) * want_q.view(9, -1, 16).sum(-1).float())
        assert int(q.abs().max()) == 127 and (0 < int(q2.abs().max()) <= 64 if levels == 2 else not q2.any())


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("bits, kind", FORMATS, ids=FORMAT_IDS)
def test_reference_is_the_product_of_the_dequantized_operands(bits, kind, levels):
    """Independent of the block bookkeeping: (qx * dx) @ (q * d + m)^T in float64, qx within half a step of x."""
    m, k, n = 4, 512, 24
    w, x = (
        random_blocks(n, k, bits, seed=7, levels=levels, kind=kind),
        torch.randn(m, k, generator=torch.Generator().manual_seed(1)),
    )
    qx, dx = ig.quantize_activations(x, levels)
    acts = (qx.view(m, -1, 32).double() * dx[..., None].double()).view(m, -1)
    # half a step, give or take the rounding of 1 / step
    assert ((acts - x.double()).abs().view(m, -1, 32) <= dx[..., None].double() * 0.5 * (1 + 1e-6)).all()
    want = acts @ ig.dequantize_blocks(w).double().T
    torch.testing.assert_close(ig.block_gemm_reference(x, w).double(), want, rtol=1e-5, atol=1e-5)


def gguf_rows(n: int, k: int, bits: int, with_mins: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    else:
        qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01).half()
    mins = (-torch.rand(n, k // 32, generator=g) * 0.1).half() if with_mins else None
    return qweight, scales, mins


@pytest.mark.parametrize("bits, with_mins", [(4, False), (4, True), (8, False)], ids=["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_dequantize_exactly_as_llama_cpp(bits, with_mins):
    qweight, scales, mins = gguf_rows(12, 96, bits, with_mins, seed=bits)
    blocks = ig.from_gguf(qweight, scales, mins, bits)
    want = gguf_dequantize(qweight, scales, mins, bits)
    assert torch.equal(ig.dequantize_blocks(blocks), want)
    assert torch.equal(ig.dequantize_blocks(blocks, torch.tensor([3, 0, 3])), want[[3, 0, 3]])


def test_awq_and_gptq_blocks_match_their_dequantization():
    """`(q - z) * s` the tools compute in fp16; the blocks' `q * s + (-z * s)` keeps `-z * s` in fp16: equal to
    fp16 rounding."""
    g = torch.Generator().manual_seed(3)
    k, n, group = 256, 16, 64
    qweight = torch.randint(-(2**31), 2**31 - 1, (k, n // 8), dtype=torch.int32, generator=g)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (k // group, n // 8), dtype=torch.int32, generator=g)
    scales = (torch.rand(k // group, n, generator=g) * 0.01 + 1e-3).half()
    fp16_step = lambda zeros: float((zeros * scales.float()).abs().max()) * 2**-10  # rounding of -z * s and (q - z) * s
    awq = ig.from_groups(unpack_awq(qweight), unpack_awq(qzeros), scales, 4)
    want = awq_dequantize(qweight, qzeros, scales).T.float()
    torch.testing.assert_close(ig.dequantize_blocks(awq), want, rtol=0, atol=fp16_step(unpack_awq(qzeros)))
    for bits in (4, 8):
        rows = torch.randint(-(2**31), 2**31 - 1, (k * bits // 32, n), dtype=torch.int32, generator=g)
        zeros = torch.randint(-(2**31), 2**31 - 1, (k // group, n * bits // 32), dtype=torch.int32, generator=g)
        gptq = ig.from_groups(unpack_rows(rows, bits), unpack_cols(zeros, bits) + 1, scales, bits)
        want = gptq_dequantize(rows, zeros, scales, bits, 1).T.float()
        step = fp16_step(unpack_cols(zeros, bits) + 1)
        torch.testing.assert_close(ig.dequantize_blocks(gptq), want, rtol=0, atol=step)


@native
@pytest.mark.parametrize("bits, kind", FORMATS, ids=FORMAT_IDS)
def test_threads_split_the_output_rows(bits, kind):
    k = 576 if kind in (ig.BLOCKS, ig.CODEBOOK) else 512
    w, x = random_blocks(1000, k, bits, seed=11, kind=kind), torch.randn(3, k)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ig.block_gemm(x, w)
        torch.set_num_threads(max(2, before))
        assert torch.equal(ig.block_gemm(x, w), one)
        torch.testing.assert_close(one, ig.block_gemm_reference(x, w), rtol=0, atol=1e-5 * float(one.abs().max()))
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None, reason="x86-64 with g++ only")
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "cooperlake", "sapphirerapids"])
def test_the_sources_compile_for_every_cpu_kind(march):
    """The kernels' sources for CPUs other than this one: plain x86-64, AVX2, AVX-512 VNNI and BF16 without AMX (AMD
    Zen 4 and 5's set), with AMX (-march=native builds only this machine's)."""
    flags = ["-fsyntax-only", f"-march={march}", "-fopenmp", "-std=c++17"]
    done = subprocess.run(["g++", *flags, *map(str, cpu_native.SOURCES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]


@native
@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None, reason="x86-64 with g++ only")
@pytest.mark.parametrize("march, kernels", [("x86-64", b"portable"), ("x86-64-v3", b"AVX2")])
def test_other_cpu_kinds_tiles_are_the_same_arithmetic(tmp_path, march, kernels):
    """The integer tiles of CPUs without AVX-512 VNNI (or BF16): plain x86-64's portable C++ and AVX2's, built here
    at -O1 (-O3 takes 2-6 times as long to compile them, and the arithmetic is the source's either way)."""
    import ctypes

    built = tmp_path / f"{march}.so"
    flags = ["-O1", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
    quant = [str(s) for s in cpu_native.SOURCES if s.name.startswith("cpu_quant")]
    subprocess.run(["g++", *flags, *quant, "-o", str(built)], check=True)
    lib = ctypes.CDLL(str(built))
    lib.tiffin_block_gemm.argtypes = cpu_native._BLOCK_GEMM_ARGS
    lib.tiffin_quant_kernels.restype = ctypes.c_char_p
    assert lib.tiffin_quant_kernels().startswith(kernels)
    # 40 rows at two levels: bf16 where built, not here
    for (bits, kind), (levels, m) in itertools.product(FORMATS, [(1, 3), (2, 5), (2, 40)]):
        w, x = random_blocks(24, 256, bits, seed=bits + m, levels=levels, kind=kind), torch.randn(m, 256)
        y = torch.empty(m, 24)
        lib.tiffin_block_gemm(
            0, x.data_ptr(), 256, m, 256, ctypes.byref(ig.native_weights(w)), 0, y.data_ptr(), 24, levels, 1
        )
        want = ig.block_gemm_reference(x, w, bf16=False)  # integers, whatever the row count
        torch.testing.assert_close(y, want, rtol=0, atol=1e-5 * float(want.abs().max()))


TRITON_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # relative to the output's scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("bits, kind", FORMATS, ids=FORMAT_IDS)
def test_triton_kernel_is_the_dequantized_product(interpreter, bits, kind, dtype):
    """The GPU path under the interpreter: the weight decoded tile by tile is `dequantize_blocks`' bit for bit (the
    dense path's one-pass dequantize), its products those of that weight in x's dtype: decode (whole and split
    across K), a mid-sized step, a prefill-sized one (the dense path)."""
    from tiffin.kernels.triton_blocks import block_gemm_launch, block_gemm_triton, dequantize_blocks_triton

    w = random_blocks(40, 512, bits, seed=bits + kind, kind=kind)
    assert torch.equal(dequantize_blocks_triton(w, dtype), ig.dequantize_blocks(w).to(dtype))
    weight = ig.dequantize_blocks(w).to(dtype).double()
    for m in (1, 37, 256):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(dtype)
        want = x.double() @ weight.T
        got = block_gemm_triton(x, w)
        assert got.dtype == dtype and got.shape == (m, 40)
        assert (got.double() - want).abs().max() <= TRITON_TOL[dtype] * want.abs().max()
    out = torch.empty(1, 40, dtype=dtype)
    launch, partial = block_gemm_launch(x[:1], w, out, splits=3)
    launch(out.device)
    assert partial is not None and (out.double() - want[:1]).abs().max() <= TRITON_TOL[dtype] * want.abs().max()

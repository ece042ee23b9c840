"""Kind FP8 of the block layout in the Triton block GEMM (`triton_blocks`): e4m3 codes decoded by integer arithmetic
(no Triton fp8 types, so sm_80 runs them), times an fp32 scale a row and block.

- Under the interpreter, at fp32 and fp16 (its bf16 arithmetic is wrong): the one-pass dequantize is
  `dequantize_blocks` rounded to x's dtype bit for bit, over every finite e4m3 byte (subnormals, negatives, both
  zeros) and scales that take products below fp32's normals; the GEMM is `dequantized_gemm_torch` for decode
  (whole and split across K), a mid-sized step and a prefill-sized one (the dense path).
- compile_check registers FP8's tiles beside the other kinds' (and, marked slow, compiles a sample for sm_80 and
  sm_90 without spills).
"""

import pytest
import torch
from compile_samples import assert_sample_compiles

from tiffin.kernels import block_gemm as ig
from tiffin.kernels import compile_check

# every finite e4m3 byte: 0x7f and 0xff are NaN
FINITE = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
# (K, N): K whole blocks (3 and 16 of them), N odd (a group of 16 rows padded)
SHAPES = [(96, 37), (512, 21)]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}  # relative to the output's scale: fp32 sums, x's dtype out


def fp8_weights(n: int, k: int, seed: int, scale_range: tuple[int, int] = (-10, 4)) -> ig.BlockWeights:
    """Codes: every finite byte in turn, shuffled; scales 2^e * (1 + u) per row and block, e in `scale_range`."""
    g = torch.Generator().manual_seed(seed)
    codes = FINITE.repeat(-(-n * k // len(FINITE)))[: n * k]
    codes = codes[torch.randperm(n * k, generator=g)].view(n, k)
    exponent = torch.randint(*scale_range, (n, k // 32), generator=g).float()
    return ig.pack_fp8(codes, torch.exp2(exponent) * (1 + torch.rand(n, k // 32, generator=g)))


def test_weights_cover_every_finite_code():
    w = fp8_weights(37, 96, seed=0)
    assert set(ig.unpack_codes(w).unique().tolist()) == set(FINITE.tolist())
    values = ig.unpack_codes(w).view(torch.float8_e4m3fn).float()
    assert values.isfinite().all() and (values.abs() == 2**-9).any() and (values == 448).any()  # subnormal, max


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_dequantize_is_the_reference_bit_for_bit(interpreter, dtype):
    """The decode (`_weight_tile`) is `e4m3(q) * d` rounded once, then to x's dtype: scales down to 2^-140 (fp32
    subnormal products, the unit 256 folded into d) and up to where fp16 still holds 448 d."""
    from tiffin.kernels.triton_blocks import dequantize_blocks_triton

    tiny = (-140, -100) if dtype == torch.float32 else (-30, -10)  # fp16: its own subnormals, and below
    for k, n in SHAPES:
        for scale_range in [(-10, 4), tiny]:
            w = fp8_weights(n, k, seed=k, scale_range=scale_range)
            want = ig.dequantize_blocks(w).to(dtype)
            got = dequantize_blocks_triton(w, dtype)
            assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("k, n", SHAPES, ids=[f"k{k}-n{n}" for k, n in SHAPES])
def test_triton_gemm_is_the_dequantized_product(interpreter, dtype, k, n):
    """1 row (decode, whole and split-K), 5 (a partial tile) and 300 (from DENSE_MIN_TOKENS: dequantize, then
    dense) against the torch path, `x @ dequantize_blocks(w).to(x.dtype).T`."""
    from tiffin.kernels.triton_blocks import block_gemm_launch, block_gemm_triton

    w = fp8_weights(n, k, seed=n)
    for m in (1, 5, 300):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        want = ig.dequantized_gemm_torch(x, w)
        got = block_gemm_triton(x, w)
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE[dtype] * float(want.abs().max()))
    out = torch.empty(1, n, dtype=dtype)
    launch, partial = block_gemm_launch(x[:1], w, out, splits=3)
    launch(out.device)
    assert partial is not None
    torch.testing.assert_close(out, want[:1], rtol=0, atol=TOLERANCE[dtype] * float(want.abs().max()))


def test_fp8_scales_must_be_float32():
    from tiffin.kernels.triton_blocks import block_gemm_launch

    w = fp8_weights(16, 64, seed=1)
    w.scales = w.scales.half()  # the kernel reads them as fp32
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="FP8 scales must be float32"):
        block_gemm_launch(x, w, torch.empty(1, 16))


# ---- compile check -------------------------------------------------------------------------------------------


def test_compile_check_registers_fp8_tiles():
    """FP8's cases are the other kinds': per dtype the decode tile whole and split-K, the mid and prefill-sized
    tiles in the 16-bit dtypes, and the dense path's dequantize."""
    configs = {case.config for _, case in compile_check.collect(80, ["block_gemm"])}
    fp8 = {config for config in configs if "8bit kind 3" in config}
    for dtype, tiles in [("bfloat16", 3), ("float16", 3), ("float32", 1)]:
        assert sum(c.startswith(f"{dtype} 8bit kind 3 tile=") for c in fp8) == tiles + 1  # + split-K
        assert f"dequantize torch.{dtype} 8bit kind 3" in fp8
    assert len(fp8) == len({config.replace("kind 3", "kind 0") for config in fp8} & configs)


# the fp32 split-K decode tile spilled a register on sm_80 while the decode added FP8's m = 0
SAMPLE = [
    "float32 8bit kind 3 tile=16x32 split-K",
    "bfloat16 8bit kind 3 tile=16x64",
    "float16 8bit kind 3 tile=64x64",
    "dequantize torch.bfloat16 8bit kind 3",
]


@pytest.mark.slow
@pytest.mark.subprocess
def test_compile_check_compiles_fp8_sample():
    """A sample of FP8's cases compiles for sm_80 (no fp8 types needed) and sm_90 without spills (all five archs:
    `python -m tiffin.kernels.compile_check --kernels block_gemm`)."""
    assert_sample_compiles(["block_gemm"], SAMPLE)

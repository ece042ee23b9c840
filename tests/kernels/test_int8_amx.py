"""The W8A8 GEMM (kernels/csrc/cpu_quant_w8a8.cpp): 8-bit weights with one scale a row against activations
quantized to int8 per token, on AMX-INT8 tiles and on AVX-512 VNNI, against `block_gemm_reference`'s per-token
arithmetic. The integer sums are exact and both sides scale them by the same fp32 `dx * d`, so the outputs agree
bit for bit (a tolerance of an fp32 rounding of the product, for the order of the two multiplications, is all
that is allowed); wrong arithmetic (a missing -128, a scale a block) is caught; where the flag is not set, or the
kernel is absent, nothing changes."""

import subprocess
import sys

import pytest
import torch

from tiffin.kernels import block_gemm as ig
from tiffin.kernels import cpu_native

w8a8 = pytest.mark.skipif(
    cpu_native.library() is None or cpu_native.w8a8_min_rows() is None,
    reason="no native W8A8 GEMM (no C++ compiler, or a CPU without AVX-512 VNNI)",
)
amx = pytest.mark.skipif(cpu_native.library() is None or cpu_native.w8a8_built() != 2, reason="no AMX-INT8 on this CPU")
ROWS = (1, 5, 16, 17, 64, 130)
SHAPES = [(n, k) for k in (64, 576, 1536) for n in (37, 100)]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def w8a8_weight(n: int, k: int, seed: int = 0, per_token: bool = True) -> tuple[ig.BlockWeights, torch.Tensor]:
    """Random codes (0 and 255 included), a scale a row over 2^-10..2^-6 (fp16-exact); the weight's float32 too."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    u[0, :2] = torch.tensor([0, 255], dtype=torch.uint8)
    d = torch.exp2(torch.rand(n, 1, generator=g) * 4 - 10).half().float()
    w = ig.pack_codes(u, d.expand(n, k // 32), (-128 * d).expand(n, k // 32), 8, 2, per_token=per_token)
    return w, (u.float() - 128) * d


def activations(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """Rows of different sizes (one of zeros, one with an outlier: per-token steps differ from per-block ones)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-4, 4, (m, 1), generator=g).float())
    x[m // 2] = 0
    if m > 2:
        x[1, 3] = 50
    return x.to(dtype)


def assert_matches_reference(got: torch.Tensor, x: torch.Tensor, w: ig.BlockWeights) -> None:
    want = ig.block_gemm_reference(x, w, per_token=True)
    # both compute float(integer) * fp32(dx * d): equal but for the rounding to x's dtype (none in fp32)
    torch.testing.assert_close(got.float(), want.to(got.dtype).float(), rtol=2**-23, atol=0)


@pytest.fixture
def threads():
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


@w8a8
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nthreads", (1, 2))
def test_native_matches_the_per_token_reference(threads, m, n, k, dtype, nthreads):
    threads(nthreads)
    w, _ = w8a8_weight(n, k, seed=n + k)
    x = activations(m, k, dtype, seed=m)
    got = ig.block_gemm(x, w)
    assert got.dtype == dtype and got.shape == (m, n)
    assert ig.in_per_token(x, w)
    assert_matches_reference(got, x, w)
    assert (got[m // 2] == 0).all()  # a row of zeros: dx 0, no NaN


@w8a8
@pytest.mark.parametrize("m", (3, 16, 33))
def test_an_input_size_of_odd_blocks_takes_vnni(m):
    """K = 96 is no whole number of 64-input tiles: the VNNI kernel serves it, AMX or not."""
    w, _ = w8a8_weight(100, 96)
    x = activations(m, 96, torch.bfloat16)
    assert_matches_reference(ig.block_gemm(x, w), x, w)


def _run_without_amx(code: str) -> None:
    """`code` in a process where TIFFIN_CPU_AMX=0 (the AMX grant is decided once a process): the VNNI kernel."""
    env = {"TIFFIN_CPU_AMX": "0", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr


@amx
def test_vnni_kernel_matches_the_reference_too():
    """On an AMX CPU, the kernel a Zen 4 runs (AVX-512 VNNI), in a process denied the tiles."""
    _run_without_amx(
        "import torch, sys\n"
        "sys.path.insert(0, 'tests/kernels')\n"
        "from tiffin.kernels import cpu_native\n"
        "import test_int8_amx as t\n"
        "assert cpu_native.w8a8_built() == 1\n"
        "for m in t.ROWS:\n"
        "    for n, k in t.SHAPES:\n"
        "        for dtype in t.DTYPES:\n"
        "            w, _ = t.w8a8_weight(n, k, seed=n + k)\n"
        "            x = t.activations(m, k, dtype, seed=m)\n"
        "            t.assert_matches_reference(t.ig.block_gemm(x, w), x, w)\n"
    )


@w8a8
def test_reference_is_the_w8a8_arithmetic_and_mutations_fail():
    """The reference against a from-scratch statement of W8A8 (int8 per token x signed int8 weights, one scale
    each), and what a wrong kernel would compute: the -128 left out, or steps a block of 32 instead of a token."""
    m, n, k = 17, 37, 576
    w, weight = w8a8_weight(n, k)
    x = activations(m, k, torch.float32)
    got = ig.block_gemm(x, w)
    dx = x.abs().amax(1, keepdim=True) / 127
    qx = (x * torch.where(dx != 0, 1 / dx, 0)).round().clamp(-127, 127)
    d = ig.factors(w)[0][:, 0]
    exact = (qx.double() @ (weight.double() / d.double()[:, None]).T) * (dx.double() * d.double()[None])
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6 * float(exact.abs().max()))
    # within int8's error of the float product
    assert (got - x @ weight.T).abs().max() < 0.02 * (x @ weight.T).abs().max()
    # a missing -128 correction: off by 128 d dx sum(qx)
    u = ig.unpack_codes(w).double()
    no_correction = (qx.double() @ u.T) * (dx.double() * d.double()[None])
    assert not torch.allclose(got.double(), no_correction, rtol=1e-3)
    # steps per block of 32 (the per-block kernels' activations): a different answer where rows have outliers
    per_block = ig.block_gemm_reference(x, w, per_token=False, bf16=False)
    assert not torch.allclose(got, per_block, rtol=1e-4, atol=1e-4 * float(per_block.abs().max()))


@w8a8
def test_only_flagged_weights_change_numerics():
    """The same codes and scales without the flag (GPTQ 8-bit, Q8_0, W8A16) keep the per-block kernels."""
    w_flag, _ = w8a8_weight(100, 576)
    w_plain, _ = w8a8_weight(100, 576, per_token=False)
    x = activations(64, 576, torch.float32)
    assert not ig.in_per_token(x, w_plain)
    want = ig.block_gemm_reference(x, w_plain)  # (bf16 dot products at 64 rows: fp32 sums in another order)
    torch.testing.assert_close(ig.block_gemm(x, w_plain), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    assert not torch.equal(ig.block_gemm(x, w_plain), ig.block_gemm(x, w_flag))


def test_pack_codes_refuses_per_token_where_scales_vary():
    n, k = 16, 64
    u = torch.randint(0, 256, (n, k), dtype=torch.int32).to(torch.uint8)
    d = torch.rand(n, k // 32) + 0.5
    with pytest.raises(ValueError, match="one scale a row"):
        ig.pack_codes(u, d, -128 * d, 8, per_token=True)  # a scale a block
    d = d[:, :1].expand(n, k // 32)
    with pytest.raises(ValueError, match="one scale a row"):
        ig.pack_codes(u, d, -100 * d, 8, per_token=True)  # not centred on 128
    with pytest.raises(ValueError, match="one scale a row"):
        ig.pack_codes(u & 15, d, -8 * d, 4, per_token=True)
    assert ig.pack_codes(u, d, -128 * d, 8, per_token=True).per_token


@w8a8
def test_stacked_and_moved_weights_keep_the_flag():
    w, _ = w8a8_weight(40, 64)
    assert w.to(torch.device("cpu")).per_token
    assert ig.stack_groups([w], 40).per_token

"""AWQ / GPTQ GEMMs: packing round trips, and the Triton kernel under the interpreter against
dequantize-then-matmul (fp32, fp16, bf16; decode, split-K, prefill tiles; every group size; act-order perm).

The packers below write each format from its description (AWQ column order 0,2,4,6,1,3,5,7; GPTQ low bits
first); that the formats match the real tools is shown bit for bit on their checkpoints in
test_quant_fixtures.py. The last test runs the kernel on those real checkpoints' layers."""

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiffin.engine.models.linear import Linear
from tiffin.engine.models.loader import build_model, get_model_config
from tiffin.kernels import quant as quant_ops
from tiffin.kernels.quant import (
    DENSE_MIN_TOKENS,
    awq_dequantize,
    awq_gemm,
    gptq_dequantize,
    gptq_gemm,
    pack_rows,
    unpack_awq,
    unpack_cols,
    unpack_rows,
)
from tiffin.kernels.triton_quant import _compile_awq, _compile_gptq, quant_gemm_launch, quant_tile

FIXTURES = Path(__file__).parents[1] / "fixtures" / "quant"

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column stored in nibble i of a word


def pack_awq_reference(codes: torch.Tensor) -> torch.Tensor:
    words = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for nibble, col in enumerate(AWQ_ORDER):
        words |= codes[:, col::8].long() << (4 * nibble)
    return _int32(words)


def pack_cols_reference(codes: torch.Tensor, bits: int) -> torch.Tensor:
    pack = 32 // bits
    words = torch.zeros(codes.shape[0], codes.shape[1] // pack, dtype=torch.int64)
    for j in range(pack):
        words |= codes[:, j::pack].long() << (bits * j)
    return _int32(words)


def _int32(words: torch.Tensor) -> torch.Tensor:
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


def random_codes(rows: int, cols: int, bits: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2**bits, (rows, cols), generator=g, dtype=torch.int32)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), words=st.integers(1, 4), bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_packing_round_trips(rows, words, bits, seed):
    g = torch.Generator().manual_seed(seed)
    pack = 32 // bits
    codes = random_codes(rows * pack, words * pack, bits, g)
    assert torch.equal(unpack_rows(pack_rows(codes, bits), bits), codes)
    assert torch.equal(unpack_cols(pack_cols_reference(codes, bits), bits), codes)
    if bits == 4:
        assert torch.equal(unpack_awq(pack_awq_reference(codes)), codes)


def test_dequantize_formula():
    """W = (q - z) * s per group, rows in groups of group_size; GPTQ v1 (zero_offset 1) stores z - 1."""
    g = torch.Generator().manual_seed(0)
    k, n, gs = 64, 16, 32
    q, z = random_codes(k, n, 4, g), random_codes(k // gs, n, 4, g).clamp(min=1)  # v1 cannot store z = 0
    s = torch.rand(k // gs, n, generator=g).half()
    want = (q - z.repeat_interleave(gs, 0)) * s.repeat_interleave(gs, 0)
    assert torch.equal(awq_dequantize(pack_awq_reference(q), pack_awq_reference(z), s), want)
    assert torch.equal(gptq_dequantize(pack_rows(q, 4), pack_cols_reference(z, 4), s, 4, 0), want)
    assert torch.equal(gptq_dequantize(pack_rows(q, 4), pack_cols_reference(z - 1, 4), s, 4, 1), want)


def make_layer(fmt: str, k: int, n: int, group_size: int, bits: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else k // group_size
    q, z = random_codes(k, n, bits, g), random_codes(groups, n, bits, g)
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.002).half()
    if fmt == "awq":
        return pack_awq_reference(q), pack_awq_reference(z), scales
    return pack_rows(q, bits), pack_cols_reference(z, bits), scales


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative to the output's scale

CASES = [
    # fmt, k, n, group_size, bits, zero_offset, act_order, m
    ("awq", 128, 64, 32, 4, 0, False, 1),
    ("awq", 256, 40, 64, 4, 0, False, 5),
    ("awq", 256, 96, 128, 4, 0, False, 37),
    ("gptq", 128, 64, 32, 4, 1, False, 1),
    ("gptq", 256, 48, 64, 4, 0, True, 3),
    ("gptq", 192, 64, -1, 4, 1, True, 20),
    ("gptq", 128, 36, 128, 8, 1, False, 2),
    ("gptq", 256, 64, 32, 8, 0, True, 70),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt, k, n, group_size, bits, zero_offset, act_order, m", CASES)
def test_triton_matches_dequantize_then_matmul(
    interpret, dtype, fmt, k, n, group_size, bits, zero_offset, act_order, m
):
    qweight, qzeros, scales = make_layer(fmt, k, n, group_size, bits, seed=k + n + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(1)).to(torch.int32) if act_order else None
    if fmt == "awq":
        want = x.double() @ awq_dequantize(qweight, qzeros, scales).double()
        got = awq_gemm(x, qweight, qzeros, scales, backend="triton")
    else:
        xs = x.double() if perm is None else x.double()[:, perm.long()]
        want = xs @ gptq_dequantize(qweight, qzeros, scales, bits, zero_offset).double()
        got = gptq_gemm(x, qweight, qzeros, scales, bits, zero_offset, perm, backend="triton")
    assert got.dtype == dtype and got.shape == (m, n)
    err = (got.double() - want).abs().max().item() / want.abs().max().item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_large_batches_dequantize_once_then_matmul(interpret, monkeypatch, fmt):
    """From DENSE_MIN_TOKENS rows on, the triton backend dequantizes the weight once and multiplies densely
    (cuBLAS on a GPU); below it the fused kernel runs. Both against the weight rebuilt from its codes."""
    k, n, group = 128, 64, 32
    g = torch.Generator().manual_seed(5)
    q, z = random_codes(k, n, 4, g), random_codes(k // group, n, 4, g)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.002).half()
    w = (q - z.repeat_interleave(group, 0)).double() * scales.double().repeat_interleave(group, 0)
    if fmt == "awq":
        packed = pack_awq_reference(q), pack_awq_reference(z), scales
        gemm = lambda x: awq_gemm(x, *packed, backend="triton")  # noqa: E731
    else:
        packed = pack_rows(q, 4), pack_cols_reference(z, 4), scales
        gemm = lambda x: gptq_gemm(x, *packed, 4, 0, backend="triton")  # noqa: E731
    asked, dispatch = [], quant_ops.kernel
    monkeypatch.setattr(quant_ops, "kernel", lambda op, backend: asked.append(backend) or dispatch(op, backend))
    for m, backend in ((DENSE_MIN_TOKENS - 1, "triton"), (DENSE_MIN_TOKENS, "torch"), (300, "torch")):
        x = torch.randn(m, k, generator=g)
        got, want = gemm(x), x.double() @ w
        assert asked.pop() == backend
        err = (got.double() - want).abs().max().item() / want.abs().max().item()
        assert err < TOL[torch.float16], (m, err)  # the weight is dequantized in fp16, as the tools do


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_split_k_equals_single_pass(interpret, fmt):
    """Forcing K splits (decode's split-K path) changes only the summation order. The last split of each tile
    reduces the partials into `out` in the kernel (NaN before): launched twice, as a graph replays it, the tile
    counters were reset and the second launch writes the same result."""
    k, n, m = 512, 64, 3
    qweight, qzeros, scales = make_layer(fmt, k, n, 64, 4, seed=7)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    outs = []
    for splits in (1, 4):
        out = torch.full((m, n), float("nan"))
        launch, partial = quant_gemm_launch(
            x, qweight, qzeros, scales, None, out, awq=fmt == "awq", bits=4, zero_offset=0, splits=splits
        )
        assert (partial is None) == (splits == 1)
        launch(x.device)
        first = out.clone()
        out.fill_(float("nan"))
        launch(x.device)
        assert torch.equal(out, first)
        outs.append(out)
    want = (awq_gemm if fmt == "awq" else lambda *a: gptq_gemm(*a, 4, 0))(x, qweight, qzeros, scales)
    for out in outs:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_tile_k_step_stays_inside_one_group():
    for group_size in (32, 64, 128, 4096, 11008):
        for m in (1, 20, 500):
            for dtype in (torch.float16, torch.float32):
                assert group_size % quant_tile(m, group_size, dtype).block_k == 0
    with pytest.raises(ValueError, match="multiple of 16"):
        quant_tile(1, 40, torch.float16)


def test_compile_check_covers_every_tile():
    """compile_check (every arch, no spills; run by test_kernels_attention's compile test) registers a case
    for each tile and launch variant the dispatcher can pick."""
    registered = {
        (
            c.args[0].dtype,
            c.kwargs["BLOCK_M"],
            c.kwargs["BLOCK_N"],
            c.kwargs["BLOCK_K"],
            c.kwargs["SPLIT"],
            c.kwargs["AWQ"],
        )
        for c in [*_compile_awq(80), *_compile_gptq(80)]
    }
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for m in (1, 16, 17, 32, 33, 4096):
            for group_size in (32, 64, 128, 4096):
                t = quant_tile(m, group_size, dtype)
                for awq in (True, False):
                    for split in (False, True) if m <= 16 else (False,):
                        assert (dtype, t.block_m, t.block_n, t.block_k, split, awq) in registered


def test_bad_shapes_raise():
    qweight, qzeros, scales = make_layer("awq", 128, 64, 32, 4, seed=0)
    with pytest.raises(ValueError, match=r"x must be \[M, 128\]"):
        awq_gemm(torch.randn(2, 64), qweight, qzeros, scales)
    with pytest.raises(ValueError, match="qzeros must be contiguous int32"):
        quant_gemm_launch(
            torch.randn(2, 128), qweight, qzeros[:2], scales, None, torch.empty(2, 64), awq=True, bits=4, zero_offset=0
        )


def load_fixture(name: str, kernel_backend: str):
    path = FIXTURES / name
    config = get_model_config(path)
    config.dtype = torch.float32
    return build_model(config, path, torch.device("cpu"), 64, kernel_backend)


@pytest.mark.parametrize("name", ["awq-g64", "gptq-4bit-g64-actorder-sym", "gptq-8bit-perchannel-sym"])
def test_triton_path_on_real_layers(name, monkeypatch):
    """Every quantized layer of the checkpoint (fused shards, act-order perm, 4 and 8 bits) through the Triton
    kernel under the interpreter, against the torch path."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch_model, triton_model = load_fixture(name, "torch"), load_fixture(name, "triton")
    g = torch.Generator().manual_seed(0)
    for (module_name, a), b in zip(torch_model.named_modules(), triton_model.modules()):
        if isinstance(a, Linear) and hasattr(a.method, "dequantize"):
            x = torch.randn(5, a.input_size, generator=g)
            want, got = a(x), b(x)
            assert b.method.backend == "triton"
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=module_name)

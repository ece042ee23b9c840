"""AWQ / GPTQ GEMMs: packing round trips, and the Triton kernel under the interpreter against
dequantize-then-matmul (fp32, fp16, bf16; decode, split-K, prefill tiles; every group size; act-order perm).
The dense path from DENSE_MIN_TOKENS rows (AWQ, GPTQ and GGUF): its one-pass Triton dequantizer against the torch
dequantizers bit for bit, the memory it allocates, and int64 offsets into whole weights.

The packers below write each format from its description (AWQ column order 0,2,4,6,1,3,5,7; GPTQ low bits
first); that the formats match the real tools is shown bit for bit on their checkpoints in
test_quant_fixtures.py. The last test runs the kernel on those real checkpoints' layers."""

import gc
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiffin.engine.models.linear import Linear
from tiffin.engine.models.loader import build_model, get_model_config
from tiffin.kernels import triton_common as tc
from tiffin.kernels import triton_dequantize
from tiffin.kernels.quant import (
    DENSE_MIN_TOKENS,
    awq_dequantize,
    awq_gemm,
    gguf_dequantize,
    gguf_gemm,
    gptq_dequantize,
    gptq_gemm,
    pack_rows,
    unpack_awq,
    unpack_cols,
    unpack_rows,
)
from tiffin.kernels.triton_dequantize import _compile_dequantize, dense_pass_columns, dequantize, group_step
from tiffin.kernels.triton_quant import _compile_awq, _compile_gguf, _compile_gptq, quant_gemm_launch, quant_tile

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


def make_gguf_layer(qtype: str, k: int, n: int, seed: int):
    """Random GGUF rows (`gguf_dequantize`'s layout) -> (qweight, scales, mins, bits)."""
    g = torch.Generator().manual_seed(seed)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.002).half()
    if qtype == "Q8_0":
        return torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), scales, None, 8
    qweight = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    mins = -(torch.rand(n, k // 32, generator=g) * 0.1).half() if qtype == "Q4_1" else None
    return qweight, scales, mins, 4


# fmt, k, n, group_size, bits, zero_offset, act_order (GGUF: fmt names the type; group 32, no zeros)
DENSE_CASES = [
    ("awq", 256, 64, 64, 4, 0, False),
    ("gptq", 256, 48, 32, 4, 1, False),
    ("gptq", 256, 64, 64, 4, 0, True),  # act-order: rows as stored (sorted by group), x gathered by perm
    ("gptq", 192, 40, -1, 4, 1, False),  # one group: BLOCK_K shrinks to divide K
    ("gptq", 128, 36, 128, 8, 1, False),
    ("gptq", 256, 64, 32, 8, 0, True),
    ("Q4_0", 256, 40, 32, 4, 8, False),
    ("Q4_1", 128, 64, 32, 4, 0, False),
    ("Q8_0", 192, 48, 32, 8, 0, False),
]


def dense_layer(fmt, k, n, group_size, bits, zero_offset, act_order, seed=0):
    """-> (gemm(x, backend), the torch dequantizer's weight, the Triton dequantizer's weight as a function of dtype)."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(1)).to(torch.int32) if act_order else None
    if fmt.startswith("Q"):
        qweight, scales, mins, bits = make_gguf_layer(fmt, k, n, seed)
        args = qweight, None, scales
        want = gguf_dequantize(qweight, scales, mins, bits)
        gemm = lambda x, backend: gguf_gemm(x, qweight, scales, mins, bits, backend)
        fmt_args = dict(awq=False, gguf=True, bits=bits, zero_offset=zero_offset, mins=mins)
    else:
        args = make_layer(fmt, k, n, group_size, bits, seed=seed)
        if fmt == "awq":
            want = awq_dequantize(*args)
            gemm = lambda x, backend: awq_gemm(x, *args, backend=backend)
        else:
            want = gptq_dequantize(*args, bits, zero_offset)
            gemm = lambda x, backend: gptq_gemm(x, *args, bits, zero_offset, perm, backend=backend)
        fmt_args = dict(awq=fmt == "awq", bits=bits, zero_offset=zero_offset)
    return gemm, want, lambda dtype: dequantize(*args, dtype, **fmt_args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("fmt, k, n, group_size, bits, zero_offset, act_order", DENSE_CASES)
def test_one_pass_dequantize_is_the_torch_dequantizer_bit_for_bit(
    interpret, dtype, fmt, k, n, group_size, bits, zero_offset, act_order
):
    """The Triton dequantizer writes x's dtype directly: the torch dequantizer's weight (scales' dtype for AWQ and
    GPTQ, fp32 for GGUF) cast to it, bit for bit, in its layout (AWQ/GPTQ [K, N], GGUF [N, K])."""
    _, want, triton_dequantize = dense_layer(fmt, k, n, group_size, bits, zero_offset, act_order)
    got = triton_dequantize(dtype)
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))


@pytest.mark.parametrize("fmt, k, n, group_size, bits, zero_offset, act_order", DENSE_CASES)
def test_large_batches_dequantize_in_one_pass_then_matmul(
    interpret, fmt, k, n, group_size, bits, zero_offset, act_order
):
    """From DENSE_MIN_TOKENS rows on, the triton backend dequantizes with its one-pass kernel and multiplies densely:
    the torch path's result bit for bit (same weight, same matmul); below, the fused GEMM runs."""
    gemm, _, _ = dense_layer(fmt, k, n, group_size, bits, zero_offset, act_order)
    g = torch.Generator().manual_seed(5)
    for m, kernel in ((DENSE_MIN_TOKENS - 1, "_quant_gemm_kernel"), (DENSE_MIN_TOKENS, "_dequantize_kernel")):
        x = torch.randn(m, k, generator=g).half()
        with tc.recording_launches() as launched:
            got = gemm(x, "triton")
        want = gemm(x, "torch")
        assert {name for name, _, _ in launched} == {kernel}
        if kernel == "_dequantize_kernel":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


@pytest.mark.parametrize(
    "fmt, group_size, bits, zero_offset",
    [("awq", 64, 4, 0), ("gptq", 128, 8, 1), ("Q4_1", 32, 4, 0), ("Q8_0", 32, 8, 0)],
)
def test_the_dense_path_allocates_no_more_than_the_weight_and_output(
    cuda_emulation, fmt, group_size, bits, zero_offset
):
    """The ≤ 3 bytes per weight of the dense path, on device memory (the emulation counts every tagged storage): at
    M = DENSE_MIN_TOKENS the peak above what was allocated is the fp16 weight plus the output, nothing more. The
    torch dequantizers, which ran there before, held int32 codes [K, N] (AWQ, GPTQ) or the fp32 weight (GGUF)
    beside it: over this bound once K > M / 2."""
    k, n, m = 512, 64, DENSE_MIN_TOKENS
    with torch.device("cuda"):
        gemm, _, _ = dense_layer(fmt, k, n, group_size, bits, zero_offset, False)
        x = torch.randn(m, k).half()
    gc.collect()  # storages of earlier tests freed now would lower the count while this one is measured
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = gemm(x, "triton")
    assert y.is_cuda and y.shape == (m, n)
    assert torch.cuda.max_memory_allocated() - before == (k * n + m * n) * 2


@pytest.mark.parametrize(
    "fmt, group_size, bits, zero_offset", [("awq", 64, 4, 0), ("gptq", 128, 8, 1), ("Q4_1", 32, 4, 0)]
)
def test_a_large_vocabulary_lm_head_dequantizes_in_bounded_passes(
    cuda_emulation, monkeypatch, fmt, group_size, bits, zero_offset
):
    """A quantized lm_head at DENSE_MIN_TOKENS rows (256 sequences sampling in one step): the dense path held the
    whole weight in x's dtype beside the logits (152k x 4096 in fp16: 1.2 GB); it now takes passes of at most
    DENSE_PASS_BYTES over the vocabulary. Scaled down (a 512 KiB pass, a 10,000 x 512 weight of 10 MB in fp16),
    the peak above the start is the logits plus one pass's buffer, not the weight, and the logits are one pass's
    bit for bit."""
    k, n, m = 512, 10_000, DENSE_MIN_TOKENS
    with torch.device("cuda"):
        gemm, _, _ = dense_layer(fmt, k, n, group_size, bits, zero_offset, False)
        x = torch.randn(m, k).half()

    def peak_and_logits(pass_bytes: int) -> tuple[int, torch.Tensor]:
        monkeypatch.setattr(triton_dequantize, "DENSE_PASS_BYTES", pass_bytes)
        gc.collect()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = gemm(x, "triton")
        return torch.cuda.max_memory_allocated() - before, y

    whole_peak, whole = peak_and_logits(1 << 30)
    assert whole_peak == (k * n + m * n) * 2  # 15.4 MB: the weight and the logits
    peak, logits = peak_and_logits(512 << 10)
    assert dense_pass_columns(k, n, torch.float16) == 512  # 20 passes, the last of 272 columns
    assert peak == m * n * 2 + (512 << 10)  # 5.6 MB: the logits and one pass
    assert torch.equal(logits, whole)


def test_the_dense_pass_bounds_a_real_lm_head():
    """A 152k x 4096 lm_head (1.2 GB in fp16, 2.5 GB in fp32) passes over at most DENSE_PASS_BYTES of weight at a
    time; an MLP's weight fits one pass."""
    for dtype in (torch.float16, torch.float32):
        columns = dense_pass_columns(4096, 151_936, dtype)
        assert columns < 151_936 and 4096 * columns * dtype.itemsize <= triton_dequantize.DENSE_PASS_BYTES
    assert dense_pass_columns(4096, 2 * 11008, torch.float16) == 2 * 11008


def test_offsets_into_whole_weights_are_int64():
    """A Q8_0 lm_head of 152k x 16k has N x K > 2^31 codes: an int32 `offs_n * K` wraps silently. Without
    allocating one, the compiled TTIR shows the offsets: the GEMM's pointers into the int8 codes and the
    dequantizer's into its fp32 output are advanced by int64 offsets (before, every offset there was int32)."""
    from tiffin.kernels.compile_check import compile_for

    def offset_types(case, pointee: str) -> set[str]:
        ttir = compile_for(case, 80).asm["ttir"]
        return set(re.findall(rf"tt\.addptr .*!tt\.ptr<{pointee}>>, tensor<[0-9x]*x(i\d+)>", ttir))

    gemm = next(c for c in _compile_gguf(80) if c.config.startswith("float32 8bit"))
    assert "i64" in offset_types(gemm, "i8")
    for case in _compile_dequantize(80):
        if case.config.startswith("float32 ") and case.config.endswith(
            ("gguf 8bit zero+0 g=32", "gptq 8bit zero+1 g=32")
        ):
            assert offset_types(case, "f32") == {"i64"}, case.config


def test_compile_check_covers_every_dequantize_tile():
    registered = {
        (c.args[4].dtype, *(c.kwargs[key] for key in ("AWQ", "GGUF", "HAS_MIN", "BITS", "BLOCK_K")))
        for c in _compile_dequantize(80)
    }
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for group_size in (32, 64, 128, 4096):
            for awq, bits in ((True, 4), (False, 4), (False, 8)):
                assert (dtype, awq, False, False, bits, group_step(64, group_size)) in registered
        for has_min, bits in ((False, 4), (True, 4), (False, 8)):  # GGUF: groups of 32
            assert (dtype, False, True, has_min, bits, 32) in registered

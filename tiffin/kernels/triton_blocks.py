"""Triton GEMM on the block layout of `tiffin.kernels.block_layout` (the GPU path of `block_gemm`): GGUF's Q5_0, Q5_1,
Q2_K to Q6_K, IQ4_NL and IQ4_XS as the CPU kernels keep them, and FP8 (e4m3 codes, an fp32 scale a row and block),
read in place.

A program owns a `BLOCK_M x BLOCK_N` output tile and walks K one block of 32 inputs at a time: the tile's weights
are decoded from the layout (`_weight_tile`: the codes' low-bit fields and high-bit planes, IQ4's codebook values
from constants, each block's or half-block's `d` and `m` from its fp16 scales or a super-block's integer sub-scales;
FP8's bytes by integer arithmetic, as
`triton_common.kv_code_values` reads fp8 KV caches, so sm_80 runs them too), `q * d + m` in fp32 exactly as
`dequantize_blocks` computes it, then rounded to x's dtype for `tl.dot` with an fp32 accumulator (the torch path's
weight, `dequantize_blocks(w).to(x.dtype)`). Decode-sized M splits K across programs (`triton_common.split_k`,
summed in the kernel). From `DENSE_MIN_TOKENS` rows on, `_dequantize_kernel` writes the weight `[N, K]` in x's
dtype in passes of at most `DENSE_PASS_BYTES`, each multiplied densely. Offsets are int64 where a whole weight's
bytes may pass 2^31.
"""

import torch
import triton
import triton.language as tl

from tiffin.kernels import triton_common as tc
from tiffin.kernels.block_layout import (
    BLOCK,
    BLOCKS,
    FORMATS,
    FP8,
    IQ4_VALUES,
    PLAIN,
    SUPER_CODEBOOK,
    SUPER_MINS,
    SUPER_MINS16,
    BlockWeights,
    record_bytes,
)
from tiffin.kernels.compile_check import CompileCase, register
from tiffin.kernels.dispatch import implements
from tiffin.kernels.quant import DENSE_MIN_TOKENS
from tiffin.kernels.triton_common import reduce_split_k
from tiffin.kernels.triton_dequantize import dense_pass_columns

DEQUANTIZE_COLUMNS = 128  # output columns a program of the dense path's dequantize writes
# e4m3 codes read as fp16 bits are 2^-8 of their value: the shift for `kv_code_values`, the unit folded into d
_E4M3_SHIFT, _E4M3_UNIT = (tl.constexpr(v) for v in tc.FP8_UNPACK["fp8_e4m3"])
# IQ4's values + 128 by code, four bytes a word (little-endian): looked up with shifts, no table in memory
_iq4_word = lambda i: tl.constexpr(
    int.from_bytes(bytes(v + 128 for v in IQ4_VALUES[4 * i : 4 * i + 4]), "little", signed=True)
)
_IQ4_W0, _IQ4_W1, _IQ4_W2, _IQ4_W3 = (_iq4_word(i) for i in range(4))


@triton.jit
def _weight_tile(codes_ptr, scales_ptr, offsets_ptr, k0, offs_n, mask_n, K, BITS: tl.constexpr, KIND: tl.constexpr):
    """The weights of inputs k0..k0+31 (one block) at columns `offs_n`, fp32 `[32, BLOCK_N]`. Kinds: 0 BLOCKS, 1
    SUPER_MINS, 2 SUPER_CENTRED, 3 FP8, 4 CODEBOOK, 5 SUPER_CODEBOOK, 6 SUPER_MINS16 (block_layout.py)."""
    CB = 64 * BITS  # code bytes of a group's block
    LOW: tl.constexpr = 4 if BITS >= 4 else 2  # bits of a code below 8 in the registers' fields
    SUB = 128 if KIND == 5 else 256  # a record's sub-scale bytes
    j = tl.arange(0, 32)
    quad = j // 4
    group, lane = (offs_n // 16).to(tl.int64), offs_n % 16
    block = k0 // 32
    if KIND == 0 or KIND == 3 or KIND == 4:  # a group's blocks in turn
        base = (group * (K // 32) + block) * CB
    else:
        record = group * (K // 256) + block // 8
        base = record * (8 * CB + SUB) + (block % 8) * CB
    at = base[None, :] + (4 * lane)[None, :] + (j % 4)[:, None]  # byte 4l + j % 4 of a register
    mask = mask_n[None, :]
    if BITS == 8:
        q = tl.load(codes_ptr + at + (quad * 64)[:, None], mask=mask, other=0).to(tl.int32)
    else:
        packed = tl.load(codes_ptr + at + (quad % LOW * 64)[:, None], mask=mask, other=0).to(tl.int32)
        q = (packed >> (quad // LOW * LOW)[:, None]) & ((1 << LOW) - 1)
        for p in tl.static_range(BITS - LOW):
            plane = tl.load(codes_ptr + at + 64 * LOW + p * 64, mask=mask, other=0).to(tl.int32)
            q |= ((plane >> quad[:, None]) & 1) << (LOW + p)
    if KIND == 4 or KIND == 5:  # the codebook's value + 128
        word = tl.where(q < 8, tl.where(q < 4, _IQ4_W0, _IQ4_W1), tl.where(q < 12, _IQ4_W2, _IQ4_W3))
        q = (word >> ((q % 4) * 8)) & 255
    if KIND == 3:  # e4m3(q) * d, no m: (q's value / 256) * (d * 256) is the same product, rounded once
        q = tc.kv_code_values(q, _E4M3_SHIFT, "fp8")
        d = tl.load(scales_ptr + (group * (K // 32) + block) * 16 + lane, mask=mask_n, other=0.0)  # fp32
        d = (d * _E4M3_UNIT)[None, :]
    elif KIND == 0 or KIND == 4:
        factor = (group * (K // 32) + block) * 16 + lane
        d = tl.load(scales_ptr + factor, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if KIND == 0:
            m = tl.load(offsets_ptr + factor, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        else:
            m = d * -128.0
    else:
        d_super = tl.load(scales_ptr + record * 16 + lane, mask=mask_n, other=0.0).to(tl.float32)
        sub = codes_ptr + record * (8 * CB + SUB) + 8 * CB + lane  # the record's integer scales, a lane each
        if KIND == 1:
            sc = tl.load(sub + (block % 8) * 16, mask=mask_n, other=0).to(tl.float32)
            mn = tl.load(sub + 128 + (block % 8) * 16, mask=mask_n, other=0).to(tl.float32)
            dmin = tl.load(offsets_ptr + record * 16 + lane, mask=mask_n, other=0.0).to(tl.float32)
            d, m = (d_super * sc)[None, :], (dmin * mn)[None, :]
        elif KIND == 6:  # a byte sc | mn << 4 per half-block
            half = (2 * (block % 8) + j // 16) * 16
            both = tl.load(sub[None, :] + half[:, None], mask=mask, other=0).to(tl.int32)
            dmin = tl.load(offsets_ptr + record * 16 + lane, mask=mask_n, other=0.0).to(tl.float32)
            d, m = d_super[None, :] * (both & 15).to(tl.float32), dmin[None, :] * (both >> 4).to(tl.float32)
        elif KIND == 5:  # a signed scale a block, codebook values centred on 128
            sc = tl.load(sub + (block % 8) * 16, mask=mask_n, other=0).to(tl.int32)
            sc = (sc - (sc >= 128).to(tl.int32) * 256).to(tl.float32)
            d = (d_super * sc)[None, :]
            m = d * -128.0
        else:  # a scale per half-block, codes centred on 2^(BITS-1)
            half = (2 * (block % 8) + j // 16) * 16
            sc = tl.load(sub[None, :] + half[:, None], mask=mask, other=0).to(tl.int32)
            sc = (sc - (sc >= 128).to(tl.int32) * 256).to(tl.float32)  # int8, stored as bytes
            d = d_super[None, :] * sc
            m = d * -(1 << (BITS - 1))
    # FP8 adds no m: a `+ 0.0` made ptxas spill a register in sm_80's fp32 split-K tile
    return q * d if KIND == 3 else q.to(tl.float32) * d + m


@triton.jit
def _block_gemm_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    offsets_ptr,
    out_ptr,
    partial_ptr,
    tile_counters_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_om,
    stride_split,
    BITS: tl.constexpr,
    KIND: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.where(k_start + k_per_split < K, k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):  # BLOCK_K is one block: K is whole blocks
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        w = _weight_tile(codes_ptr, scales_ptr, offsets_ptr, k0, offs_n, mask_n, K, BITS, KIND)
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), acc)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    tile = offs_m[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        counter = tile_counters_ptr + pid_m * tl.num_programs(1) + pid_n
        reduce_split_k(acc, partial_ptr + tile, out_ptr + tile, mask, counter, pid_k, tl.num_programs(2), stride_split)
    else:
        tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(
    codes_ptr,
    scales_ptr,
    offsets_ptr,
    out_ptr,
    N,
    K,
    n_start,
    width,
    BITS: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Columns `n_start` to `n_start + width` of the weight into `out` `[width, K]` (as `dequantize_blocks`)."""
    k0 = tl.program_id(0) * 32
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < width
    w = _weight_tile(codes_ptr, scales_ptr, offsets_ptr, k0, n_start + cols, mask_n, K, BITS, KIND)
    offs = cols.to(tl.int64)[None, :] * K + (k0 + tl.arange(0, 32))[:, None]
    tl.store(out_ptr + offs, w.to(out_ptr.dtype.element_ty), mask=mask_n[None, :])


def block_tile(m: int, dtype: torch.dtype, kind: int) -> tc.Tile:
    """One block of K a step; decode-sized M the smallest MMA height (the codes are what costs), larger M wider
    tiles; fp32 operands take twice the registers (with IQ4_XS's codebook and sub-block scales, one stage: two
    spilled on sm_89)."""
    fp32 = dtype == torch.float32
    if m <= 16:
        stages = 1 if fp32 and kind == SUPER_CODEBOOK else 2
        return tc.Tile(16, 32 if fp32 else 64, BLOCK, num_warps=4, num_stages=stages)
    if m <= 32:
        return tc.Tile(32, 32 if fp32 else 64, BLOCK, num_warps=8, num_stages=2)
    return tc.Tile(32 if fp32 else 64, 64, BLOCK, num_warps=8 if fp32 else 4, num_stages=2)


@implements("dequantized_block_gemm", "triton")
def block_gemm_triton(x: torch.Tensor, w: BlockWeights) -> torch.Tensor:
    """`x [M, K]` @ the weight -> `[M, N]` in x's dtype."""
    x = x if x.stride(1) == 1 else x.contiguous()
    if x.shape[0] >= DENSE_MIN_TOKENS:
        return _dense(x, w)
    out = tc.empty((x.shape[0], w.out_features), x.dtype, x.device)
    if x.shape[0]:
        block_gemm_launch(x, w, out)[0](x.device)
    return out


def _dense(x: torch.Tensor, w: BlockWeights) -> torch.Tensor:
    k, n = w.in_features, w.out_features
    columns = dense_pass_columns(k, n, x.dtype)
    out = tc.empty((x.shape[0], n), x.dtype, x.device)
    buffer = tc.empty((k * min(columns, n),), x.dtype, x.device)
    for start in range(0, n, columns):
        width = min(columns, n - start)
        weight = buffer[: k * width].view(width, k)
        dequantize_launch(w, weight, start)(x.device)
        torch.mm(x, weight.T, out=out[:, start : start + width])
    return out


def dequantize_blocks_triton(w: BlockWeights, dtype: torch.dtype) -> torch.Tensor:
    """The weight `[N, K]` in `dtype`: `dequantize_blocks(w).to(dtype)`, bit for bit."""
    out = tc.empty((w.out_features, w.in_features), dtype, w.codes.device)
    dequantize_launch(w, out, 0)(w.codes.device)
    return out


def dequantize_launch(w: BlockWeights, out: torch.Tensor, n_start: int) -> tc.Launch:
    _check(w)
    width = out.shape[0]
    return tc.Launch(
        _dequantize_kernel,
        (w.in_features // BLOCK, triton.cdiv(width, DEQUANTIZE_COLUMNS)),
        (w.codes, w.scales, w.offsets if w.offsets.numel() else w.scales, out, w.out_features, w.in_features)
        + (n_start, width),
        dict(BITS=w.bits, KIND=w.kind, BLOCK_N=DEQUANTIZE_COLUMNS, num_warps=4),
    )


def block_gemm_launch(
    x: torch.Tensor, w: BlockWeights, out: torch.Tensor, splits: int | None = None
) -> tuple[tc.Launch, torch.Tensor | None]:
    """The launch that writes `out`, and with split-K its fp32 partials (scratch, returned for tests)."""
    _check(w)
    m, k = x.shape
    if k != w.in_features or x.dtype not in tc.DTYPES:
        raise ValueError(f"block gemm: x must be [M, {w.in_features}] of {tc.DTYPES}, got {x.dtype} {tuple(x.shape)}")
    tile = tc.emulated_width(block_tile(m, x.dtype, w.kind), w.out_features)
    grid_mn = (triton.cdiv(m, tile.block_m), triton.cdiv(w.out_features, tile.block_n))
    k_per_split, partial = tc.split_k(out, k, BLOCK, grid_mn[0] * grid_mn[1], splits)
    counters = tc.tile_counters(out.device, grid_mn[0] * grid_mn[1]) if partial is not None else out
    args = (x, w.codes, w.scales, w.offsets if w.offsets.numel() else w.scales, out)
    args += (out if partial is None else partial, counters, m, w.out_features, k, k_per_split, x.stride(0))
    args += (out.stride(0), partial.stride(0) if partial is not None else 0)
    kwargs = dict(BITS=w.bits, KIND=w.kind, SPLIT=partial is not None, **tc.dot_options(x), **tile.options())
    return tc.Launch(_block_gemm_kernel, (*grid_mn, triton.cdiv(k, k_per_split)), args, kwargs), partial


def _check(w: BlockWeights) -> None:
    groups = -(-w.out_features // 16)
    units = w.in_features // BLOCK // (1 if w.kind in PLAIN else 8)
    if w.codes.shape != (groups, units * record_bytes(w.bits, w.kind)) or not w.codes.is_contiguous():
        raise ValueError(f"block gemm: codes {tuple(w.codes.shape)} are not the layout of {w.bits}-bit kind {w.kind}")
    if w.kind == FP8 and w.scales.dtype != torch.float32:  # read as fp32: an fp16 scale would be misread
        raise ValueError(f"block gemm: FP8 scales must be float32, got {w.scales.dtype}")


@register("block_gemm")
def _compile_cases(arch: int):
    """Every format's decode tile (whole and split-K), mid and prefill-sized tiles, in the 16-bit dtypes models
    run in on CUDA, and fp32's decode tile; the dense path's dequantize per format and dtype. No tile depends on
    the arch."""
    for bits, kind in sorted(FORMATS):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            w, name = _example_weights(bits, kind), str(dtype).removeprefix("torch.")
            cases = [(1, 1), (1, 4), (32, 1), (128, 1)] if dtype != torch.float32 else [(1, 1), (1, 4)]
            for m, splits in cases:
                x = torch.empty(m, 4096, dtype=dtype, device="meta")
                launch, _ = block_gemm_launch(x, w, torch.empty_like(x), splits)
                kw = launch.kwargs
                config = f"{name} {bits}bit kind {kind} tile={kw['BLOCK_M']}x{kw['BLOCK_N']}" + " split-K" * kw["SPLIT"]
                yield CompileCase(launch.kernel, config, launch.args, kw)
            out = torch.empty(4096, 4096, dtype=dtype, device="meta")
            launch = dequantize_launch(w, out, 0)
            yield CompileCase(launch.kernel, f"dequantize {dtype} {bits}bit kind {kind}", launch.args, launch.kwargs)


def _example_weights(bits: int, kind: int, k: int = 4096, n: int = 4096) -> BlockWeights:
    meta = dict(device="meta")
    units = k // 32 if kind in PLAIN else k // 256
    codes = torch.empty(n // 16, units * record_bytes(bits, kind), dtype=torch.uint8, **meta)
    scales = torch.empty(n // 16, units * 16, dtype=torch.float32 if kind == FP8 else torch.float16, **meta)
    with_offsets = kind in (BLOCKS, SUPER_MINS, SUPER_MINS16)
    offsets = torch.empty(n // 16 if with_offsets else 0, units * 16, dtype=torch.float16, **meta)
    return BlockWeights(codes, scales, offsets, bits, k, n, kind=kind)

"""Triton fused dequant-GEMM for AWQ, GPTQ and GGUF weights (the GPU path of `awq_gemm` / `gptq_gemm` /
`gguf_gemm`).

One kernel serves every format (`AWQ` picks the unpacking; GGUF's Q4_0 / Q4_1 / Q8_0 come in GPTQ's row
packing with no packed zeros: a constant zero and, for Q4_1, a float minimum per group): a program owns a
`BLOCK_M x BLOCK_N` output tile and walks K `BLOCK_K` rows at a time. `BLOCK_K` divides the group size, so each
K step reads one row of zeros and scales; the weight tile is unpacked from int32 words, dequantized to the
scales' dtype exactly as the tools do (`(q - z) * s`; GGUF's weight stays in fp32, as llama.cpp computes it),
and fed to `tl.dot` with an fp32 accumulator. Act-order GPTQ arrives with rows sorted by group; `perm` gathers
the matching columns of x.

Small M (decode) cannot fill the GPU with output tiles alone, so K is split across programs ("split-K"):
each writes an fp32 partial and counts itself in on its tile's counter; the last to arrive sums the tile's
partials (in split order: the result does not depend on who arrives last) into the output and resets the counter
for the next launch (or graph replay). One launch, where a separate `sum` and `copy_` were two more kernels per
linear in a decode layer. Host code never reads device tensors.

From `DENSE_MIN_TOKENS` rows on the GEMM is compute-bound: `_dequantize_kernel` writes the weight in x's dtype
in one pass (each program one tile, decoded by the same `_dequantize_tile` as the GEMM's, so both compute the
torch dequantizers' values) and a dense matmul follows, in passes over the output columns of at most
`DENSE_PASS_BYTES` of dequantized weight each: a 152k-vocabulary lm_head at hidden 4096 is 1.2 GB in fp16, which
a batch of 256 sampled rows would otherwise allocate beside its logits. Offsets into a whole weight (GGUF's
`[N, K]` codes, the dequantized weight) are int64: N x K passes 2^31 for a large vocabulary's lm_head.

Launch, interpreter and tile plumbing: triton_common.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from tiffin.kernels import triton_common as tc
from tiffin.kernels.compile_check import CompileCase, register
from tiffin.kernels.dispatch import implements
from tiffin.kernels.quant import DENSE_MIN_TOKENS
from tiffin.kernels.triton_common import reduce_split_k

# The dense path's dequantized weight per pass; a weight larger than this (an lm_head) is multiplied in passes over
# its output columns, each still a large matmul (152k x 4096 fp16: 5 passes of 32k columns).
DENSE_PASS_BYTES = 256 << 20


def quant_tile(m: int, group_size: int, dtype: torch.dtype, arch: int = 80) -> tc.Tile:
    """Decode-sized M gets the smallest MMA height (memory-bound: the words are what costs); larger M gets
    wider tiles. fp32 operands take twice the registers, so its tiles are narrower and spread over 8 warps.
    Every tile compiles without spills for sm_80, sm_86, sm_89, sm_90 and sm_120 (compile_check): sm_120's
    widest 16-bit tile steps K by 32."""
    fp32 = dtype == torch.float32
    if m <= 16:
        block_m, block_n, block_k, warps = (16, 32, 32, 4) if fp32 else (16, 64, 64, 4)
    elif m <= 32:
        block_m, block_n, block_k, warps = (32, 32, 32, 8) if fp32 else (32, 64, 32, 4)
    else:
        block_m, block_n, block_k, warps = (32, 64, 32, 8) if fp32 else (64, 128, 64, 8)
    block_k = group_step(block_k, group_size)
    if arch == 120 and block_m == 64:  # 64x128x64 spills 16 bytes there (AWQ and GPTQ, 16-bit)
        block_k = min(block_k, 32)
    stages = 2 if fp32 else 3
    return tc.Tile(block_m, block_n, block_k, num_warps=warps, num_stages=stages)


def group_step(block_k: int, group_size: int) -> int:
    """The largest K step up to `block_k` within one group (the kernels read one row of zeros and scales per step)."""
    while group_size % block_k:
        block_k //= 2
    if block_k < 16:
        raise ValueError(f"quantized gemm: group size {group_size} must be a multiple of 16 for the Triton kernel")
    return block_k


@triton.jit
def _dequantize_tile(
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    mins_ptr,
    offs_k,
    offs_n,
    mask_k,
    mask_n,
    group,
    N,
    K,
    group_size,
    AWQ: tl.constexpr,
    GGUF: tl.constexpr,
    HAS_MIN: tl.constexpr,
    BITS: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
):
    """The weight at rows `offs_k` (all in group `group`) and columns `offs_n`, `[BLOCK_K, BLOCK_N]`, exactly as
    the torch dequantizers compute it: in the scales' dtype (AWQ, GPTQ) or fp32 (GGUF)."""
    PACK = 32 // BITS  # plain names: the interpreter cannot rewrite annotated constexpr locals twice
    MAXQ = (1 << BITS) - 1
    w_mask = mask_k[:, None] & mask_n[None, :]
    if GGUF:  # rows of 32-input blocks; 4-bit: inputs j and j + 16 of a block share its byte j
        rows = offs_n.to(tl.int64)[None, :]  # N x K bytes pass 2^31 (a 152k x 16k Q8_0 lm_head)
        if BITS == 4:
            byte = (offs_k // 32) * 16 + offs_k % 16
            q = tl.load(qweight_ptr + rows * (K // 2) + byte[:, None], mask=w_mask, other=0)
            q = (q.to(tl.int32) >> ((offs_k % 32) // 16 * 4)[:, None]) & MAXQ
        else:
            q = tl.load(qweight_ptr + rows * K + offs_k[:, None], mask=w_mask, other=0).to(tl.int32)
        s = tl.load(scales_ptr + offs_n * (K // group_size) + group, mask=mask_n, other=0.0)
        # kept in fp32, exactly as llama.cpp dequantizes (q * s needs at most 19 bits)
        w = (q - ZERO_OFFSET).to(tl.float32) * s[None, :].to(tl.float32)
        if HAS_MIN:
            m = tl.load(mins_ptr + offs_n * (K // group_size) + group, mask=mask_n, other=0.0)
            w += m.to(tl.float32)[None, :]
    else:
        words_n = N // PACK  # int32 words per row of qzeros (and of AWQ's qweight)
        if AWQ:  # AutoAWQ's column order 0,2,4,6,1,3,5,7 within a word
            col_shift = ((offs_n % 8) // 2 + (offs_n % 2) * 4) * 4
            q = tl.load(qweight_ptr + offs_k[:, None] * words_n + (offs_n // PACK)[None, :], mask=w_mask, other=0)
            q = (q >> col_shift[None, :]) & MAXQ
        else:
            col_shift = (offs_n % PACK) * BITS
            q = tl.load(qweight_ptr + (offs_k // PACK)[:, None] * N + offs_n[None, :], mask=w_mask, other=0)
            q = (q >> ((offs_k % PACK) * BITS)[:, None]) & MAXQ
        s = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0)
        z = tl.load(qzeros_ptr + group * words_n + offs_n // PACK, mask=mask_n, other=0)
        z = ((z >> col_shift) & MAXQ) + ZERO_OFFSET
        # rounded to the scales' dtype: the weight exactly as the tools dequantize it
        w = ((q - z[None, :]).to(tl.float32) * s[None, :].to(tl.float32)).to(s.dtype)
    return w


@triton.jit
def _quant_gemm_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    mins_ptr,
    perm_ptr,
    out_ptr,
    partial_ptr,
    tile_counters_ptr,
    M,
    N,
    K,
    group_size,
    k_per_split,
    stride_xm,
    stride_om,
    stride_split,
    AWQ: tl.constexpr,
    GGUF: tl.constexpr,
    HAS_MIN: tl.constexpr,
    BITS: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    HAS_PERM: tl.constexpr,
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
    k_end = tl.where(k_start + k_per_split < K, k_start + k_per_split, K)  # tl.minimum: not when interpreted
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        if HAS_PERM:
            src_k = tl.load(perm_ptr + offs_k, mask=mask_k, other=0)
        else:
            src_k = offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + src_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        group = k0 // group_size
        w = _dequantize_tile(
            qweight_ptr, qzeros_ptr, scales_ptr, mins_ptr, offs_k, offs_n, mask_k, mask_n, group, N, K, group_size,
            AWQ, GGUF, HAS_MIN, BITS, ZERO_OFFSET
        )  # fmt: skip
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    tile = offs_m[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:  # partials [splits, M, N] fp32, laid out as out
        counter = tile_counters_ptr + pid_m * tl.num_programs(1) + pid_n
        reduce_split_k(acc, partial_ptr + tile, out_ptr + tile, mask, counter, pid_k, tl.num_programs(2), stride_split)
    else:
        tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    mins_ptr,
    out_ptr,
    N,
    K,
    group_size,
    n_start,
    width,
    AWQ: tl.constexpr,
    GGUF: tl.constexpr,
    HAS_MIN: tl.constexpr,
    BITS: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Output columns `n_start` to `n_start + width` of the weight (N columns) into `out`, `width` wide."""
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = n_start + cols
    mask_k, mask_n = offs_k < K, cols < width
    group = tl.program_id(0) * BLOCK_K // group_size
    w = _dequantize_tile(
        qweight_ptr, qzeros_ptr, scales_ptr, mins_ptr, offs_k, offs_n, mask_k, mask_n, group, N, K, group_size,
        AWQ, GGUF, HAS_MIN, BITS, ZERO_OFFSET
    )  # fmt: skip
    # int64: the weight has N x K elements, past 2^31 for a large lm_head
    if GGUF:  # [N, K], as gguf_dequantize returns it
        offs = cols.to(tl.int64)[None, :] * K + offs_k[:, None]
    else:
        offs = offs_k.to(tl.int64)[:, None] * width + cols[None, :]
    tl.store(out_ptr + offs, w.to(out_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])


@implements("awq_gemm", "triton")
def awq_gemm_triton(x, qweight, qzeros, scales) -> torch.Tensor:
    return _run(x, qweight, qzeros, scales, None, awq=True, bits=4, zero_offset=0)


@implements("gptq_gemm", "triton")
def gptq_gemm_triton(x, qweight, qzeros, scales, bits: int, zero_offset: int, perm=None) -> torch.Tensor:
    return _run(x, qweight, qzeros, scales, perm, awq=False, bits=bits, zero_offset=zero_offset)


@implements("gguf_gemm", "triton")
def gguf_gemm_triton(x, qweight, scales, mins, bits: int) -> torch.Tensor:
    zero = 8 if bits == 4 and mins is None else 0  # Q4_0's codes are centred on 8; Q8_0's are signed
    return _run(x, qweight, None, scales, None, awq=False, gguf=True, bits=bits, zero_offset=zero, mins=mins)


def _run(x, qweight, qzeros, scales, perm, **fmt) -> torch.Tensor:
    x = x if x.stride(1) == 1 else x.contiguous()
    if x.shape[0] >= DENSE_MIN_TOKENS:  # compute-bound: one pass to a dense weight, then cuBLAS
        return _dense(x if perm is None else x[:, perm], qweight, qzeros, scales, **fmt)
    m, n = x.shape[0], scales.shape[0 if fmt.get("gguf") else 1]
    out = tc.empty((m, n), x.dtype, x.device)
    if m == 0:
        return out
    launch, _ = quant_gemm_launch(x, qweight, qzeros, scales, perm, out, **fmt)
    launch(x.device)
    return out


def _dense(x, qweight, qzeros, scales, *, gguf: bool = False, **fmt) -> torch.Tensor:
    """x @ the weight: dequantized whole where it fits `DENSE_PASS_BYTES`, else into one buffer of that size pass
    after pass, each pass's product written into its columns of the output (the same dot products: the same
    values as one pass)."""
    k, n = x.shape[1], scales.shape[0 if gguf else 1]
    columns = dense_pass_columns(k, n, x.dtype)
    if columns >= n:
        w = dequantize(qweight, qzeros, scales, x.dtype, gguf=gguf, **fmt)
        return torch.nn.functional.linear(x, w) if gguf else x @ w
    out = tc.empty((x.shape[0], n), x.dtype, x.device)
    buffer = tc.empty((k * columns,), x.dtype, x.device)
    for start in range(0, n, columns):
        width = min(columns, n - start)
        w = buffer[: k * width].view((width, k) if gguf else (k, width))
        dequantize_launch(qweight, qzeros, scales, w, gguf=gguf, n_start=start, **fmt)(x.device)
        torch.mm(x, w.T if gguf else w, out=out[:, start : start + width])
    return out


def dense_pass_columns(k: int, n: int, dtype: torch.dtype) -> int:
    """Output columns per pass of the dense path: as many as `DENSE_PASS_BYTES` of weight hold, in whole tiles of
    `_dequantize_kernel` (at least one: 128 columns), all `n` where they fit."""
    columns = DENSE_PASS_BYTES // (k * dtype.itemsize) // 128 * 128
    return n if columns >= n else max(columns, 128)


def dequantize(qweight, qzeros, scales, dtype: torch.dtype, *, gguf: bool = False, **fmt) -> torch.Tensor:
    """The weight in `dtype`, laid out as the torch dequantizers return it (AWQ/GPTQ `[K, N]`, GGUF `[N, K]`) and
    equal to theirs cast to `dtype`, bit for bit; `fmt` as `quant_gemm_launch`'s (awq, bits, zero_offset, mins)."""
    bits, n = fmt["bits"], scales.shape[0 if gguf else 1]
    if gguf:  # qweight [N, K*bits/8] bytes
        shape = n, qweight.shape[1] * 8 // bits
    else:  # qweight AWQ [K, N/8], GPTQ [K*bits/32, N] int32 words
        shape = qweight.shape[0] * (1 if fmt["awq"] else 32 // bits), n
    out = tc.empty(shape, dtype, scales.device)
    dequantize_launch(qweight, qzeros, scales, out, gguf=gguf, **fmt)(scales.device)
    return out


def dequantize_launch(
    qweight,
    qzeros,
    scales,
    out,
    *,
    awq: bool,
    bits: int,
    zero_offset: int,
    gguf: bool = False,
    mins=None,
    n_start: int = 0,
) -> tc.Launch:
    """The launch that writes the weight's output columns from `n_start` on into `out` (`dequantize`'s layout, as
    many columns as `out` has; `n_start` a multiple of 128) in one pass: 0.5-1 byte of codes read and one element
    written per weight, the zeros and scales read once per tile."""
    width, k = out.shape if gguf else out.shape[::-1]
    n, groups = scales.shape if gguf else scales.shape[::-1]
    _check_quant_launch(out.dtype, qweight, qzeros, scales, mins, None, awq, gguf, bits, k, n, groups)
    block_k, block_n = group_step(64, k // groups), 128
    if n_start % block_n or n_start + width > n or not out.is_contiguous():
        raise ValueError(f"dequantize: columns {n_start}+{width} of {n} into {tuple(out.shape)} (contiguous)")
    return tc.Launch(
        _dequantize_kernel,
        (k // block_k, triton.cdiv(width, block_n)),  # block_k divides the group size, hence K
        (
            qweight,
            scales if qzeros is None else qzeros,
            scales,
            scales if mins is None else mins,
            out,
            n,
            k,
            k // groups,
            n_start,
            width,
        ),
        dict(
            AWQ=awq,
            GGUF=gguf,
            HAS_MIN=mins is not None,
            BITS=bits,
            ZERO_OFFSET=zero_offset,
            BLOCK_K=block_k,
            BLOCK_N=block_n,
            num_warps=8,
        ),
    )


def quant_gemm_launch(
    x,
    qweight,
    qzeros,
    scales,
    perm,
    out,
    *,
    awq: bool,
    bits: int,
    zero_offset: int,
    gguf: bool = False,
    mins=None,
    splits: int | None = None,
    arch: int | None = None,
) -> tuple[tc.Launch, torch.Tensor | None]:
    """The launch for one call, which writes `out`, and with split-K the fp32 `[splits, M, N]` partials it sums
    there (scratch, returned for tests); `splits` defaults to the dispatcher's choice. `gguf`: GGUF rows
    (`qweight [N, K*bits/8]`, `scales` and Q4_1's `mins` `[N, K/32]`, no `qzeros`: a constant zero
    `zero_offset`). Tiles are `arch`'s (None: the device's)."""
    m, k = x.shape
    n, groups = scales.shape if gguf else scales.shape[::-1]
    _check_quant_launch(x.dtype, qweight, qzeros, scales, mins, perm, awq, gguf, bits, k, n, groups)
    group_size = k // groups
    tile = quant_tile(m, group_size, x.dtype, tc.arch(x.device) if arch is None else arch)
    if gguf and x.dtype == torch.float32:  # its nibble addressing takes a few more registers: 2 stages spill
        tile = dataclasses.replace(tile, num_stages=1)
    grid_mn = (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n))
    k_per_split, partial = tc.split_k(out, k, tile.block_k, grid_mn[0] * grid_mn[1], splits)
    if partial is not None and x.dtype == torch.float32:  # the in-kernel reduction's registers: 2 stages spill
        tile = dataclasses.replace(tile, num_stages=1)
    if partial is not None and out.stride() != partial.stride()[1:]:
        raise ValueError(f"quantized gemm: out must be contiguous for split-K, got strides {out.stride()}")
    counters = tc.tile_counters(out.device, grid_mn[0] * grid_mn[1]) if partial is not None else out
    launch = tc.Launch(
        _quant_gemm_kernel,
        (*grid_mn, triton.cdiv(k, k_per_split)),
        (
            x,
            qweight,
            scales if qzeros is None else qzeros,  # unread placeholders where absent
            scales,
            scales if mins is None else mins,
            x if perm is None else perm,
            out,
            out if partial is None else partial,  # unread placeholders without split-K
            counters,
            m,
            n,
            k,
            group_size,
            k_per_split,
            x.stride(0),
            out.stride(0),
            partial.stride(0) if partial is not None else 0,
        ),
        dict(
            AWQ=awq,
            GGUF=gguf,
            HAS_MIN=mins is not None,
            BITS=bits,
            ZERO_OFFSET=zero_offset,
            HAS_PERM=perm is not None,
            SPLIT=partial is not None,
            **tc.dot_options(x),
            **tile.options(),
        ),
    )
    return launch, partial


def _check_quant_launch(x_dtype, qweight, qzeros, scales, mins, perm, awq, gguf, bits, k, n, groups) -> None:
    pack = 32 // bits
    if gguf:
        want = {"qweight": ((n, k * bits // 8), torch.int8 if bits == 8 else torch.uint8)}
    elif awq:
        want = {"qweight": ((k, n // pack), torch.int32), "qzeros": ((groups, n // pack), torch.int32)}
    else:
        want = {"qweight": ((k // pack, n), torch.int32), "qzeros": ((groups, n // pack), torch.int32)}
    for name, (shape, dtype) in want.items():
        tensor = qweight if name == "qweight" else qzeros
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(
                f"quantized gemm: {name} must be contiguous {str(dtype).removeprefix('torch.')} {shape}, got "
                f"{tensor.dtype} {tuple(tensor.shape)}"
            )
    if mins is not None and (mins.shape != scales.shape or not mins.is_contiguous()):
        raise ValueError(f"quantized gemm: mins must be contiguous {tuple(scales.shape)}, got {tuple(mins.shape)}")
    if (not gguf and n % pack) or k % groups or k % pack or not scales.is_contiguous():
        raise ValueError(f"quantized gemm: K={k}, N={n}, {groups} groups do not fit {bits}-bit packing")
    if x_dtype not in tc.DTYPES:
        raise ValueError(f"quantized gemm: x dtype must be one of {tc.DTYPES}, got {x_dtype}")
    if perm is not None and (perm.shape != (k,) or perm.dtype != torch.int32):
        raise ValueError(f"quantized gemm: perm must be int32 [{k}], got {perm.dtype} {tuple(perm.shape)}")


@register("awq_gemm")
def _compile_awq(arch: int):
    """Every tile the dispatcher picks (decode, decode split-K, mid, prefill) per dtype and K step, on the arch
    given; group size and shapes are runtime arguments except where they shrink BLOCK_K."""
    yield from _compile_cases(arch, awq=True, variants=[(4, 0, "")])


@register("gptq_gemm")
def _compile_gptq(arch: int):
    yield from _compile_cases(arch, awq=False, variants=[(4, 1, ""), (4, 0, "perm"), (8, 1, "perm")])


@register("gguf_gemm")
def _compile_gguf(arch: int):
    """Q4_0 and Q8_0 (constant zero), Q4_1 (float minimum); GGUF's groups are always 32."""
    variants = [(4, 8, "gguf"), (8, 0, "gguf"), (4, 0, "gguf min")]
    yield from _compile_cases(arch, awq=False, variants=variants, groups=(32,))


@register("quant_dequantize")
def _compile_dequantize(arch: int):
    """The dense path's one-pass dequantize per output dtype and format (act-order needs no variant: the dense
    path gathers x); its tiles do not depend on the arch."""
    variants = [(True, 4, 0, ""), (False, 4, 1, ""), (False, 8, 1, "")]
    variants += [(False, 4, 8, "gguf"), (False, 8, 0, "gguf"), (False, 4, 0, "gguf min")]
    for dtype in tc.DTYPES:
        for awq, bits, zero_offset, form in variants:
            for group_size in (32,) if form.startswith("gguf") else (32, 128):
                _, qweight, qzeros, scales, mins, _, _ = _example_inputs(dtype, 1, group_size, bits, awq, form)
                out = torch.empty(4096, 4096, dtype=dtype, device="meta")
                fmt = dict(awq=awq, bits=bits, zero_offset=zero_offset, gguf=form.startswith("gguf"), mins=mins)
                launch = dequantize_launch(qweight, qzeros, scales, out, **fmt)
                kind = "awq" if awq else form or "gptq"
                config = f"{str(dtype).removeprefix('torch.')} {kind} {bits}bit zero+{zero_offset} g={group_size}"
                yield CompileCase(launch.kernel, config, launch.args, launch.kwargs)


def _compile_cases(arch: int, awq: bool, variants, groups=(32, 128)):
    """`variants`: (bits, zero_offset, form), form "" (packed zeros), "perm" (act-order), "gguf" (no packed
    zeros), "gguf min" (no packed zeros, float minimum)."""
    seen = set()
    for dtype in tc.DTYPES:
        name = str(dtype).removeprefix("torch.")
        for bits, zero_offset, form in variants:
            for group_size in groups:
                for m, splits in ((1, 1), (1, 4), (32, 1), (256, 1)):
                    x, qweight, qzeros, scales, mins, perm, out = _example_inputs(dtype, m, group_size, bits, awq, form)
                    gguf = form.startswith("gguf")
                    launch, _ = quant_gemm_launch(
                        x,
                        qweight,
                        qzeros,
                        scales,
                        perm,
                        out,
                        awq=awq,
                        bits=bits,
                        zero_offset=zero_offset,
                        gguf=gguf,
                        mins=mins,
                        splits=splits,
                        arch=arch,
                    )
                    key = (dtype, *sorted(launch.kwargs.items()))
                    if key in seen:
                        continue
                    seen.add(key)
                    kw = launch.kwargs
                    config = (
                        f"{name} {bits}bit zero+{zero_offset} {form} "
                        f"tile={kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}{' split-K' if kw['SPLIT'] else ''}"
                    )
                    yield CompileCase(launch.kernel, config, launch.args, launch.kwargs)


def _example_inputs(dtype, m: int, group_size: int, bits: int, awq: bool, form: str):
    k, n, pack = 4096, 4096, 32 // bits
    meta = dict(device="meta")
    x = torch.empty(m, k, dtype=dtype, **meta)
    if form.startswith("gguf"):
        qweight = torch.empty(n, k * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8, **meta)
        scales, qzeros = torch.empty(n, k // group_size, dtype=torch.float16, **meta), None
    else:
        qweight = torch.empty((k, n // pack) if awq else (k // pack, n), dtype=torch.int32, **meta)
        scales = torch.empty(k // group_size, n, dtype=torch.float16, **meta)
        qzeros = torch.empty(k // group_size, n // pack, dtype=torch.int32, **meta)
    mins = torch.empty_like(scales) if form == "gguf min" else None
    perm = torch.empty(k, dtype=torch.int32, **meta) if form == "perm" else None
    return x, qweight, qzeros, scales, mins, perm, torch.empty(m, n, dtype=dtype, **meta)

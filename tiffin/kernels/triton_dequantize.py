"""Triton one-pass dequantization of AWQ, GPTQ and GGUF (Q4_0, Q4_1, Q8_0) weights, and the dense path of their
GEMMs built on it; the tile decoding (`dequantize_tile`) and the layout checks (`check_quant_launch`) the fused GEMM
(triton_quant) shares.

From `DENSE_MIN_TOKENS` rows on the GEMM is compute-bound: `_dequantize_kernel` writes the weight in x's dtype
in one pass (each program one tile, decoded by the same `dequantize_tile` as the fused GEMM's, so both compute the
torch dequantizers' values) and a dense matmul follows, in passes over the output columns of at most
`DENSE_PASS_BYTES` of dequantized weight each: a 152k-vocabulary lm_head at hidden 4096 is 1.2 GB in fp16, which
a batch of 256 sampled rows would otherwise allocate beside its logits. Offsets into a whole weight (GGUF's
`[N, K]` codes, the dequantized weight) are int64: N x K passes 2^31 for a large vocabulary's lm_head.
"""

import torch
import triton
import triton.language as tl

from tiffin.kernels import triton_common as tc
from tiffin.kernels.compile_check import CompileCase, register

# The dense path's dequantized weight per pass; a weight larger than this (an lm_head) is multiplied in passes over
# its output columns, each still a large matmul (152k x 4096 fp16: 5 passes of 32k columns).
DENSE_PASS_BYTES = 256 << 20


def group_step(block_k: int, group_size: int) -> int:
    """The largest K step up to `block_k` within one group (the kernels read one row of zeros and scales per step)."""
    while group_size % block_k:
        block_k //= 2
    if block_k < 16:
        raise ValueError(f"quantized gemm: group size {group_size} must be a multiple of 16 for the Triton kernel")
    return block_k


@triton.jit
def dequantize_tile(
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
    w = dequantize_tile(
        qweight_ptr, qzeros_ptr, scales_ptr, mins_ptr, offs_k, offs_n, mask_k, mask_n, group, N, K, group_size,
        AWQ, GGUF, HAS_MIN, BITS, ZERO_OFFSET
    )  # fmt: skip
    # int64: the weight has N x K elements, past 2^31 for a large lm_head
    if GGUF:  # [N, K], as gguf_dequantize returns it
        offs = cols.to(tl.int64)[None, :] * K + offs_k[:, None]
    else:
        offs = offs_k.to(tl.int64)[:, None] * width + cols[None, :]
    tl.store(out_ptr + offs, w.to(out_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])


def dense_gemm(x, qweight, qzeros, scales, *, gguf: bool = False, **fmt) -> torch.Tensor:
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
    equal to theirs cast to `dtype`, bit for bit; `fmt` as `triton_quant.quant_gemm_launch`'s (awq, bits,
    zero_offset, mins)."""
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
    check_quant_launch(out.dtype, qweight, qzeros, scales, mins, None, awq, gguf, bits, k, n, groups)
    block_k, block_n = group_step(64, k // groups), 128
    if n_start % block_n or n_start + width > n or not out.is_contiguous():
        raise ValueError(f"dequantize: columns {n_start}+{width} of {n} into {tuple(out.shape)} (contiguous)")
    return tc.Launch(
        _dequantize_kernel,
        (k // block_k, triton.cdiv(width, block_n)),  # block_k divides the group size, hence K
        (*weight_args(qweight, qzeros, scales, mins), out, n, k, k // groups, n_start, width),
        dict(**format_constexprs(awq, gguf, bits, zero_offset, mins), BLOCK_K=block_k, BLOCK_N=block_n, num_warps=8),
    )


def weight_args(qweight, qzeros, scales, mins) -> tuple:
    """`dequantize_tile`'s weight pointers, in its order: absent zeros (GGUF) and mins (all but Q4_1) get the scales
    as unread placeholders."""
    return qweight, scales if qzeros is None else qzeros, scales, scales if mins is None else mins


def format_constexprs(awq: bool, gguf: bool, bits: int, zero_offset: int, mins) -> dict:
    """The constexprs by which `dequantize_tile` unpacks a format, the same in both kernels."""
    return dict(AWQ=awq, GGUF=gguf, HAS_MIN=mins is not None, BITS=bits, ZERO_OFFSET=zero_offset)


def check_quant_launch(x_dtype, qweight, qzeros, scales, mins, perm, awq, gguf, bits, k, n, groups) -> None:
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


@register("quant_dequantize")
def _compile_dequantize(arch: int):
    """The dense path's one-pass dequantize per output dtype and format (act-order needs no variant: the dense
    path gathers x); its tiles do not depend on the arch."""
    variants = [(True, 4, 0, ""), (False, 4, 1, ""), (False, 8, 1, "")]
    variants += [(False, 4, 8, "gguf"), (False, 8, 0, "gguf"), (False, 4, 0, "gguf min")]
    for dtype in tc.DTYPES:
        for awq, bits, zero_offset, form in variants:
            for group_size in (32,) if form.startswith("gguf") else (32, 128):
                _, qweight, qzeros, scales, mins, _, _ = example_inputs(dtype, 1, group_size, bits, awq, form)
                out = torch.empty(4096, 4096, dtype=dtype, device="meta")
                fmt = dict(awq=awq, bits=bits, zero_offset=zero_offset, gguf=form.startswith("gguf"), mins=mins)
                launch = dequantize_launch(qweight, qzeros, scales, out, **fmt)
                kind = "awq" if awq else form or "gptq"
                config = f"{str(dtype).removeprefix('torch.')} {kind} {bits}bit zero+{zero_offset} g={group_size}"
                yield CompileCase(launch.kernel, config, launch.args, launch.kwargs)


def example_inputs(dtype, m: int, group_size: int, bits: int, awq: bool, form: str):
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

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
each writes an fp32 partial and one reduction sums them. Host code never reads device tensors.

Same interpreter conventions as the attention kernels: CPU tensors run under TRITON_INTERPRET=1, where bf16
operands are upcast to fp32 (`UPCAST`) because the interpreter's bf16 math is wrong.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tiffin.kernels.compile_check import CompileCase, register
from tiffin.kernels.triton_attention import Launch, _num_sms

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class QuantTile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def quant_tile(m: int, group_size: int, dtype: torch.dtype) -> QuantTile:
    """Decode-sized M gets the smallest MMA height (memory-bound: the words are what costs); larger M gets
    wider tiles. fp32 operands take twice the registers, so its tiles are narrower and spread over 8 warps.
    Every tile compiles without spills for sm_80 and sm_90 (compile_check)."""
    fp32 = dtype == torch.float32
    if m <= 16:
        block_m, block_n, block_k, warps = (16, 32, 32, 4) if fp32 else (16, 64, 64, 4)
    elif m <= 32:
        block_m, block_n, block_k, warps = (32, 32, 32, 8) if fp32 else (32, 64, 32, 4)
    else:
        block_m, block_n, block_k, warps = (32, 64, 32, 8) if fp32 else (64, 128, 64, 8)
    while group_size % block_k:  # one group per K step
        block_k //= 2
    if block_k < 16:
        raise ValueError(f"quantized gemm: group size {group_size} must be a multiple of 16 for the Triton kernel")
    return QuantTile(block_m, block_n, block_k, num_warps=warps, num_stages=2 if fp32 else 3)


def split_k(programs: int, k: int, block_k: int, num_sms: int) -> int:
    """K splits so that about two waves of programs run; each split at least one K step."""
    if programs >= 2 * num_sms:
        return 1
    return max(1, min(MAX_SPLIT_K, triton.cdiv(2 * num_sms, programs), k // block_k))


@triton.jit
def _quant_gemm_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    mins_ptr,
    perm_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    k_per_split,
    stride_xm,
    stride_om,
    stride_split,
    AWQ: tl.constexpr,
    PACKED_ZEROS: tl.constexpr,
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
    PACK = 32 // BITS  # plain names: the interpreter cannot rewrite annotated constexpr locals twice
    MAXQ = (1 << BITS) - 1
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    words_n = N // PACK  # int32 words per row of qzeros (and of AWQ's qweight)
    if AWQ:  # AutoAWQ's column order 0,2,4,6,1,3,5,7 within a word
        col_shift = ((offs_n % 8) // 2 + (offs_n % 2) * 4) * 4
    else:
        col_shift = (offs_n % PACK) * BITS
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
        w_mask = mask_k[:, None] & mask_n[None, :]
        if AWQ:
            q = tl.load(qweight_ptr + offs_k[:, None] * words_n + (offs_n // PACK)[None, :], mask=w_mask, other=0)
            q = (q >> col_shift[None, :]) & MAXQ
        else:
            q = tl.load(qweight_ptr + (offs_k // PACK)[:, None] * N + offs_n[None, :], mask=w_mask, other=0)
            q = (q >> ((offs_k % PACK) * BITS)[:, None]) & MAXQ
        s = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0)
        if PACKED_ZEROS:
            z = tl.load(qzeros_ptr + group * words_n + offs_n // PACK, mask=mask_n, other=0)
            z = ((z >> col_shift) & MAXQ) + ZERO_OFFSET
            # rounded to the scales' dtype: the weight exactly as the tools dequantize it
            w = ((q - z[None, :]).to(tl.float32) * s[None, :].to(tl.float32)).to(s.dtype)
        else:  # GGUF: kept in fp32, as llama.cpp dequantizes
            w = (q - ZERO_OFFSET).to(tl.float32) * s[None, :].to(tl.float32)
            if HAS_MIN:
                w += tl.load(mins_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    ptrs = out_ptr + pid_k * stride_split + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        tl.store(ptrs, acc, mask=mask)
    else:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def awq_gemm_triton(x, qweight, qzeros, scales) -> torch.Tensor:
    return _run(x, qweight, qzeros, scales, None, awq=True, bits=4, zero_offset=0)


def gptq_gemm_triton(x, qweight, qzeros, scales, bits: int, zero_offset: int, perm=None) -> torch.Tensor:
    return _run(x, qweight, qzeros, scales, perm, awq=False, bits=bits, zero_offset=zero_offset)


def gguf_gemm_triton(x, qweight, scales, mins, bits: int) -> torch.Tensor:
    zero = 0 if mins is not None else 1 << (bits - 1)
    return _run(x, qweight, None, scales, None, awq=False, bits=bits, zero_offset=zero, mins=mins)


def _run(x, qweight, qzeros, scales, perm, **fmt) -> torch.Tensor:
    x = x if x.stride(1) == 1 else x.contiguous()
    m, n = x.shape[0], scales.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    launch, partial = quant_gemm_launch(x, qweight, qzeros, scales, perm, out, **fmt)
    launch(x.device)
    if partial is not None:
        out.copy_(partial.sum(0))
    return out


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
    mins=None,
    splits: int | None = None,
) -> tuple[Launch, torch.Tensor | None]:
    """The launch for one call and, with split-K, the fp32 `[splits, M, N]` partials it writes (summed by the
    caller); `splits` defaults to the dispatcher's choice. `qzeros` None: GGUF's constant zero `zero_offset`
    and optional float minimum `mins [groups, N]`."""
    m, k = x.shape
    n = scales.shape[1]
    groups = scales.shape[0]
    _check_quant_launch(x, qweight, qzeros, scales, mins, perm, awq, bits, k, n, groups)
    group_size = k // groups
    tile = quant_tile(m, group_size, x.dtype)
    grid_mn = (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n))
    if splits is None:
        splits = split_k(grid_mn[0] * grid_mn[1], k, tile.block_k, _num_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), tile.block_k) * tile.block_k
    splits = triton.cdiv(k, k_per_split)
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else None
    target = out if partial is None else partial
    launch = Launch(
        _quant_gemm_kernel,
        (*grid_mn, splits),
        (
            x,
            qweight,
            scales if qzeros is None else qzeros,  # unread placeholders where absent
            scales,
            scales if mins is None else mins,
            x if perm is None else perm,
            target,
            m,
            n,
            k,
            group_size,
            k_per_split,
            x.stride(0),
            target.stride(-2),
            target.stride(0) if splits > 1 else 0,
        ),
        dict(
            AWQ=awq,
            PACKED_ZEROS=qzeros is not None,
            HAS_MIN=mins is not None,
            BITS=bits,
            ZERO_OFFSET=zero_offset,
            HAS_PERM=perm is not None,
            SPLIT=splits > 1,
            UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16,
            DOT_PRECISION="tf32x3" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        ),
    )
    return launch, partial


def _check_quant_launch(x, qweight, qzeros, scales, mins, perm, awq, bits, k, n, groups) -> None:
    pack = 32 // bits
    if awq:
        want = {"qweight": (k, n // pack), "qzeros": (groups, n // pack)}
    else:
        want = {"qweight": (k // pack, n), "qzeros": (groups, n // pack)}
    for name, tensor in (("qweight", qweight), ("qzeros", qzeros)):
        if tensor is None:
            continue
        if tuple(tensor.shape) != want[name] or tensor.dtype != torch.int32 or not tensor.is_contiguous():
            raise ValueError(
                f"quantized gemm: {name} must be contiguous int32 {want[name]}, got "
                f"{tensor.dtype} {tuple(tensor.shape)}"
            )
    if mins is not None and (mins.shape != scales.shape or not mins.is_contiguous()):
        raise ValueError(f"quantized gemm: mins must be contiguous {tuple(scales.shape)}, got {tuple(mins.shape)}")
    if (qzeros is not None and n % pack) or k % groups or k % pack or not scales.is_contiguous():
        raise ValueError(f"quantized gemm: K={k}, N={n}, {groups} groups do not fit {bits}-bit packing")
    if x.dtype not in DTYPES:
        raise ValueError(f"quantized gemm: x dtype must be one of {DTYPES}, got {x.dtype}")
    if perm is not None and (perm.shape != (k,) or perm.dtype != torch.int32):
        raise ValueError(f"quantized gemm: perm must be int32 [{k}], got {perm.dtype} {tuple(perm.shape)}")


@register("awq_gemm")
def _compile_awq():
    """Every tile the dispatcher picks (decode, decode split-K, mid, prefill) per dtype and K step; group size
    and shapes are runtime arguments except where they shrink BLOCK_K."""
    yield from _compile_cases(awq=True, variants=[(4, 0, "")])


@register("gptq_gemm")
def _compile_gptq():
    yield from _compile_cases(awq=False, variants=[(4, 1, ""), (4, 0, "perm"), (8, 1, "perm")])


@register("gguf_gemm")
def _compile_gguf():
    """Q4_0 and Q8_0 (constant zero), Q4_1 (float minimum); GGUF's groups are always 32."""
    yield from _compile_cases(awq=False, variants=[(4, 8, "gguf"), (8, 128, "gguf"), (4, 0, "gguf min")], groups=(32,))


def _compile_cases(awq: bool, variants, groups=(32, 128)):
    """`variants`: (bits, zero_offset, form), form "" (packed zeros), "perm" (act-order), "gguf" (no packed
    zeros), "gguf min" (no packed zeros, float minimum)."""
    seen = set()
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        for bits, zero_offset, form in variants:
            for group_size in groups:
                for m, splits in ((1, 1), (1, 4), (32, 1), (256, 1)):
                    x, qweight, qzeros, scales, mins, perm, out = _example_inputs(dtype, m, group_size, bits, awq, form)
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
                        mins=mins,
                        splits=splits,
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
    qweight = torch.empty((k, n // pack) if awq else (k // pack, n), dtype=torch.int32, **meta)
    scales = torch.empty(k // group_size, n, dtype=torch.float16, **meta)
    qzeros = None if form.startswith("gguf") else torch.empty(k // group_size, n // pack, dtype=torch.int32, **meta)
    mins = torch.empty_like(scales) if form == "gguf min" else None
    perm = torch.empty(k, dtype=torch.int32, **meta) if form == "perm" else None
    return x, qweight, qzeros, scales, mins, perm, torch.empty(m, n, dtype=dtype, **meta)

"""Triton fused dequant-GEMM for AWQ and GPTQ weights (the GPU path of `awq_gemm` / `gptq_gemm`).

One kernel serves both formats (`AWQ` picks the unpacking): a program owns a `BLOCK_M x BLOCK_N` output tile
and walks K `BLOCK_K` rows at a time. `BLOCK_K` divides the group size, so each K step reads one row of zeros
and scales; the weight tile is unpacked from int32 words, dequantized to the scales' dtype exactly as the
tools do (`(q - z) * s`), and fed to `tl.dot` with an fp32 accumulator. Act-order GPTQ arrives with rows
sorted by group; `perm` gathers the matching columns of x.

Small M (decode) cannot fill the GPU with output tiles alone, so K is split across programs ("split-K"):
each writes an fp32 partial and one reduction sums them. Host code never reads device tensors.

Launch, interpreter and tile plumbing: triton_common.
"""

import torch
import triton
import triton.language as tl

from tiffin.kernels import triton_common as tc
from tiffin.kernels.compile_check import CompileCase, register
from tiffin.kernels.dispatch import implements


def quant_tile(m: int, group_size: int, dtype: torch.dtype) -> tc.Tile:
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
    return tc.Tile(block_m, block_n, block_k, num_warps=warps, num_stages=2 if fp32 else 3)


@triton.jit
def _quant_gemm_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
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
        z = tl.load(qzeros_ptr + group * words_n + offs_n // PACK, mask=mask_n, other=0)
        z = ((z >> col_shift) & MAXQ) + ZERO_OFFSET
        s = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0)
        # rounded to the scales' dtype: the weight exactly as the tools dequantize it
        w = ((q - z[None, :]).to(tl.float32) * s[None, :].to(tl.float32)).to(s.dtype)
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


@implements("awq_gemm", "triton")
def awq_gemm_triton(x, qweight, qzeros, scales) -> torch.Tensor:
    return _run(x, qweight, qzeros, scales, None, awq=True, bits=4, zero_offset=0)


@implements("gptq_gemm", "triton")
def gptq_gemm_triton(x, qweight, qzeros, scales, bits: int, zero_offset: int, perm=None) -> torch.Tensor:
    return _run(x, qweight, qzeros, scales, perm, awq=False, bits=bits, zero_offset=zero_offset)


def _run(x, qweight, qzeros, scales, perm, **fmt) -> torch.Tensor:
    x = x if x.stride(1) == 1 else x.contiguous()
    m, n = x.shape[0], scales.shape[1]
    out = tc.empty((m, n), x.dtype, x.device)
    if m == 0:
        return out
    return tc.run_split_k(*quant_gemm_launch(x, qweight, qzeros, scales, perm, out, **fmt), out)


def quant_gemm_launch(
    x, qweight, qzeros, scales, perm, out, *, awq: bool, bits: int, zero_offset: int, splits: int | None = None
) -> tuple[tc.Launch, torch.Tensor | None]:
    """The launch for one call and, with split-K, the fp32 `[splits, M, N]` partials it writes (summed by the
    caller); `splits` defaults to the dispatcher's choice."""
    m, k = x.shape
    n = scales.shape[1]
    groups = scales.shape[0]
    _check_quant_launch(x, qweight, qzeros, scales, perm, awq, bits, k, n, groups)
    group_size = k // groups
    tile = quant_tile(m, group_size, x.dtype)
    grid_mn = (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n))
    k_per_split, partial = tc.split_k(out, k, tile.block_k, grid_mn[0] * grid_mn[1], splits)
    target = out if partial is None else partial
    launch = tc.Launch(
        _quant_gemm_kernel,
        (*grid_mn, triton.cdiv(k, k_per_split)),
        (
            x,
            qweight,
            qzeros,
            scales,
            x if perm is None else perm,
            target,
            m,
            n,
            k,
            group_size,
            k_per_split,
            x.stride(0),
            target.stride(-2),
            target.stride(0) if partial is not None else 0,
        ),
        dict(
            AWQ=awq,
            BITS=bits,
            ZERO_OFFSET=zero_offset,
            HAS_PERM=perm is not None,
            SPLIT=partial is not None,
            **tc.dot_options(x),
            **tile.options(),
        ),
    )
    return launch, partial


def _check_quant_launch(x, qweight, qzeros, scales, perm, awq, bits, k, n, groups) -> None:
    pack = 32 // bits
    if awq:
        want = {"qweight": (k, n // pack), "qzeros": (groups, n // pack)}
    else:
        want = {"qweight": (k // pack, n), "qzeros": (groups, n // pack)}
    for name, tensor in (("qweight", qweight), ("qzeros", qzeros)):
        if tuple(tensor.shape) != want[name] or tensor.dtype != torch.int32 or not tensor.is_contiguous():
            raise ValueError(
                f"quantized gemm: {name} must be contiguous int32 {want[name]}, got "
                f"{tensor.dtype} {tuple(tensor.shape)}"
            )
    if n % pack or k % groups or k % pack or not scales.is_contiguous():
        raise ValueError(f"quantized gemm: K={k}, N={n}, {groups} groups do not fit {bits}-bit packing")
    if x.dtype not in tc.DTYPES:
        raise ValueError(f"quantized gemm: x dtype must be one of {tc.DTYPES}, got {x.dtype}")
    if perm is not None and (perm.shape != (k,) or perm.dtype != torch.int32):
        raise ValueError(f"quantized gemm: perm must be int32 [{k}], got {perm.dtype} {tuple(perm.shape)}")


@register("awq_gemm")
def _compile_awq():
    """Every tile the dispatcher picks (decode, decode split-K, mid, prefill) per dtype and K step; group size
    and shapes are runtime arguments except where they shrink BLOCK_K."""
    yield from _compile_cases(awq=True, variants=[(4, 0, False)])


@register("gptq_gemm")
def _compile_gptq():
    yield from _compile_cases(awq=False, variants=[(4, 1, False), (4, 0, True), (8, 1, True)])


def _compile_cases(awq: bool, variants):
    seen = set()
    for dtype in tc.DTYPES:
        name = str(dtype).removeprefix("torch.")
        for bits, zero_offset, act_order in variants:
            for group_size in (32, 128):
                for m, splits in ((1, 1), (1, 4), (32, 1), (256, 1)):
                    x, qweight, qzeros, scales, perm, out = _example_inputs(dtype, m, group_size, bits, awq, act_order)
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
                        splits=splits,
                    )
                    key = (dtype, *sorted(launch.kwargs.items()))
                    if key in seen:
                        continue
                    seen.add(key)
                    kw = launch.kwargs
                    config = (
                        f"{name} {bits}bit zero+{zero_offset}{' perm' if act_order else ''} "
                        f"tile={kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}{' split-K' if kw['SPLIT'] else ''}"
                    )
                    yield CompileCase(launch.kernel, config, launch.args, launch.kwargs)


def _example_inputs(dtype, m: int, group_size: int, bits: int, awq: bool, act_order: bool):
    k, n, pack = 4096, 4096, 32 // bits
    meta = dict(device="meta")
    x = torch.empty(m, k, dtype=dtype, **meta)
    qweight = torch.empty((k, n // pack) if awq else (k // pack, n), dtype=torch.int32, **meta)
    qzeros = torch.empty(k // group_size, n // pack, dtype=torch.int32, **meta)
    scales = torch.empty(k // group_size, n, dtype=torch.float16, **meta)
    perm = torch.empty(k, dtype=torch.int32, **meta) if act_order else None
    return x, qweight, qzeros, scales, perm, torch.empty(m, n, dtype=dtype, **meta)

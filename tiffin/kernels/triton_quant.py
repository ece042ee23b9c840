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

From `DENSE_MIN_TOKENS` rows on the GEMM is compute-bound: the weight is dequantized in one pass and multiplied
densely (triton_dequantize, which also holds the tile decoding and layout checks this kernel shares).

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
from tiffin.kernels.triton_dequantize import (
    check_quant_launch,
    dense_gemm,
    dequantize_tile,
    example_inputs,
    format_constexprs,
    group_step,
    weight_args,
)


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
        w = dequantize_tile(
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
        return dense_gemm(x if perm is None else x[:, perm], qweight, qzeros, scales, **fmt)
    m, n = x.shape[0], scales.shape[0 if fmt.get("gguf") else 1]
    out = tc.empty((m, n), x.dtype, x.device)
    if m == 0:
        return out
    launch, _ = quant_gemm_launch(x, qweight, qzeros, scales, perm, out, **fmt)
    launch(x.device)
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
    check_quant_launch(x.dtype, qweight, qzeros, scales, mins, perm, awq, gguf, bits, k, n, groups)
    group_size = k // groups
    tile = tc.emulated_width(quant_tile(m, group_size, x.dtype, tc.arch(x.device) if arch is None else arch), n)
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
            *weight_args(qweight, qzeros, scales, mins),
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
            **format_constexprs(awq, gguf, bits, zero_offset, mins),
            HAS_PERM=perm is not None,
            SPLIT=partial is not None,
            **tc.dot_options(x),
            **tile.options(),
        ),
    )
    return launch, partial


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


def _compile_cases(arch: int, awq: bool, variants, groups=(32, 128)):
    """`variants`: (bits, zero_offset, form), form "" (packed zeros), "perm" (act-order), "gguf" (no packed
    zeros), "gguf min" (no packed zeros, float minimum)."""
    seen = set()
    for dtype in tc.DTYPES:
        name = str(dtype).removeprefix("torch.")
        for bits, zero_offset, form in variants:
            for group_size in groups:
                for m, splits in ((1, 1), (1, 4), (32, 1), (256, 1)):
                    x, qweight, qzeros, scales, mins, perm, out = example_inputs(dtype, m, group_size, bits, awq, form)
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

"""Triton multi-LoRA shrink / expand (the GPU path of `lora_shrink` / `lora_expand`): Punica's segmented GEMM.

Tokens arrive grouped by adapter slot (`LoRAMetadata.sorted_tokens`, `slot_starts`, `slot_counts`). The grid's
last axis is the slot: a program takes one `BLOCK_M` tile of that slot's tokens, gathers their rows, and
multiplies them by the slot's weights with `tl.dot`, so every tile is a plain GEMM however the batch mixes
adapters. Programs past a slot's token count return at once; grids are sized from host-side ints (the largest
group), so host code never reads device tensors.

Shrink (`[T, K] -> [T, N]`, K large, N = slices x rank small) splits K across programs when tiles alone
cannot fill the GPU (decode): each split writes an fp32 partial, and the last of a tile's splits to arrive sums
them into the output (`reduce_split_k`, counted on the shared tile counters), so a split-K shrink is one launch.
Expand (`[T, N] -> += [T, O]`) runs a grid axis over the fused layer's slices; each slice reads its own rank
block of the shrink result and adds into its own output columns. Each output element is written by exactly one
program: the only atomics are split-K's tile counters.

Launch, interpreter and tile plumbing: triton_common.
"""

import functools

import torch
import triton
import triton.language as tl

from tiffin.kernels import triton_common as tc
from tiffin.kernels.compile_check import CompileCase, register
from tiffin.kernels.dispatch import implements
from tiffin.kernels.lora import LoRAMetadata
from tiffin.kernels.triton_common import reduce_split_k


def shrink_tile(max_slot_tokens: int, n: int, dtype: torch.dtype) -> tc.Tile:
    """Small N (slices x rank): one or few N tiles, long K steps; fp32 halves the tiles (3xTF32 registers)."""
    fp32, block_m = dtype == torch.float32, _block_m(max_slot_tokens)
    block_n = min(max(16, triton.next_power_of_2(n)), 32 if fp32 else 64)
    block_k = (64 if fp32 else 128) if block_m == 16 else (32 if fp32 else 64)
    return tc.Tile(block_m, block_n, block_k)


def expand_tile(max_slot_tokens: int, rank: int, dtype: torch.dtype) -> tc.Tile:
    """K is the rank (small, one or two steps); wide N tiles over the outputs."""
    fp32, block_m = dtype == torch.float32, _block_m(max_slot_tokens)
    block_k = min(max(16, triton.next_power_of_2(rank)), 32 if fp32 else 64)
    block_n = 32 if fp32 else (64 if block_m == 64 else 128)
    return tc.Tile(block_m, block_n, block_k)


def _block_m(max_slot_tokens: int) -> int:
    return 16 if max_slot_tokens <= 16 else 32 if max_slot_tokens <= 32 else 64


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    partial_ptr,
    tile_counters_ptr,
    sorted_ptr,
    starts_ptr,
    counts_ptr,
    N,
    K,
    k_per_split,
    stride_xt,
    stride_as,
    stride_an,
    stride_ot,
    stride_split,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_mn, pid_k, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid_mn // num_n, pid_mn % num_n
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    tokens = tl.load(sorted_ptr + tl.load(starts_ptr + slot) + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(
            x_ptr + tokens[:, None] * stride_xt + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        a = tl.load(
            a_base + offs_n[None, :] * stride_an + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0
        )
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc)
        else:
            acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
    tile = tokens[:, None] * stride_ot + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:  # partials [splits, T, N] fp32, laid out as out; a tile's splits all get here or all returned
        counter = tile_counters_ptr + slot * tl.num_programs(0) + pid_mn
        reduce_split_k(acc, partial_ptr + tile, out_ptr + tile, mask, counter, pid_k, tl.num_programs(1), stride_split)
    else:
        tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lora_expand_kernel(
    h_ptr,
    b_ptr,
    y_ptr,
    sorted_ptr,
    starts_ptr,
    counts_ptr,
    offsets_ptr,
    R,
    max_slice,
    stride_ht,
    stride_bs,
    stride_br,
    stride_yt,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_mn, piece, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_n = tl.cdiv(max_slice, BLOCK_N)
    pid_m, pid_n = pid_mn // num_n, pid_mn % num_n
    count = tl.load(counts_ptr + slot)
    out_lo = tl.load(offsets_ptr + piece)
    out_hi = tl.load(offsets_ptr + piece + 1)
    if pid_m * BLOCK_M >= count or out_lo + pid_n * BLOCK_N >= out_hi:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    tokens = tl.load(sorted_ptr + tl.load(starts_ptr + slot) + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = out_lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_hi
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_K):
        offs_r = r0 + tl.arange(0, BLOCK_K)
        mask_r = offs_r < R
        h = tl.load(
            h_ptr + tokens[:, None] * stride_ht + (piece * R + offs_r)[None, :],
            mask=mask_m[:, None] & mask_r[None, :],
            other=0.0,
        )
        b = tl.load(
            b_base + offs_r[:, None] * stride_br + offs_n[None, :], mask=mask_r[:, None] & mask_n[None, :], other=0.0
        )
        if UPCAST:
            acc = tl.dot(h.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(h, b, acc, input_precision=DOT_PRECISION)
    ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


@implements("lora_shrink", "triton")
def lora_shrink_triton(x: torch.Tensor, a_stack: torch.Tensor, md: LoRAMetadata) -> torch.Tensor:
    x = x if x.stride(1) == 1 else x.contiguous()
    out = tc.empty((x.shape[0], a_stack.shape[1]), x.dtype, x.device)
    shrink_launch(x, a_stack, out, md)[0](x.device)
    return out


def shrink_launch(
    x, a_stack, out, md: LoRAMetadata, splits: int | None = None
) -> tuple[tc.Launch, torch.Tensor | None]:
    """The launch, which writes `out`, and with split-K the fp32 `[splits, T, N]` partials it sums there itself
    (scratch, returned for tests); `splits` defaults to the dispatcher's choice."""
    k, n = x.shape[1], a_stack.shape[1]
    tile = tc.emulated_width(shrink_tile(md.max_slot_tokens, n, x.dtype), n)
    tiles = triton.cdiv(md.max_slot_tokens, tile.block_m) * triton.cdiv(n, tile.block_n)
    k_per_split, partial = tc.split_k(out, k, tile.block_k, tiles * md.num_slots, splits)
    if partial is not None and out.stride() != partial.stride()[1:]:
        raise ValueError(f"lora_shrink: out must be contiguous for split-K, got strides {out.stride()}")
    counters = tc.tile_counters(out.device, tiles * md.num_slots) if partial is not None else out
    launch = tc.Launch(
        _lora_shrink_kernel,
        (tiles, triton.cdiv(k, k_per_split), md.num_slots),
        (
            x,
            a_stack,
            out,
            out if partial is None else partial,  # unread placeholders without split-K
            counters,
            md.sorted_tokens,
            md.slot_starts,
            md.slot_counts,
            n,
            k,
            k_per_split,
            x.stride(0),
            a_stack.stride(0),
            a_stack.stride(1),
            out.stride(0),
            partial.stride(0) if partial is not None else 0,
        ),
        dict(SPLIT=partial is not None, **tc.dot_options(x), **tile.options()),
    )
    return launch, partial


@implements("lora_expand", "triton")
def lora_expand_triton(h, b_stack, y, slice_offsets: list[int], md: LoRAMetadata) -> torch.Tensor:
    h = h if h.stride(1) == 1 else h.contiguous()
    if y.stride(1) != 1:
        raise ValueError("lora_expand: y's rows must be contiguous")
    expand_launch(h, b_stack, y, slice_offsets, _offsets(tuple(slice_offsets), y.device), md)(y.device)
    return y


@implements("lora_apply", "triton")
def lora_apply_triton(x, a_stack, b_stack, y, slice_offsets: list[int], md: LoRAMetadata) -> torch.Tensor:
    return lora_expand_triton(lora_shrink_triton(x, a_stack, md), b_stack, y, slice_offsets, md)


@functools.cache
def _offsets(slice_offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Each layer's slice boundaries as a device tensor, made once (a layer's slices never change)."""
    return torch.tensor(slice_offsets, dtype=torch.int32, device=device)


def expand_launch(h, b_stack, y, slice_offsets: list[int], offsets: torch.Tensor, md: LoRAMetadata) -> tc.Launch:
    """`offsets`: `slice_offsets` as an int32 device tensor (the kernel reads each slice's output range)."""
    r = b_stack.shape[1]
    max_slice = max(b - a for a, b in zip(slice_offsets, slice_offsets[1:]))
    tile = tc.emulated_width(expand_tile(md.max_slot_tokens, r, h.dtype), max_slice)
    tiles = triton.cdiv(md.max_slot_tokens, tile.block_m) * triton.cdiv(max_slice, tile.block_n)
    return tc.Launch(
        _lora_expand_kernel,
        (tiles, len(slice_offsets) - 1, md.num_slots),
        (
            h,
            b_stack,
            y,
            md.sorted_tokens,
            md.slot_starts,
            md.slot_counts,
            offsets,
            r,
            max_slice,
            h.stride(0),
            b_stack.stride(0),
            b_stack.stride(1),
            y.stride(0),
        ),
        dict(**tc.dot_options(h), **tile.options()),
    )


@register("lora_shrink")
def _compile_shrink(arch: int):
    """Every shrink tile the dispatcher picks (the same on every arch): per dtype, decode (with and without
    split-K) and prefill groups, for slot ranks 16 and 64 over a 3-slice (qkv) layer."""
    seen = set()
    for dtype in tc.DTYPES:
        for rank in (16, 64):
            for tokens, splits in ((1, 1), (1, 4), (24, 1), (256, 1), (256, 2)):
                x, a, _, _, md = _example(dtype, tokens, rank)
                out = torch.empty(x.shape[0], a.shape[1], dtype=dtype, device="meta")
                launch, _ = shrink_launch(x, a, out, md, splits=splits)
                key = (dtype, tuple(sorted(launch.kwargs.items())))
                if key not in seen:
                    seen.add(key)
                    yield CompileCase(launch.kernel, _config(dtype, rank, launch.kwargs), launch.args, launch.kwargs)


@register("lora_expand")
def _compile_expand(arch: int):
    seen = set()
    for dtype in tc.DTYPES:
        for rank in (16, 64):
            for tokens in (1, 24, 256):
                x, _, b, h, md = _example(dtype, tokens, rank)
                y = torch.empty(x.shape[0], b.shape[0], dtype=dtype, device="meta")
                offsets = [0, 4096, 5120, 6144]
                launch = expand_launch(h, b, y, offsets, torch.empty(4, dtype=torch.int32, device="meta"), md)
                key = (dtype, tuple(sorted(launch.kwargs.items())))
                if key not in seen:
                    seen.add(key)
                    yield CompileCase(launch.kernel, _config(dtype, rank, launch.kwargs), launch.args, launch.kwargs)


def _config(dtype: torch.dtype, rank: int, kw: dict) -> str:
    split = " split-K" if kw.get("SPLIT") else ""
    tile = f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}"
    return f"{str(dtype).removeprefix('torch.')} rank={rank} tile={tile}{split}"


def _example(dtype: torch.dtype, tokens: int, rank: int, slots: int = 4, hidden: int = 4096, slices: int = 3):
    """Shape-only ("meta") tensors laid out as the engine lays them: a qkv layer, `tokens` per slot."""
    meta = dict(device="meta")
    t = tokens * slots
    x = torch.empty(t, hidden, dtype=dtype, **meta)
    a = torch.empty(slots, slices * rank, hidden, dtype=dtype, **meta)
    b = torch.empty(slots, rank, 6144, dtype=dtype, **meta)
    h = torch.empty(t, slices * rank, dtype=dtype, **meta)
    ints = lambda n: torch.empty(n, dtype=torch.int32, **meta)
    md = LoRAMetadata(
        t,
        torch.empty(t, dtype=torch.int64, **meta),
        ints(slots),
        ints(slots),
        slots,
        tokens,
        [],
        False,
        None,
        None,
        None,
        None,
    )
    return x, a, b, h, md

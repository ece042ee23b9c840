"""Triton `fused_moe` (the GPU path of `kernels.fused_moe.fused_moe`): two grouped GEMMs over the (token, choice)
pairs sorted by expert into blocks of `BLOCK_M` rows (`align_by_expert`, on the device), as vLLM's fused_moe.

A program takes one block (one expert's rows, its padding masked) and one `BLOCK_N` slice of the outputs: it
gathers its pairs' input rows, multiplies them by that expert's weights with `tl.dot`, and stores each row at its
pair's place, so every pair's row is written by exactly one program and no atomics are needed. The first GEMM
reads token `p // top_k`'s row of x and writes the pair's gate_up; the activation runs on those rows (the model's
own `act_and_mul`); the second reads the pair's row and scales it by the pair's routing weight (in fp32, before
rounding); a sum over each token's `top_k` rows ends it. Blocks past the last expert's (`block_expert` -1) return
at once: the grid is sized by the bound the host knows (`padded_pairs`), never by a count read back.

Launch, interpreter and tile plumbing: triton_common.
"""

import torch
import triton
import triton.language as tl

from tiffin.kernels import triton_common as tc
from tiffin.kernels.compile_check import CompileCase, register
from tiffin.kernels.dispatch import implements
from tiffin.kernels.fused_moe import ActAndMul, align_by_expert, padded_pairs


def moe_tile(num_pairs: int, num_experts: int, dtype: torch.dtype) -> tc.Tile:
    """Block rows by the pairs an expert gets on average (decode: a few, so 16 wastes the least padding); fp32
    halves the N and K steps (3xTF32 keeps three operands' worth of registers)."""
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    if dtype == torch.float32:
        return tc.Tile(block_m, 32, 32)
    return tc.Tile(block_m, 64, 64 if block_m < 64 else 32)


@triton.jit(do_not_specialize=["num_pairs"])  # one binary for every token count of a tile (warm-up covers it)
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    weights_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    rows_per_a,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_om,
    MUL_WEIGHT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < num_pairs
    pairs = tl.where(mask_m, pairs, 0).to(tl.int64)
    rows = pairs // rows_per_a
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    b_base = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a_mask = mask_m[:, None] & mask_k[None, :]
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :], mask=a_mask, other=0.0)
        b = tl.load(b_base + offs_k[:, None] * stride_bk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def moe_gemm_launch(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    rows_per_a: int,
    weights: torch.Tensor | None,
    tile: tc.Tile,
) -> tc.Launch:
    """`out[p] = (weights[p] *) a[p // rows_per_a] @ b[e]^T` for every pair p of expert e's blocks; `b [E, N, K]`,
    `a` and `out` with contiguous rows."""
    n, k = b.shape[1:]
    grid = (len(block_expert), triton.cdiv(n, tile.block_n))
    args = (a, b, out, out if weights is None else weights, sorted_pairs, block_expert, num_pairs, rows_per_a, n, k)
    args += (a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0))
    kwargs = dict(MUL_WEIGHT=weights is not None, **tc.dot_options(a), **tile.options())
    return tc.Launch(_moe_gemm_kernel, grid, args, kwargs)


@implements("fused_moe", "triton")
def fused_moe_triton(x, w13, w2, weights, experts, act_and_mul: ActAndMul) -> torch.Tensor:
    if x.stride(1) != 1:
        raise ValueError("fused_moe: x's rows must be contiguous")
    (num_tokens, top_k), num_experts = experts.shape, w13.shape[0]
    num_pairs, device = num_tokens * top_k, x.device
    tile = tc.emulated_width(moe_tile(num_pairs, num_experts, x.dtype), max(w13.shape[1], w2.shape[1]))
    sorted_pairs, block_expert = align_by_expert(experts, num_experts, tile.block_m)
    gate_up = tc.empty((num_pairs, w13.shape[1]), x.dtype, device)
    moe_gemm_launch(x, w13, gate_up, sorted_pairs, block_expert, num_pairs, top_k, None, tile)(device)
    h = act_and_mul(gate_up).contiguous()
    out = tc.empty((num_pairs, w2.shape[1]), x.dtype, device)
    weights = weights.to(x.dtype).contiguous().view(-1)
    moe_gemm_launch(h, w2, out, sorted_pairs, block_expert, num_pairs, 1, weights, tile)(device)
    return out.view(num_tokens, top_k, -1).sum(1)


@register("fused_moe")
def _compile_cases(arch: int):
    """Qwen3-30B-A3B's experts (128, hidden 2048, intermediate 768, top 8) at decode and prefill sizes: every tile
    `moe_tile` picks, both GEMMs."""
    meta = dict(device="meta")
    num_experts, hidden, inter, top_k = 128, 2048, 768, 8
    for dtype in tc.DTYPES:
        for num_tokens in (1, 512, 2048):
            num_pairs = num_tokens * top_k
            tile = moe_tile(num_pairs, num_experts, dtype)
            rows = padded_pairs(num_pairs, num_experts, tile.block_m)
            ints = lambda n: torch.empty(n, dtype=torch.int32, **meta)
            sorted_pairs, block_expert = ints(rows), ints(rows // tile.block_m)
            x = torch.empty(num_tokens, hidden, dtype=dtype, **meta)
            w13 = torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, **meta)
            w2 = torch.empty(num_experts, hidden, inter, dtype=dtype, **meta)
            gate_up = torch.empty(num_pairs, 2 * inter, dtype=dtype, **meta)
            h, out = gate_up[:, :inter].contiguous(), torch.empty(num_pairs, hidden, dtype=dtype, **meta)
            weights = torch.empty(num_pairs, dtype=dtype, **meta)
            name = f"{str(dtype).removeprefix('torch.')} tile={tile.block_m}x{tile.block_n}x{tile.block_k}"
            for what, launch in (
                ("gate_up", moe_gemm_launch(x, w13, gate_up, sorted_pairs, block_expert, num_pairs, top_k, None, tile)),
                ("down", moe_gemm_launch(h, w2, out, sorted_pairs, block_expert, num_pairs, 1, weights, tile)),
            ):
                yield CompileCase(launch.kernel, f"{name} {what} tokens={num_tokens}", launch.args, launch.kwargs)

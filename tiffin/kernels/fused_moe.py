"""A mixture of experts' SwiGLU-style experts applied to each token's chosen ones, weighted and summed: the op
`fused_moe`, its torch implementation, and the sort by expert the Triton one launches on (`align_by_expert`).

Layout: `w13 [E, 2I, H]` (each expert's gate rows, then its up rows) and `w2 [E, H, I]`; a token `t` chose
`experts[t, :k]` with routing `weights[t, :k]`; its output is `sum_j weights[t, j] * w2[e] act_and_mul(w13[e] x[t])`
over its choices `e = experts[t, j]`. A (token, choice) pair is `p = t * k + j`.

The torch implementation (`run_experts`) sorts the pairs by expert and runs one GEMM pair per expert that has
tokens, reading each expert's count on the host: one sync a layer, which a CPU does not mind and a CUDA graph
cannot hold. The Triton one (`triton_fused_moe.py`, as vLLM's fused_moe) sorts on the device into blocks of
`block_m` rows, each block one expert's (`align_by_expert`); its padded length is bounded by what the host knows
(`num_pairs + min(E, num_pairs) * (block_m - 1)`), so its grid, and a graph captured on it, depend on the number
of tokens alone.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tiffin.kernels.dispatch import implements, kernel

ActAndMul = Callable[[torch.Tensor], torch.Tensor]  # gate_up [..., 2I] -> act(gate) * up [..., I]


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    act_and_mul: ActAndMul,
    backend: str = "torch",
) -> torch.Tensor:
    """`x [T, H]`, `weights [T, k]` (x's dtype), `experts [T, k]` (int) -> `[T, H]`: the module docstring's sum."""
    num_experts, two_i, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or w2.shape != (num_experts, hidden, two_i // 2) or two_i % 2:
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not fit")
    if weights.shape != experts.shape or experts.shape[0] != x.shape[0] or experts.dtype.is_floating_point:
        raise ValueError(f"fused_moe: weights {tuple(weights.shape)} / experts {experts.dtype} {tuple(experts.shape)}")
    return kernel("fused_moe", backend)(x, w13, w2, weights, experts, act_and_mul)


def run_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`x [T, H]`, each token's `experts [T, k]` and their routing `weights [T, k]` -> `sum_k weights[t, k] *
    expert(experts[t, k], x[t])` `[T, H]`, calling `expert(e, rows)` once per expert chosen, on all its rows."""
    top_k = experts.shape[1]
    flat = experts.flatten()
    order = flat.argsort(stable=True)  # the (token, choice) pairs grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the layer's one host sync
    xs = x[order // top_k]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start : start + n] = expert(e, xs[start : start + n])
            start += n
    # back to (token, choice) order: a scatter of distinct rows, deterministic where index_add_'s atomics are not
    ys = torch.empty_like(ys).index_copy_(0, order, ys).view(-1, top_k, ys.shape[-1])
    return (ys * weights[..., None]).sum(1)


@implements("fused_moe", "torch")
def fused_moe_torch(x, w13, w2, weights, experts, act_and_mul: ActAndMul) -> torch.Tensor:
    expert = lambda e, rows: F.linear(act_and_mul(F.linear(rows, w13[e])), w2[e])
    return run_experts(x, weights, experts, w13.shape[0], expert)


def padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted, padded pairs (a whole number of blocks): each expert with pairs pads its count to a
    multiple of `block_m`, and at most min(E, num_pairs) experts have any."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`experts [T, k]` -> (`sorted_pairs [padded_pairs]` int32: the pair ids grouped by expert, each expert's run
    padded to a multiple of `block_m` with `T * k` (no pair), then padding to the end; `block_expert
    [padded_pairs / block_m]` int32: each block's expert, -1 for the blocks past the last expert's). Fixed-size
    device ops only (scatter_add, cumsum, argsort, searchsorted): no host read, as a graph capture needs."""
    flat = experts.flatten()
    num_pairs, device = len(flat), flat.device
    rows = padded_pairs(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    by_expert = flat[order]
    # a sorted pair's row: its expert's padded start, plus its rank among the pairs of that expert
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[by_expert]
    dest = (ends - padded)[by_expert] + rank
    sorted_pairs = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(ends, starts, right=True)  # the e with ends[e - 1] <= start < ends[e]
    return sorted_pairs, torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)

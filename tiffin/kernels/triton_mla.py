"""Triton `mla_attention` for decode-only steps (a CUDA graph's, and every eager decode step): the absorbed
decode of kernels/mla.py in one launch, reading the latent cache in place through the block tables and each
row's `seq_lens` on the device. Steps with a prefill run the torch implementation (its plan is built on the host:
eager only).

A program owns one decode row (a sequence) and `BLOCK_H` of its heads: their absorbed queries [W_UK^T q_nope,
q_pe] against the row's latent vectors [c, k_pe], `BLOCK_N` tokens at a time, with an online softmax; the values
are the same vectors' first `rank` dims, so the program accumulates `[BLOCK_H, rank]` and W_UV (torch) finishes
the heads' outputs. The grid is (rows, head blocks): it depends on the batch size alone, as a graph replay needs.
Not split across the context (a long context at batch 1 runs rows x heads / BLOCK_H programs).

Launch, interpreter and tile plumbing: triton_common.
"""

import torch
import triton
import triton.language as tl

from tiffin.kernels import triton_common as tc
from tiffin.kernels.attention import AttentionMetadata
from tiffin.kernels.compile_check import CompileCase, register
from tiffin.kernels.dispatch import implements
from tiffin.kernels.mla import decodes_on_triton, mla_attention_torch


def mla_tile(rank: int, dtype: torch.dtype) -> tc.Tile:
    """block_m: heads a program; block_n: tokens a step; block_k: the latent's padded rank. A wide latent
    (DeepSeek's 512) takes 8 warps for its `[heads, rank]` accumulator."""
    rank_pad = max(16, triton.next_power_of_2(rank))
    wide = rank_pad >= 256
    block_n = 32
    return tc.Tile(16, block_n, rank_pad, num_warps=8 if wide else 4, num_stages=1)


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale,
    num_heads,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_bt,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row, head_block = tl.program_id(0), tl.program_id(1)
    heads = head_block * BLOCK_M + tl.arange(0, BLOCK_M)
    head_ok = heads < num_heads
    r, p = tl.arange(0, BLOCK_K), tl.arange(0, ROPE_PAD)
    r_ok, p_ok = r < RANK, p < ROPE
    q = q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_c = tl.load(q + r[None, :], mask=head_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q + RANK + p[None, :], mask=head_ok[:, None] & p_ok[None, :], other=0.0)
    if UPCAST:
        q_c, q_pe = q_c.to(tl.float32), q_pe.to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + row)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < seq_len
        block = tl.load(block_tables_ptr + row.to(tl.int64) * stride_bt + n // block_size, mask=n_ok, other=0)
        slot = block.to(tl.int64) * stride_cb + (n % block_size) * stride_cs
        c = tl.load(cache_ptr + slot[:, None] + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        k_pe = tl.load(cache_ptr + slot[:, None] + RANK + p[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0.0)
        if UPCAST:
            c, k_pe = c.to(tl.float32), k_pe.to(tl.float32)
        s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION) * scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        weights = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(weights, 1)
        acc = tl.dot(weights.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m = m_new
    out = out_ptr + row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + r[None, :]
    tl.store(out, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & r_ok[None, :])


def mla_decode_launch(query: torch.Tensor, cache: torch.Tensor, out: torch.Tensor, md: AttentionMetadata, scale: float):
    """`query [B, H, rank + rope]` (absorbed, one row a sequence), `cache [blocks, block_size, 1, rank + rope]` ->
    `out [B, H, rank]`: the softmax-weighted sum of each row's latent `c`s."""
    rows, num_heads, _ = query.shape
    rank = out.shape[2]
    rope = query.shape[2] - rank
    tile = mla_tile(rank, query.dtype)
    grid = (rows, triton.cdiv(num_heads, tile.block_m))
    args = (query, cache, out, md.seq_lens, md.block_tables, scale, num_heads, cache.shape[1])
    args += (query.stride(0), query.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1))
    args += (md.block_tables.stride(0),)
    kwargs = dict(RANK=rank, ROPE=rope, ROPE_PAD=max(16, triton.next_power_of_2(rope)))
    return tc.Launch(_mla_decode_kernel, grid, args, kwargs | tc.dot_options(query) | tile.options())


@implements("mla_attention", "triton")
def mla_attention_triton(q_nope, q_pe, cache, md: AttentionMetadata, scale, w_uk, w_uv, fresh_latent=None):
    rank = w_uk.shape[2]
    if md.max_query_len != 1 or not decodes_on_triton(rank, q_nope.dtype):  # the torch plan: eager steps only
        return mla_attention_torch(q_nope, q_pe, cache, md, scale, w_uk, w_uv, fresh_latent)
    query = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe], dim=-1)
    latent_out = tc.empty((len(query), query.shape[1], rank), query.dtype, query.device)
    mla_decode_launch(query, cache, latent_out, md, scale)(query.device)
    return torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


@register("mla_attention")
def _compile_cases(arch: int):
    """DeepSeek-V3's latent (rank 512, rope 64, 16 heads a rank at TP=8) and V2-Lite's (16 heads), a small one."""
    meta = dict(device="meta")
    for dtype in tc.DTYPES:
        for rank, rope, heads in ((512, 64, 16), (128, 32, 8)):
            if not decodes_on_triton(rank, dtype):
                continue
            query = torch.empty(4, heads, rank + rope, dtype=dtype, **meta)
            cache = torch.empty(64, 16, 1, rank + rope, dtype=dtype, **meta)
            out = torch.empty(4, heads, rank, dtype=dtype, **meta)
            ints = lambda *shape: torch.empty(*shape, dtype=torch.int32, **meta)
            md = AttentionMetadata(None, ints(5), ints(4), ints(4, 16), [], [], 1, 256)
            launch = mla_decode_launch(query, cache, out, md, 0.1)
            name = f"{str(dtype).removeprefix('torch.')} rank={rank} rope={rope}"
            yield CompileCase(launch.kernel, name, launch.args, launch.kwargs)

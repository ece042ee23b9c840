"""Multi-head latent attention (DeepSeek's MLA) over a latent paged cache: the op and its torch implementation.

Layout: `cache` `[num_blocks, block_size, 1, kv_lora_rank + rope_dim]` holds one latent vector per token, [c, k_pe]
(c the normalized compressed KV, k_pe the rotated key shared by every head), paged and addressed as every other
cache (`attention.py`: slots, block tables, query_start_loc, seq_lens). Head h's key is [W_UK[h] c, k_pe], its
value W_UV[h] c, with `w_uk [H, nope, rank]` and `w_uv [H, v_dim, rank]` the up-projections.

Decode rows (one query token) attend absorbed: their query [W_UK[h]^T q_nope, q_pe] against the latent vectors
as one KV head whose first `rank` dims are also the value, the output then through W_UV: they read rank + rope
numbers a key, never expand the context. Prefill spans (several query tokens) expand their context's latent into
per-head keys and values, as transformers does, and run SDPA: absorbed, each query token would cost rank + rope
multiply-adds per key and head where the expanded keys cost nope + rope (512 + 64 against 128 + 64 in
DeepSeek-V3), which the expansion, once per key and not per query, repays on a prompt of more than a few tokens.

This torch implementation plans its steps on the host (`attention._plan`: the rows' context lengths); the Triton
backend runs decode-only steps in one kernel that reads them on the device (triton_mla.py), so CUDA graphs capture
them, and its steps with a prefill here.
"""

from dataclasses import replace

import torch
import torch.nn.functional as F

from tiffin.kernels import cpu_native
from tiffin.kernels.attention import AttentionMetadata, _decode_groups, _gather, _plan
from tiffin.kernels.dispatch import implements

MAX_FP32_RANK = 128  # the Triton decode's widest fp32 latent (`decodes_on_triton`)


def decodes_on_triton(rank: int, dtype: torch.dtype) -> bool:
    """Whether the Triton decode (triton_mla.py) takes a latent of `rank` in `dtype`: fp32 latents past
    MAX_FP32_RANK spill registers (3xTF32 dots triple their operands), so their steps run the torch plan, eagerly."""
    return dtype != torch.float32 or rank <= MAX_FP32_RANK


@implements("mla_attention", "torch")
def mla_attention_torch(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    fresh_latent: torch.Tensor | None = None,
) -> torch.Tensor:
    """`q_nope [T, H, nope]`, `q_pe [T, H, rope]` (rotated) -> `[T, H, v_dim]`. `fresh_latent [T, 1, rank + rope]`:
    this step's latent vectors as written to the cache, which a prompt without a cached prefix expands rather than
    reading them back."""
    num_tokens, num_heads, rank = len(q_nope), q_nope.shape[1], w_uk.shape[2]
    out = q_nope.new_zeros(num_tokens, num_heads, w_uv.shape[1])  # padding rows past the batch stay 0
    native = cpu_native.supports_cache(q_pe, cache)
    decodes, prefills = _plan(md, cache.shape[1], q_nope.device, native)
    rows = (decodes[0] if decodes is not None else None) if native else [g.rows for g in decodes]
    if rows is not None and len(rows):
        rows = rows if native else torch.cat(rows)
        query = torch.cat([torch.bmm(q_nope[rows].transpose(0, 1), w_uk).transpose(0, 1), q_pe[rows]], dim=-1)
        latent_out = torch.empty_like(query)
        compact = torch.empty(num_tokens, dtype=torch.int64, device=q_nope.device)  # a row -> its place in `query`
        compact[rows] = torch.arange(len(rows), device=q_nope.device)
        if native:
            block_tables, seq_lens, seqs = md.block_tables, md.seq_lens, decodes[1]
            cpu_native.paged_decode(query, latent_out, cache, cache, None, None, block_tables, seq_lens,
                                    compact[rows], seqs, scale)  # fmt: skip
        else:
            groups = [replace(g, rows=compact[g.rows]) for g in decodes]
            _decode_groups(query, latent_out, cache, cache, None, None, groups, scale, 0, 0.0)
        out[rows] = torch.bmm(latent_out[..., :rank].transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    for p in prefills:
        if fresh_latent is not None and p.mask is None:  # no cached prefix: this step's vectors are the context
            latent = fresh_latent[p.rows, 0]
        else:
            latent = _gather(cache, None, p, q_nope.dtype)[0, 0]  # [length, rank + rope]
        c, k_pe = latent.split([rank, latent.shape[1] - rank], dim=-1)
        k_nope = torch.matmul(c, w_uk.transpose(1, 2))  # [H, length, nope]
        key = torch.cat([k_nope, k_pe.expand(num_heads, -1, -1)], dim=-1)
        value = torch.matmul(c, w_uv.transpose(1, 2))  # [H, length, v_dim]
        query = torch.cat([q_nope[p.rows], q_pe[p.rows]], dim=-1).transpose(0, 1)
        o = F.scaled_dot_product_attention(query, key, value, attn_mask=p.mask, is_causal=p.mask is None, scale=scale)
        out[p.rows] = o.transpose(0, 1)
    return out

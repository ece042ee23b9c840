"""Paged attention and KV-cache writes: the op interface and its torch implementation.

Layout: `k_cache`, `v_cache` are `[num_blocks, block_size, num_kv_heads, head_dim]`. Token `t` of a request
lives in slot `block_table[t // block_size] * block_size + t % block_size`; slot -1 means "skip" (padding).
A batch is flattened: request `i` owns query rows `query_start_loc[i]:query_start_loc[i+1]`, which are the
last `query_len` tokens of its `seq_len` tokens of context (cached prefix + this step's tokens), attended
causally.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


DECODE_GROUP = 16


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token, -1 = skip
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32: context length of each request including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, rows padded with any valid block id
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int


def write_kv_torch(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Scatter this step's `key`/`value` `[T, num_kv_heads, head_dim]` into the paged caches."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Blocks of each row of `block_tables` as one contiguous `[B, num_kv_heads, length, head_dim]` tensor."""
    num_blocks = -(-length // cache.shape[1])
    index = block_tables[:, :num_blocks].reshape(-1)
    kv = cache.index_select(0, index).view(block_tables.shape[0], -1, *cache.shape[2:])
    return kv[:, :length].transpose(1, 2)


def paged_attention_torch(query, k_cache, v_cache, md: AttentionMetadata, scale: float) -> torch.Tensor:
    """`query` `[T, num_heads, head_dim]` -> `[T, num_heads, head_dim]`.

    Decode rows (one query token) run as one padded batch; each prefill chunk runs on its own, since padding
    queries of very different lengths together would waste most of the work.
    """
    out = torch.empty_like(query)
    starts, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    if decodes:
        _decode(query, k_cache, v_cache, md, scale, decodes, out)
    for i, n in enumerate(query_lens):
        if n > 1:
            rows = slice(starts[i], starts[i + 1])
            out[rows] = _prefill(query[rows], k_cache, v_cache, md.block_tables[i : i + 1], seq_lens[i], scale)
    return out


def _decode(query, k_cache, v_cache, md, scale, decodes, out) -> None:
    """Decode rows sorted by context length and run in groups, each padded only to its own longest context:
    gathering K/V dominates the cost, and one group padded to the batch's longest would read far more."""
    decodes = sorted(decodes, key=md.seq_lens_cpu.__getitem__)
    for first in range(0, len(decodes), DECODE_GROUP):
        group = decodes[first : first + DECODE_GROUP]
        lens = [md.seq_lens_cpu[i] for i in group]
        rows = torch.tensor([md.query_start_loc_cpu[i] for i in group], device=query.device)
        tables = md.block_tables[torch.tensor(group, device=query.device)]
        k, v = _gather(k_cache, tables, lens[-1]), _gather(v_cache, tables, lens[-1])
        mask = None
        if lens[0] != lens[-1]:
            mask = torch.arange(lens[-1], device=query.device) < torch.tensor(lens, device=query.device)[:, None]
            mask = mask[:, None, None, :]
        q = query[rows].unsqueeze(2)  # [b, H, 1, D]
        o = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[rows] = o.squeeze(2)


def _prefill(query, k_cache, v_cache, block_table, seq_len, scale) -> torch.Tensor:
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    k, v = _gather(k_cache, block_table, seq_len), _gather(v_cache, block_table, seq_len)
    n = query.shape[0]
    if n == seq_len:
        mask, causal = None, True
    else:  # query i sits at position seq_len - n + i and sees keys up to it
        pos = torch.arange(seq_len - n, seq_len, device=query.device)
        mask, causal = torch.arange(seq_len, device=query.device) <= pos[:, None], False
    o = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )
    return o.squeeze(0).transpose(0, 1)

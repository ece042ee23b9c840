"""Paged attention and KV-cache writes: the op interface and its torch implementation.

Layout: `k_cache`, `v_cache` are `[num_blocks, block_size, num_kv_heads, head_dim]`. Token `t` of a request
lives in slot `block_table[t // block_size] * block_size + t % block_size`; slot -1 means "skip" (padding).
A batch is flattened: request `i` owns query rows `query_start_loc[i]:query_start_loc[i+1]`, which are the
last `query_len` tokens of its `seq_len` tokens of context (cached prefix + this step's tokens), attended
causally; a non-causal call (`causal=False`, encoders) lets every row see all `seq_len` keys of its request.
A causal call may narrow each row to its last `window` keys (sliding-window layers: key k is seen by the query
at position p when p - window < k <= p, as transformers masks them) and soft-cap its scores (Gemma 2:
`softcap * tanh(score / softcap)`, after the scale, before the mask); 0 turns either off (non-causal calls: off).
"""

import functools
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tiffin.kernels import cpu_native, kv_quant
from tiffin.kernels.dispatch import implements

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
    torch_plan: tuple | None = field(default=None, repr=False)  # the torch path's per-step work, shared by layers
    # the sliding-window layers' own (their slots and block tables) where they keep a KV cache group of their own
    sliding: "AttentionMetadata | None" = field(default=None, repr=False)


@implements("write_kv", "torch")
def write_kv_torch(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter this step's `key`/`value` `[T, num_kv_heads, head_dim]` into the paged caches (quantized first
    where the caches are, `kv_quant`). A latent (MLA) cache is its own V cache (`v_cache is k_cache`): the key
    alone is written."""
    if k_scale is not None and cpu_native.supports_cache(key, k_cache):  # one pass, not a dozen ops a layer
        return cpu_native.write_kv(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    keep = slot_mapping >= 0
    if not slot_mapping.is_cpu:
        key, value, slot_mapping = padding_as_first_kept(key, value, slot_mapping, keep)
    elif not bool(keep.all()):  # reading `keep` is free on the host, and dropping rows beats copying them
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if k_scale is not None:
        key = kv_quant.rotate(key, exact=True)
    for x, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale))[: 1 if v_cache is k_cache else 2]:
        if scales is None:
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x.to(cache.dtype))
        else:
            codes, x_scales = kv_quant.quantize(x, cache.dtype)
            bytes_ = cache.view(torch.uint8).view(-1, *cache.shape[2:])  # torch copies no fp8 by index on CPU
            bytes_.index_copy_(0, slot_mapping, codes.view(torch.uint8))
            scales.view(-1, scales.shape[2]).index_copy_(0, slot_mapping, x_scales)


def padding_as_first_kept(key, value, slot_mapping, keep):
    """Padding rows become copies of the first kept row: its slot is then written twice with the same values,
    which needs no host read of `keep` (a stall per layer on a GPU). A step writes at least one token."""
    first = keep.to(torch.uint8).argmax()
    rows = torch.where(keep, torch.arange(len(keep), device=keep.device), first)
    return key[rows], value[rows], slot_mapping[rows]


@dataclass
class _Span:
    """Query rows that attend to the first `length` slots of the same number of block tables."""

    rows: torch.Tensor | slice
    blocks: torch.Tensor  # block ids to gather, table after table
    count: int  # how many tables
    length: int
    last: torch.Tensor  # the position of each row's query `[count or rows]`, which a window's mask starts from
    # None: every row sees all `length` keys (decode) or plain causal (prefill). A prefill span's mask is the
    # causal one, which a non-causal call ignores: the plan is shared by causal and non-causal calls.
    mask: torch.Tensor | None


def _gather(cache: torch.Tensor, scales: torch.Tensor | None, span: _Span, dtype: torch.dtype) -> torch.Tensor:
    """The span's blocks as one contiguous `[count, num_kv_heads, length, head_dim]` tensor of `dtype` (a quantized
    cache's dequantized: only the span's blocks, never the cache)."""
    if scales is None:
        kv = cache.index_select(0, span.blocks)
    else:  # torch selects no fp8 by index on CPU: their bytes
        codes = cache.view(torch.uint8).index_select(0, span.blocks).view(cache.dtype)
        kv = kv_quant.dequantize(codes, scales.index_select(0, span.blocks), dtype)
    return kv.view(span.count, -1, *cache.shape[2:])[:, : span.length].transpose(1, 2).to(dtype)


def _plan(md: AttentionMetadata, block_size: int, device, native: bool) -> tuple:
    """The decode rows and prefill chunks of a step, built once and shared by every layer.

    Decodes are `(rows, seqs)` index tensors for the native kernel, which reads K/V in place. Without it they
    run sorted by context length in groups, each padded only to its own longest context: gathering K/V
    dominates the cost, and one group padded to the batch's longest would read far more. Each prefill chunk
    runs on its own, since padding queries of very different lengths together wastes most of the work.
    """
    if md.torch_plan is not None:
        return md.torch_plan
    starts, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
    tables = md.block_tables
    blocks = lambda rows, length: tables[rows, : -(-length // block_size)].reshape(-1)
    decodes = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
    if native:
        rows_and_seqs = (torch.tensor([starts[i] for i in decodes]), torch.tensor(decodes)) if decodes else None
        md.torch_plan = rows_and_seqs, _prefill_spans(md, blocks, device)
        return md.torch_plan
    decodes.sort(key=seq_lens.__getitem__)
    groups = []
    for first in range(0, len(decodes), DECODE_GROUP):
        group = decodes[first : first + DECODE_GROUP]
        lens = torch.tensor([seq_lens[i] for i in group], device=device)
        length = seq_lens[group[-1]]
        mask = None
        if seq_lens[group[0]] != length:
            mask = (torch.arange(length, device=device) < lens[:, None])[:, None, None, :]
        index = torch.tensor(group, device=device)
        rows = torch.tensor([starts[i] for i in group], device=device)
        groups.append(_Span(rows, blocks(index, length), len(group), length, lens - 1, mask))
    md.torch_plan = groups, _prefill_spans(md, blocks, device)
    return md.torch_plan


def _prefill_spans(md: AttentionMetadata, blocks, device) -> list[_Span]:
    starts, spans = md.query_start_loc_cpu, []
    for i, (length, n) in enumerate((md.seq_lens_cpu[i], starts[i + 1] - starts[i]) for i in range(len(starts) - 1)):
        if n > 1:
            mask = None  # no cached prefix: plain causal
            pos = torch.arange(length - n, length, device=device)  # query j sits at position length - n + j
            if n != length:  # and sees keys up to it
                mask = torch.arange(length, device=device) <= pos[:, None]
            rows = slice(starts[i], starts[i + 1])
            spans.append(_Span(rows, blocks(slice(i, i + 1), length), 1, length, pos, mask))
    return spans


@implements("paged_attention", "torch")
def paged_attention_torch(
    query,
    k_cache,
    v_cache,
    md: AttentionMetadata,
    scale: float,
    causal: bool = True,
    k_scale=None,
    v_scale=None,
    query_rotated=False,
    fresh_kv=None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """`query` `[T, num_heads, head_dim]` -> `[T, num_heads, head_dim]`. Decode rows (one query token, the last
    of its context) see every key (of their window) either way; `causal` only changes the prefill spans. Without
    the native kernels, a window or a soft-cap runs `_attend`, the reference of both."""
    out = torch.empty_like(query)
    out[md.query_start_loc_cpu[-1] :] = 0  # rows past the batch's tokens (padding) belong to no sequence
    native = cpu_native.supports_cache(query, k_cache) and not query_rotated  # it rotates the queries itself
    decodes, prefills = _plan(md, k_cache.shape[1], query.device, native)
    kv = (k_cache, v_cache, k_scale, v_scale)
    if native and decodes is not None:  # the native kernel rotates the queries of a quantized cache itself
        cpu_native.paged_decode(query, out, *kv, md.block_tables, md.seq_lens, *decodes, scale, window, softcap)
    fresh = [fresh_kv is not None and p.mask is None for p in prefills]  # no cached prefix: all in `fresh_kv`
    native_prefill = native and _prefill_native(query)  # reading the cache in place, queries unrotated
    rotated = query  # against keys stored rotated
    if k_scale is not None and not query_rotated and (not native or not (native_prefill or all(fresh))):
        rotated = kv_quant.rotate(query).to(query.dtype)
    if not native:
        _decode_groups(rotated, out, *kv, decodes, scale, window, softcap)
    for p, from_fresh in zip(prefills, fresh):
        if native_prefill and from_fresh:
            k, v = (x[p.rows] for x in fresh_kv)
            cpu_native.prefill_attention(query[p.rows], k, v, scale, causal, out[p.rows], window, softcap)
            continue
        if native_prefill:
            args = (p.blocks, p.length, scale, causal, window, softcap)
            cpu_native.paged_prefill(query[p.rows], out[p.rows], *kv, *args)
            continue
        if from_fresh:
            q, (k, v) = query[p.rows], (x[p.rows].transpose(0, 1).unsqueeze(0) for x in fresh_kv)
        else:
            q = rotated[p.rows]
            k, v = _gather(k_cache, k_scale, p, q.dtype), _gather(v_cache, v_scale, p, q.dtype)
        if window or softcap:
            mask = _window_mask(p.last, p.length, window)
            out[p.rows] = _attend(q.transpose(0, 1).unsqueeze(0), k, v, mask, scale, softcap)[0].transpose(0, 1)
            continue
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
            k,
            v,
            attn_mask=p.mask if causal else None,
            is_causal=causal and p.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[p.rows] = o.squeeze(0).transpose(0, 1)
    return out


def _decode_groups(query, out, k_cache, v_cache, k_scale, v_scale, groups: list[_Span], scale, window, softcap):
    """The torch decode path: each group's K/V gathered, then SDPA or grouped matmuls (`_decode_by_matmuls`)."""
    for g in groups:
        q = query[g.rows]
        k, v = _gather(k_cache, k_scale, g, q.dtype), _gather(v_cache, v_scale, g, q.dtype)
        if window or softcap:
            mask = _window_mask(g.last[:, None], g.length, window)[:, None]  # [b, 1, 1, L]
            out[g.rows] = _attend(q.unsqueeze(2), k, v, mask, scale, softcap).squeeze(2)
        elif _decode_by_matmuls(q.device.type, q.dtype):
            out[g.rows] = _decode(q, k.contiguous(), v.contiguous(), g.mask, scale)
        else:
            o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=g.mask, scale=scale, enable_gqa=True)
            out[g.rows] = o.squeeze(2)


def _prefill_native(query: torch.Tensor) -> bool:
    """Whether a prefill span runs the native kernel rather than SDPA: fp32 (1.1-1.6x SDPA's flash kernel), and
    bf16 where the CPU has bf16 dot products but no AMX tiles (AMD Zen 4 and 5), on which SDPA widens bf16 to
    fp32 (the kernel: 2.8-3.7x); with AMX tiles SDPA's bf16 runs on them. Figures:
    benchmarks/README.md. TIFFIN_CPU_PREFILL=sdpa|native overrides, for measuring."""
    choice = os.environ.get("TIFFIN_CPU_PREFILL", "auto")
    if choice == "sdpa" or not cpu_native.supports_prefill(query):
        return False
    return choice == "native" or query.dtype == torch.float32 or not torch.cpu._is_amx_tile_supported()


@functools.cache
def _decode_by_matmuls(device_type: str, dtype: torch.dtype) -> bool:
    """Whether one-token queries skip SDPA for `_decode`. SDPA's CPU flash kernel runs bf16/fp16 on AMX tiles
    where the CPU has them (Xeon 4th gen+), and there it is the faster; without AMX (AMD Zen 4, older Xeons)
    grouped matmuls are, by far; at fp32 SDPA is never the slower (figures: benchmarks/README.md).
    TIFFIN_CPU_DECODE=sdpa|matmul overrides, for measuring."""
    choice = os.environ.get("TIFFIN_CPU_DECODE", "auto")
    if choice != "auto":
        return choice == "matmul"
    return device_type == "cpu" and dtype != torch.float32 and not torch.cpu._is_amx_tile_supported()


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float):
    """One-token queries `[b, H, D]` against contiguous `[b, Hkv, L, D]` keys and values (strided ones send
    matmul down a slow path), as two batched matmuls with the query heads that share a KV head stacked as rows.
    Scores stay in the input dtype (as in SDPA's matmuls), the softmax runs in fp32."""
    b, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q = (q * scale).view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2))  # [b, Hkv, group, L]
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(probs, v).view(b, num_heads, head_dim)


def _window_mask(last: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """`[*last.shape, length]`: whether each key is seen by the query at position `last`, causally, within its
    last `window` keys (0: all)."""
    keys = torch.arange(length, device=last.device)
    seen = keys <= last[..., None]
    return seen & (keys > last[..., None] - window) if window else seen


def _attend(q, k, v, mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Attention of `q [b, H, n, D]` over `k`/`v` `[b, Hkv, L, D]` under `mask` (broadcast to `[b, H, n, L]`),
    the scores soft-capped where `softcap`: scores and softmax in fp32 (as transformers' eager Gemma attention
    upcasts its softmax), the probabilities rounded to v's dtype for P.V."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).to(v.dtype)
    return torch.matmul(probs, v)

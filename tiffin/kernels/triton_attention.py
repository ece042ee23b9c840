"""Triton paged attention (the GPU path of `paged_attention`; the KV-cache write: triton_write_kv).

One attention kernel, two tile shapes. A program owns `BLOCK_M` query rows: `block_q` consecutive tokens of one
request times `heads` query heads that share one KV head (GQA without repeating K/V; a group larger than the
tile is spread over several programs). It walks the request's KV through its block table `BLOCK_N` tokens a
step with an online softmax, skipping the causal mask on steps every row fully sees. Non-causal calls
(`CAUSAL=False`, encoders) let every row see all of its request's keys: only the last step masks, at `seq_len`.
- Prefill tiles (`DECODE=False`, 64-128 rows) serve requests with several query tokens: chunked prefills with
  a cached prefix as well as fresh prompts. Each program finds its request by binary search over
  `query_start_loc`.
- Decode tiles (`DECODE=True`, 16 rows, one token) serve the requests with one query token, one program per
  request and KV head. A mixed batch launches both; each program skips the other kind's requests, so decode
  rows never pay for prefill-sized tiles. In decode-only batches where requests x KV heads cannot fill the GPU,
  each request's KV range is split across programs ("flash decoding") and a merge kernel combines the partial
  softmaxes. A one-token query is the last of its context and sees every key either way, so decode tiles are
  the one (causal) binary for both kinds of call.

Quantized caches (`kv_quant`: int8 or fp8 codes, a bf16 scale per token and KV head) are read in place: each
K/V tile's codes times its tokens' scales, in fp32, rounded to the query's dtype (the values the torch path
dequantizes), then the same math. fp8 codes are unpacked by bit arithmetic, not Triton's fp8 types, so every
format runs from sm_80 on; e4m3 and e5m2 share one binary (`KV_CODES="fp8"`, the format a runtime argument).
The write kernel quantizes per token and KV head, keys rotated first where head_dim is a power of two
(triton_common has the code arithmetic both share, and the rotation the fused rotary write shares too).

Host code never reads device tensors: grids come from the host-side ints in `AttentionMetadata`. Launch,
interpreter and tile plumbing: triton_common.
"""

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tiffin.kernels import kv_quant
from tiffin.kernels import triton_common as tc
from tiffin.kernels.attention import AttentionMetadata
from tiffin.kernels.compile_check import CompileCase, register
from tiffin.kernels.dispatch import implements
from tiffin.kernels.triton_common import bf16_bits_to_float, kv_code_values

HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
# fp32 queries on a quantized cache: d=256 spills on sm_80 and sm_90 at every tile tried (BLOCK_N 16 or 32, one or
# two stages, 8 or 16 warps: 3xTF32 operand halves beside the scaled codes); refused, the torch backend serves it
QUANTIZED_FP32_HEAD_DIMS = HEAD_DIMS[:-1]
MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the parallelism it adds


def attention_tile(
    head_dim: int, dtype: torch.dtype, decode: bool, arch: int = 80, quantized: bool = False, bounded: bool = False
):
    """`block_m` query rows (tokens x query heads of one KV head) per program, `block_n` KV tokens per
    inner-loop step; `block_k` is the QK dot's inner dimension, the padded head dim. `quantized`: the KV cache
    holds codes (`_quantized_tile`). `bounded` (a window or soft-cap, 16-bit queries on a model-dtype cache only:
    fp32 tiles and quantized caches' spilled with it) takes registers for the mask's bounds and the cap: decode
    tiles step at most 64 keys (d <= 32 spilled at 128 on sm_89)."""
    tile = _model_dtype_tile(head_dim, dtype, decode, arch)
    tile = _quantized_tile(tile, dtype, decode, arch) if quantized else tile
    return dataclasses.replace(tile, block_n=min(tile.block_n, 64)) if bounded else tile


def _quantized_tile(tile: tc.Tile, dtype: torch.dtype, decode: bool, arch: int) -> tc.Tile:
    """Codes are scaled in registers on their way to the dots (a model-dtype tile goes from global to shared memory
    and on to the dot untouched), which takes registers the model-dtype tiles do not have to spare. What
    compile_check found spill-free: 16-bit decode tiles with 8 warps at the head dims of `_WIDE_QUANTIZED_DECODE`
    (4 elsewhere: ptxas spills some of those at 8), in the model-dtype tile's stages except two on sm_120; prefill
    tiles in one stage except on
    sm_90 (227 KB of shared memory keeps the second out of registers), d=256 in 16-token KV steps where a block
    has 99 KB. fp32 tiles (already 8 warps) fit as they are, except d=256, refused (`QUANTIZED_FP32_HEAD_DIMS`)."""
    if dtype == torch.float32:
        return tile
    if decode:
        warps = 8 if tile.block_k in _WIDE_QUANTIZED_DECODE.get(arch, ()) else 4
        return dataclasses.replace(tile, num_warps=warps, num_stages=2 if arch == 120 else tile.num_stages)
    if arch == 90:
        return tile
    block_n = 16 if tile.block_k == 256 and arch in (86, 89, 120) else tile.block_n
    return dataclasses.replace(tile, block_n=block_n, num_stages=1)


_WIDE_QUANTIZED_DECODE = {80: (128, 256), 86: (256,), 89: (256,), 90: (32,), 120: (256,)}  # padded head dims


def _model_dtype_tile(head_dim: int, dtype: torch.dtype, decode: bool, arch: int) -> tc.Tile:
    d = pad_head_dim(head_dim)
    small_shared = arch in (86, 89, 120)  # 99 KB of shared memory per block (sm_80: 163 KB, sm_90: 227 KB)
    if dtype == torch.float32:  # 3xTF32 keeps hi/lo halves of each operand in registers: small tiles, 8 warps
        # a second stage of d=256 K/V tiles takes 100 KB: one stage there
        stages = 1 if small_shared and d > 128 else 2
        return tc.Tile(16 if decode or d > 128 else 32, 32, d, num_warps=8, num_stages=stages)
    if decode:  # memory-bound: 16 rows (the GQA group) is the smallest MMA; wide KV steps keep loads in flight
        block_m, block_n = 16, (128 if d <= 32 else 64 if d <= 128 else 32)
    else:
        block_m, block_n = (128, 64) if d <= 128 else (64, 32)
    # ptxas caps sm_86/89's two-stage d=64 decode pipeline at 64 registers and spills; three stages do not
    # (sm_120 likewise at d=128)
    stages = 3 if small_shared and decode and (d == 64 or (arch == 120 and d == 128)) else 2
    return tc.Tile(block_m, block_n, d, num_warps=4 if block_m * d < 8192 else 8, num_stages=stages)


def pad_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit(
    do_not_specialize=[
        "num_seqs",
        "num_tokens",
        "num_heads",
        "group",
        "heads",
        "block_q",
        "block_shift",
        "stride_bt",
        "stride_sb",
        "stride_ss",
        "fp8_shift",
        "window",
    ]
)
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    part_ptr,
    stats_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,
    fp8_shift,
    code_unit,
    window,
    softcap,
    num_seqs,
    num_tokens,
    num_heads,
    group,
    heads,
    block_q,
    block_shift,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_sb,
    stride_ss,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr,
    SPLIT: tl.constexpr,
    CAUSAL: tl.constexpr,
    BOUNDED: tl.constexpr,
    KV_CODES: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Program (tile, kv_head x head chunk, split).
    tile, split = tl.program_id(0), tl.program_id(2)
    chunks = tl.cdiv(group, heads)
    kv_head, chunk = tl.program_id(1) // chunks, tl.program_id(1) % chunks

    if DECODE:  # tile = request; multi-token requests belong to the prefill launch
        seq = tile
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        first = 0
        skip = q_len != 1
    else:
        # Request i owns the tiles from query_start_loc[i] // block_q + i on: room for its ceil(q_len / block_q)
        # tiles. Decode requests (one token) belong to the decode launch.
        lo, hi = 0, num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(query_start_loc_ptr + mid) // block_q + mid <= tile:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        first = (tile - q_start // block_q - seq) * block_q  # the tile's first query token, request-local
        skip = (q_len == 1) | (first >= q_len)
    if skip:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos0 = seq_len - q_len + first  # cache position of the tile's first query token

    rows = tl.arange(0, BLOCK_M)
    row_tok = rows // heads
    head_in_group = chunk * heads + rows % heads
    row_ok = (row_tok < block_q) & (first + row_tok < q_len) & (head_in_group < group)
    token = q_start + first + row_tok
    head = kv_head * group + head_in_group
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q_off = token * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # A row sees the keys up to its own position; non-causal, every row sees them all, as the request's last
    # position does. The tile's keys end at its last row's position; SPLIT cuts them into BLOCK_N-aligned equal
    # ranges. Keys before `first_row_end` are visible to every row. (Non-causal keeps the causal mask's form with
    # every row at the last position: masking only `n_ok` made ptxas spill the fp32 d=64 prefill tile on sm_120.)
    if CAUSAL:
        row_pos = q_pos0 + row_tok
        kv_end = tl.minimum(q_pos0 + block_q, seq_len)
        first_row_end = q_pos0 + 1
    else:
        row_pos = tl.full([BLOCK_M], seq_len - 1, tl.int32)
        kv_end = seq_len
        first_row_end = seq_len
    # BOUNDED (a causal call with a window or a soft-cap, either 0 where off): a sliding window (`window` > 0)
    # starts the keys at the first row's window, no row sees those before, and every step masks.
    kv_first = 0
    if BOUNDED:
        kv_first = tl.where(window > 0, tl.maximum(q_pos0 - window + 1, 0), 0)
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_first, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        kv_lo = kv_first + split * per_split
        kv_hi = tl.minimum(kv_lo + per_split, kv_end)
    else:
        kv_lo = kv_first
        kv_hi = kv_end
    # Whole BLOCK_N steps of keys every row sees skip the mask.
    unmasked_end = kv_lo + tl.maximum(tl.minimum(first_row_end, kv_hi) - kv_lo, 0) // BLOCK_N * BLOCK_N
    if BOUNDED:
        unmasked_end = tl.where(window > 0, kv_lo, unmasked_end)
        row_first = tl.where(window > 0, row_pos - window + 1, 0)  # each row's first key

    bt_row = block_tables_ptr + seq * stride_bt
    block_mask = (1 << block_shift) - 1
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for phase in tl.static_range(2):
        if phase == 0:
            start_n = kv_lo
            end_n = unmasked_end
        else:
            start_n = unmasked_end
            end_n = kv_hi
        for n0 in range(start_n, end_n, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < kv_hi
            block = tl.load(bt_row + (n >> block_shift), mask=n_ok, other=0).to(tl.int64)
            in_block = n & block_mask
            k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
            v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
            k = tl.load(k_cache_ptr + k_off[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if KV_CODES != "":  # code x scale in fp32, rounded to the query's dtype: `kv_quant.dequantize`
                s_off = block * stride_sb + in_block * stride_ss + kv_head
                k_s = bf16_bits_to_float(tl.load(k_scale_ptr + s_off, mask=n_ok, other=0)) * code_unit
                v_s = bf16_bits_to_float(tl.load(v_scale_ptr + s_off, mask=n_ok, other=0)) * code_unit
                dtype = q_ptr.dtype.element_ty
                k = (kv_code_values(k, fp8_shift, KV_CODES) * k_s[None, :]).to(dtype)
                v = (kv_code_values(v, fp8_shift, KV_CODES) * v_s[:, None]).to(dtype)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # log2 domain
            if BOUNDED:
                if softcap > 0:  # softcap * tanh(score / softcap), `softcap` given in the log2 domain
                    s = softcap * (2 * tl.sigmoid(2 * s / softcap) - 1)
            if phase == 1:
                seen = (n[None, :] <= row_pos[:, None]) & n_ok[None, :]
                if BOUNDED:
                    seen = seen & (n[None, :] >= row_first[:, None])
                s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see no key in this range
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new

    if SPLIT:  # unnormalized partial [splits, T, H, HEAD_DIM_PAD] and its (max, sum) [splits, T, H, 2]
        part_row = (split * num_tokens + token) * num_heads + head
        tl.store(part_ptr + part_row[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(stats_ptr + part_row * 2, m_i, mask=row_ok)
        tl.store(stats_ptr + part_row * 2 + 1, l_i, mask=row_ok)
    else:
        o_off = token * stride_ot + head * stride_oh
        out = acc / l_i[:, None]
        tl.store(out_ptr + o_off[:, None] + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_splits", "num_tokens"])
def _merge_splits_kernel(
    out_ptr,
    part_ptr,
    stats_ptr,
    num_splits,
    num_tokens,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    token, head = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, MAX_SPLITS)
    s_ok = s < num_splits
    part_row = (s * num_tokens + token) * tl.num_programs(1) + head
    m = tl.load(stats_ptr + part_row * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(stats_ptr + part_row * 2 + 1, mask=s_ok, other=0.0)
    # Split 0 always holds the first key of the window, which the query sees, so the max is finite; empty splits
    # weigh 0.
    w = tl.math.exp2(m - tl.max(m, 0))
    d = tl.arange(0, HEAD_DIM_PAD)
    part = tl.load(part_ptr + part_row[:, None] * HEAD_DIM_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out, mask=d < HEAD_DIM)


@implements("paged_attention", "triton")
def paged_attention_triton(
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
    out = tc.empty(query.shape, query.dtype, query.device)
    if k_scale is not None and not query_rotated:  # against keys stored rotated (kv_quant)
        query = kv_quant.rotate(query).to(query.dtype)
    if query.shape[0]:
        kv = (k_cache, v_cache, md, scale, out)
        options = dict(causal=causal, k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap)
        for launch in paged_attention_launches(query, *kv, **options):
            launch(query.device)
    return out


def paged_attention_launches(
    query,
    k_cache,
    v_cache,
    md: AttentionMetadata,
    scale: float,
    out,
    splits: int | None = None,
    arch=None,
    causal: bool = True,
    k_scale=None,
    v_scale=None,
    window: int = 0,
    softcap: float = 0.0,
) -> list[tc.Launch]:
    """The launches for one call: prefill tiles unless every request decodes, and decode tiles. Decode-only
    batches may split KV `splits` ways (None: the dispatcher's choice), adding the merge. Tiles are `arch`'s
    (None: the device's). `causal` reaches only the prefill tiles (decode tiles see every key anyway). A quantized
    cache comes with its scales `k_scale`/`v_scale`. `window` and `softcap` (0: off) are runtime arguments of
    the binaries built `BOUNDED`, which only calls with either launch (as runtime arguments in every kernel they
    made the fp32 tiles spill)."""
    _check_attention_args(query, k_cache, v_cache, md, k_scale, v_scale)
    if (window or softcap) and (query.dtype == torch.float32 or k_scale is not None):
        raise ValueError(
            "paged_attention: the Triton kernel applies a window or soft-cap to 16-bit queries on a model-dtype KV "
            f"cache only, not {query.dtype} queries on a {k_cache.dtype} cache (those tiles spill registers); use "
            "kernel_backend='torch', or a 16-bit dtype and kv_cache_dtype='auto'"
        )
    arch = tc.arch(query.device) if arch is None else arch
    kv = (_KVCache(k_cache, v_cache, k_scale, v_scale), md, scale, out, arch)
    bounds = dict(window=window, softcap=softcap)
    decode = _attention(query, *kv, decode=True, **bounds)
    if md.max_query_len > 1:
        prefill = _attention(query, *kv, decode=False, causal=causal, **bounds)
        return [prefill, decode]
    if splits is None:
        splits = tc.num_splits(math.prod(decode.grid), triton.cdiv(md.max_seq_len, MIN_SPLIT_TOKENS), query.device)
    if splits == 1:
        return [decode]
    num_tokens, num_heads, head_dim = query.shape
    d_pad = pad_head_dim(head_dim)
    part = tc.empty((splits, num_tokens, num_heads, d_pad), torch.float32, query.device)
    stats = tc.empty((splits, num_tokens, num_heads, 2), torch.float32, query.device)
    merge = tc.Launch(
        _merge_splits_kernel,
        (num_tokens, num_heads),
        (out, part, stats, splits, num_tokens, out.stride(0), out.stride(1)),
        dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, MAX_SPLITS=tc.MAX_SPLITS),
    )
    return [_attention(query, *kv, True, splits, part, stats, **bounds), merge]


@dataclass(frozen=True)
class _KVCache:
    """The caches as the attention kernel reads them: fp8 codes as bytes, scales as their bf16 bits (int16); a
    model-dtype cache passes itself in the scales' places (never read: `KV_CODES=""`)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def args(self) -> tuple:
        if self.k_scale is None:
            return self.k, self.v, self.k, self.v
        codes = (tc.kv_code_view(self.k), tc.kv_code_view(self.v))
        return *codes, self.k_scale.view(torch.int16), self.v_scale.view(torch.int16)

    def options(self) -> tuple[str, int, float]:
        """(KV_CODES, fp8_shift, code_unit): "", "int8" or "fp8", and an fp8 format's unpacking
        (`triton_common.FP8_UNPACK`)."""
        codes = tc.kv_codes(self.k)
        if codes.startswith("fp8"):
            return "fp8", *tc.FP8_UNPACK[codes]
        return codes, 0, 1.0


def _attention(
    query,
    kv: _KVCache,
    md,
    scale,
    out,
    arch,
    decode,
    splits=1,
    part=None,
    stats=None,
    causal=True,
    window=0,
    softcap=0.0,
):
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv.k.shape[1:3]
    kv_codes, fp8_shift, code_unit = kv.options()
    scale_strides = kv.k_scale.stride()[:2] if kv.k_scale is not None else (0, 0)
    num_seqs, group = md.seq_lens.shape[0], num_heads // num_kv_heads
    bounded = bool(window or softcap)
    tile = attention_tile(head_dim, query.dtype, decode, arch, quantized=kv.k_scale is not None, bounded=bounded)
    heads = min(group, tile.block_m)
    block_q = 1 if decode else tile.block_m // heads
    num_tiles = num_seqs if decode else num_tokens // block_q + num_seqs
    return tc.Launch(
        _paged_attention_kernel,
        (num_tiles, num_kv_heads * triton.cdiv(group, heads), splits),
        (
            query,
            *kv.args(),
            out,
            out if part is None else part,
            out if stats is None else stats,
            md.query_start_loc,
            md.seq_lens,
            md.block_tables,
            scale * math.log2(math.e),
            fp8_shift,
            code_unit,
            window,
            softcap * math.log2(math.e),
            num_seqs,
            num_tokens,
            num_heads,
            group,
            heads,
            block_q,
            block_size.bit_length() - 1,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            *kv.k.stride()[:3],
            *kv.v.stride()[:3],
            md.block_tables.stride(0),
            *scale_strides,
        ),
        dict(
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=tile.block_k,
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            DECODE=decode,
            SPLIT=splits > 1,
            CAUSAL=causal,
            BOUNDED=bounded,
            KV_CODES=kv_codes,
            **tc.dot_options(query),
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        ),
    )


def _check_attention_args(query, k_cache, v_cache, md: AttentionMetadata, k_scale=None, v_scale=None) -> None:
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"paged_attention: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit "
            f"query {tuple(query.shape)}"
        )
    cache_dtype = query.dtype if k_scale is None else k_cache.dtype  # quantized: codes of any format, any query
    if query.dtype not in tc.DTYPES or k_cache.dtype != cache_dtype or v_cache.dtype != cache_dtype:
        raise ValueError(
            f"paged_attention: query/cache dtypes must match and be one of {tc.DTYPES} (or the caches quantized, "
            f"with scales), got {query.dtype}/{k_cache.dtype}/{v_cache.dtype}"
        )
    if k_scale is not None:
        tc.check_kv_scales("paged_attention", k_cache, k_scale, v_scale)
        if query.dtype == torch.float32 and head_dim not in QUANTIZED_FP32_HEAD_DIMS:
            raise ValueError(
                f"paged_attention: kv_cache_dtype {tc.kv_codes(k_cache)} with float32 queries and head_dim "
                f"{head_dim} is not supported by the Triton kernel (head dims {QUANTIZED_FP32_HEAD_DIMS}); use "
                f"kernel_backend='torch' or a 16-bit dtype"
            )
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"paged_attention: head_dim {head_dim} not supported by the Triton kernel ({HEAD_DIMS})")
    if block_size & (block_size - 1):
        raise ValueError(f"paged_attention: block_size must be a power of two, got {block_size}")
    if query.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_attention: head_dim must be the contiguous dimension of query and caches")
    for name in ("query_start_loc", "seq_lens", "block_tables"):
        t = getattr(md, name)
        if t.dtype != torch.int32 or t.device != query.device:
            raise ValueError(f"paged_attention: md.{name} must be int32 on {query.device}, got {t.dtype} on {t.device}")
    if md.block_tables.stride(1) != 1:
        raise ValueError("paged_attention: md.block_tables rows must be contiguous")


@register("paged_attention")
def _compile_cases(arch: int):
    """Every launch the dispatchers can make: each query dtype and head dim, on model-dtype caches and quantized
    ones (int8, fp8: e4m3 and e5m2 share the binary), the prefill tile causal and not, the decode tile with and
    without KV splits, the causal ones `BOUNDED` too (a window or soft-cap: 16-bit queries, model-dtype caches),
    and the merge. Block size, GQA ratio and batch shape
    are runtime arguments that do not change the binary."""
    for dtype in tc.DTYPES:
        name = str(dtype).removeprefix("torch.")
        for codes, cache_dtype in (("", dtype), ("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
            label = f" kv={codes}" if codes else ""
            for head_dim in QUANTIZED_FP32_HEAD_DIMS if codes and dtype == torch.float32 else HEAD_DIMS:
                seen = set()
                kinds = [(False, None, True, 0), (False, None, False, 0), (True, 1, True, 0), (True, 2, True, 0)]
                if dtype != torch.float32 and not codes:
                    kinds += [(False, None, True, 8), (True, 1, True, 8), (True, 2, True, 8)]
                for decode_only, splits, causal, window in kinds:
                    query, cache, _, md, scale, out = _example_inputs(dtype, head_dim, decode_only)
                    cache = cache.to(cache_dtype)
                    scales = tc.example_kv_scales(cache)
                    for launch in paged_attention_launches(
                        query, cache, cache, md, scale, out, splits, arch, causal, *scales, window=window
                    ):
                        kind = _launch_kind(launch)
                        if kind not in seen and not (codes and kind == "merge"):  # the merge reads no cache
                            seen.add(kind)
                            config = f"{name} d={head_dim}{label} {kind}"
                            yield CompileCase(launch.kernel, config, launch.args, launch.kwargs)


def _launch_kind(launch: tc.Launch) -> str:
    if launch.kernel is _merge_splits_kernel:
        return "merge"
    bounded = " bounded" if launch.kwargs["BOUNDED"] else ""
    if launch.kwargs["DECODE"]:
        return ("decode split" if launch.kwargs["SPLIT"] else "decode") + bounded
    return ("prefill" if launch.kwargs["CAUSAL"] else "prefill non-causal") + bounded


def _example_inputs(dtype: torch.dtype, head_dim: int, decode: bool):
    """Shape-only ("meta") arguments for `paged_attention_launches`: only dtypes, constexprs and the
    16-divisibility of pointers and strides reach the compiler, and those match any engine batch."""
    num_kv_heads, group, block_size, num_blocks = 2, 4, 16, 8
    num_tokens = 2 if decode else 8
    meta = dict(device="meta")
    query = torch.empty(num_tokens, num_kv_heads * group, head_dim, dtype=dtype, **meta)
    cache = torch.empty(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, **meta)
    starts = [0, 1, 2] if decode else [0, 3, 8]
    md = AttentionMetadata(
        slot_mapping=torch.empty(num_tokens, dtype=torch.int64, **meta),
        query_start_loc=torch.empty(3, dtype=torch.int32, **meta),
        seq_lens=torch.empty(2, dtype=torch.int32, **meta),
        block_tables=torch.empty(2, 4, dtype=torch.int32, **meta),
        query_start_loc_cpu=starts,
        seq_lens_cpu=[40, 64],
        max_query_len=1 if decode else 5,
        max_seq_len=64,
    )
    return query, cache, cache, md, head_dim**-0.5, torch.empty_like(query)

"""The Triton paged-attention kernels: `_paged_attention_kernel`, whose programs each own a tile of query rows (the
tokens of one request times the query heads of one KV head) and walk that request's KV through its block table with
an online softmax, in prefill or decode tiles, over all of the keys or one split of them; and `_merge_splits_kernel`,
which combines the splits' partial softmaxes. What the tiles are, when each launches and how the cache is read:
triton_attention, which builds every launch of them.
"""

import triton
import triton.language as tl

from tiffin.kernels.triton_common import bf16_bits_to_float, kv_code_values


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

"""Quantized KV caches (kernels/kv_quant.py): the reference's error bounds, the native CPU write (byte for byte the
reference's codes) and decode attention, and the torch path, each against attention over the dequantized cache."""

import pytest
import torch

from tiffin import kernels
from tiffin.kernels import AttentionMetadata, cpu_native, kv_quant

CODES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
CODE_IDS = ["int8", "e4m3", "e5m2"]
# the largest error of a value relative to its head's largest magnitude: half a step at the top of the range
# the native kernel's queries meet int8 keys in int16 (15 bits of the head's largest magnitude), fp8 ones in fp32
QUERY_ERROR = {torch.int8: 2e-4, torch.float8_e4m3fn: 1e-5, torch.float8_e5m2: 1e-5}
RELATIVE_ERROR = {torch.int8: 0.5 / 127, torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}


@pytest.mark.parametrize("dtype", CODES, ids=CODE_IDS)
def test_quantize_error_is_within_half_a_step(dtype):
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 3, 64)[:, None, None]
    x[0, 1] = 0  # an all-zero head: codes 0, finite
    codes, scales = kv_quant.quantize(x, dtype)
    assert codes.dtype == dtype and scales.dtype == torch.bfloat16 and scales.shape == x.shape[:-1]
    error = (kv_quant.dequantize(codes, scales, torch.float32) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.all(error <= amax * RELATIVE_ERROR[dtype] * 1.01 + 1e-30)
    assert not codes[0, 1].float().any() and torch.isfinite(scales).all()


@pytest.mark.parametrize("head_dim", [16, 64, 128, 80])
def test_rotation_is_the_orthonormal_hadamard_matrix(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(5, 3, head_dim, generator=gen)
    if head_dim & (head_dim - 1):  # not a power of two: no rotation
        assert torch.equal(kv_quant.rotate(x), x)
        return
    popcount = [[bin(i & j).count("1") for j in range(head_dim)] for i in range(head_dim)]
    matrix = (-1.0) ** torch.tensor(popcount, dtype=torch.float64) / head_dim**0.5
    torch.testing.assert_close(kv_quant.rotate(x).double(), x.double() @ matrix, rtol=1e-6, atol=1e-6)
    q = torch.randn(4, head_dim, generator=gen, dtype=torch.float64)
    scores = kv_quant.rotate(q).double() @ kv_quant.rotate(x).double().flatten(0, 1).T  # q.k kept: fp32 rounding aside
    torch.testing.assert_close(scores, q @ x.double().flatten(0, 1).T, rtol=1e-5, atol=1e-5)


def test_rotation_spreads_an_outlier_channel():
    """A key head with one channel 20x the others: the rotated head quantizes with several times less error."""
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    x[:, 7] *= 20
    error = lambda y: (kv_quant.dequantize(*kv_quant.quantize(y, torch.int8), torch.float32) - y).pow(2).mean()
    assert error(kv_quant.rotate(x)) * 4 < error(x)


def test_int8_heads_use_the_whole_range():
    codes, _ = kv_quant.quantize(torch.randn(100, 2, 64), torch.int8)
    assert codes.abs().amax(-1).eq(127).all()


@pytest.mark.parametrize("head_dim", [64, 80])
def test_kv_blocks_round_trip_within_the_int8_error(head_dim):
    """`quantize_kv` stores blocks as a quantized cache does (keys rotated: rotated queries meet them as the keys),
    `dequantize_kv` rotates the keys back: each head within the int8 error of its largest magnitude (the keys' in
    L2, which the rotation keeps; a score's within that times the query's norm)."""
    kv = torch.randn(2, 3, 16, 2, head_dim, generator=torch.Generator().manual_seed(head_dim))
    kv[0, ..., 5] *= 20  # an outlier channel
    codes, scales = kv_quant.quantize_kv(kv, torch.int8)
    assert codes.shape == kv.shape and codes.dtype == torch.int8 and scales.shape == kv.shape[:-1]
    step = RELATIVE_ERROR[torch.int8] * 1.01
    key_error = kv_quant.rotate(kv[0]).abs().amax(-1) * step * head_dim**0.5  # per head, in L2
    q = torch.randn(head_dim, generator=torch.Generator().manual_seed(1))
    scores = kv_quant.dequantize(codes[0], scales[0], torch.float32) @ kv_quant.rotate(q)
    assert torch.all((scores - kv[0] @ q).abs() <= key_error * q.norm())
    back = kv_quant.dequantize_kv(codes, scales, torch.float32)
    assert kv_quant.dequantize_kv(codes, scales, torch.bfloat16).dtype == torch.bfloat16
    assert torch.all((back[1] - kv[1]).abs() <= kv[1].abs().amax(-1, keepdim=True) * step)
    assert torch.all((back[0] - kv[0]).norm(dim=-1) <= key_error)


def _write_case(cache_dtype, dtype, tokens=37, heads=3, head_dim=64, blocks=10, block_size=16):
    gen = torch.Generator().manual_seed(tokens)
    key = (torch.randn(tokens, heads, head_dim, generator=gen) * 3).to(dtype)
    value = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    key[3] = 0
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[5] = -1  # padding: nothing written
    caches = [torch.zeros(blocks, block_size, heads, head_dim, dtype=cache_dtype) for _ in range(2)]
    scales = [torch.zeros(blocks, block_size, heads, dtype=torch.bfloat16) for _ in range(2)]
    return key, value, slots, caches, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache_dtype", CODES, ids=CODE_IDS)
@pytest.mark.parametrize("head_dim", [64, 40])  # 16 lanes at a time (int8, AVX-512), one at a time
def test_native_write_is_the_reference(dtype, cache_dtype, head_dim):
    """Values byte for byte the reference's codes and scales; keys rotated, by butterflies where the reference
    multiplies by the matrix: within half a step of the rotated keys, their scales within a bf16 rounding."""
    key, value, slots, (kc, vc), (ks, vs) = _write_case(cache_dtype, dtype, head_dim=head_dim)
    cpu_native.write_kv(key, value, kc, vc, ks, vs, slots)
    keep = slots >= 0
    written = lambda cache: cache.view(torch.uint8).flatten(0, 1)[slots[keep]].view(cache_dtype)
    codes, want_scales = kv_quant.quantize(value[keep], cache_dtype)
    assert torch.equal(written(vc).view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(vs.flatten(0, 1)[slots[keep]], want_scales)
    rotated, k_scales = kv_quant.rotate(key[keep]), ks.flatten(0, 1)[slots[keep]]
    amax = rotated.abs().amax(-1, keepdim=True)
    error = (kv_quant.dequantize(written(kc), k_scales, torch.float32) - rotated).abs()
    assert torch.all(error <= amax * RELATIVE_ERROR[cache_dtype] * 1.01 + 1e-30)
    torch.testing.assert_close(k_scales, kv_quant.quantize(rotated, cache_dtype)[1], rtol=1e-2, atol=0)
    untouched = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert not kc.view(torch.uint8).flatten(0, 1)[untouched].any()  # the padding row wrote nothing


def _decode_case(cache_dtype, dtype, head_dim, lens, num_heads=6, num_kv_heads=2, block_size=16):
    """A paged quantized cache of `len(lens)` sequences (shuffled blocks), one-token queries, and the same cache
    dequantized to `dtype`: the reference's input (its keys rotated, as stored: the reference rotates its
    queries)."""
    gen = torch.Generator().manual_seed(head_dim + len(lens))
    blocks_per_seq = -(-max(lens) // block_size)
    num_blocks = blocks_per_seq * len(lens) + 1
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    codes, scales = kv_quant.quantize(kv, cache_dtype)
    plain = kv_quant.dequantize(codes, scales, dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: blocks_per_seq * len(lens)].view(len(lens), -1).int()
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=seq_lens,
        block_tables=tables,
        query_start_loc_cpu=list(range(len(lens) + 1)),
        seq_lens_cpu=list(lens),
        max_query_len=1,
        max_seq_len=max(lens),
    )
    return query, codes, scales, plain, md


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache_dtype", CODES, ids=CODE_IDS)
@pytest.mark.parametrize("head_dim", [32, 64, 128])  # 64, 128: the AVX-512 kernel where the CPU has it
def test_native_decode_reads_quantized_blocks_as_their_values(dtype, cache_dtype, head_dim):
    lens = [1, 17, 40, 100]  # 1 and 17: a tile of 16 and a tail; several sequences: tasks per sequence
    query, codes, scales, plain, md = _decode_case(cache_dtype, dtype, head_dim, lens)
    out, ref = torch.empty_like(query), torch.empty_like(query)
    rows = torch.arange(len(lens))
    cpu_native.paged_decode(query, out, *codes, *scales, md.block_tables, md.seq_lens, rows, rows, 0.125)
    rotated = kv_quant.rotate(query).to(dtype)
    cpu_native.paged_decode(rotated, ref, *plain, None, None, md.block_tables, md.seq_lens, rows, rows, 0.125)
    tolerance = dict(rtol=1e-5, atol=QUERY_ERROR[cache_dtype]) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache_dtype", CODES, ids=CODE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_avx2_decode_reads_quantized_blocks_as_their_values(avx2_library, monkeypatch, dtype, cache_dtype, head_dim):
    """The 8-lane task of CPUs without AVX-512 (built for x86-64-v3) on codes, its tiles of 8 tokens and tails (1, 7,
    8, 17, ...), against this machine's kernel on the dequantized cache."""
    lens = [1, 7, 8, 17, 40, 100]
    query, codes, scales, plain, md = _decode_case(cache_dtype, dtype, head_dim, lens)
    out, ref = torch.empty_like(query), torch.empty_like(query)
    rows = torch.arange(len(lens))
    cpu_native.paged_decode(
        kv_quant.rotate(query).to(dtype), ref, *plain, None, None, md.block_tables, md.seq_lens, rows, rows, 0.125
    )
    monkeypatch.setattr(cpu_native, "library", lambda: avx2_library)
    cpu_native.paged_decode(query, out, *codes, *scales, md.block_tables, md.seq_lens, rows, rows, 0.125)
    tolerance = dict(rtol=1e-5, atol=QUERY_ERROR[cache_dtype]) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache_dtype", [None, *CODES], ids=["model-dtype", *CODE_IDS])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_native_prefill_reads_the_cache_in_place(dtype, cache_dtype, head_dim):
    """A prompt's chunk after its cached prefix (70 queries, the last of 300 slots through a shuffled block
    table): the native prefill kernel reads the blocks in place, a quantized cache's codes times their scales with
    the keys rotated back, against float64 attention of the unrotated queries over the cache's values."""
    lens = [300]
    query, codes, scales, plain, md = _decode_case(cache_dtype or torch.int8, dtype, head_dim, lens)
    query = torch.randn(70, 6, head_dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    if not cpu_native.supports_prefill(query):
        pytest.skip("this CPU has no AVX512-BF16: the prefill kernel is not built")
    caches, cache_scales = (plain, (None, None)) if cache_dtype is None else (codes, scales)
    out = torch.empty_like(query)
    cpu_native.paged_prefill(query, out, *caches, *cache_scales, md.block_tables[0], 300, 0.125)
    values_of = plain if cache_dtype is None else kv_quant.dequantize(codes, scales, torch.float32)
    keys, values = (x.flatten(0, 1)[_slots(md.block_tables[0], 16, 300)].float() for x in values_of)
    if cache_dtype is not None:
        keys = kv_quant.rotate(keys)  # stored rotated: rotated back
    keys, values = keys.double(), values.double()
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys.repeat_interleave(3, 1)) * 0.125
    visible = torch.arange(300) <= torch.arange(230, 300)[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    ref = torch.einsum("hqk,khd->qhd", probs, values.repeat_interleave(3, 1))
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < tolerance


def _slots(table: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    positions = torch.arange(length)
    return table[positions // block_size].long() * block_size + positions % block_size


@pytest.mark.parametrize("cache_dtype", CODES, ids=CODE_IDS)
def test_torch_path_matches_the_native_kernel(monkeypatch, cache_dtype):
    """The torch path (no native library: fp16 models, other CPUs' fallback) over the same quantized cache."""
    query, codes, scales, _, md = _decode_case(cache_dtype, torch.float32, 64, [5, 33, 70])
    native = kernels.paged_attention(query, *codes, md, 0.125, "torch", True, *scales)
    monkeypatch.setattr(cpu_native, "supports_cache", lambda *_: False)
    md.torch_plan = None
    torch_path = kernels.paged_attention(query, *codes, md, 0.125, "torch", True, *scales)
    torch.testing.assert_close(torch_path, native, rtol=1e-5, atol=QUERY_ERROR[cache_dtype])


def test_a_prompt_attends_its_fresh_kv_and_a_later_chunk_the_cache():
    """One step, two prefills written through write_kv: a prompt without a cached prefix attends the keys and
    values given as `fresh_kv` (exactly, not their int8 codes read back); a chunk after a cached prefix attends
    the dequantized cache, its own tokens included, as a later decode step reads them."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, block_size, prefix, n = 4, 2, 64, 16, 12, 20
    caches = [torch.zeros(6, block_size, kv_heads, head_dim, dtype=torch.int8) for _ in range(2)]
    scales = [torch.zeros(6, block_size, kv_heads, dtype=torch.bfloat16) for _ in range(2)]
    q, k, v = (torch.randn(prefix + 2 * n, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    kernels.write_kv(k[:prefix], v[:prefix], *caches, torch.arange(prefix) + 4 * block_size, "torch", *scales)
    step = slice(prefix, None)  # request 0: blocks 1, 2, no prefix; request 1: blocks 4, 5 after `prefix` tokens
    md = AttentionMetadata(
        slot_mapping=torch.cat([torch.arange(n) + block_size, torch.arange(prefix, prefix + n) + 4 * block_size]),
        query_start_loc=torch.tensor([0, n, 2 * n], dtype=torch.int32),
        seq_lens=torch.tensor([n, prefix + n], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [4, 5]], dtype=torch.int32),
        query_start_loc_cpu=[0, n, 2 * n],
        seq_lens_cpu=[n, prefix + n],
        max_query_len=n,
        max_seq_len=prefix + n,
    )
    kernels.write_kv(k[step], v[step], *caches, md.slot_mapping, "torch", *scales)
    fresh_kv = k[step], v[step]
    out = kernels.paged_attention(q[step], *caches, md, head_dim**-0.5, "torch", True, *scales, fresh_kv=fresh_kv)

    def sdpa(q, k, v, mask):  # [n, heads, head_dim] against [L, kv_heads, head_dim]
        o = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(0, 1) for x in (q, k, v)), attn_mask=mask, enable_gqa=True
        )
        return o.transpose(0, 1)

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    torch.testing.assert_close(out[:n], sdpa(q[prefix : prefix + n], k[step][:n], v[step][:n], causal))
    k1, v1 = torch.cat([k[:prefix], k[prefix + n :]]), torch.cat([v[:prefix], v[prefix + n :]])
    kd, vd = (kv_quant.dequantize(*kv_quant.quantize(x, torch.int8), torch.float32) for x in (kv_quant.rotate(k1), v1))
    mask = torch.ones(n, prefix + n, dtype=torch.bool).tril(prefix)
    torch.testing.assert_close(out[n:], sdpa(kv_quant.rotate(q[prefix + n :]), kd, vd, mask), rtol=1e-5, atol=1e-5)


def test_scales_are_checked():
    query, codes, scales, plain, md = _decode_case(torch.int8, torch.float32, 64, [5])
    with pytest.raises(ValueError, match="quantized"):
        kernels.paged_attention(query, *codes, md, 0.125)
    with pytest.raises(ValueError, match="quantized"):
        kernels.paged_attention(query, *plain, md, 0.125, "torch", True, *scales)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.paged_attention(query, *codes, md, 0.125, "torch", True, scales[0][:, :4], scales[1][:, :4])

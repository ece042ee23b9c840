"""Sliding-window attention and logit soft-capping (Gemma 2/3) in `paged_attention`: each implementation (the torch
path's reference `_attend`, the native CPU decode and prefill kernels, the Triton kernels under the interpreter at
fp32/fp16) against a float64 reference written here, one request at a time with an explicit window mask.

Batches mix fresh prompts longer than the window, chunks after a cached prefix that cross the window's edge, and
decode rows with contexts shorter and longer than the window."""

import math

import pytest
import torch
from test_fused_kernels import interpreter  # noqa: F401  (kernels interpreted, NaN buffers)
from test_kernels_attention import TOLERANCE, make_batch, naive_attention, rel_error

from tiffin.kernels import attention, cpu_native, kv_quant, paged_attention

# (window, softcap): Gemma 3's local layers, Gemma 2's local and global layers; a window of one key
BOUNDS = [(24, 0.0), (24, 2.0), (0, 2.0), (1, 0.0)]
IDS = ["window", "window+softcap", "softcap", "window1"]


def windowed_attention(query, k_cache, v_cache, md, scale, window, softcap) -> torch.Tensor:
    """Float64: request i's query at position p sees keys k with p - window < k <= p (all k <= p without a
    window), scores `softcap * tanh(s / softcap)` first where softcap > 0."""
    group, block_size = query.shape[1] // k_cache.shape[2], k_cache.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for i, seq_len in enumerate(md.seq_lens_cpu):
        rows = slice(md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1])
        where = [(int(md.block_tables[i, t // block_size]), t % block_size) for t in range(seq_len)]
        k = torch.stack([k_cache[b, o] for b, o in where]).double().repeat_interleave(group, 1)  # [L, H, D]
        v = torch.stack([v_cache[b, o] for b, o in where]).double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", query[rows].double(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - (rows.stop - rows.start), seq_len)[:, None]
        keys = torch.arange(seq_len)
        seen = (keys <= q_pos) & ((keys > q_pos - window) if window else True)
        out[rows] = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~seen, -math.inf), -1), v)
    return out


def mixed_batch(dtype, head_dim, group=2, block_size=16, seed=0):
    """A fresh prompt of 70 tokens, a 30-token chunk after 50 cached ones, decode rows of 5 to 300 tokens."""
    gen = torch.Generator().manual_seed(seed)
    query_lens = [70, 30, 1, 1, 1, 1]
    context_lens = [0, 50, 4, 23, 24, 299]
    return make_batch(query_lens, context_lens, 2 * group, 2, head_dim, block_size, dtype, gen)


@pytest.fixture(params=["native", "reference"])
def cpu_path(request, monkeypatch):
    """The native kernels (decode and, fp32/bf16 at head dims 64/128 with AVX512-BF16, prefill), or the torch
    path without them (`_attend`)."""
    if request.param == "native":
        assert cpu_native.library() is not None, "the native CPU kernels did not build (see the log)"
    else:
        monkeypatch.setattr(cpu_native, "supports", lambda *tensors: False)
        monkeypatch.setattr(cpu_native, "supports_cache", lambda *tensors: False)
    return request.param


@pytest.mark.parametrize("window,softcap", BOUNDS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 96])  # 96: the native decode's generic loop, the prefill's SDPA-less path
def test_torch_path_window_and_softcap(cpu_path, window, softcap, dtype, head_dim):
    batch = mixed_batch(dtype, head_dim, seed=head_dim)
    out = paged_attention(*batch, 0.125, window=window, softcap=softcap)
    want = windowed_attention(*batch, 0.125, window, softcap)
    assert rel_error(out, want) < TOLERANCE[dtype]
    assert rel_error(want.float(), naive_attention(*batch, 0.125)) > 0.05  # the window and cap change the answer


@pytest.mark.parametrize("window,softcap", [(24, 2.0), (0, 0.0)], ids=["window+softcap", "plain"])
def test_native_prefill_kernel_window(window, softcap):
    """`prefill_attention` on its own: 300 keys, query rows in blocks of 32, window across its 256-key tiles."""
    if not cpu_native.supports_prefill(torch.empty(1, 1, 64)):
        pytest.skip("this CPU has no AVX512-BF16: no native prefill kernel")
    batch = make_batch([300], [0], 4, 2, 64, 16, torch.float32, torch.Generator().manual_seed(1))
    query, k_cache, _, md = batch
    slots = md.block_tables[0, torch.arange(300) // 16].long() * 16 + torch.arange(300) % 16
    k, v = (c.flatten(0, 1)[slots] for c in batch[1:3])
    out = cpu_native.prefill_attention(query, k, v, 0.125, True, None, window, softcap)
    assert rel_error(out, windowed_attention(*batch, 0.125, window, softcap)) < 1e-5


def test_quantized_cache_native_decode_window(cpu_path):
    """An int8 cache: its tokens' scales are read from the window's first token on."""
    gen = torch.Generator().manual_seed(2)
    query, k_cache, v_cache, md = make_batch([1, 1], [40, 200], 4, 2, 64, 16, torch.float32, gen)
    codes, scales = kv_quant.quantize_kv(torch.stack([k_cache, v_cache]), torch.int8)
    plain = kv_quant.dequantize_kv(codes, scales, torch.float32)
    out = paged_attention(query, *codes, md, 0.125, k_scale=scales[0], v_scale=scales[1], window=24, softcap=2.0)
    assert rel_error(out, windowed_attention(query, *plain, md, 0.125, 24, 2.0)) < 1e-3


def test_bad_bounds_are_refused():
    batch = mixed_batch(torch.float32, 64)
    with pytest.raises(ValueError, match="window"):
        paged_attention(*batch, 0.125, causal=False, window=8)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention(*batch, 0.125, softcap=-1.0)
    with pytest.raises(ValueError, match="causal"):
        paged_attention(*batch, 0.125, causal=False, softcap=2.0)


@pytest.mark.parametrize("window,softcap", BOUNDS, ids=IDS)
@pytest.mark.parametrize("head_dim", [64, 32])  # 32: the decode tile's 128-key steps cut to 64
def test_triton_window_and_softcap(interpreter, window, softcap, head_dim):  # noqa: F811
    """fp16 (the interpreter computes bf16 wrongly; fp32 and quantized caches are refused, below)."""
    batch = mixed_batch(torch.float16, head_dim, group=4, block_size=16, seed=3)
    out = paged_attention(*batch, 0.125, backend="triton", window=window, softcap=softcap)
    assert not out.isnan().any(), "output not fully written"
    assert rel_error(out, windowed_attention(*batch, 0.125, window, softcap)) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("window", [24, 200])
def test_triton_decode_splits_start_at_the_window(interpreter, monkeypatch, window):  # noqa: F811
    """Decode-only, KV split several ways from the window's first key: the merge weighs empty splits as zero."""
    from tiffin.kernels import triton_attention as ta

    monkeypatch.setattr(ta, "MIN_SPLIT_TOKENS", 16)
    batch = make_batch([1, 1], [300, 30], 8, 1, 64, 16, torch.float16, torch.Generator().manual_seed(4))
    assert len(ta.paged_attention_launches(*batch, 0.125, batch[0], window=window)) == 2  # attention + merge
    out = paged_attention(*batch, 0.125, backend="triton", window=window, softcap=3.0)
    assert rel_error(out, windowed_attention(*batch, 0.125, window, 3.0)) < TOLERANCE[torch.float16]


def test_triton_refuses_what_spills():
    """fp32 queries and quantized caches with a window or soft-cap spill registers (compile_check): refused by
    name, pointing at what serves them."""
    query, k_cache, v_cache, md = mixed_batch(torch.float32, 64)
    with pytest.raises(ValueError, match="16-bit queries on a model-dtype KV cache only"):
        paged_attention(query, k_cache, v_cache, md, 0.1, backend="triton", window=4)
    codes, scales = kv_quant.quantize_kv(torch.stack([k_cache, v_cache]), torch.int8)
    with pytest.raises(ValueError, match="kernel_backend='torch'"):
        paged_attention(query.half(), *codes, md, 0.1, "triton", k_scale=scales[0], v_scale=scales[1], softcap=2.0)


def test_attend_is_the_reference_of_sdpa():
    """`_attend` without window or cap equals SDPA's causal attention: the reference path is the plain one's."""
    q, k, v = (torch.randn(1, 4, 9, 32, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2)
    assert torch.allclose(attention._attend(q, k, v, mask, 0.2, 0.0), want, atol=1e-6)

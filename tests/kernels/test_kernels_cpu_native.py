"""The native CPU kernels (kernels/csrc) against plain torch references, and the torch fallback without a
compiler. Paged decode attention is also checked beside the other CPU decode paths in test_kernels_attention."""

import logging

import pytest
import torch

from tiffin import kernels
from tiffin.kernels import cpu_native, rms_norm


@pytest.fixture(autouse=True)
def built():
    assert cpu_native.library() is not None, "the native CPU kernels did not build (a compiler is on CI machines)"


def reference_rms_norm(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 600])  # 600 x 576 runs multithreaded
def test_rms_norm_matches_torch(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    out = cpu_native.rms_norm(x, weight, 1e-6)
    ref = reference_rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.bfloat16:  # fp32 math agrees to an ulp, which bf16 rounding hides
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_argmax_is_torchs_first_max(dtype):
    """Ties (few distinct values), a maximum in the ragged tail past the last 64-wide chunk, rows of -inf, NaN
    (torch.max picks the first NaN), one column, and rows many enough to run multithreaded."""
    gen = torch.Generator().manual_seed(0)
    cases = [torch.randn(64, 32000, generator=gen), torch.randint(0, 3, (9, 200), generator=gen).float()]
    tail = torch.zeros(3, 130)
    tail[:, 129] = 1
    edge = torch.randn(5, 70, generator=gen)
    edge[0] = -torch.inf
    edge[1, [3, 40]] = torch.nan
    edge[2, 69] = torch.nan
    edge[3, [0, 65]] = torch.inf
    cases += [tail, edge, torch.randn(4, 1, generator=gen)]
    for x in (c.to(dtype) for c in cases):
        assert torch.equal(cpu_native.argmax(x), x.max(-1).indices)
    wide = torch.randn(6, 300, generator=gen).to(dtype)
    assert torch.equal(kernels.argmax(wide[:, 10:250]), wide[:, 10:250].max(-1).indices)  # rows 300 apart
    assert torch.equal(kernels.argmax(wide.T), wide.T.max(-1).indices)  # columns strided: torch's


def test_rms_norm_of_a_strided_view():
    x = torch.randn(4, 3, 64).bfloat16()[:, 1]  # rows 192 elements apart
    weight = torch.randn(64).bfloat16()
    assert torch.equal(rms_norm(x, weight, 1e-5), reference_rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [3, 300])  # 300 x 12 heads x 64 runs multithreaded
def test_rotary_matches_torch(monkeypatch, dtype, tokens):
    from tiffin.engine.models.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(tokens)
    rope = RotaryEmbedding(64, 4096, 10000.0, None)
    qkv = (torch.randn(tokens, 16, 64, generator=gen) * 3).to(dtype)
    x = qkv[:, :12]  # the query and key heads of a fused projection: rows 16 heads apart
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    out = rope(positions, x)
    monkeypatch.setattr(cpu_native, "supports", lambda *tensors: False)
    ref = RotaryEmbedding(64, 4096, 10000.0, None)(positions, x)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.bfloat16:  # every product and sum rounded as torch rounds them
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_no_compiler_falls_back_to_torch(monkeypatch, caplog):
    monkeypatch.setattr(cpu_native.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    cpu_native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
            assert cpu_native.library() is None
        assert "no C++ compiler" in caplog.text
        x, weight = torch.randn(5, 64).bfloat16(), torch.randn(64).bfloat16()
        assert not cpu_native.supports(x, weight)
        assert torch.equal(rms_norm(x, weight, 1e-6), reference_rms_norm(x, weight, 1e-6))
    finally:
        cpu_native.library.cache_clear()


def test_paged_decode_refuses_strided_heads():
    query = torch.randn(2, 4, 128).bfloat16()[:, :, :64]  # head_dim not contiguous within a row's heads
    cache = torch.zeros(4, 16, 2, 64).bfloat16()
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    rows = torch.arange(2)
    with pytest.raises(ValueError, match="heads contiguous"):
        cpu_native.paged_decode(
            query, torch.empty(2, 4, 64).bfloat16(), cache, cache, None, None, tables, lens, rows, rows, 1.0
        )


def reference_attention(q, k, v, scale, causal):
    """Float64, each query head against KV head `head // group`; causal: query i is position n_k - n_q + i."""
    (n_q, heads, _), (n_k, kv_heads, _) = q.shape, k.shape
    k, v = (x.double().repeat_interleave(heads // kv_heads, 1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if causal:
        visible = torch.arange(n_k) <= torch.arange(n_k - n_q, n_k)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


PREFILL_SHAPES = [(37, 37, True), (70, 1000, True), (1, 65, True), (100, 100, False), (33, 130, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_q,n_k,causal", PREFILL_SHAPES + [(1536, 1536, True)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (4, 1, 64)])
def test_prefill_attention_matches_float64(dtype, n_q, n_k, causal, heads, kv_heads, head_dim):
    """Queries, keys and values as views of one fused projection's rows (strided, as the models split them),
    tiles of keys and blocks of 32 queries cut anywhere, multithreaded; within the dtype's tolerance of the
    float64 reference (bf16: what SDPA in bf16 reaches too, its probabilities rounded to bf16 alike)."""
    if not cpu_native.supports_prefill(torch.empty(1, 1, head_dim, dtype=dtype)):
        pytest.skip("this CPU has no AVX512-BF16: the prefill kernel is not built")
    if n_q == 1536 and (heads, head_dim) != (9, 64):
        pytest.skip("one long prompt suffices")
    gen = torch.Generator().manual_seed(n_q * heads + head_dim)
    width = (heads + 2 * kv_heads) * head_dim
    rows = (torch.randn(n_k, width, generator=gen) + 0.5).to(dtype)
    q, k, v = rows.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = q[n_k - n_q :].view(n_q, heads, head_dim), k.view(n_k, kv_heads, -1), v.view(n_k, kv_heads, -1)
    out = cpu_native.prefill_attention(q, k, v, head_dim**-0.5, causal)
    ref = reference_attention(q, k, v, head_dim**-0.5, causal)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < tolerance


def paged(keys: list[torch.Tensor], values: list[torch.Tensor], block_size: int, gen: torch.Generator) -> tuple:
    """Each sequence's `[len, kv_heads, d]` key and value rows in blocks placed at random in two caches -> (K cache,
    V cache, block tables)."""
    per_seq = [-(-len(k) // block_size) for k in keys]
    order = torch.randperm(sum(per_seq), generator=gen).int()
    tables = torch.zeros(len(keys), max(per_seq), dtype=torch.int32)
    k_cache, v_cache = (torch.zeros(sum(per_seq) * block_size, *keys[0].shape[1:], dtype=keys[0].dtype) for _ in "kv")
    for i, (k, v) in enumerate(zip(keys, values)):
        tables[i, : per_seq[i]] = order[sum(per_seq[:i]) : sum(per_seq[: i + 1])]
        t = torch.arange(len(k))
        slots = tables[i, t // block_size].long() * block_size + t % block_size
        k_cache[slots], v_cache[slots] = k, v
    return k_cache.unflatten(0, (-1, block_size)), v_cache.unflatten(0, (-1, block_size)), tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,window,softcap",
    [(9, 3, 64, 0, 0.0), (4, 4, 128, 0, 0.0), (8, 2, 128, 50, 0.0), (9, 3, 64, 0, 30.0)],
)
def test_avx2_paged_decode_matches_float64(
    avx2_library, monkeypatch, dtype, heads, kv_heads, head_dim, window, softcap
):
    """Lengths off the 8-token tile (1, 7, 8, 37, 300), one sequence (a task per KV head) and twelve (a task per
    sequence), blocks anywhere in the cache, a sliding window, soft-capping: within the dtype's rounding of the
    float64 reference."""
    gen = torch.Generator().manual_seed(heads + head_dim + window)
    monkeypatch.setattr(cpu_native, "library", lambda: avx2_library)
    for lens in ([300], [1, 7, 8, 37, 300, 16, 9, 64, 130, 2, 8, 45]):
        keys, values = ([torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for n in lens] for _ in range(2))
        k_cache, v_cache, tables = paged(keys, values, 16, gen)
        query = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
        out = torch.empty_like(query)
        rows, scale = torch.arange(len(lens)), head_dim**-0.5
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        cpu_native.paged_decode(
            query, out, k_cache, v_cache, None, None, tables, seq_lens, rows, rows, scale, window, softcap
        )
        for i, n in enumerate(lens):
            seen = slice(n - window if 0 < window < n else 0, n)
            k, v = (x[seen].double().repeat_interleave(heads // kv_heads, 1) for x in (keys[i], values[i]))
            scores = torch.einsum("hd,khd->hk", query[i].double(), k) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            want = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), v)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out[i].double(), want, rtol=tol, atol=tol, msg=f"sequence {i} of length {n}")

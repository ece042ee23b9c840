"""The Triton kernels on quantized KV caches (`kv_quant`: int8 / fp8 codes, a bf16 scale per token and KV head),
under Triton's interpreter on CPU tensors, fp32 and fp16 queries (the interpreter computes bf16 wrongly).

- `write_kv` and `rotary_write_kv` write the codes and scales `kv_quant.quantize` computes (of the keys rotated by
  `kv_quant.rotate(exact=True)`, which the fused kernel's fp64 butterflies reproduce), bit for bit: the kernels
  round with integer arithmetic on fp32 bits (int8 half to even as torch's `round`, fp8 to nearest even as
  torch's cast), so there is no tie to excuse; the inputs include exact ties, an all-zero head and values in fp8's
  subnormal range. (The torch backend's CPU write sums the rotation in the native kernel's order, an ulp away:
  the reference here is `kv_quant` itself.)
- `paged_attention` reads a quantized cache as the torch implementation does: both within the dtype's tolerance
  of a float64 attention over the dequantized cache (prefill after a cached prefix, fresh prompts, decode,
  split-KV decode with its merge; GQA, block size 16, head dims 64 and 128).
- compile_check registers every quantized variant (and, marked slow, compiles a sample for sm_80 and sm_90).
"""

import math

import pytest
import torch
from compile_samples import assert_sample_compiles
from test_fused_kernels import DTYPES, TOLERANCE, interpreter  # noqa: F401  (autouse: kernels interpreted, NaN buffers)
from test_kernels_attention import make_batch, naive_attention, naive_bidirectional_attention, rel_error

from tiffin import kernels
from tiffin.kernels import compile_check, kv_quant
from tiffin.kernels import triton_attention as ta
from tiffin.kernels import triton_attention_kernels as tak

CODES = list(kv_quant.CACHE_DTYPES)


def empty_cache(shape, codes: str):
    """Zeroed codes `shape` and scales `shape[:3]` of `codes`' format (k and v)."""
    dtype = kv_quant.CACHE_DTYPES[codes]
    caches = [torch.zeros(shape, dtype=dtype) for _ in "kv"]
    scales = [torch.zeros(shape[:3], dtype=kv_quant.SCALE_DTYPE) for _ in "kv"]
    return caches, scales


def assert_same_cache(got: tuple, want: tuple) -> None:
    """Codes compared as bytes (fp8 has no equality on CPU, and -0.0 must keep its sign byte), scales exactly."""
    (got_caches, got_scales), (want_caches, want_scales) = got, want
    for g, w in zip(got_caches, want_caches, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    for g, w in zip(got_scales, want_scales, strict=True):
        assert torch.equal(g, w)


def reference_write(key, value, slots, shape, codes: str) -> tuple:
    """The caches `kv_quant` says `key` and `value` make at `slots` (-1 skipped): keys rotated, then quantized."""
    caches, scales = empty_cache(shape, codes)
    keep = slots >= 0
    for x, cache, scale in ((kv_quant.rotate(key, exact=True), caches[0], scales[0]), (value, caches[1], scales[1])):
        c, s = kv_quant.quantize(x[keep], kv_quant.CACHE_DTYPES[codes])
        cache.view(torch.uint8).view(-1, *shape[2:])[slots[keep]] = c.view(torch.uint8)
        scale.view(-1, shape[2])[slots[keep]] = s
    return caches, scales


def hard_heads(tokens: int, num_kv_heads: int, head_dim: int, dtype, gen) -> torch.Tensor:
    """Random heads of every magnitude, plus the cases rounding decides: head 0 of token 0 all zeros, head 1
    of token 0 values k + 0.5 for amax 127 (scale 1: int8 ties), token 1 values 2^-20..2^0 (fp8 subnormals)."""
    x = torch.randn(tokens, num_kv_heads, head_dim, generator=gen) * torch.logspace(-3, 3, tokens)[:, None, None]
    x[0, 0] = 0
    ties = torch.arange(head_dim) % 16 - 7.5
    ties[0] = 127
    x[0, 1] = ties
    x[1, 0] = torch.logspace(-20, 0, head_dim, base=2.0) * torch.where(torch.arange(head_dim) % 2 == 0, 1, -1)
    return x.to(dtype)


@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 80])  # 80: a block padded past the head, masked
def test_write_kv_matches_quantize(codes, dtype, head_dim, monkeypatch):
    """Key and value as strided views of one fused qkv row, as the model passes them; slot -1 skipped. The kernel
    rotates the keys itself (no fp64 matmul in torch before it)."""
    gen = torch.Generator().manual_seed(head_dim)
    num_kv_heads, tokens = 2, 6
    key = hard_heads(tokens, num_kv_heads, head_dim, dtype, gen)
    qkv = torch.cat([torch.randn(tokens, 4 * head_dim).to(dtype), key.flatten(1), key.flip(0).flatten(1)], 1)
    _, key, value = qkv.split([4 * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    key, value = key.view(tokens, num_kv_heads, head_dim), value.view(tokens, num_kv_heads, head_dim)
    slots = torch.tensor([31, -1, 0, 79, 16, 5])
    shape = (5, 16, num_kv_heads, head_dim)
    want, got = reference_write(key, value, slots, shape, codes), empty_cache(shape, codes)
    monkeypatch.setattr(kv_quant, "rotate", None)
    kernels.write_kv(key, value, *got[0], slots, "triton", *got[1])
    assert_same_cache(got, want)
    assert got[1][0].view(-1, num_kv_heads)[31, 0] == torch.finfo(torch.bfloat16).tiny  # the all-zero head
    if codes == "int8":  # the ties (a value head: keys are rotated) half to even: 0.5 -> 0, 1.5 -> 2, -0.5 -> -0
        tie_codes = got[0][1].view(-1, num_kv_heads, head_dim)[5, 1, :16].tolist()
        assert tie_codes == [127, -6, -6, -4, -4, -2, -2, -0, 0, 2, 2, 4, 4, 6, 6, 8]


def rope(head_dim: int, max_pos: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim", [48, 64])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["", "qk_norm"])
@pytest.mark.parametrize("rotate_query", [False, True], ids=["", "rotate_query"])
def test_rotary_write_kv_matches_quantize(codes, dtype, head_dim, qk_norm, rotate_query):
    """Four query heads on two KV heads: the roped queries equal the torch path's, the caches hold the codes and
    scales of its roped keys and values. Head_dim 48 (halves of 24: a block padded past them) stores keys as they
    are, 64 rotated by the Hadamard matrix (kv_quant), in the same kernel; `rotate_query` returns the queries
    rotated alike there. With `qk_norm` the heads are RMS-normalized (Qwen3) before the rope."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, tokens = 4, 2, 5
    cos, sin = rope(head_dim)
    qkv = hard_heads(tokens, heads + 2 * kv_heads, head_dim, dtype, gen).flatten(1)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots, positions = torch.tensor([3, -1, 12, 0, 7]), torch.tensor([3, 9, 12, 0, 63])
    shape = (4, 4, kv_heads, head_dim)
    got, want = empty_cache(shape, codes), empty_cache(shape, codes)
    norms = [(torch.rand(head_dim, generator=gen) + 0.5).to(dtype) for _ in "qk"] + [1e-6] if qk_norm else []
    args = (slots, positions, cos, sin, heads)
    q = kernels.rotary_write_kv(qk, v, *got[0], *args, "triton", *got[1], *norms, rotate_query=rotate_query)
    q_want = kernels.rotary_write_kv(qk, v, *want[0], *args, "torch", *want[1], *norms, rotate_query=rotate_query)
    torch.testing.assert_close(q, q_want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    normed = kernels.fused.qk_rms_norm(qk, heads, *norms, "torch") if qk_norm else qk
    roped = kernels.fused.rotate(normed, cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None])
    assert_same_cache(got, reference_write(roped[:, heads:], v, slots, shape, codes))


def quantized_batch(query_lens, context_lens, num_kv_heads, group, head_dim, dtype, codes, seed):
    """A random batch (`make_batch`: scrambled block tables, block size 16) whose caches are quantized."""
    gen = torch.Generator().manual_seed(seed)
    query, k, v, md = make_batch(query_lens, context_lens, num_kv_heads * group, num_kv_heads, head_dim, 16, dtype, gen)
    (k_codes, k_scale), (v_codes, v_scale) = (kv_quant.quantize(x, kv_quant.CACHE_DTYPES[codes]) for x in (k, v))
    return query, k_codes, v_codes, md, k_scale, v_scale


def check_attention(batch, dtype, causal=True) -> None:
    """Triton within the dtype's tolerance of the float64 naive attention of the rotated queries over the cache
    dequantized to the query's dtype (the values it and the torch implementation compute with), and within twice
    that of the torch
    implementation on the same quantized cache (whose fp16 decode keeps its scores in fp16)."""
    query, k_codes, v_codes, md, k_scale, v_scale = batch
    scale = 1 / math.sqrt(query.shape[-1])
    k, v = kv_quant.dequantize(k_codes, k_scale, dtype), kv_quant.dequantize(v_codes, v_scale, dtype)
    rotated = kv_quant.rotate(query).to(dtype)  # the cache holds keys rotated: queries meet them rotated
    want = (naive_attention if causal else naive_bidirectional_attention)(rotated, k, v, md, scale)
    out = kernels.paged_attention(query, k_codes, v_codes, md, scale, "triton", causal, k_scale, v_scale)
    assert out.dtype == dtype and not out.isnan().any(), "output not fully written"
    assert rel_error(out, want) <= TOLERANCE[dtype]
    torch_out = kernels.paged_attention(query, k_codes, v_codes, md, scale, "torch", causal, k_scale, v_scale)
    # the native CPU decode meets int8 keys with the query in 15 bits (test_kv_quant.QUERY_ERROR)
    native_int8 = k_codes.dtype == torch.int8 and dtype == torch.float32
    assert rel_error(out, torch_out.double()) <= (2e-4 if native_int8 else 2 * TOLERANCE[dtype])


# (query_lens, context_lens, num_kv_heads, group, head_dim): each code format at each dtype runs them all
BATCHES = {
    "prefill-after-prefix-and-decodes": ([20, 1, 33, 1], [40, 70, 0, 5], 2, 2, 64),  # fresh prompt too
    "decode-split": ([1, 1, 1], [5, 100, 47], 2, 4, 128),  # KV split two ways + merge (MIN_SPLIT_TOKENS 32)
    "prefill-gqa8": ([17, 1], [15, 62], 1, 8, 128),
}


@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_paged_attention_matches_torch(codes, dtype, name, monkeypatch):
    monkeypatch.setattr(ta, "MIN_SPLIT_TOKENS", 32)  # splits at short contexts: less for the interpreter to run
    batch = quantized_batch(*BATCHES[name], dtype, codes, seed=len(name))
    if name == "decode-split":
        launches = ta.paged_attention_launches(*batch[:4], 0.1, batch[0], k_scale=batch[4], v_scale=batch[5])
        assert [launch.kernel for launch in launches] == [tak._paged_attention_kernel, tak._merge_splits_kernel]
    check_attention(batch, dtype)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_paged_attention_takes_queries_rotated(backend):
    """`query_rotated`: queries rotated by the caller (the fused rotary write) are not rotated again: the answer is
    the one for the unrotated queries (bit for bit on Triton, which rotates them so itself; the torch path then
    skips the native decode, which rotates in its own order)."""
    query, *kv = quantized_batch(*BATCHES["prefill-after-prefix-and-decodes"], torch.float16, "int8", seed=5)
    rotated = kv_quant.rotate(query).to(query.dtype)
    out = kernels.paged_attention(query, *kv[:3], 0.125, backend, True, *kv[3:])
    kv[2].torch_plan = None  # the torch path plans per decode kind
    got = kernels.paged_attention(rotated, *kv[:3], 0.125, backend, True, *kv[3:], query_rotated=True)
    if backend == "triton":
        assert torch.equal(got, out)
    else:
        assert rel_error(got, out.double()) <= 2 * TOLERANCE[torch.float16]


def test_paged_attention_non_causal_matches_torch():
    """Encoders read a quantized cache too: the non-causal prefill tile."""
    batch = quantized_batch([1, 7, 33], [0, 0, 0], 2, 2, 64, torch.float16, "int8", seed=3)
    check_attention(batch, torch.float16, causal=False)


def test_write_then_attend_round_trip():
    """The Triton write, then the Triton read, of a 24-token prompt: the attention equals the torch attention over
    the torch-written cache, and is close to the unquantized answer."""
    gen = torch.Generator().manual_seed(11)
    query, k, _, md = make_batch([24], [0], 4, 2, 64, 16, torch.float32, gen)
    slots = md.block_tables[0, torch.arange(24) // 16].long() * 16 + torch.arange(24) % 16
    key, value = torch.randn(24, 2, 64, generator=gen), torch.randn(24, 2, 64, generator=gen)
    plain = [torch.zeros_like(k) for _ in "kv"]
    kernels.write_kv(key, value, *plain, slots, "torch")
    exact = kernels.paged_attention(query, *plain, md, 0.125, "torch")
    outs = {}
    for backend in ("triton", "torch"):
        caches, scales = empty_cache(k.shape, "fp8_e4m3")
        kernels.write_kv(key, value, *caches, slots, backend, *scales)
        md.torch_plan = None  # the torch path plans per cache kind (the native CPU kernel reads no fp8)
        outs[backend] = kernels.paged_attention(query, *caches, md, 0.125, backend, True, *scales)
    assert rel_error(outs["triton"], outs["torch"].double()) <= TOLERANCE[torch.float32]
    assert rel_error(outs["triton"], exact.double()) < 0.1  # e4m3 keeps 3 mantissa bits


def test_rejects_inconsistent_quantized_caches():
    query, k_codes, v_codes, md, k_scale, v_scale = quantized_batch([3], [4], 1, 2, 64, torch.float32, "int8", 0)
    with pytest.raises(ValueError, match="KV scales must be contiguous"):
        kernels.paged_attention(query, k_codes, v_codes, md, 0.1, "triton", True, k_scale.float(), v_scale.float())
    with pytest.raises(ValueError, match="dtypes"):
        kernels.paged_attention(query, k_codes, v_codes.float(), md, 0.1, "triton", True, k_scale, v_scale)
    with pytest.raises(ValueError, match="key/value dtypes"):
        key = torch.zeros(1, 1, 64, dtype=torch.int32)
        kernels.write_kv(key, key, k_codes, v_codes, torch.tensor([0]), "triton", k_scale, v_scale)
    query, *kv = quantized_batch([3], [4], 1, 2, 256, torch.float32, "int8", 0)
    with pytest.raises(ValueError, match="kv_cache_dtype int8 with float32 queries and head_dim 256"):
        kernels.paged_attention(query, *kv[:3], 0.1, "triton", True, *kv[3:])


# ---- compile check -------------------------------------------------------------------------------------------


def test_compile_check_registers_every_quantized_variant():
    """Without compiling: the registered cases include, per query dtype, each head dim's quantized tiles (int8,
    and fp8 whose two formats share a binary; fp32 without d=256, which is refused), the quantized KV writes per
    padded head dim and code format, and the rotary write per code format."""
    configs = {
        case.config for _, case in compile_check.collect(80, ["paged_attention", "write_kv", "fused_elementwise"])
    }
    for dtype in ("float16", "bfloat16", "float32"):
        for codes in ("int8", "fp8"):
            for head_dim in ta.QUANTIZED_FP32_HEAD_DIMS if dtype == "float32" else ta.HEAD_DIMS:
                for kind in ("prefill", "prefill non-causal", "decode", "decode split"):
                    assert f"{dtype} d={head_dim} kv={codes} {kind}" in configs
        for codes in CODES:
            for block in (16, 32, 64, 128, 256):
                assert f"{dtype} write_kv kv={codes} block={block}" in configs
            for head_dim in (64, 128, 256):
                assert f"rotary_write_kv {dtype} head_dim={head_dim} kv={codes}" in configs


SAMPLE = [
    "float16 d=128 kv=int8 prefill",
    "float16 d=128 kv=fp8 decode",
    "bfloat16 d=64 kv=fp8 decode split",
    "float32 d=64 kv=int8 prefill non-causal",
    "float16 write_kv kv=fp8_e4m3 block=128",
    "bfloat16 write_kv kv=int8 block=64",
    "rotary_write_kv float16 head_dim=128 kv=fp8_e5m2",
]


@pytest.mark.slow
@pytest.mark.subprocess
def test_compile_check_compiles_quantized_sample():
    """A sample of the quantized variants compiles for sm_80 (fp8 codes too: unpacked without Triton's fp8 types)
    and sm_90 without spills (the full table: `python -m tiffin.kernels.compile_check`)."""
    assert_sample_compiles(["paged_attention", "write_kv", "fused_elementwise"], SAMPLE)

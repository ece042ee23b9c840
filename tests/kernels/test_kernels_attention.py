"""Paged attention and KV-cache writes: the torch implementation against a naive per-request reference, and
the Triton kernels against the same reference under Triton's interpreter, causal (decoders) and not (encoders,
`causal=False`); compile_check for sm_89/90 (`CI_ARCHS`).

Interpreter setup: the `interpreter` fixture sets TRITON_INTERPRET=1 only while this module's kernel tests run.
tiffin's launcher reads that variable at call time (not when `@triton.jit` runs at import), so it does not
matter which test module imported the kernels first, and nothing leaks into other modules. compile_check runs
in a subprocess with the variable removed, since it needs the real JIT path.
"""

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from tiffin.kernels import attention, compile_check, cpu_native, paged_attention, resolve_backend, write_kv
from tiffin.kernels import triton_attention as ta
from tiffin.kernels import triton_common as tc
from tiffin.kernels.attention import (
    AttentionMetadata,
    padding_as_first_kept,
    paged_attention_torch,
    write_kv_torch,
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the Triton path allocates (output, split partials) starts as NaN."""

    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(tc, "empty", nan_empty)


def make_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, gen):
    """Random query and caches with scrambled block tables; every request's blocks are distinct."""
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max(blocks) + 1), int(order[-1]), dtype=torch.int32)  # padded rows
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    md = AttentionMetadata(
        slot_mapping=torch.full((sum(query_lens),), -1, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return query, k_cache, v_cache, md


def naive_attention(query, k_cache, v_cache, md, scale) -> torch.Tensor:
    """Float64, one request at a time: slots computed from the block table by hand, an explicit causal mask,
    each query head reading KV head `head // group`."""
    num_heads, group = query.shape[1], query.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    k_flat = k_cache.double().flatten(0, 1)
    v_flat = v_cache.double().flatten(0, 1)
    kv_head = torch.arange(num_heads) // group
    out = torch.empty(query.shape, dtype=torch.float64)
    for i, seq_len in enumerate(md.seq_lens_cpu):
        start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        positions = torch.arange(seq_len)
        slots = md.block_tables[i, positions // block_size].long() * block_size + positions % block_size
        k = k_flat[slots][:, kv_head].transpose(0, 1)  # [H, seq_len, D]
        v = v_flat[slots][:, kv_head].transpose(0, 1)
        q = query[start:end].double().transpose(0, 1)  # [H, n, D]
        query_pos = torch.arange(seq_len - (end - start), seq_len)
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(positions > query_pos[:, None], float("-inf"))
        out[start:end] = (torch.softmax(scores, -1) @ v).transpose(0, 1)
    return out


def naive_bidirectional_attention(query, k_cache, v_cache, md, scale) -> torch.Tensor:
    """The non-causal reference, written apart from `naive_attention`: float64, one request at a time, its keys
    looked up token by token through the block table, no mask at all (every query row of a request sees all
    `seq_len` keys), K/V heads repeated for the query heads that share them."""
    group, block_size = query.shape[1] // k_cache.shape[2], k_cache.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for i, seq_len in enumerate(md.seq_lens_cpu):
        rows = slice(md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1])
        where = [(int(md.block_tables[i, t // block_size]), t % block_size) for t in range(seq_len)]
        k = torch.stack([k_cache[b, o] for b, o in where]).double().repeat_interleave(group, 1)  # [L, H, D]
        v = torch.stack([v_cache[b, o] for b, o in where]).double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", query[rows].double(), k) * scale
        out[rows] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    return out


def rel_error(out, ref) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def random_lens(gen, num_requests):
    """Prefill chunks of 2..130 tokens (the first 100+) alternating with decode rows (1 token); cached context
    of 0..500 tokens."""
    query_lens, context_lens = [], []
    for i in range(num_requests):
        query_lens.append(1 if i % 2 else int(torch.randint(100 if i == 0 else 2, 131, (1,), generator=gen)))
        context_lens.append(int(torch.randint(0, 501, (1,), generator=gen)))
    return query_lens, context_lens


# ---- torch implementation ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_torch_paged_attention_matches_naive(seed):
    gen = torch.Generator().manual_seed(seed)
    group = (1, 4, 8, 2)[seed]
    query_lens, context_lens = random_lens(gen, 5)
    query_lens[0], context_lens[0] = 7, 0  # a fresh prompt (causal, no cached prefix)
    query_lens += [1] * 20  # more decode rows than one of the torch path's length-sorted decode groups
    context_lens += torch.randint(0, 300, (20,), generator=gen).tolist()
    batch = make_batch(query_lens, context_lens, 2 * group, 2, 64, (16, 32)[seed % 2], torch.float32, gen)
    out = paged_attention_torch(*batch, 0.125)
    assert rel_error(out, naive_attention(*batch, 0.125)) < 1e-5


@pytest.fixture(params=["native", "sdpa", "matmul"])
def decode_path(request, monkeypatch):
    """Each CPU decode implementation, whichever this CPU would pick: the native kernel (built here: these
    machines have a compiler), else SDPA or grouped matmuls."""
    if request.param == "native":
        assert cpu_native.library() is not None, "the native CPU kernels did not build (see the log)"
    else:
        monkeypatch.setattr(cpu_native, "supports", lambda *tensors: False)
    monkeypatch.setenv("TIFFIN_CPU_DECODE", request.param)
    attention._decode_by_matmuls.cache_clear()
    yield request.param
    attention._decode_by_matmuls.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 3, 4, 5])
@pytest.mark.parametrize("head_dim", [64, 128, 96])  # 96: the native kernel's generic (non-AVX-512) loop
def test_torch_decode_paths_match_naive(decode_path, dtype, group, head_dim):
    """Decode groups of unequal context lengths (masked) beside a prefill chunk, within the dtype's tolerance.
    Contexts of 0-400 tokens: partial tiles of 16 tokens and whole ones, across block boundaries."""
    gen = torch.Generator().manual_seed(group)
    query_lens = [33] + [1] * 40
    context_lens = [64] + torch.randint(0, 400, (40,), generator=gen).tolist()
    batch = make_batch(query_lens, context_lens, 2 * group, 2, head_dim, 16, dtype, gen)
    out = paged_attention_torch(*batch, 0.125)
    assert out.dtype == dtype
    assert rel_error(out, naive_attention(*batch, 0.125)) < TOLERANCE[dtype]


# Whole prompts as an encoder runs them (query_len == seq_len), one of them a single token.
ENCODER_LENS = [1, 7, 33, 100]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_torch_noncausal_matches_naive(dtype, head_dim):
    """GQA 4 query heads on 2 KV heads, block size 16: the prompts cross block boundaries and the last block of
    each is partial."""
    gen = torch.Generator().manual_seed(head_dim)
    batch = make_batch(ENCODER_LENS, [0] * 4, 4, 2, head_dim, 16, dtype, gen)
    out = paged_attention(*batch, 0.125, causal=False)
    assert out.dtype == dtype
    assert rel_error(out, naive_bidirectional_attention(*batch, 0.125)) < TOLERANCE[dtype]


def test_torch_noncausal_with_cached_prefix_and_decodes(decode_path):
    """The general semantics, beyond what the engine sends: rows of a chunk after a cached prefix see the whole
    context, later tokens included, and one-token queries (each decode path) see all their keys."""
    gen = torch.Generator().manual_seed(11)
    query_lens, context_lens = random_lens(gen, 6)
    batch = make_batch(query_lens, context_lens, 4, 2, 64, 16, torch.float32, gen)
    out = paged_attention(*batch, 0.125, causal=False)
    assert rel_error(out, naive_bidirectional_attention(*batch, 0.125)) < 1e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_causal_and_noncausal_calls_share_metadata(interpreter, backend):
    """Layers share one metadata object and the torch path caches its per-step plan (masks included) on it: a
    causal and a non-causal call on it, in either order, each get their own answer. The batch has a fresh
    prompt, a chunk after a cached prefix (the masked span) and a decode row."""
    gen = torch.Generator().manual_seed(3)
    batch = make_batch([33, 20, 1], [0, 40, 70], 4, 2, 64, 16, torch.float32, gen)
    causal_ref, noncausal_ref = naive_attention(*batch, 0.125), naive_bidirectional_attention(*batch, 0.125)
    assert rel_error(causal_ref.float(), noncausal_ref) > 0.1  # the two answers tell each other apart
    for causal in (True, False, True, False):
        out = paged_attention(*batch, 0.125, backend=backend, causal=causal)
        assert rel_error(out, causal_ref if causal else noncausal_ref) < 1e-5, causal
    assert backend != "torch" or batch[3].torch_plan is not None


@pytest.mark.parametrize("slots", [[17, -1, 3, 95, -1], [-1, -1, 40, 3, -1]])
def test_torch_write_kv_skips_padding_slots(slots):
    """On the host padding rows are dropped; on a GPU they are rewritten as the first kept row (no host read):
    that second path runs here on CPU tensors through the same index_copy_."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(6, 16, 2, 32, generator=gen), torch.randn(6, 16, 2, 32, generator=gen)
    key, value = torch.randn(5, 2, 32, generator=gen), torch.randn(5, 2, 32, generator=gen)
    slots = torch.tensor(slots)
    k_want, v_want = k_cache.clone().flatten(0, 1), v_cache.clone().flatten(0, 1)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            k_want[s], v_want[s] = key[t], value[t]
    k_dev, v_dev = k_cache.clone().flatten(0, 1), v_cache.clone().flatten(0, 1)
    k_rows, v_rows, dev_slots = padding_as_first_kept(key, value, slots, slots >= 0)
    assert bool((dev_slots >= 0).all())
    k_dev.index_copy_(0, dev_slots, k_rows), v_dev.index_copy_(0, dev_slots, v_rows)
    assert torch.equal(k_dev, k_want) and torch.equal(v_dev, v_want)
    write_kv_torch(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.flatten(0, 1), k_want) and torch.equal(v_cache.flatten(0, 1), v_want)


# ---- Triton kernels under the interpreter --------------------------------------------------------------

# Every pair of (block size, head dim, GQA ratio) values appears, at each dtype.
SHAPES = [(16, 64, 1), (32, 128, 1), (16, 128, 4), (32, 64, 4), (32, 64, 8), (16, 128, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size,head_dim,group", SHAPES, ids=[f"bs{b}-d{d}-g{g}" for b, d, g in SHAPES])
def test_triton_attention_mixed_batch(interpreter, poisoned, dtype, block_size, head_dim, group):
    gen = torch.Generator().manual_seed(block_size + head_dim + group + (dtype == torch.float16))
    query_lens, context_lens = random_lens(gen, 4)
    num_kv_heads = 2 if group == 1 else 1
    batch = make_batch(query_lens, context_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype, gen)
    check_triton(batch, dtype)


@pytest.mark.parametrize(
    "query_lens,context_lens,num_kv_heads,group,head_dim,dtype",
    [
        ([1, 1, 1], [5, 300, 47], 2, 4, 128, torch.float16),  # decode only: split KV + merge
        ([1], [480], 1, 8, 64, torch.float32),  # one long decode: more splits
        ([1, 1], [9, 33], 1, 32, 64, torch.float32),  # group > tile rows: heads spread over programs
        ([130, 64], [0, 100], 1, 1, 128, torch.float16),  # prefill only, several query tiles per request
        ([20, 1, 33], [40, 70, 0], 2, 2, 80, torch.float32),  # head dim padded to 128 and masked
        ([17, 1], [15, 62], 2, 3, 16, torch.float16),  # smallest head dim; GQA ratio not a power of two
        ([12, 1, 1], [50, 200, 3], 2, 4, 64, torch.bfloat16),  # bf16: upcast under the interpreter
    ],
    ids=["decode-split", "long-decode", "group32", "prefill", "d80", "d16-g3", "bf16"],
)
def test_triton_attention_edge_shapes(
    interpreter, poisoned, query_lens, context_lens, num_kv_heads, group, head_dim, dtype
):
    gen = torch.Generator().manual_seed(sum(query_lens) + sum(context_lens))
    batch = make_batch(query_lens, context_lens, num_kv_heads * group, num_kv_heads, head_dim, 16, dtype, gen)
    check_triton(batch, dtype)


def test_triton_decode_split_count(interpreter, poisoned, monkeypatch):
    """Many splits, most of them empty for the short request: the merge must weigh empty splits as zero."""
    monkeypatch.setattr(ta, "MIN_SPLIT_TOKENS", 16)
    gen = torch.Generator().manual_seed(5)
    batch = make_batch([1], [300], 8, 1, 64, 16, torch.float32, gen)
    assert len(ta.paged_attention_launches(*batch, 0.1, batch[0])) == 2  # attention + merge
    check_triton(batch, torch.float32)
    batch = make_batch([1], [20], 8, 1, 64, 16, torch.float32, gen)
    check_triton(batch, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 80])  # 80: padded to 128 and masked
def test_triton_noncausal_matches_naive(interpreter, poisoned, dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim + (dtype == torch.float16))
    batch = make_batch(ENCODER_LENS, [0] * 4, 4, 2, head_dim, 16, dtype, gen)
    check_triton(batch, dtype, causal=False)


@pytest.mark.parametrize(
    "query_lens,context_lens,group,head_dim,dtype",
    [
        ([130, 1, 20, 1], [0, 300, 45, 7], 2, 64, torch.float32),  # several query tiles; chunk after a prefix
        ([1, 1, 1], [5, 300, 47], 4, 128, torch.float16),  # decode only: split KV + merge
    ],
    ids=["prefix-and-decodes", "decode-split"],
)
def test_triton_noncausal_general(interpreter, poisoned, query_lens, context_lens, group, head_dim, dtype):
    """Beyond what the engine sends: a chunk after a cached prefix sees its later tokens too; one-token queries
    (the decode tiles, which a non-causal call launches as they are) see their whole context."""
    gen = torch.Generator().manual_seed(sum(query_lens))
    batch = make_batch(query_lens, context_lens, 2 * group, 2, head_dim, 16, dtype, gen)
    check_triton(batch, dtype, causal=False)


def test_triton_noncausal_changes_only_the_prefill_binary(interpreter):
    """A one-token query sees every key either way: a non-causal call launches the causal decode binary, so
    encoders add one kernel variant (the prefill tile), which compile_check covers."""
    gen = torch.Generator().manual_seed(0)
    batch = make_batch([7, 1], [0, 20], 4, 2, 64, 16, torch.float16, gen)
    causal, noncausal = (ta.paged_attention_launches(*batch, 0.1, batch[0], causal=c) for c in (True, False))
    assert [launch.kwargs["CAUSAL"] for launch in noncausal] == [False, True]
    assert noncausal[1].kwargs == causal[1].kwargs


def check_triton(batch, dtype, causal=True):
    scale = 1 / math.sqrt(batch[0].shape[-1])
    out = paged_attention(*batch, scale, backend="triton", causal=causal)
    assert out.dtype == dtype and not out.isnan().any(), "output not fully written"
    reference = naive_attention if causal else naive_bidirectional_attention
    err = rel_error(out, reference(*batch, scale))
    print(f"rel_error={err:.2e}", end=" ")
    assert err <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_triton_write_kv(interpreter, dtype):
    gen = torch.Generator().manual_seed(1)
    num_kv_heads, head_dim, block_size = 2, 64, 16
    k_cache = torch.randn(5, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(5, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # key/value as strided views of one fused qkv projection, like the model produces them
    qkv = torch.randn(6, 4 * head_dim + 2 * num_kv_heads * head_dim, generator=gen).to(dtype)
    _, key, value = qkv.split([4 * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    key, value = key.view(6, num_kv_heads, head_dim), value.view(6, num_kv_heads, head_dim)
    slots = torch.tensor([31, -1, 0, 79, 16, -1])
    k_want, v_want = k_cache.clone(), v_cache.clone()
    write_kv_torch(key, value, k_want, v_want, slots)
    write_kv(key, value, k_cache, v_cache, slots, backend="triton")
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    batch = make_batch([3], [4], 2, 1, 64, 16, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        paged_attention(*batch, 0.1, backend="triton")


def test_triton_rejects_unsupported_shapes(interpreter):
    gen = torch.Generator().manual_seed(0)
    query, k_cache, v_cache, md = make_batch([3], [4], 2, 1, 64, 16, torch.float32, gen)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(query[..., :48], k_cache[..., :48], v_cache[..., :48], md, 0.1, backend="triton")
    with pytest.raises(ValueError, match="dtypes"):
        paged_attention(query.half(), k_cache, v_cache, md, 0.1, backend="triton")
    md.block_tables = md.block_tables.long()
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(query, k_cache, v_cache, md, 0.1, backend="triton")


def test_resolve_backend(monkeypatch):
    monkeypatch.delenv("TIFFIN_KERNEL_BACKEND", raising=False)
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("triton", torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match="kernel_backend"):
        resolve_backend("cuda", torch.device("cpu"))
    monkeypatch.setenv("TIFFIN_KERNEL_BACKEND", "torch")
    assert resolve_backend("triton", torch.device("cuda")) == "torch"


# ---- engine end to end -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_engine_greedy_triton_equals_torch(interpreter, tiny_model, arch):
    """Greedy tokens through the Triton kernels equal the torch path: prefill tiles spanning several query
    tiles, a prefill on a prefix-cached block (second call), decode steps."""
    from tiffin import LLM, SamplingParams

    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(4, 2048, (20,), generator=gen).tolist()
    first = [prefix + [7, 8, 9], torch.randint(4, 2048, (70,), generator=gen).tolist()]
    second = [prefix + [11], [5]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_model(arch), dtype="float32", device="cpu", kernel_backend=backend)
        outs = [
            o
            for batch in (first, second)
            for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        ]
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    assert tokens["triton"] == tokens["torch"]


# ---- compile check ---------------------------------------------------------------------------------------


# Two archs: sm_89 (99 KB of shared memory per block, the least; the dispatchers pick sm_86's tiles alike) and
# sm_90 (227 KB, wgmma), each configuration compiled for one of them (`--split-archs`): both took a cold Triton cache
# past 1,500 s on an AVX2 AMD EPYC with the suite beside it, ~1 s a case on the Intel Xeon kind of these 2-core
# machines. sm_80 (163 KB) and sm_120 (99 KB) have tiles of their own (`attention_tile`), checked with sm_86 by
# `python -m tiffin.kernels.compile_check` (~2,900 cases). Run all five, unsplit, after changing a kernel.
CI_ARCHS = (89, 90)


@pytest.mark.slow
@pytest.mark.subprocess
def test_compile_check_every_arch_class():
    """Every registered kernel configuration (attention, quantized GEMMs, LoRA, the fused element-wise kernels)
    compiles for one of `CI_ARCHS` without spills and within the arch's shared memory per block, with the tiles
    its dispatcher picks there."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tiffin.kernels.compile_check", "--arch", ",".join(map(str, CI_ARCHS)), "--split-archs"],
        capture_output=True,
        text=True,
        env=env,
        timeout=3000,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for dtype in ("float16", "bfloat16", "float32"):
        for head_dim in ta.HEAD_DIMS:
            for kind in ("decode", "decode split", "merge", "prefill", "prefill non-causal"):
                row = rf"{dtype} d={head_dim} {kind} +sm_({'|'.join(map(str, CI_ARCHS))}) "
                assert re.search(row, proc.stdout), (dtype, head_dim, kind)
    for kernel in (
        "awq_gemm",
        "gptq_gemm",
        "gguf_gemm",
        "quant_dequantize",
        "block_gemm",
        "lora_shrink",
        "lora_expand",
        "fused_elementwise",
    ):
        assert kernel in proc.stdout, kernel


def test_attention_tiles_fit_each_arch():
    """What compile_check found on sm_86/sm_89/sm_120 (99 KB of shared memory per block): fp32 d=256 tiles take one
    stage there (two need 102,400 B), and 16-bit d=64 decode three stages (two spill); sm_80/sm_90 keep theirs."""
    for arch in (80, 90):
        assert ta.attention_tile(256, torch.float32, False, arch).num_stages == 2
        assert ta.attention_tile(64, torch.float16, True, arch).num_stages == 2
    for arch in (86, 89, 120):
        assert ta.attention_tile(256, torch.float32, False, arch).num_stages == 1
        assert ta.attention_tile(64, torch.bfloat16, True, arch).num_stages == 3
        assert ta.attention_tile(64, torch.bfloat16, False, arch) == ta.attention_tile(64, torch.bfloat16, False, 80)


def test_split_archs_compile_each_configuration_once():
    case = lambda config: compile_check.CompileCase(kernel=None, args=(), kwargs={}, config=config)
    common = [(f"k{i}", case(f"c{i}")) for i in range(40)]
    cases = [(name, c, arch) for arch in CI_ARCHS for name, c in common] + [("only", case("sm_90 tile"), 90)]
    picked = compile_check.one_arch_each(cases)
    assert sorted((name, c.config) for name, c, _ in picked) == sorted(
        [(n, c.config) for n, c in common] + [("only", "sm_90 tile")]
    )
    assert {arch for _, _, arch in picked} == set(CI_ARCHS)  # both archs take a share
    assert ("only", "sm_90 tile", 90) in [(name, c.config, arch) for name, c, arch in picked]


def test_compile_check_limits_shared_memory_per_arch():
    ok = dict(kernel="k", config="c", registers=64, spills=0)
    assert compile_check.Result(arch=80, shared=102_400, **ok).ok
    assert compile_check.Result(arch=86, shared=101_376, **ok).ok
    over = compile_check.Result(arch=86, shared=102_400, **ok)
    assert not over.ok and over.status == "SHARED > 101376"
    assert not compile_check.Result(arch=90, shared=232_449, **ok).ok
    assert not compile_check.Result(arch=120, shared=102_400, **ok).ok  # 99 KB, not sm_80's 163
    with pytest.raises(SystemExit):
        compile_check.main(["--arch", "75"])


def test_compile_check_reports_failures(monkeypatch):
    import triton
    import triton.language as tl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # compile_check needs JITFunctions

    @triton.jit
    def broken(x_ptr, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)  # BLOCK=3 is not a power of two

    x = torch.empty(4, device="meta")
    compile_check.collect(80)  # import every kernel module first, so none registers into the patched registry
    cases = {"broken": lambda arch: [compile_check.CompileCase(broken, "block=3", (x,), {"BLOCK": 3})]}
    monkeypatch.setattr(compile_check, "_GENERATORS", cases)
    assert compile_check.main(["--arch", "90", "--jobs", "1"]) == 1

"""KV host tiers through the engine: the prefix cache's host tier (kv_offload_memory) and preemption by swap
(preemption_mode swap) give the outputs the engine gives without them (a quantized cache's: those of a pool that
never evicts), computing fewer prefill tokens, within their host memory, and leave no device or swap block held
once requests end or are aborted (the conftest has the block manager's invariants checked after every step)."""

import random

import pytest
import torch

from tiffin import LLM, SamplingParams
from tiffin.engine.config import EngineConfig
from tiffin.engine.core.kv_offload import KVCopies
from tiffin.kernels import kv_quant

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tiny_model):
    return str(tiny_model("llama"))


def engine(path, **kwargs):
    return LLM(path, dtype="float32", block_size=BLOCK, **kwargs).llm_engine


def drive(engine, requests: list[tuple[list[int], SamplingParams]]) -> tuple[list[list[int]], int]:
    """Run `requests` to the end: their output tokens, in order, and the most host KV bytes in use on the way."""
    first = len(engine.requests) and max(map(int, engine.requests)) + 1
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(first + i), {"prompt_token_ids": prompt}, params)
    outputs, most_host_bytes = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = out.outputs[0].token_ids
        most_host_bytes = max(most_host_bytes, engine.stats().host_kv_bytes_used)
    return [outputs[first + i] for i in range(len(requests))], most_host_bytes


def conversations(vocab: int, num: int, turns: int, seed: int = 0):
    """Multi-turn chats: each turn's prompt is the chat so far (a long system prompt, then user and model turns) and
    a new user turn; yields each turn's prompts (one per chat) and takes their outputs back."""
    rng = random.Random(seed)
    chats = [[rng.randrange(4, vocab) for _ in range(80)] for _ in range(num)]
    for _ in range(turns):
        prompts = [chat + [rng.randrange(4, vocab) for _ in range(rng.randrange(3, 20))] for chat in chats]
        outputs = yield prompts
        chats = [p + o for p, o in zip(prompts, outputs)]


def run_conversations(engine, num: int = 8, turns: int = 3) -> tuple[list[list[int]], int]:
    gen, outputs, most = conversations(engine.model_config.vocab_size, num, turns), [], 0
    prompts = next(gen)
    while True:
        turn, host_bytes = drive(engine, [(p, GREEDY) for p in prompts])
        outputs += turn
        most = max(most, host_bytes)
        try:
            prompts = gen.send(turn)
        except StopIteration:
            return outputs, most


def test_host_tier_recomputes_fewer_prefill_tokens_with_the_same_outputs(path):
    """8 chats of 3 turns, their prefixes (about 8 x 100-180 tokens) far past the 16-block pool: without the tier
    every turn recomputes its chat, with it the chat's blocks come back from host memory."""
    without = engine(path, num_kv_blocks=16)
    want, _ = run_conversations(without)
    bytes_per_block = without.model_runner.kv_spec.bytes_per_block
    setting = 60 * bytes_per_block
    tiered = engine(path, num_kv_blocks=16, kv_offload_memory=setting)
    got, most_host_bytes = run_conversations(tiered)
    assert got == want
    stats, base = tiered.stats(), without.stats()
    assert stats.host_tier_hits >= 20 * BLOCK and stats.prefix_cache_hits > base.prefix_cache_hits
    assert stats.prefill_tokens <= base.prefill_tokens - stats.host_tier_hits // 2, (stats, base)
    assert 0 < most_host_bytes <= setting and stats.kv_bytes_per_token * BLOCK == bytes_per_block
    small = engine(path, num_kv_blocks=16, kv_offload_memory=4 * bytes_per_block)  # LRU drops most
    assert run_conversations(small)[0] == want
    assert small.stats().host_tier_evictions > 0 and small.stats().host_kv_bytes_used <= 4 * bytes_per_block


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """The tiny llama with head_dim 64: a head's int8 codes and scale take 66 bytes, against bf16's 128."""
    from tiffin.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-head64"), head_dim=64))


@pytest.mark.parametrize("dtype, ratio", [("bfloat16", 1.9), ("float32", 3.8)])
def test_an_int8_tier_holds_more_blocks_in_the_same_bytes(wide_heads, dtype, ratio):
    """The tier's tensors are int8 codes and bf16 scales within kv_offload_memory, the swap region's the pool's
    format; a multi-turn workload fills more blocks than the auto tier holds, its bytes counted as they are."""
    args = dict(dtype=dtype, block_size=BLOCK, num_kv_blocks=16, preemption_mode="swap", swap_space=0.001)
    auto = LLM(wide_heads, kv_offload_memory=1 << 20, **args).llm_engine
    setting = 20 * auto.model_runner.kv_spec.bytes_per_block
    int8 = LLM(wide_heads, kv_offload_memory=setting, kv_offload_dtype="int8", **args).llm_engine
    runner = int8.model_runner
    blocks = runner.num_host_blocks[0]
    assert blocks >= ratio * 20 and [t.dtype for t in auto.model_runner.host_tier] == [auto.model_runner.kv_spec.dtype]
    codes, scales = runner.host_tier
    assert (codes.dtype, scales.dtype, codes.shape[2], scales.shape[2]) == (torch.int8, torch.bfloat16, blocks, blocks)
    assert codes.nbytes + scales.nbytes == blocks * runner.tier_spec.bytes_per_block <= setting
    assert [t.dtype for t in runner.host_swap] == [runner.kv_spec.dtype]
    _, most_host_bytes = run_conversations(int8, turns=2)
    assert int8.block_manager.tier.num_used_blocks > 20 and most_host_bytes <= setting
    assert int8.stats().host_kv_bytes_used == int8.block_manager.tier.num_used_blocks * runner.tier_spec.bytes_per_block


def record_tier_copies(runner) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Wraps `runner.copy_blocks`; the list it returns gets, for each block loaded from the host tier, the K/V the
    block had when offloaded, the tier's codes and scales then, and the K/V loaded."""
    offloaded, loaded, copy_blocks = {}, [], runner.copy_blocks

    def copy(copies):
        tier, _ = copies.split(runner.num_host_blocks[0])
        before = {host: runner.kv_cache[:, :, block].clone() for block, host in tier.offloads}
        copy_blocks(copies)
        offloaded.update(
            {host: (kv, *(t[:, :, host].clone() for t in runner.host_tier)) for host, kv in before.items()}
        )
        loaded.extend((*offloaded[host], runner.kv_cache[:, :, block].clone()) for host, block in tier.loads)

    runner.copy_blocks = copy
    return loaded


def test_an_int8_tier_recomputes_as_few_tokens_and_loads_kv_quant_blocks(path):
    """The multi-turn chats on a tier of 30 fp32 blocks' bytes, which holds 3.5x as many int8 ones: at least the
    auto tier's hits, no more prefill tokens. Each block is stored as kv_quant quantizes it and loaded as it
    dequantizes that (the int8 cache's error, keys rotated back); the first tokens are the no-tier run's."""
    without = engine(path, num_kv_blocks=16)
    want, _ = run_conversations(without)
    setting = 30 * without.model_runner.kv_spec.bytes_per_block
    auto = engine(path, num_kv_blocks=16, kv_offload_memory=setting)
    assert run_conversations(auto)[0] == want
    int8 = engine(path, num_kv_blocks=16, kv_offload_memory=setting, kv_offload_dtype="int8")
    loads = record_tier_copies(int8.model_runner)
    got, most_host_bytes = run_conversations(int8)
    stats, base = int8.stats(), auto.stats()
    assert stats.host_tier_hits >= base.host_tier_hits and stats.prefill_tokens <= base.prefill_tokens, (stats, base)
    assert stats.host_tier_hits >= 50 * BLOCK and 0 < most_host_bytes <= setting
    assert len(loads) == stats.host_tier_hits // BLOCK
    for kv, codes, scales, got_kv in loads:
        want_codes, want_scales = kv_quant.quantize_kv(kv, torch.int8)
        assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
        assert torch.allclose(got_kv, kv_quant.dequantize_kv(codes, scales, torch.float32), rtol=1e-6, atol=1e-7)
        assert not torch.equal(got_kv, kv) and (got_kv - kv).abs().max() <= kv.abs().max() / 50
    assert sum(g[0] == w[0] for g, w in zip(got, want)) >= 0.75 * len(want)


def test_a_prefix_continues_past_a_tier_hit_to_the_blocks_still_on_the_device(path):
    """A 64-token prompt asked twice: the second computes its block 3 again (the last token is always recomputed),
    its copy unhashed, so the blocks of its answer (4, 5) follow a block 3 the first one holds. A filler then evicts
    only that block 3 to the tier (unhashed and unused blocks go first). The chat's next turn finds blocks 0-2 and 4-5
    on the device and 3 in the tier: it computes only its tokens past them, where a prefix stopping at the first
    block the tier lacks would recompute blocks 4-5 too; its outputs are a run's without the tier."""
    vocab = 2048
    rng = random.Random(2)
    prompt = [rng.randrange(4, vocab) for _ in range(4 * BLOCK)]
    filler = [rng.randrange(4, vocab) for _ in range(10 * BLOCK)]  # with its answer, 11 of the 16 blocks
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 40, 8)]

    def turns(llm):
        drive(llm, [(prompt, params[0])])
        (answer,), _ = drive(llm, [(prompt, params[1])])
        drive(llm, [(filler, params[2])])
        before = llm.stats()
        (last,), _ = drive(llm, [(prompt + answer + filler[:10], params[2])])  # 114 tokens: 6 full blocks cached
        return answer + last, before, llm.stats()

    want, *_ = turns(engine(path, num_kv_blocks=16))
    got, before, after = turns(engine(path, num_kv_blocks=16, kv_offload_memory=1 << 20))
    assert got == want
    assert after.prefix_cache_hits - before.prefix_cache_hits == 6 * BLOCK
    assert after.host_tier_hits - before.host_tier_hits == BLOCK
    assert after.prefill_tokens - before.prefill_tokens == 114 - 6 * BLOCK


def preempting_workload(vocab: int, num: int = 10, max_tokens: int = 60, seed: int = 0):
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [([rng.randrange(4, vocab) for _ in range(rng.randrange(10, 40))], params) for _ in range(num)]


def test_swap_resumes_preempted_sequences_without_recompute(path):
    """A 12-block pool for 10 sequences of up to 100 tokens: preempted every few steps."""
    recompute = engine(path, num_kv_blocks=12)
    requests = preempting_workload(recompute.model_config.vocab_size)
    want, _ = drive(recompute, requests)
    swap = engine(path, num_kv_blocks=12, preemption_mode="swap", swap_space=0.01)
    got, most_host_bytes = drive(swap, requests)
    assert got == want
    stats, base = swap.stats(), recompute.stats()
    assert base.num_preemptions >= 5 and stats.swapped_out_seqs >= 5, (stats, base)
    assert stats.swapped_in_seqs == stats.swapped_out_seqs == stats.num_preemptions
    assert stats.prefill_tokens < base.prefill_tokens and most_host_bytes > 0
    assert stats.host_kv_bytes_used == 0 and stats.num_swapped == 0
    # a swap region of one block swaps nothing: recompute, as without it
    tight = engine(
        path, num_kv_blocks=12, preemption_mode="swap", swap_space=swap.model_runner.kv_spec.bytes_per_block / 2**30
    )
    assert drive(tight, requests)[0] == want and tight.stats().swapped_out_seqs < stats.swapped_out_seqs


def test_swap_stays_lossless_beside_an_int8_tier(path):
    """Swap with an int8 tier: the swap region keeps the pool's fp32 blocks, so the outputs are an unpreempted
    run's while the tier fills with int8 ones."""
    requests = preempting_workload(2048)
    want, _ = drive(engine(path, num_kv_blocks=256), requests)
    tiers = dict(preemption_mode="swap", swap_space=0.01, kv_offload_memory=1 << 20, kv_offload_dtype="int8")
    swap = engine(path, num_kv_blocks=12, **tiers)
    assert [t.dtype for t in swap.model_runner.host_swap] == [torch.float32]
    assert [t.dtype for t in swap.model_runner.host_tier] == [torch.int8, torch.bfloat16]
    got, _ = drive(swap, requests)
    stats = swap.stats()
    assert got == want and stats.swapped_out_seqs == stats.num_preemptions >= 5, stats
    assert swap.block_manager.tier.num_used_blocks > 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_an_int8_tier_keeps_a_quantized_pool_format(path, kv_cache_dtype):
    """A quantized pool's blocks are no wider than int8 ones: the tier stores them as the pool does, losslessly."""
    runner = engine(path, num_kv_blocks=12, kv_cache_dtype=kv_cache_dtype, kv_offload_memory=1 << 20).model_runner
    int8 = engine(
        path, num_kv_blocks=12, kv_cache_dtype=kv_cache_dtype, kv_offload_memory=1 << 20, kv_offload_dtype="int8"
    )
    assert int8.model_runner.tier_spec == runner.tier_spec == runner.kv_spec
    assert [t.dtype for t in int8.model_runner.host_tier] == [t.dtype for t in runner.kv_tensors]


def test_fp8_is_vllms_name_for_e4m3(path):
    runner = engine(path, num_kv_blocks=12, kv_cache_dtype="fp8").model_runner
    assert runner.config.kv_cache_dtype == "fp8_e4m3"
    assert runner.kv_cache.dtype == torch.float8_e4m3fn


def test_a_bad_kv_offload_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_offload_dtype"):
        EngineConfig("model", kv_offload_dtype="fp8_e4m3")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_caches_move_codes_and_scales(path, kv_cache_dtype):
    """A quantized cache's blocks are codes and scales, two tensors: both go to the host tiers and back. The
    workload runs twice: preempted by swap, then its prefixes found in the host tier. The outputs are those of a
    pool that never evicts, not of recompute: a recomputed prompt attends its exact keys and values, not the
    codes its decode steps read."""
    roomy = engine(path, num_kv_blocks=80, kv_cache_dtype=kv_cache_dtype)
    requests = preempting_workload(roomy.model_config.vocab_size)
    want = [drive(roomy, requests)[0], drive(roomy, requests)[0]]
    assert roomy.stats().num_preemptions == 0
    tiers = dict(preemption_mode="swap", swap_space=0.01, kv_offload_memory=1 << 20)
    tiered = engine(path, num_kv_blocks=12, kv_cache_dtype=kv_cache_dtype, **tiers)
    assert len(tiered.model_runner.host_tier) == len(tiered.model_runner.host_swap) == 2
    assert [drive(tiered, requests)[0], drive(tiered, requests)[0]] == want
    stats = tiered.stats()
    assert stats.swapped_out_seqs > 0 and stats.host_tier_hits > 0 and stats.swapped_out_seqs == stats.num_preemptions


def test_thousands_of_short_requests_leave_no_block_held(path):
    """2,000 short requests over a few shared prefixes, swap and the host tier on, the pool forcing preemptions:
    afterwards every device block and every swap block is free (host-tier blocks stay: they are a cache)."""
    llm = engine(
        path, num_kv_blocks=10, max_num_seqs=32, preemption_mode="swap", swap_space=0.001, kv_offload_memory=1 << 20
    )
    rng = random.Random(1)
    vocab = llm.model_config.vocab_size
    prefixes = [[rng.randrange(4, vocab) for _ in range(rng.randrange(16, 40))] for _ in range(6)]
    requests = [
        (
            rng.choice(prefixes) + [rng.randrange(4, vocab) for _ in range(rng.randrange(1, 6))],
            SamplingParams(temperature=0, max_tokens=rng.randrange(1, 8), ignore_eos=True),
        )
        for _ in range(2000)
    ]
    outputs, _ = drive(llm, requests)
    assert [len(o) for o in outputs] == [p.max_tokens for _, p in requests]
    stats, bm = llm.stats(), llm.block_manager
    assert stats.swapped_out_seqs > 0 and stats.host_tier_hits > 0 and stats.num_swapped == 0
    assert bm.num_free_blocks == bm.num_blocks and bm.swap.num_used_blocks == 0 and not bm.swap.released
    assert not llm.scheduler.swapped and not llm.scheduler.running and not llm.scheduler.waiting
    bm.check_invariants([])


def test_an_int8_tier_leaves_no_block_held(path):
    """300 requests over shared prefixes, a third aborted midway, with swap and an int8 tier and preemptions:
    afterwards every device and swap block is free, the tier's blocks (a cache) within its bytes."""
    setting = 1 << 16
    llm = engine(
        path,
        num_kv_blocks=10,
        max_num_seqs=16,
        preemption_mode="swap",
        swap_space=0.001,
        kv_offload_memory=setting,
        kv_offload_dtype="int8",
    )
    rng = random.Random(2)
    prefixes = [[rng.randrange(4, 2048) for _ in range(rng.randrange(16, 40))] for _ in range(8)]
    for i in range(300):
        prompt = rng.choice(prefixes) + [rng.randrange(4, 2048) for _ in range(rng.randrange(1, 6))]
        llm.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=rng.randrange(1, 12)))
    aborted, finished = set(), set()
    while llm.has_unfinished_requests():
        finished |= {out.request_id for out in llm.step() if out.finished}
        running = [s.request_id for s in llm.scheduler.running + list(llm.scheduler.swapped)]
        if len(aborted) < 100 and running:
            aborted.add(running[-1])
            llm.abort_request(running[-1])
    stats, bm = llm.stats(), llm.block_manager
    assert stats.swapped_out_seqs > 0 and stats.host_tier_hits > 0 and len(finished | aborted) == 300
    assert bm.num_free_blocks == bm.num_blocks and bm.swap.num_used_blocks == 0 and not bm.swap.released
    assert 0 < stats.host_kv_bytes_used == bm.tier.num_used_blocks * llm.model_runner.tier_spec.bytes_per_block
    assert stats.host_kv_bytes_used <= setting and not bm.tier.pinned
    bm.check_invariants([])


def test_aborting_a_swapped_request_frees_its_host_blocks(path):
    llm = engine(path, num_kv_blocks=12, preemption_mode="swap", swap_space=0.01)
    for i, (prompt, params) in enumerate(preempting_workload(llm.model_config.vocab_size)):
        llm.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while not llm.scheduler.swapped:
        llm.step()
    swapped = llm.scheduler.swapped[0]
    held, own = llm.block_manager.swap.num_used_blocks, len(swapped.swap_blocks)
    assert held >= own > 0 and llm.stats().num_swapped >= 1
    (out,) = llm.abort_request(swapped.request_id)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert swapped.swap_blocks == [] and swapped not in llm.scheduler.swapped
    assert llm.block_manager.swap.num_used_blocks == held - own
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.block_manager.swap.num_used_blocks == 0 and llm.stats().kv_blocks_used == 0


def test_a_swapped_sequence_keeps_its_grammar(path, monkeypatch):
    """Structured outputs across preemption by swap: the grammar's state stays (only recompute drops it), and the
    outputs are an unpreempted run's."""
    pytest.importorskip("xgrammar")
    from tiffin import StructuredOutputsParams
    from tiffin.engine.structured.backend import GrammarState

    schema = {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}}}
    so = StructuredOutputsParams(json=schema | {"required": ["id", "name"]})
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=so)] * 6
    prompts = [f"Record {i} as JSON, then stop." for i in range(6)]
    want = [o.outputs[0].text for o in LLM(path, num_kv_blocks=256).generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(GrammarState, "drop", lambda self: pytest.fail("a swapped sequence's grammar was dropped"))
    tight = LLM(path, num_kv_blocks=30, block_size=4, preemption_mode="swap", swap_space=0.01)
    got = [o.outputs[0].text for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.stats().swapped_out_seqs > 0 and got == want


CUDA_ARGS = dict(kernel_backend="torch", enforce_eager=True, max_model_len=128, num_kv_blocks=12)
CUDA_TIERS = dict(preemption_mode="swap", swap_space=0.01, kv_offload_memory=1 << 20)


@pytest.fixture(scope="module")
def on_cpu(path):
    """A preempting workload and, for each kv_offload_dtype, its outputs on the CPU, twice (before the CUDA
    emulation, which a CPU engine cannot run under): no tier for auto (lossless), the same tiers for int8."""
    requests = preempting_workload(2048, num=6, max_tokens=30)
    plain = drive(engine(path, num_kv_blocks=12), requests)[0]
    int8 = engine(path, kv_offload_dtype="int8", **CUDA_TIERS, **CUDA_ARGS)
    return requests, {"auto": [plain, plain], "int8": [drive(int8, requests)[0], drive(int8, requests)[0]]}


@pytest.mark.parametrize("kv_offload_dtype", ["auto", "int8"])
def test_copies_on_the_cuda_path(path, on_cpu, cuda_emulation, kv_offload_dtype):
    """Emulated CUDA (torch kernels): pinned host blocks, copies on the side stream (an int8 tier's blocks
    quantized and dequantized on the device); the outputs are the CPU's."""
    requests, want = on_cpu
    cuda = engine(path, device="cuda", kv_offload_dtype=kv_offload_dtype, **CUDA_TIERS, **CUDA_ARGS)
    assert all(cuda_emulation.is_pinned(t) for t in cuda.model_runner.host_tier + cuda.model_runner.host_swap)
    assert drive(cuda, requests)[0] == want[kv_offload_dtype][0]
    # the second time, prefixes come back from the host tier
    assert drive(cuda, requests)[0] == want[kv_offload_dtype][1]
    stats = cuda.stats()
    assert stats.swapped_out_seqs > 0 and stats.host_tier_hits > 0, stats
    assert len(cuda.model_runner.host_tier) == 1 + (kv_offload_dtype == "int8")


def test_offloads_overlap_the_forward_on_cuda(path, on_cpu, cuda_emulation, monkeypatch):
    """Emulated CUDA: in a step that offloads, no host synchronization and no write to the host blocks between its
    copies and its forward (the device -> host copies overlap it); the host blocks hold the evicted bytes by the
    next step's copies, and the outputs are the CPU's."""
    from tiffin.testing.emulated_graphs import EmulatedEvent, EmulatedStream

    requests, want = on_cpu
    cuda = engine(path, device="cuda", **CUDA_TIERS, **CUDA_ARGS)
    runner = cuda.model_runner
    regions = {"tier": runner.host_tier, "swap": runner.host_swap}
    pools = {t.untyped_storage().data_ptr() for pool in regions.values() for t in pool}
    log, evicted, landed, lost = [], {}, [], []  # lost: asserting in a step would fail the step, not the test
    for cls in (EmulatedStream, EmulatedEvent):
        monkeypatch.setattr(cls, "synchronize", lambda self: log.append("sync"))
    index_copy, writing = torch.Tensor.index_copy_, []

    def scatter(self, dim, index, source):
        if not writing and self.untyped_storage().data_ptr() in pools:
            log.append("host write")
        writing.append(self)  # the emulation's torch function mode calls this again: once a write
        try:
            return index_copy(self, dim, index, source)
        finally:
            writing.pop()

    def check_landed():
        """The host blocks hold what the last offloading step evicted."""
        for (region, host), kv in evicted.items():
            if not all(torch.equal(t[:, :, host], b) for t, b in zip(regions[region], kv)):
                lost.append((region, host))
        landed.append(len(evicted))
        evicted.clear()

    def copy(copies, *args, copy=runner._copy):
        check_landed()
        for region, part in zip(regions, copies.split(runner.num_host_blocks[0])):
            evicted.update({(region, h): [t[:, :, b].cpu() for t in runner.kv_tensors] for b, h in part.offloads})
        rereads = {h for _, h in copies.offloads} & {h for h, _ in copies.loads}  # these land before the loads
        log.append("offloading step" if copies.offloads and not rereads else "step")
        return copy(copies, *args)

    def run_model(inputs, run_model=runner.run_model):
        log.append("forward")
        return run_model(inputs)

    monkeypatch.setattr(torch.Tensor, "index_copy_", scatter)
    monkeypatch.setattr(runner, "_copy", copy)
    monkeypatch.setattr(runner, "run_model", run_model)
    assert drive(cuda, requests)[0] == want["auto"][0]
    runner.finish_offloads()
    check_landed()
    assert cuda.stats().swapped_out_seqs > 0 and sum(landed) > 0 and not lost, lost
    # from each offloading step's copies to its forward
    overlapped = [step.split("forward")[0] for step in " ".join(log).split("offloading step")[1:]]
    assert len(overlapped) > 3 and not [s for s in overlapped if "sync" in s or "host write" in s], overlapped
    assert "host write" in " ".join(log)
    # a load of a host block an offload of its step writes: that offload lands first (a host synchronization)
    host = runner.num_host_blocks[0]  # the swap region's first
    for t in runner.kv_tensors:
        t[:, :, 0] = torch.rand_like(t[:, :, 0])
    want_kv, log[:] = [t[:, :, 0].cpu() for t in runner.kv_tensors], []
    runner.copy_blocks(KVCopies([(0, host)], [(host, 1)]))
    assert log == ["step", "sync", "host write"] and not runner.pending_offloads, log
    assert all(torch.equal(t[:, :, 1].cpu(), b) for t, b in zip(runner.kv_tensors, want_kv))

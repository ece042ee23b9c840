"""Gemma 3's sliding-window layers keep a KV cache group of their own (`core.window_blocks`, `worker.kv_groups`):
a sequence holds KV for its whole context in the global layers and for about a window in the local ones.

A Gemma 3-shaped tiny fp32 checkpoint written by transformers: 6 layers, 5 local (a window of 16 keys) and 1
global, blocks of 4 tokens; its 8k context scaled down to 512 tokens (the window a 32nd of it). Counted at every
step, from the blocks each group's pool holds: the global group holds the context's blocks, the window group at
most the window plus one step's tokens and a block, and a decoding sequence holds at most
(window + block_size) x local layers + context x global layers tokens of KV. Greedy outputs and prompt logprobs equal
transformers' on the same weights (1e-4), with prefill chunks that cross window edges, preemption by recompute, and
prefix-cache hits (the second run of the same prompts); no block is held once requests finish or are aborted."""

import pytest
import torch
from references import reference_generate, spread_weights
from transformers import AutoConfig, AutoModelForCausalLM

from tiffin import LLM, SamplingParams
from tiffin.engine.config import EngineConfig
from tiffin.engine.core.block_manager import BlockManager
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.core.window_blocks import HybridBlockManager, new_block_manager
from tiffin.engine.worker import graphed_decode, kv_groups, model_runner
from tiffin.tiny import write_tokenizer

VOCAB, WINDOW, BLOCK, CONTEXT = 512, 16, 4, 512
LOCAL_LAYERS, GLOBAL_LAYERS = 5, 1
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=LOCAL_LAYERS + GLOBAL_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=24,
    vocab_size=VOCAB,
    max_position_embeddings=CONTEXT,
    rms_norm_eps=1e-6,
    sliding_window=WINDOW,
    layer_types=["sliding_attention"] * LOCAL_LAYERS + ["full_attention"] * GLOBAL_LAYERS,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    },
)
NEW_TOKENS = 40


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    p = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (3, 19, 37, 61)]
    return p + [p[3][:32] + p[1][:9]]  # shares 8 blocks with the 61-token prompt, 2 windows' worth


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(its path, the transformers model)."""
    path = tmp_path_factory.mktemp("gemma3_sliding")
    config = AutoConfig.for_model("gemma3_text", **TINY)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    spread_weights(hf, 0.0, 1, 3.0)
    hf.save_pretrained(path)
    write_tokenizer(path, VOCAB, False, CONTEXT)
    hf.generation_config.eos_token_id = None
    return path, hf


@pytest.fixture(scope="module")
def expected(checkpoint):
    return [reference_generate(checkpoint[1], p, NEW_TOKENS) for p in prompts()]


class Watch:
    """Each step's blocks, read right after the step is scheduled (its new blocks allocated, none freed yet):
    (per scheduled sequence: its computed tokens, tokens scheduled, blocks held in each group; blocks in use in each
    group; the distinct blocks of each group that running sequences hold)."""

    def __init__(self, llm: LLM):
        engine = llm.llm_engine
        self.bm, self.steps, schedule = engine.block_manager, [], engine.scheduler.schedule
        self.null = self.bm.window.null_block
        running = engine.scheduler.running
        self.diverged = False  # some window table entry differs from the block table's at its place

        def watched(*args, **kwargs):
            out = schedule(*args, **kwargs)
            seqs = [
                (s.num_computed_tokens, n, s.block_table, s.window_table)
                for s, n in zip(out.seqs, out.num_scheduled_tokens)
            ]
            held = [(c, n, len(t), sum(b != self.null for b in w)) for c, n, t, w in seqs]
            tables = {b for s in running for b in s.block_table}, {b for s in running for b in s.window_table}
            distinct = len(tables[0]), len(tables[1] - {self.null})
            self.diverged |= any(w not in (b, self.null) for s, _, t, wt in seqs for w, b in zip(wt, t))
            self.steps.append((held, self.bm.num_used_blocks, self.bm.window.num_used_blocks, distinct))
            return out

        engine.scheduler.schedule = watched


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), **(dict(dtype="float32", block_size=BLOCK) | kwargs))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)


def assert_matches(out, tokens: list[int], logprobs: list[float]) -> None:
    got = out.outputs[0]
    assert got.token_ids == tokens
    got_lp = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
    assert max(abs(a - b) for a, b in zip(got_lp, logprobs)) < 1e-4


def assert_nothing_held(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert bm.num_used_blocks == bm.window.num_used_blocks == 0
    bm.check_invariants([])


def window_bound(n: int) -> int:
    """The most blocks a step of `n` tokens needs in the window group: keys back to its first query's window."""
    return -(-(WINDOW - 1 + n) // BLOCK) + 1


@pytest.fixture(scope="module")
def long_run(checkpoint):
    """One sequence from a 24-token prompt to the whole context, prefilled in chunks of 16: (the engine, its
    output, what `Watch` saw)."""
    llm = engine(checkpoint[0], max_num_batched_tokens=16, max_num_seqs=2)
    watch = Watch(llm)
    prompt = prompts()[3][:24]
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(CONTEXT - len(prompt)), use_tqdm=False)[0]
    return llm, prompt, out, watch


def test_long_context_holds_a_window_of_kv_in_local_layers(long_run):
    llm, prompt, out, watch = long_run
    runner = llm.llm_engine.model_runner
    assert isinstance(llm.llm_engine.block_manager, HybridBlockManager)
    assert runner.window_group.layers == tuple(range(LOCAL_LAYERS)) and runner.window_group.window == WINDOW
    # each pool's tensors hold only their layers' KV, on their own number of blocks (and the dummy one)
    local, full = runner.model.model.layers[0].self_attn, runner.model.model.layers[-1].self_attn
    assert local.k_cache.shape[0] == runner.window_blocks + 1 < full.k_cache.shape[0] == runner.num_blocks + 1
    assert len(out.outputs[0].token_ids) + len(prompt) == CONTEXT
    peak_tokens = 0
    for held, used, window_used, _ in watch.steps:
        ((computed, n, table, window_held),) = held
        assert used == table == -(-(computed + n) // BLOCK)  # the global group: the whole context
        assert window_used == window_held <= window_bound(n)  # the window group: the window and the step's tokens
        if n == 1:
            assert window_held >= WINDOW // BLOCK
            peak_tokens = max(peak_tokens, BLOCK * (window_held * LOCAL_LAYERS + table * GLOBAL_LAYERS))
    assert max(c + n for held, *_ in watch.steps for c, n, *_ in held) == CONTEXT - 1  # the last token: not computed
    bound = (WINDOW + BLOCK) * LOCAL_LAYERS + CONTEXT * GLOBAL_LAYERS
    print(f"peak KV held decoding: {peak_tokens} layer-tokens; bound {bound}; one group: {CONTEXT * 6}")
    assert peak_tokens <= bound < CONTEXT * (LOCAL_LAYERS + GLOBAL_LAYERS) / 2
    assert_nothing_held(llm)


def test_long_context_output_matches_transformers(checkpoint, long_run):
    _, prompt, out, _ = long_run
    tokens, logprobs = reference_generate(checkpoint[1], prompt, CONTEXT - len(prompt))
    assert_matches(out, tokens, logprobs)


def test_batch_with_chunks_preemption_and_prefix_hits_matches_transformers(checkpoint, expected):
    """Chunks of up to 12 tokens cross window edges; a global pool of 48 blocks runs 5 sequences of up to 101
    tokens (26 blocks) by preempting; the second run's prompts hit the first's cached blocks, the window group's
    only where the window before the hit is cached (its table holds the null block before)."""
    llm = engine(checkpoint[0], max_num_batched_tokens=12, max_num_seqs=4, num_kv_blocks=30)
    runner, bm = llm.llm_engine.model_runner, llm.llm_engine.block_manager
    cap = 4 * (-(-(WINDOW - 1) // BLOCK) + 2) + 12 // BLOCK  # a window and 2 blocks a sequence, a step's tokens
    assert (runner.num_blocks, runner.window_blocks) == (30 * 6 - cap * 5, cap)  # the memory of 30 blocks x 6 layers
    watch = Watch(llm)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], greedy(NEW_TOKENS), use_tqdm=False)
        for out, (tokens, logprobs) in zip(outs, expected):
            assert_matches(out, tokens, logprobs)
        assert_nothing_held(llm)
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for held, used, window_used, distinct in watch.steps:
        assert (used, window_used) == distinct  # every block in use is a running sequence's
        assert all(w <= window_bound(n) for _, n, _, w in held) and window_used <= cap
    # hits past the window: those sequences were admitted with their window group's first blocks null
    assert max(out.num_cached_tokens for out in outs) > WINDOW
    assert bm.window.num_blocks == cap


def test_prompt_logprobs_in_chunks_match_transformers(checkpoint):
    path, hf = checkpoint
    llm = engine(path, max_num_batched_tokens=12)
    prompt = prompts()[3]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].prompt_logprobs
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert got[0] is None
    diffs = [abs(got[i][prompt[i]].logprob - want[i - 1, prompt[i]].item()) for i in range(1, len(prompt))]
    assert max(diffs) < 1e-4
    assert_nothing_held(llm)


def test_aborts_leave_no_block_held(checkpoint):
    llm = engine(checkpoint[0], max_num_batched_tokens=12, max_num_seqs=4)
    engine_ = llm.llm_engine
    for i, p in enumerate(prompts()):
        engine_.add_request(str(i), {"prompt_token_ids": p}, greedy(NEW_TOKENS))
    for _ in range(8):  # some sequences decoding, some prefilling, some waiting
        engine_.step()
    assert engine_.block_manager.window.num_used_blocks > 0
    engine_.abort_request([str(i) for i in range(len(prompts()))])
    assert not engine_.has_unfinished_requests()
    assert_nothing_held(llm)


def test_gemma3_4b_shape_at_8k_context_counts_blocks():
    """Gemma 3 4B's shape (34 layers, every 6th global: 29 local with a window of 1024, 5 global; blocks of 16) on
    the block managers alone: a sequence prefilled in chunks of 512 and decoded to 8192 tokens, as the scheduler
    allocates. Each group's pool gets the memory `split_pool` gives it from one pool of all 34 layers."""
    window, block, context, local, full, chunk = 1024, 16, 8192, 29, 5, 512
    group = kv_groups.WindowGroup(tuple(range(local)), window)
    config = EngineConfig(model="x", max_num_seqs=1, max_num_batched_tokens=chunk, block_size=block)
    cap = kv_groups.window_pool_cap(group, config)
    num_blocks, window_blocks = kv_groups.split_pool(context // block, local + full, group, cap, context // block)
    assert (num_blocks, window_blocks) == (context // block, cap)  # one 8k sequence fits; the window pool is small
    bm = HybridBlockManager(num_blocks, block, True, window, window_blocks)
    seq = Sequence("a", 0, list(range(1000)), SamplingParams(), 1)
    peak_decoding = peak = 0
    while seq.num_tokens < context:
        n = min(seq.num_tokens - seq.num_computed_tokens, chunk)
        assert bm.allocate_slots(seq, n)
        tokens = block * (bm.window.num_used_blocks * local + bm.num_used_blocks * full)
        peak = max(peak, tokens)
        if n == 1:
            peak_decoding = max(peak_decoding, tokens)
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    assert bm.num_used_blocks == context // block and bm.window.num_used_blocks == window // block + 1
    bound = (window + block) * local + context * full
    print(
        f"4B shape at 8k: decoding peak {peak_decoding} layer-tokens of KV, any step {peak}; bound {bound}; one pool "
        f"{context * (local + full)}; pools of {num_blocks} + {window_blocks} blocks"
    )
    assert peak_decoding <= bound and peak <= bound + (chunk - 1) * local
    bm.free_seq(seq)
    bm.check_invariants([])


def test_window_hits_need_the_window_before_them():
    """vLLM's rule: a hit of n blocks needs the window group's blocks that the query after them reads."""
    bm = HybridBlockManager(64, BLOCK, True, WINDOW, 64)
    null, prompt = bm.window.null_block, list(range(41))
    first = Sequence("a", 0, prompt, SamplingParams(), 1)
    assert bm.allocate_slots(first, 41)
    ids = list(first.window_table)
    first.num_computed_tokens = 41
    assert bm.allocate_slots(first, 1)  # its next step reads keys from 41 - 15 = 26 on: blocks 0..5 go back
    assert first.window_table == [null] * 6 + ids[6:] and bm.window.num_used_blocks == 5
    assert len(bm.window.cached) == 10  # still findable
    bm.check_invariants([first])
    bm.free_seq(first)
    again = Sequence("b", 0, prompt, SamplingParams(), 1)
    assert len(bm.get_computed_blocks(again)) == 10  # every block cached in both groups
    bm.window._uncache(ids[7])
    hits = bm.get_computed_blocks(again)
    assert len(hits) == 7  # the query at 28 reads blocks 3..6, all cached; one at 40 would read 6..9
    assert bm.allocate_slots(again, 41 - 28, hits)
    assert again.window_table[:7] == [null] * 3 + ids[3:7] and again.block_table[:7] == hits
    bm.check_invariants([again])
    fresh = again.window_table[7:]  # hashed as they were allocated: cached again
    bm.free_seq(again)
    for block in [*fresh, ids[3]]:
        bm.window._uncache(block)
    assert len(bm.get_computed_blocks(again)) == 3  # blocks 0..2: from the start
    bm.window._uncache(ids[0])
    assert bm.get_computed_blocks(again) == []
    bm.check_invariants([])


def test_split_and_fallbacks():
    group = kv_groups.WindowGroup((0, 1, 2, 3, 4), WINDOW)
    cap = 25
    assert kv_groups.split_pool(20, 6, group, cap, 1000) == (20, 20)  # too small to split: as one pool
    assert kv_groups.split_pool(100, 6, group, cap, 1000) == (100 * 6 - 25 * 5, 25)
    assert kv_groups.split_pool(100, 6, group, cap, 300) == (300, 25)

    class Layer:
        def __init__(self, window):
            self.window = window

    layers = [Layer(WINDOW)] * 5 + [Layer(0)]
    assert kv_groups.window_group(layers, EngineConfig(model="x")) == group
    assert kv_groups.window_group([Layer(0)] * 6, EngineConfig(model="x")) is None  # no window: one pool
    ngram = dict(method="ngram", num_speculative_tokens=2)
    for settings in (dict(preemption_mode="swap"), dict(kv_offload_memory=1 << 20), dict(speculative_config=ngram)):
        assert kv_groups.window_group(layers, EngineConfig(model="x", **settings)) is None
    assert type(new_block_manager(8, BLOCK, True, (0, 0), None)) is BlockManager


@pytest.mark.slow  # about 80 s of CPU: every token under the Triton interpreter
def test_cuda_graphs_read_the_window_groups_tables(checkpoint, cuda_emulation, monkeypatch):
    """The CUDA path under the emulation (Triton kernels under the interpreter, fp16: Triton applies windows to 16-bit
    queries): decode steps replayed from graphs read the window group's slots and tables from the graphs' buffers.
    The graphed engine equals the eager one token for token, logprobs within 1e-3, past the window, on pools split
    so small that the two groups' block ids part ways."""
    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)
    monkeypatch.setattr(graphed_decode, "decode_batch_sizes", lambda rows, quantized: [1, 2])
    batch = [{"prompt_token_ids": p[:18]} for p in prompts()[2:4]]
    settings = dict(device="cuda", dtype="float16", max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64)
    outs = {}
    for eager in (True, False):
        llm = engine(checkpoint[0], enforce_eager=eager, num_kv_blocks=48, **settings)
        runner, watch = llm.llm_engine.model_runner, Watch(llm)
        assert (runner.num_blocks, runner.window_blocks) == (32, 2 * 6 + 2)
        replays = cuda_emulation.replays
        outs[eager] = [o.outputs[0] for o in llm.generate(batch, greedy(14), use_tqdm=False)]
        assert watch.diverged and (cuda_emulation.replays > replays) != eager
        assert_nothing_held(llm)
    assert runner.decode_graphs.window_dummy == runner.window_blocks
    for got, want in zip(outs[False], outs[True]):
        assert got.token_ids == want.token_ids
        pairs = zip(got.logprobs, want.logprobs, want.token_ids)
        assert max(abs(g[t].logprob - w[t].logprob) for g, w, t in pairs) < 1e-3

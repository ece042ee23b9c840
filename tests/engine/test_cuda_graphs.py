"""The engine's CUDA path run on the CPU through the CUDA emulation (`tiffin.testing.cuda_emulation`, Triton
kernels under the interpreter): decode steps replayed from captured graphs give the tokens (and logprobs) of the
same engine run eagerly, for each architecture, with adapters and speculation; the defects the emulation found,
each pinned by a test. Quantized weights and KV caches: test_cuda_graphs_quantized (a module of their own, so that
xdist's loadscope can run the two halves side by side). fp32 and fp16 only: the interpreter computes bf16 dots
wrongly."""

import asyncio

import pytest
import torch
from graph_runs import PROMPTS, assert_same, build, generate, graphed_equals_eager
from lora_adapters import ADAPTERS, make_adapter
from transformers import AutoModelForCausalLM

from tiffin import LLM, AsyncLLMEngine, LoRARequest, SamplingParams
from tiffin.engine.worker import graphed_decode, kv_cache, model_runner
from tiffin.testing.cuda_emulation import CudaEmulation


@pytest.fixture(scope="module")
def llama_eager(tiny_model) -> list:
    """`generate` on the eager llama engine of `build`'s defaults, in a CUDA emulation of its own: what graphed and
    speculating llama engines must give. Computed once for the module's tests, which only read it."""
    with pytest.MonkeyPatch.context() as patched, CudaEmulation():
        patched.setenv("TRITON_INTERPRET", "1")
        patched.setattr(model_runner, "warm_up_triton", lambda runner: None)
        return generate(build(tiny_model("llama"), eager=True))


def keep_graph_sizes(monkeypatch, keep: set[int]) -> None:
    """Decode graphs captured only for the sizes of `decode_batch_sizes` in `keep` (and its largest): each size
    captured costs two forwards of that many rows under the interpreter (the sizing's capture and the engine's)."""
    sizes = graphed_decode.decode_batch_sizes
    monkeypatch.setattr(
        graphed_decode,
        "decode_batch_sizes",
        lambda n, quantized: [s for s in sizes(n, quantized) if s in keep or s == sizes(n, quantized)[-1]],
    )


def test_graphed_decode_equals_eager_llama(tiny_model, cuda_emulation, llama_eager):
    """The graphed engine warms up, as an engine starts on a GPU. Failed before `Rotation`: the capture reused the
    cos/sin rows of the eager pass before it, so tokens differed from the second on. Steps of at most 32 tokens: the
    prompts still prefill in one step, as llama_eager's did, and warm-up's steps stop at 32 tokens (under the
    interpreter each token of a step costs)."""
    llm = build(tiny_model("llama"), eager=False, max_num_batched_tokens=32)
    assert_same(generate(llm), llama_eager)
    assert cuda_emulation.replays == 4


@pytest.mark.parametrize("arch", ["qwen3", pytest.param("qwen2", marks=pytest.mark.slow), "mistral"])
def test_graphed_decode_equals_eager_architectures(tiny_model, cuda_emulation, no_warm_up, arch):
    graphed_equals_eager(tiny_model(arch), cuda_emulation, dtype="float16")


def test_graphed_decode_with_lora_equals_eager(tiny_model, cuda_emulation, no_warm_up, tmp_path):
    """Decode steps mixing the base model and two adapters replay graphs captured before any adapter loaded (slot
    indices in the graph's buffers, weights in the slots), with the eager engine's tokens; then again after one
    adapter is removed and a third loaded into its slot between steps."""
    path = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    a, b, c = (
        LoRARequest(name, i + 1, str(make_adapter(path, tmp_path / name, i, model, **ADAPTERS[name])))
        for i, name in enumerate(ADAPTERS)
    )
    first, second = [None, a, b, a], [c, None, a, c]

    def run(llm: LLM) -> list:
        outs = generate(llm, first)
        llm.llm_engine.remove_lora(b.lora_int_id)
        return outs + generate(llm, second)

    want = run(build(path, eager=True, enable_lora=True, max_loras=2))
    llm = build(path, eager=False, enable_lora=True, max_loras=2)
    engine, uploads = llm.llm_engine, []
    slots, step = engine.model_runner.lora_slots, engine.step

    def counted():  # (replayed, uploads) per step
        replays = cuda_emulation.replays
        cuda_emulation.reset_counts()
        outputs = step()
        uploads.append((cuda_emulation.replays - replays, len(cuda_emulation.uploads)))
        return outputs

    engine.step = counted
    assert sorted(engine.model_runner.decode_graphs.graphs) == [1, 2, 4]
    got = generate(llm, first)
    assert cuda_emulation.replays == 4 and [m.name for m in slots.slots] == ["qv-r8", "all-rslora-r16"]
    llm.llm_engine.remove_lora(b.lora_int_id)
    got += generate(llm, second)
    assert cuda_emulation.replays == 8 and [m.name for m in slots.slots] == ["qv-r8", "mlp-patterns"]
    assert_same(got, want)
    assert got[4][0] != want[0][0], "the third adapter changes nothing"  # the first prompt, base then adapter
    assert all(n == 1 for replayed, n in uploads if replayed), uploads  # a graphed step's one upload, LoRA's too


def test_an_eager_lora_step_uploads_once(tiny_model, cuda_emulation, no_warm_up, tmp_path):
    """A prefill beside decodes, with an adapter (installed the step before): one pinned upload, the adapter's
    token -> slot grouping in it. Before, the grouping's arrays were copies of their own (4 more, pageable)."""
    path = tiny_model("llama")
    adapter = LoRARequest("qv-r8", 1, str(make_adapter(path, tmp_path / "qv", 0, **ADAPTERS["qv-r8"])))
    engine = build(path, eager=True, enable_lora=True, max_loras=2).llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params, adapter)
    engine.step()  # installs the adapter
    engine.add_request("b", PROMPTS[1], params, adapter)
    engine.add_request("c", PROMPTS[2], params)
    cuda_emulation.reset_counts()
    engine.step()
    assert len(cuda_emulation.uploads) == 1 and cuda_emulation.uploads[0].endswith("pinned"), cuda_emulation.uploads


def test_engine_thread_launches_on_the_engine_device(tiny_model, cuda_emulation, no_warm_up, llama_eager):
    """`device="cuda:1"` under AsyncLLMEngine: the engine is built in this thread, its steps run in `tiffin-engine`,
    whose current device was cuda:0: Triton launched there with cuda:1's tensors (an illegal address on a GPU).
    It gives the tokens of the eager engine on cuda:0."""
    path = tiny_model("llama")
    engine = AsyncLLMEngine.from_engine_args(
        str(path), device="cuda:1", dtype="float32", num_kv_blocks=64, max_num_seqs=4, max_model_len=96
    )
    params = [
        SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=4, seed=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=2, seed=2, ignore_eos=True),
    ]

    async def final(prompt: str, p: SamplingParams):
        async for out in engine.generate(prompt, p):
            last = out
        return last.outputs[0]

    async def run_all():
        return await asyncio.gather(*(final(prompt, p) for prompt, p in zip(PROMPTS, params)))

    try:
        assert engine.engine.model_runner.kv_cache.device == torch.device("cuda", 1)
        outs = asyncio.run(run_all())
    finally:
        engine.shutdown()
    assert_same([(c.token_ids, c.logprobs) for c in outs], llama_eager)


@pytest.mark.parametrize("eager", [False, True], ids=["graphed", "eager"])
def test_a_decode_step_uploads_once_and_reads_the_tokens(tiny_model, cuda_emulation, no_warm_up, eager):
    """Host <-> device traffic of one decode step with every sampling feature but structured outputs: one pinned
    upload (the batch and the sampler's parameters), one read of the sampled tokens, one of the logprobs. Before,
    ~20 uploads (each parameter column, index and seeded row's noise its own pageable copy) and 8 reads."""
    llm = build(tiny_model("llama"), eager=eager)
    engine = llm.llm_engine
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=8, min_tokens=4, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=0.8, top_k=5, max_tokens=8, repetition_penalty=1.2, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=8, logprobs=2, frequency_penalty=0.3),
    ]
    for i, p in enumerate(params):
        engine.add_request(str(i), PROMPTS[i], p)
    engine.step()  # the prefill
    for with_logprobs in (True, False):
        if not with_logprobs:
            engine.abort_request("3")
            engine.step()
        cuda_emulation.reset_counts()
        engine.step()
        assert len(cuda_emulation.uploads) == 1 and cuda_emulation.uploads[0].endswith("pinned"), cuda_emulation.uploads
        assert len(cuda_emulation.reads) == 1 + with_logprobs, cuda_emulation.reads
    assert cuda_emulation.replays == (0 if eager else 3)


# every filter, penalty and seed at once: the sampler's largest pass, which KV sizing profiles
WORST = SamplingParams(
    temperature=0.8,
    top_k=5,
    top_p=0.9,
    min_p=0.01,
    logprobs=20,
    min_tokens=2,
    max_tokens=3,
    seed=1,
    repetition_penalty=1.2,
    frequency_penalty=0.1,
    presence_penalty=0.1,
    ignore_eos=True,
)


@pytest.mark.slow
def test_memory_stays_within_utilization_with_graphs_and_the_worst_sampler(tiny_model, no_warm_up, monkeypatch):
    """KV sizing on an emulated device of 7 MiB at utilization 0.5: after start (KV cache and graphs) and the
    largest step sampled with every filter, penalty and seed, the peak stays within 3.5 MiB. Before, the pool was
    sized before the graphs were captured (their memory came on top) and the profiled sampler ran no penalties
    (their [rows, vocab] counts came on top); and start failed: the profiling step read `cpu_decoder` before it
    was set. 16 sequences, graphs of 1, 2, 4 and 16 rows (of decode_batch_sizes', to capture few: each captured
    row costs a forward of it under the interpreter, twice); the pool, 76 blocks, sized by memory."""
    keep_graph_sizes(monkeypatch, {1, 2, 4})
    total, utilization = 7 << 20, 0.5
    with pytest.MonkeyPatch.context() as patched, CudaEmulation(total_memory=total):
        patched.setenv("TRITON_INTERPRET", "1")
        config = dict(max_num_seqs=16, max_model_len=96, max_num_batched_tokens=96, num_kv_blocks=None)
        llm = build(tiny_model("llama"), eager=False, gpu_memory_utilization=utilization, **config)
        runner = llm.llm_engine.model_runner
        llm.generate([{"prompt_token_ids": [5] * 90}] + [{"prompt_token_ids": [7]}] * 15, WORST, use_tqdm=False)
        assert torch.cuda.max_memory_allocated() <= total * utilization
        assert runner.num_blocks < 16 * runner.max_blocks_per_seq  # sized by memory, not by max_num_seqs


@pytest.mark.slow
def test_a_draft_model_shares_the_memory_of_the_targets_kv_pool(tiny_model, no_warm_up, monkeypatch):
    """With a draft model, on an emulated device of 11 MiB at utilization 0.5: the draft's weights and KV pool count
    in the target's sizing, so the peak stays within 5.5 MiB after start and after the largest step sampled with
    every filter, penalty and seed, and both pools hold as many blocks; what stays in use after start (both
    models' graphs too) leaves the profiled step's peak. Before, the target filled the budget alone, and the
    draft's weights and pool came on top (7.7 MB, on 14 MiB and 16 sequences); and the profiled sampler pass had
    max_num_seqs rows, where a verifying step samples twice as many. 8 sequences (16 verifying rows) and graphs of 1,
    2, 4 rows and the largest (of decode_batch_sizes', to capture few): each captured row costs a forward of it under
    the interpreter, four times over (the sizing's and the engine's capture, target and draft)."""
    keep_graph_sizes(monkeypatch, {1, 2, 4})
    total, utilization = 11 << 20, 0.5
    with pytest.MonkeyPatch.context() as patched, CudaEmulation(total_memory=total):
        patched.setenv("TRITON_INTERPRET", "1")
        profiles, profile_memory = [], kv_cache.profile_memory
        patched.setattr(kv_cache, "profile_memory", lambda *args: profiles.append(profile_memory(*args)) or profiles[0])
        path = tiny_model("llama")
        spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 1}
        config = dict(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=96, num_kv_blocks=None)
        llm = build(path, eager=False, gpu_memory_utilization=utilization, speculative_config=spec, **config)
        engine = llm.llm_engine
        target, draft = engine.model_runner, engine.proposer.runner
        assert torch.cuda.max_memory_allocated() <= total * utilization
        # what stays in use leaves the profiled peak, but for the dummy block past each pool (sizing leaves it out)
        dummies = target.kv_spec.bytes_per_block + draft.kv_spec.bytes_per_block
        assert torch.cuda.memory_allocated() + profiles[0].peak <= total * utilization + dummies
        llm.generate([{"prompt_token_ids": [5] * 90}] + [{"prompt_token_ids": [7]}] * 7, WORST, use_tqdm=False)
        assert torch.cuda.max_memory_allocated() <= total * utilization
        assert engine.stats().spec_drafts > 0
        assert draft.num_blocks == target.num_blocks < 8 * target.max_blocks_per_seq  # sized by memory
        assert engine.proposer.block_manager.num_blocks == target.num_blocks


@pytest.mark.slow
def test_seeded_rows_draw_on_the_device_independently_of_the_batch(tiny_model, cuda_emulation, no_warm_up):
    """A seeded request's noise is drawn on the device (a twin of its generator there), not on the host and
    uploaded: its tokens are the same alone or beside others, and no step uploads a vocabulary's worth of noise."""
    llm = build(tiny_model("llama"), eager=True)
    seeded = SamplingParams(temperature=1.0, max_tokens=6, seed=7, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    cuda_emulation.reset_counts()
    batch = llm.generate(PROMPTS, [seeded, others, others, seeded], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    vocab = llm.llm_engine.model_config.vocab_size
    assert not [u for u in cuda_emulation.uploads if f"({vocab},)" in u or f", {vocab})" in u]


def propose_continuation(engine, want: list) -> None:
    """Proposals of up to 3 tokens from the run's own continuation `want` (the tiny model repeats nothing an
    n-gram would find); request ids are the engine's first, 0.."""
    continuation = {str(i): ids for i, (ids, _) in enumerate(want)}

    class Known:
        def propose(self, seqs):
            for seq in seqs:
                seq.spec_token_ids = continuation[seq.request_id][seq.num_output_tokens :][:3]

    engine.proposer = Known()


def count_steps(engine, emu) -> list[tuple[int, int, int, int]]:
    """From now on, per step of `engine`: (uploads, reads, graphs the target replayed, sequences verifying
    proposals); a draft model's replays are its own."""
    steps, step, execute, target_replays = [], engine.step, engine.model_runner.execute, [0]

    def executed(scheduler_output):
        replays = emu.replays
        out = execute(scheduler_output)
        target_replays[0] += emu.replays - replays
        return out

    def counted():
        emu.reset_counts()
        replays, drafts = target_replays[0], engine.scheduler.spec_drafts
        outputs = step()
        replayed = target_replays[0] - replays
        steps.append((len(emu.uploads), len(emu.reads), replayed, engine.scheduler.spec_drafts - drafts))
        return outputs

    engine.model_runner.execute, engine.step = executed, counted
    return steps


def assert_verifying_steps_replayed(engine, steps: list) -> None:
    assert engine.model_runner.decode_graphs.sizes == [1, 2, 4, 8, 16]  # 4 sequences of 1 + 3 proposals
    verifying = [replayed for _, _, replayed, verified in steps if verified]
    assert verifying and all(replayed == 1 for replayed in verifying), steps


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_on_the_cuda_path(tiny_model, cuda_emulation, no_warm_up, method, llama_eager):
    """Verifying steps on the CUDA path (Triton kernels, pinned uploads, decode graphs): the tokens of no
    speculation (the eager engine's, which graphed steps give); a verifying step replays a graph of its rows (a
    row per proposal and one more), uploads once and reads its tokens and acceptances at once."""
    path, want = tiny_model("llama"), llama_eager
    # 3 proposals (the continuation's, or the draft's): 16 rows, one graph size fewer than the default 4's 20
    spec = {"method": method, "model": str(path) if method == "draft_model" else None, "num_speculative_tokens": 3}
    llm = build(path, eager=False, speculative_config=spec)
    engine = llm.llm_engine
    if method == "ngram":
        propose_continuation(engine, want)
    steps = count_steps(engine, cuda_emulation)
    assert_same(generate(llm), want)
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.kv_blocks_used == 0, stats
    assert_verifying_steps_replayed(engine, steps)
    if method == "ngram":  # the draft model's forwards upload and read on their own
        assert all(uploads == 1 and reads <= 2 for uploads, reads, _, _ in steps), steps


def drafted(llm: LLM, emu) -> tuple[list, list, int, list[int]]:
    """`generate(llm)` with a draft model -> (its outputs, the proposals of each round, the proposals accepted, the
    graphs each draft step padded to a graph size replayed); checks the draft's pool ends empty."""
    proposer, proposals, replays = llm.llm_engine.proposer, [], []
    propose, graphs = proposer.propose, proposer.runner.decode_graphs

    def recorded(seqs):
        propose(seqs)
        proposals.append([(seq.request_id, list(seq.spec_token_ids)) for seq in seqs])

    def counted(size, model, run=graphs and graphs.run):
        before = emu.replays
        hidden = run(size, model)
        replays.append(emu.replays - before)
        return hidden

    proposer.propose = recorded
    if graphs is not None:
        graphs.run = counted
    outputs = generate(llm)
    propose([])
    assert proposer.block_manager.num_used_blocks == 0 and not proposer.shadows
    return outputs, proposals, llm.llm_engine.stats().spec_accepted_tokens, replays


def test_draft_rounds_replay_the_drafts_decode_graphs(tiny_model, cuda_emulation, no_warm_up):
    """A draft model's one-token steps (a round's later forwards) replay the draft's own decode graphs, captured
    for up to max_num_seqs rows: its proposals, so the acceptances and tokens, are the eager draft's (greedy and
    seeded), and its pool ends empty. Before, the draft ran every step eagerly."""
    path = tiny_model("llama")
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    want, want_proposals, want_accepted, eager_replays = drafted(
        build(path, eager=True, speculative_config=spec), cuda_emulation
    )
    llm = build(path, eager=False, speculative_config=spec)
    graphs = llm.llm_engine.proposer.runner.decode_graphs
    assert graphs.sizes == [1, 2, 4] and set(graphs.graphs) == {1, 2, 4}
    got, proposals, accepted, replays = drafted(llm, cuda_emulation)
    assert_same(got, want)
    assert proposals == want_proposals and accepted == want_accepted > 0
    assert not eager_replays and replays and all(n == 1 for n in replays), replays


SPEC_NGRAM = {"method": "ngram", "num_speculative_tokens": 3}  # propose_continuation's 3 tokens: 16 rows at most


def test_verifying_steps_with_adapters_replay_graphs(tiny_model, cuda_emulation, no_warm_up, tmp_path):
    """A verifying step mixing the base model and two adapters: each of a sequence's rows runs its adapter in the
    replayed graph, giving the tokens of eager steps without speculation."""
    path = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    a, b = (
        LoRARequest(name, i + 1, str(make_adapter(path, tmp_path / name, i, model, **ADAPTERS[name])))
        for i, name in enumerate(list(ADAPTERS)[:2])
    )
    loras = [a, None, b, a]
    want = generate(build(path, eager=True, enable_lora=True, max_loras=2), loras)
    llm = build(path, eager=False, enable_lora=True, max_loras=2, speculative_config=SPEC_NGRAM)
    propose_continuation(llm.llm_engine, want)
    steps = count_steps(llm.llm_engine, cuda_emulation)
    assert_same(generate(llm, loras), want)
    assert_verifying_steps_replayed(llm.llm_engine, steps)

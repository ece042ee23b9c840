"""Speculative decoding is lossless inside continuous batching: with proposals verified, greedy outputs are the
ones without speculation token for token, and seeded sampled outputs too (deterministic proposals keep each
position's draws); across the four tiny architectures, plain and GGUF and AWQ weights, mixed LoRA batches,
preemption and chunked prefill in the same run; logprobs, stop conditions and n alike; no block left behind;
a proposer that raises costing only its step's proposals; acceptance counted per position.

Random tiny models copy nothing, so real n-gram proposals are mostly rejected; the `Scripted` proposer proposes
the run's known continuation, one token in five corrupted, so that long accepted runs and rejections both
happen."""

import dataclasses
import itertools
import json
import logging
import random

import jsonschema
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.gguf_files import write_gguf
from tests.lora_adapters import make_adapter
from tiffin import LLM, SamplingParams
from tiffin.engine.config import EngineConfig
from tiffin.engine.lora.request import LoRARequest

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
PROMPT_LENS = (3, 17, 40, 9, 33, 60)
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=1.0, top_k=40, top_p=0.9, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True, presence_penalty=0.3
)
# both at once: a 6-request batch that preempts (16 blocks of 16 tokens) and prefills in chunks of 37 tokens
TIGHT = {"num_kv_blocks": 16, "max_num_batched_tokens": 37}
AWQ = "tests/fixtures/quant/awq-g64"
# n-grams of one token: the tiny models' outputs rarely repeat longer ones (a scripted run speculates as ngram)
# proposals whatever the batch (on CPU `auto` stops them from 4 running sequences)
ALWAYS = {"disable_by_batch_size": None}
SPECS = {
    "ngram": {"method": "ngram", "prompt_lookup_min": 1, **ALWAYS},
    "suffix": {"method": "suffix", "suffix_decoding_min_token_prob": 0, **ALWAYS},
    "scripted": {"method": "ngram", **ALWAYS},
}


class Scripted:
    """Proposes up to 6 tokens of each sequence's known continuation, one in five corrupted."""

    def __init__(self, expected: dict[tuple[str, int], list[int]], vocab: int):
        self.expected, self.vocab, self.rng = expected, vocab, random.Random(0)

    def propose(self, seqs) -> None:
        for seq in seqs:
            ahead = self.expected[seq.request_id, seq.index][seq.num_output_tokens :][: self.rng.randint(1, 6)]
            seq.spec_token_ids = [t if self.rng.random() < 0.8 else (t + 1) % self.vocab for t in ahead]


def generate(path, prompts, params, spec=None, scripted=None, loras=None, **engine_args):
    """Outputs keyed by (request id, index), and the engine's stats; checks every block came back."""
    llm = LLM(str(path), dtype="float32", speculative_config=spec, **engine_args)
    engine = llm.llm_engine
    if scripted is not None:
        engine.proposer = Scripted(scripted, engine.model_config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    return {(o.request_id, c.index): c for o in outs for c in o.outputs}, stats


def prompts_for(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def check_lossless(path, prompts, params, loras=None, draft=None, tight=True, **engine_args):
    """Each method's outputs equal those without speculation; with `tight`, under preemption and chunked prefill.
    `draft`: the draft model of the draft_model run (none without)."""
    expected, _ = generate(path, prompts, params, loras=loras, **engine_args)
    tokens = {key: c.token_ids for key, c in expected.items()}
    specs = {**SPECS, "draft_model": {"method": "draft_model", "model": str(draft), **ALWAYS}}
    for method in ("ngram", "suffix", "scripted", "draft_model")[: 4 if draft else 3]:
        spec = specs[method]
        scripted = tokens if method == "scripted" else None
        got, stats = generate(path, prompts, params, spec, scripted, loras, **(TIGHT if tight else {}), **engine_args)
        wrong = [key for key in expected if got[key].token_ids != tokens[key]]
        assert not wrong, f"{method}: outputs that differ from no speculation: {wrong}"
        assert stats.num_preemptions > 0 or not tight, stats
        assert stats.spec_draft_tokens > 0 or method in ("ngram", "suffix") and not tight, stats
        if method == "scripted":
            assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """Two adapters per architecture; requests alternate base, first, second."""

    def make(arch: str) -> list[LoRARequest | None]:
        root = tmp_path_factory.mktemp(f"adapters-{arch}")
        kw = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
        dirs = [make_adapter(tiny_model(arch), root / f"a{i}", seed=i, **kw) for i in range(2)]
        reqs = [None, *(LoRARequest(f"{arch}-{i}", i + 1, str(d)) for i, d in enumerate(dirs))]
        return [reqs[i % 3] for i in range(len(PROMPT_LENS))]

    return make


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_lossless_plain(tiny_model, arch, params):
    check_lossless(tiny_model(arch), prompts_for(1000, len(arch)), params, draft=tiny_model(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_lossless_mixed_lora_batch(tiny_model, adapters, arch):
    loras = adapters(arch)
    path = tiny_model(arch)
    check_lossless(path, prompts_for(1000, 1), GREEDY, loras, draft=path, enable_lora=True, max_loras=2)


@pytest.fixture(scope="module")
def gguf_model(tiny_model, tmp_path_factory):
    return lambda arch: write_gguf(tiny_model(arch), tmp_path_factory.mktemp("gguf") / f"{arch}.gguf", QType.Q4_0)


@pytest.mark.parametrize("arch", ARCHS)
def test_lossless_gguf(tiny_model, gguf_model, arch):
    """The native int8 kernels take bf16 dot products from 32 rows on, so their tokens depend on how many rows a
    step holds, with or without speculation; exact (fp32) computes the same whatever the batch. The draft: the
    unquantized model."""
    path, draft = gguf_model(arch), tiny_model(arch)
    check_lossless(path, prompts_for(1000, 2), GREEDY, draft=draft, cpu_quant_compute="exact")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lossless_gguf_native_kernels_alone(gguf_model, arch):
    """One sequence at a time, a step stays below 32 rows: the native kernels' tokens are the same."""
    for prompt in prompts_for(1000, 2)[:3]:
        check_lossless(gguf_model(arch), [prompt], GREEDY, tight=False)


def test_lossless_awq():
    check_lossless(AWQ, prompts_for(512, 3), GREEDY, cpu_quant_compute="exact")


def test_logprobs_stops_and_n_as_without(tiny_model):
    """Each emitted token's logprobs, stop tokens (min_tokens first), stop strings and n samples: as without."""
    path = tiny_model("llama")
    prompts = prompts_for(1000, 4)
    expected, _ = generate(path, prompts, GREEDY)
    stop_at = [c.token_ids[5] for c in expected.values()]
    stop_text = expected["0", 0].text[4:9]
    params = [
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=3, stop_token_ids=stop_at, min_tokens=3),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop=[stop_text], ignore_eos=True),
        SamplingParams(temperature=0.9, max_tokens=NEW_TOKENS, n=3, seed=5, ignore_eos=True, logprobs=1),
    ]
    for p in params:
        want, _ = generate(path, prompts, p)
        scripted = {key: c.token_ids + [0] * NEW_TOKENS for key, c in want.items()}
        got, stats = generate(path, prompts, p, SPECS["scripted"], scripted, **TIGHT)
        assert stats.spec_accepted_tokens > 0
        for key, c in want.items():
            g = got[key]
            assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
                c.token_ids,
                c.text,
                c.finish_reason,
                c.stop_reason,
            ), key
            if c.logprobs is not None:  # the same tokens and ranks; values to float rounding (other batch shapes)
                assert [{t: lp.rank for t, lp in d.items()} for d in g.logprobs] == [
                    {t: lp.rank for t, lp in d.items()} for d in c.logprobs
                ], key
                values = lambda logprobs: [lp.logprob for d in logprobs for lp in d.values()]
                assert values(g.logprobs) == pytest.approx(values(c.logprobs), abs=1e-4), key


def test_disable_by_batch_size_auto_is_4_on_cpu_64_on_cuda():
    config = lambda device, limit="auto": EngineConfig(
        "m", device=device, speculative_config={"disable_by_batch_size": limit}
    ).spec_batch_limit()
    assert (config("cpu"), config("cuda"), config("cpu", None), config("cuda", 9)) == (4, 64, None, 9)
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        config("cpu", 1)


def test_no_proposals_from_disable_by_batch_size_on(tiny_model):
    path = tiny_model("llama")
    prompts = prompts_for(1000, 5)
    spec = {"method": "ngram", "disable_by_batch_size": len(prompts)}
    expected, _ = generate(path, prompts, GREEDY)
    scripted = {key: c.token_ids for key, c in expected.items()}
    _, stats = generate(path, prompts, GREEDY, spec, scripted, max_num_seqs=len(prompts))
    # every request runs at once from the first step to the last: never fewer than the limit
    assert stats.spec_draft_tokens == 0
    _, stats = generate(path, prompts, GREEDY, spec, scripted, max_num_seqs=len(prompts) - 1)
    assert stats.spec_draft_tokens > 0


def test_acceptance_per_position_reaches_the_metrics(tiny_model):
    """A draft is accepted up to its first rejected proposal: each position's count is at most the one before, and
    they sum to the accepted proposals. The scripted proposer proposes up to 6: only num_speculative_tokens (4)
    are verified. /metrics exports the counts, labelled by position, advanced by what each stats adds."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tiffin.plugin.metrics import engine_metrics

    path = tiny_model("llama")
    prompts = prompts_for(1000, 7)
    expected, _ = generate(path, prompts, GREEDY)
    scripted = {key: c.token_ids for key, c in expected.items()}
    _, stats = generate(path, prompts, GREEDY, SPECS["scripted"], scripted, **TIGHT)
    per_pos = stats.spec_accepted_per_pos
    assert len(per_pos) == 4 and sum(per_pos) == stats.spec_accepted_tokens, stats
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])) and per_pos[-1] > 0, per_pos
    assert per_pos[0] < stats.spec_drafts and stats.spec_draft_tokens <= 4 * stats.spec_drafts, stats

    def exported() -> dict[str, float]:
        families = text_string_to_metric_families(generate_latest(REGISTRY).decode())
        name = "tiffin_spec_decode_num_accepted_tokens_per_pos_total"
        return {s.labels["position"]: s.value for f in families for s in f.samples if s.name == name}

    metrics = engine_metrics()
    before = exported()
    metrics.on_stats(stats)
    metrics.on_stats(dataclasses.replace(stats, spec_accepted_per_pos=tuple(3 * n for n in per_pos)))
    after = exported()
    assert {p: after[p] - before.get(p, 0) for p in after} == {str(i): 3 * n for i, n in enumerate(per_pos)}


def test_a_proposer_that_raises_leaves_its_step_without_proposals(tiny_model, monkeypatch, caplog):
    """Every other round sets its proposals, then raises: those steps decode without any, and outputs are those
    of no speculation; the error is logged once."""
    path = tiny_model("llama")
    prompts = prompts_for(1000, 8)
    expected, _ = generate(path, prompts, GREEDY)
    scripted, propose, calls = {key: c.token_ids for key, c in expected.items()}, Scripted.propose, itertools.count()

    def flaky(self, seqs) -> None:
        propose(self, seqs)
        if next(calls) % 2:
            raise ValueError("proposer failed")

    monkeypatch.setattr(Scripted, "propose", flaky)
    with caplog.at_level(logging.ERROR, logger="tiffin.engine.llm_engine"):
        got, stats = generate(path, prompts, GREEDY, SPECS["scripted"], scripted, **TIGHT)
    assert {key: c.token_ids for key, c in got.items()} == scripted
    assert stats.spec_accepted_tokens > 0 and next(calls) > 4, stats
    assert [r.exc_info[1].args for r in caplog.records if r.exc_info] == [("proposer failed",)]


def test_structured_outputs_as_without(tiny_model):
    """The grammar takes proposals up to the first it rejects, and masks each verifying row as it would that
    position: every output valid, and the same as without speculation, greedy and seeded."""
    pytest.importorskip("xgrammar")
    from tiffin import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"enum": ["a", "bb"]}},
        },
        "required": ["name", "tags"],
    }
    path = tiny_model("llama")
    prompts = prompts_for(1000, 6)
    for temperature in (0, 1.0):
        so = StructuredOutputsParams(json=schema)
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=60, structured_outputs=so)
        expected, _ = generate(path, prompts, params)
        scripted = {key: c.token_ids + [0] * 60 for key, c in expected.items()}
        for spec, proposals in ((SPECS["ngram"], None), (SPECS["scripted"], scripted)):
            got, stats = generate(path, prompts, params, spec, proposals, **TIGHT)
            assert stats.spec_accepted_tokens > 0, stats
            for key, c in expected.items():
                assert got[key].token_ids == c.token_ids and got[key].finish_reason == c.finish_reason, key
                if c.finish_reason == "stop":
                    jsonschema.validate(json.loads(got[key].text), schema)


def mixed_request(rng: random.Random, vocab: int) -> tuple[dict, SamplingParams]:
    span = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 12))]
    prompt = (span * rng.randint(1, 4))[: rng.randint(1, 40)]
    kind = rng.choice(["greedy", "seeded", "sampled", "n", "logprobs", "stops"])
    common = dict(max_tokens=rng.randint(1, 16), ignore_eos=rng.random() < 0.5)
    params = {
        "greedy": dict(temperature=0),
        "seeded": dict(temperature=0.8, top_p=0.9, seed=rng.randrange(100)),
        "sampled": dict(temperature=1.0, top_k=20, presence_penalty=0.5),
        "n": dict(temperature=0.7, n=2),
        "logprobs": dict(temperature=0, logprobs=2),
        "stops": dict(temperature=0, stop_token_ids=span[:2], min_tokens=rng.randint(0, common["max_tokens"])),
    }[kind]
    return {"prompt_token_ids": prompt}, SamplingParams(**params, **common)


@pytest.mark.parametrize(
    "method, host_tiers",
    [("ngram", False), ("suffix", False), ("draft_model", False), ("ngram", True)],
    ids=["ngram", "suffix", "draft_model", "ngram-swap-offload"],
)
def test_no_block_leaks_after_many_mixed_requests(tiny_model, monkeypatch, method, host_tiers):
    """300 requests a method (1,200 in all): greedy, seeded, sampled, n=2, logprobs, stop ids, some aborted while
    they run, on a pool small enough to preempt and in chunked prefills; the block invariants checked after every
    step; every block back once idle, the draft's too (and, preempting by swap beside the host tier, every swap
    block)."""
    monkeypatch.setenv("TIFFIN_CHECK_INVARIANTS", "1")
    path = tiny_model("llama")
    spec = {**SPECS.get(method, {"method": method, **ALWAYS}), "model": str(path) if method == "draft_model" else None}
    tiers = dict(preemption_mode="swap", swap_space=0.001, kv_offload_memory=1 << 20) if host_tiers else {}
    llm = LLM(str(path), dtype="float32", speculative_config=spec, num_kv_blocks=24, max_num_batched_tokens=64, **tiers)
    engine, rng, live, added = llm.llm_engine, random.Random(method), set(), 0
    while added < 300 or engine.has_unfinished_requests():
        while added < 300 and len(live) < 16:
            engine.add_request(str(added), *mixed_request(rng, 1000))
            live.add(str(added))
            added += 1
        outputs = engine.step() + (engine.abort_request(rng.choice(sorted(live))) if rng.random() < 0.03 else [])
        live -= {o.request_id for o in outputs if o.finished}
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0, stats
    if host_tiers:
        assert stats.swapped_out_seqs > 0 and stats.host_tier_evictions > 0, stats
        assert engine.block_manager.swap.num_used_blocks == 0
    engine.proposer.propose([])  # forgets the sequences gone since its last round
    if method == "draft_model":
        assert engine.proposer.block_manager.num_used_blocks == 0
    if method == "suffix":
        assert not engine.proposer.own

"""Speculative decoding with a draft model (`draft_model`): greedy outputs the target's whatever the draft, the
draft's KV reused across rounds (a draft equal to the target is accepted nearly always), seeded sampling what it
is without speculation, unseeded proposals drawn from the q they report, no draft block leaked, a failing draft
costing only its proposals, and drafts that cannot serve refused."""

import itertools
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiffin import LLM, SamplingParams
from tiffin.engine.core.sequence import Sequence
from tiffin.tiny import make_tiny_model

PROMPT_LENS = (3, 17, 40, 65, 9, 120)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
MODES = {"plain": {}, "preempted": {"num_kv_blocks": 14}, "chunked": {"max_num_batched_tokens": 37}}


@pytest.fixture(autouse=True)
def check_invariants(monkeypatch):
    """The engine checks its blocks after each step, the proposer its own after each round."""
    monkeypatch.setenv("TIFFIN_CHECK_INVARIANTS", "1")


@pytest.fixture(scope="module")
def draft(tiny_model, tmp_path_factory):
    """`draft(kind, arch)`: "other", a tiny llama of another seed; "noisy", the target `arch` with its weights
    perturbed, so that it agrees with the target about half the time."""
    made = {}

    def get(kind: str, arch: str = "llama"):
        if (kind, arch) not in made:
            path = tmp_path_factory.mktemp(f"draft-{kind}-{arch}")
            if kind == "other":
                make_tiny_model(path, "llama", seed=1)
            else:
                shutil.copytree(tiny_model(arch), path, dirs_exist_ok=True)
                g = torch.Generator().manual_seed(0)
                weights = load_file(path / "model.safetensors")
                noisy = {k: w + 0.01 * w.std() * torch.randn(w.shape, generator=g) for k, w in weights.items()}
                save_file(noisy, str(path / "model.safetensors"), metadata={"format": "pt"})
            made[kind, arch] = path
        return made[kind, arch]

    return get


@pytest.fixture(scope="module")
def reference(tiny_model):
    """`reference(arch)`: the greedy outputs without speculation."""
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = generate(LLM(str(tiny_model(arch)), dtype="float32"))
        return made[arch]

    return get


def prompts(vocab: int = 2048) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(4, vocab, (n,), generator=g).tolist()} for n in PROMPT_LENS]


def generate(llm: LLM, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


def with_draft(target, draft_path, **engine_args) -> LLM:
    spec = {
        "method": "draft_model",
        "model": str(draft_path),
        "num_speculative_tokens": 4,
        "disable_by_batch_size": None,
    }
    return LLM(str(target), dtype="float32", speculative_config=spec, **engine_args)


def assert_no_blocks_held(llm: LLM) -> None:
    proposer = llm.llm_engine.proposer
    assert llm.llm_engine.stats().kv_blocks_used == 0
    assert proposer.block_manager.num_used_blocks > 0  # the finished requests' shadows, until the next round
    proposer.propose([])
    assert proposer.block_manager.num_used_blocks == 0 and not proposer.shadows


def test_tiny_seeds_share_the_vocabulary(tiny_model, draft):
    assert (tiny_model("llama") / "tokenizer.json").read_bytes() == (draft("other") / "tokenizer.json").read_bytes()


def test_draft_equal_to_target_is_accepted(tiny_model, reference):
    target = tiny_model("llama")
    llm = with_draft(target, target)
    assert generate(llm) == reference("llama")
    stats = llm.llm_engine.stats()
    print(f"draft = target: {stats.spec_accepted_tokens}/{stats.spec_draft_tokens} accepted")
    assert stats.spec_draft_tokens > 100 and stats.spec_accepted_tokens >= 0.95 * stats.spec_draft_tokens
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["other", "noisy"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_outputs_are_the_targets(tiny_model, draft, reference, arch, kind, mode):
    llm = with_draft(tiny_model(arch), draft(kind, arch), **MODES[mode])
    assert generate(llm) == reference(arch)
    stats = llm.llm_engine.stats()
    print(f"{arch} {kind} {mode}: {stats.spec_accepted_tokens}/{stats.spec_draft_tokens} accepted")
    assert stats.spec_draft_tokens > 0
    if kind == "noisy":  # proposals accepted in part: a shadow keeps its KV up to the first rejected one
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert (stats.num_preemptions > 0) == (mode == "preempted")
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("mode", ["plain", "preempted"])
def test_a_failing_draft_forward_costs_only_its_rounds_proposals(tiny_model, reference, monkeypatch, caplog, mode):
    """The draft's first forward raises (the prompts': their blocks hashed, never written), then one in 11, the
    first of a round or a later one: those rounds' steps decode without proposals. Every request finishes with
    the target's greedy outputs, the error is logged once, no block of either pool is left, and the draft, started
    over after each failure, is still accepted nearly always (a hashed block left unwritten would be found by the
    prompt's next round, and the draft would propose from garbage)."""
    target = tiny_model("llama")
    llm = with_draft(target, target, **MODES[mode])
    runner, calls = llm.llm_engine.proposer.runner, itertools.count()
    run_model = runner.run_model

    def flaky(*args):
        if next(calls) % 11 == 0:
            raise RuntimeError("draft forward failed")
        return run_model(*args)

    monkeypatch.setattr(runner, "run_model", flaky)
    with caplog.at_level(logging.ERROR, logger="tiffin.engine.llm_engine"):
        outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert all(o.finished and o.error is None for o in outputs)
    assert [o.outputs[0].token_ids for o in outputs] == reference("llama")
    logged = [r for r in caplog.records if r.exc_info and r.exc_info[1].args == ("draft forward failed",)]
    assert len(logged) == 1 and next(calls) > 33, logged  # logged once of 4 failures or more
    stats = llm.llm_engine.stats()
    print(f"failing draft = target {mode}: {stats.spec_accepted_tokens}/{stats.spec_draft_tokens} accepted")
    assert stats.spec_accepted_tokens >= 0.95 * stats.spec_draft_tokens > 0
    assert_no_blocks_held(llm)


def test_seeded_sampling_emits_what_it_emits_without_speculation(tiny_model, draft):
    """A seeded sequence's proposals race the target's own noise: its tokens are those of no speculation, however
    the steps ran (the second run finds its prompts in both prefix caches: other positions get proposals)."""
    target = tiny_model("llama")
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=40, ignore_eos=True)
    params = [seeded] * (len(PROMPT_LENS) - 1) + [GREEDY]  # a greedy sequence drafts beside sampled ones
    expected = generate(LLM(str(target), dtype="float32"), params)
    for kind, least in (("noisy", 0.3), ("self", 0.95)):
        llm = with_draft(target, target if kind == "self" else draft("noisy"))
        first = llm.generate(prompts(), params, use_tqdm=False)
        assert all(o.finished and o.outputs[0].finish_reason == "length" for o in first)
        assert [o.outputs[0].token_ids for o in first] == expected == generate(llm, params)
        stats = llm.llm_engine.stats()
        print(f"seeded, draft {kind}: {stats.spec_accepted_tokens}/{stats.spec_draft_tokens} accepted")
        assert stats.spec_accepted_tokens >= least * stats.spec_draft_tokens > 0
        assert_no_blocks_held(llm)


def test_unseeded_sampling_completes_and_a_draft_equal_to_the_target_is_accepted(tiny_model):
    """Unseeded proposals are verified against the q they report: q = p when the draft is the target."""
    target = tiny_model("llama")
    llm = with_draft(target, target)
    outputs = llm.generate(prompts(), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, ignore_eos=True))
    assert all(o.finished and len(o.outputs[0].token_ids) == 40 for o in outputs)
    stats = llm.llm_engine.stats()
    print(f"unseeded, draft = target: {stats.spec_accepted_tokens}/{stats.spec_draft_tokens} accepted")
    assert stats.spec_accepted_tokens >= 0.95 * stats.spec_draft_tokens > 0
    assert_no_blocks_held(llm)


def test_unseeded_proposals_follow_the_q_they_report(tiny_model, draft):
    """Verification is lossless only if a proposal is drawn from the q it reports: 1300 draws of one position
    (their 3900 prompt tokens fit one draft step)."""
    llm = with_draft(tiny_model("llama"), draft("other"))
    proposer, params = llm.llm_engine.proposer, SamplingParams(temperature=0.2, top_k=5, max_tokens=10)
    seqs = [Sequence("r", i, [5, 6, 7], params, 10) for i in range(1300)]
    proposer.propose(seqs)
    q = torch.stack([s.spec_probs[0] for s in seqs])
    assert q.shape == (1300, 2048) and torch.allclose(q, q[:1].expand_as(q), atol=1e-5)
    support = q[0].nonzero()[:, 0]
    assert len(support) == 5 and torch.allclose(q[0].sum(), torch.tensor(1.0))
    drawn = torch.bincount(torch.tensor([s.spec_token_ids[0] for s in seqs]), minlength=2048) / len(seqs)
    assert drawn[support].sum() == 1
    chi2 = len(seqs) * ((drawn[support] - q[0][support]) ** 2 / q[0][support]).sum()
    assert chi2 < 25, (chi2, drawn[support], q[0][support])  # 4 degrees of freedom: p < 1e-4
    proposer.propose([])


def test_drafts_that_cannot_serve_are_refused(tiny_model, tmp_path):
    wide = make_tiny_model(tmp_path / "wide", "llama", vocab_size=3000)
    with pytest.raises(ValueError, match="vocab_size 3000, more than the target's 2048"):
        with_draft(tiny_model("llama"), wide)
    embedder = make_tiny_model(tmp_path / "embed", "qwen3", architectures=["Qwen3Model"])
    with pytest.raises(ValueError, match="cannot generate"):
        with_draft(tiny_model("llama"), embedder)


def test_target_and_draft_pools_share_the_kv_memory_and_their_block_count(tiny_model, draft):
    """`kv_cache_memory` holds both pools, of as many blocks each (on CUDA `gpu_memory_utilization`'s budget the
    same: test_cuda_graphs); an explicit `num_kv_blocks` is both pools' size. Before, each pool took it all."""
    target, other = tiny_model("llama"), draft("other")
    llm = with_draft(target, other, kv_cache_memory=2 << 20)
    runner, draft_runner = llm.llm_engine.model_runner, llm.llm_engine.proposer.runner
    both = runner.kv_spec.bytes_per_block + draft_runner.kv_spec.bytes_per_block
    assert runner.num_blocks == draft_runner.num_blocks == (2 << 20) // both
    assert llm.llm_engine.proposer.block_manager.num_blocks == runner.num_blocks
    llm = with_draft(target, other, num_kv_blocks=40)
    assert llm.llm_engine.model_runner.num_blocks == llm.llm_engine.proposer.runner.num_blocks == 40

"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against transformers' log_softmax over its own logits at every
prompt position, on tiny fp32 llama and qwen3 checkpoints (1e-4): each prompt token's logprob and rank and the top k
at its position, with the prompt whole or split in prefill chunks, after its blocks were cached by an earlier
request, after a preemption by recompute, under the CUDA emulation with graphs (a one-token chunk replayed from a
decode graph), batched with requests that do not ask; logits computed only for the rows of the requests that ask."""

import dataclasses

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tiffin import LLM, SamplingParams
from tiffin.engine.core.scheduler import SchedulerOutput
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.errors import ParamError
from tiffin.engine.worker import model_runner

PROMPT_LENS = [1, 2, 23, 40, 9]
TOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request, tiny_model):
    return reference(tiny_model(request.param))


def reference(path) -> tuple:
    """(checkpoint path, prompts, transformers' logprobs [len(prompt), vocab] per prompt)."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    with torch.inference_mode():
        want = [hf(torch.tensor([p])).logits[0].log_softmax(-1) for p in prompts]
    return path, prompts, want


def assert_prompt_logprobs(got: list, prompt: list[int], want: torch.Tensor, k: int, decoded: bool = True) -> None:
    """`got` is vLLM's shape (None, then per token its own entry and the top `k`) and equals `want` (transformers'
    logprobs at every position) within TOL: values, ranks (up to ties within TOL), and the top k's membership;
    `decoded`: each with its token's text (the engine's)."""
    assert len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        row, entry, token = want[j - 1], got[j], prompt[j]
        assert token in entry and len(entry) in (k, k + 1)
        assert len(entry) == k + 1 or row[token] >= row.topk(k).values[-1] - TOL  # k: its token is among the top k
        kth = row.topk(max(k, 1)).values[-1]
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) < TOL, (j, t)
            assert (row > lp.logprob + TOL).sum() + 1 <= lp.rank <= (row > lp.logprob - TOL).sum() + 1, (j, t)
            assert (lp.decoded_token is not None) == decoded
            if t != token:
                assert row[t] >= kth - TOL  # one of the top k


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.prompt_logprobs for o in outs]


def asking(k: int | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=k)


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers(case, engine_args):
    """A batch mixing k = 0, k = 5 and requests that do not ask; chunked: prompts of 23 and 40 tokens cut in chunks
    of at most 16 (shared with the other prompts of the step). Logits are computed for the sampled rows and the
    prompt rows of the requests that ask, no others."""
    path, prompts, want = case
    llm = LLM(str(path), dtype="float32", max_num_seqs=8, **engine_args)
    runner = llm.llm_engine.model_runner
    runner.policy = dataclasses.replace(runner.policy, pad_rows=False)  # the real rows (padded: test_row_buckets)
    rows, compute_logits = [], runner.model.compute_logits
    runner.model.compute_logits = lambda hidden: rows.append(len(hidden)) or compute_logits(hidden)
    ks = [5, 0, 5, None, 0]
    got = run(llm, prompts, [asking(k) for k in ks])
    for out, prompt, w, k in zip(got, prompts, want, ks):
        if k is None:
            assert out is None
        else:
            assert_prompt_logprobs(out, prompt, w, k)
    assert sum(rows) == 2 * len(prompts) + sum(len(p) - 1 for p, k in zip(prompts, ks) if k is not None)
    if engine_args:
        assert max(rows) <= 16


def test_prefix_cache_warm_request_still_full(case):
    """A prompt whose blocks an earlier request cached: a request asking for prompt logprobs computes the whole
    prompt anew (no cached token), equal to transformers; one that does not ask reads the cache."""
    path, prompts, want = case
    llm = LLM(str(path), dtype="float32", block_size=16)
    prompt = prompts[3]
    llm.generate([{"prompt_token_ids": prompt}], asking(None), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": prompt}], asking(3), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert_prompt_logprobs(out.prompt_logprobs, prompt, want[3], 3)
    again = llm.generate([{"prompt_token_ids": prompt}], asking(None), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and again.prompt_logprobs is None


def test_preemption_and_n(case):
    """Few KV blocks: sequences are preempted by recompute (some mid-prompt, some after); n = 2 samples of one
    request share its prompt logprobs."""
    path, prompts, want = case
    llm = LLM(str(path), dtype="float32", block_size=16, num_kv_blocks=6, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, prompt_logprobs=2, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[2:4]], params, use_tqdm=False)
    assert llm.llm_engine.stats().num_preemptions > 0
    for out, prompt, w in zip(outs, prompts[2:4], want[2:4]):
        assert len(out.outputs) == 2
        assert_prompt_logprobs(out.prompt_logprobs, prompt, w, 2)


def test_speculative_decoding(case):
    """A draft model proposing (the target's own checkpoint): prompt logprobs are the target's, and the draft computes
    none (its forwards' logits rows: its sequences' proposals only)."""
    path, prompts, want = case
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2}
    llm = LLM(str(path), dtype="float32", speculative_config=spec)
    draft, rows = llm.llm_engine.proposer.runner.model, []
    compute_logits = draft.compute_logits
    draft.compute_logits = lambda hidden: rows.append(len(hidden)) or compute_logits(hidden)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    for out, prompt, w in zip(run(llm, prompts[2:4], [params] * 2), prompts[2:4], want[2:4]):
        assert_prompt_logprobs(out, prompt, w, 1)
    assert llm.llm_engine.stats().spec_draft_tokens > 0 and 0 < max(rows) <= 2


@pytest.mark.parametrize("k", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_refused(k):
    with pytest.raises(ParamError, match=r"prompt_logprobs must be an integer in \[0, 20\] \(max_logprobs\)"):
        SamplingParams(prompt_logprobs=k)


def test_graphed_engine(tiny_model, cuda_emulation, monkeypatch):
    """The CUDA path with decode graphs (llama: the other families' graphs are test_cuda_graphs'): a batch with and
    without prompt logprobs through the engine, then a prompt computed in one-token chunks, each a step replayed
    from a decode graph, its logits row a prompt row."""
    path, prompts, want = reference(tiny_model("llama"))
    monkeypatch.setattr(model_runner, "warm_up_triton", lambda runner: None)
    llm = LLM(str(path), device="cuda", dtype="float32", num_kv_blocks=16, max_num_seqs=4, max_model_len=64)
    runner = llm.llm_engine.model_runner
    assert runner.decode_graphs is not None
    replays = cuda_emulation.replays
    got = run(llm, prompts[1:3] + prompts[4:], [asking(2), asking(None), asking(4)])
    assert cuda_emulation.replays > replays and got[1] is None
    assert_prompt_logprobs(got[0], prompts[1], want[1], 2)
    assert_prompt_logprobs(got[2], prompts[4], want[4], 4)
    prompt = prompts[4]
    seq = Sequence("p", 0, prompt, asking(3), 1)
    seq.block_table = [0]
    for n in [3] + [1] * (len(prompt) - 4):  # up to the last token but one, which would sample
        step, replays = SchedulerOutput(), cuda_emulation.replays
        step.add(seq, n)
        seq.prompt_logprobs += runner.execute(step).prompt_logprobs[0]
        seq.num_computed_tokens += n
        assert cuda_emulation.replays - replays == (n == 1)
    assert_prompt_logprobs(seq.prompt_logprobs, prompt, want[4], 3, decoded=False)  # the prompt's last but one: all


def test_host_batch_rows():
    """The prompt rows of a step follow its sampling rows in `logits_indices`, from the first position that lacks
    logprobs to the prompt's last but one."""
    from tiffin.engine.worker.batch import host_batch

    a = Sequence("a", 0, list(range(10)), asking(1), 1)
    b = Sequence("b", 0, list(range(6)), asking(None), 1)
    c = Sequence("c", 0, list(range(5)), asking(0), 1)
    for seq in (a, b, c):
        seq.block_table = [0]
    a.num_computed_tokens, a.prompt_logprobs = 4, [None] * 3  # recomputed from 4 with 3 entries in: from 4 on
    c.num_computed_tokens, c.prompt_logprobs = 0, [None] * 3  # recomputed from 0: positions 0, 1 need none
    step = SchedulerOutput()
    for seq, n in ((a, 6), (b, 6), (c, 5)):
        step.add(seq, n)
    assert step.prompt_rows == [(0, 4, 5), (2, 2, 2)]
    got = host_batch(step, 16).logits_indices
    np.testing.assert_array_equal(got, [5, 11, 16, 0, 1, 2, 3, 4, 14, 15])

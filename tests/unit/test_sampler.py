import math
from dataclasses import dataclass, field

import pytest
import torch

from tiffin.engine.sampling_params import SamplingParams
from tiffin.engine.worker.sampler import Sampler, apply_penalties, sampling_probs


@dataclass
class FakeSeq:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    grammar: None = None
    proposed = forced = -1
    draft_probs = None

    def noise_seed(self) -> int | None:
        return None if self.params.seed is None else hash((self.params.seed, self.num_output_tokens))

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def seq(prompt=(), output=(), **kw) -> FakeSeq:
    return FakeSeq(SamplingParams(**kw), list(prompt), list(output))


def random_logits(*shape, seed=0, scale=3.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------- plain per-row reference


def reference_probs(row: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """min_p -> top_k -> top_p on one row, in plain Python."""

    def softmax(xs):
        m = max(x for x in xs if x is not None)
        e = [0.0 if x is None else math.exp(x - m) for x in xs]
        z = sum(e)
        return [v / z for v in e]

    scaled = [x / temperature for x in row]
    probs = softmax(scaled)
    kept = [x if p >= min_p * max(probs) else None for x, p in zip(scaled, probs)]
    order = sorted((i for i, x in enumerate(kept) if x is not None), key=lambda i: -kept[i])
    if top_k:
        kept = [x if i in order[:top_k] else None for i, x in enumerate(kept)]
    probs = softmax(kept)
    total, keep = 0.0, set()
    for i in order:
        if kept[i] is None:
            continue
        keep.add(i)
        total += probs[i]
        if total >= top_p:
            break
    return softmax([x if i in keep else None for i, x in enumerate(kept)])


FILTERS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.5, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=8, top_p=0.6, min_p=0.02),
    dict(temperature=2.0, top_k=100),  # k larger than the vocabulary
    dict(temperature=1.0, top_p=0.01),  # only the top token survives
    dict(temperature=1.0, top_p=1e-9),  # 1 - top_p rounds to 1 in float32: the top token must still stay
]


TOP_K_ONLY = [dict(top_k=1), dict(top_k=7, temperature=0.5), dict(), dict(top_k=100), dict(top_k=3, min_p=0.2)]


@pytest.mark.parametrize("filters", [FILTERS, TOP_K_ONLY], ids=["sorted", "top_k_only"])
def test_sampling_probs_match_reference(filters):
    logits = random_logits(len(filters), 64, seed=1)
    ps = [SamplingParams(**f) for f in filters]
    got = sampling_probs(logits, ps)
    for row, p, sp, f in zip(logits.tolist(), got, ps, filters):
        ref = torch.tensor(reference_probs(row, sp.temperature, sp.top_k, sp.top_p, sp.min_p))
        assert torch.equal(p > 0, ref > 0), f  # same support
        torch.testing.assert_close(p, ref, atol=1e-5, rtol=1e-4, msg=str(f))
        assert p.sum().item() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("filters", FILTERS)
def test_sampled_frequencies_match_reference(filters):
    n, vocab = 20000, 12
    row = random_logits(vocab, seed=2, scale=1.5)
    sp = SamplingParams(**filters)
    ref = torch.tensor(reference_probs(row.tolist(), sp.temperature, sp.top_k, sp.top_p, sp.min_p))
    out = Sampler(eos_token_ids=set(), seed=3)(row.expand(n, vocab).clone(), [seq(**filters)] * n)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double() / n
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.nonzero(ref).flatten().tolist())
    bound = 5 * (ref * (1 - ref) / n).sqrt() + 1e-3
    assert ((freq - ref).abs() <= bound).all(), (freq, ref)


def test_seeded_rows_sample_the_reference_distribution():
    n, vocab = 4000, 10
    row = random_logits(vocab, seed=4, scale=1.0)
    ref = torch.tensor(reference_probs(row.tolist(), 1.0, 0, 0.9, 0.0))
    seqs = [seq(top_p=0.9, seed=1000 + i) for i in range(n)]
    out = Sampler(set())(row.expand(n, vocab).clone(), seqs)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double() / n
    assert ((freq - ref).abs() <= 5 * (ref * (1 - ref) / n).sqrt() + 1e-3).all(), (freq, ref)


# ---------------------------------------------------------------- seeds, greedy


def _run(sampler: Sampler, steps: torch.Tensor, batches: list[list[FakeSeq]], pos: int) -> list[int]:
    """Feed step t's logits to every row of batch t; return the tokens at row `pos` each step."""
    return [sampler(logits.expand(len(b), -1).clone(), b).token_ids[pos] for logits, b in zip(steps, batches)]


def test_seeded_row_independent_of_batch_and_position():
    steps = random_logits(6, 500, seed=5, scale=1.0)
    kw = dict(seed=1234, temperature=0.8, top_p=0.95)
    alone = seq(**kw)
    expected = _run(Sampler(set(), seed=0), steps, [[alone]] * 6, 0)

    mixed = seq(**kw)
    others = lambda: [seq(), seq(seed=9), seq(temperature=0), seq(top_k=3)]
    batches = [others()[:2] + [mixed] + others()[2:] for _ in range(6)]
    assert _run(Sampler(set(), seed=77), steps, batches, 2) == expected
    last = seq(**kw)
    assert _run(Sampler(set(), seed=1), steps, [others() + [last] for _ in range(6)], 4) == expected
    other_seed = seq(**{**kw, "seed": 4321})
    assert _run(Sampler(set()), steps, [[other_seed]] * 6, 0) != expected


def test_unseeded_rows_follow_the_sampler_seed():
    logits = random_logits(16, 300, seed=6, scale=0.5)
    a = Sampler(set(), seed=11)(logits, [seq() for _ in range(16)]).token_ids
    b = Sampler(set(), seed=11)(logits, [seq() for _ in range(16)]).token_ids
    c = Sampler(set(), seed=12)(logits, [seq() for _ in range(16)]).token_ids
    assert a == b and a != c


def test_greedy_and_top_k_1_are_argmax():
    logits = random_logits(7, 1000, seed=7)
    argmax = logits.argmax(-1).tolist()
    seqs = [
        seq(temperature=0),
        seq(top_k=1),
        seq(top_k=1, temperature=2.0),
        seq(temperature=0, top_p=0.1),
        seq(top_k=1, seed=3),
        seq(temperature=1e-7),
        seq(top_p=1e-9),
    ]
    assert Sampler(set())(logits, seqs).token_ids == argmax
    assert Sampler(set())(logits, [seq(temperature=0)] * 7).token_ids == argmax  # all-greedy fast path


def test_model_dtype_logits_sample_as_their_fp32_copy():
    logits = random_logits(6, 1000, seed=9).bfloat16()
    logits[0, 10] = logits[0, 20] = logits[0].max() + 1  # a tie: the first index wins, in either dtype
    mixed = lambda: [seq(temperature=0), seq(seed=4), seq(temperature=0, logprobs=2), seq(temperature=0), seq()]
    greedy = lambda: [seq(temperature=0, min_tokens=1)] * 6  # min_tokens bans no token here (no EOS ids)
    for batch in (mixed, greedy):
        n = len(batch())
        reference = Sampler(set(), seed=1)(logits[:n].float(), batch())
        out = Sampler(set(), seed=1)(logits[:n], batch())
        assert out.token_ids == reference.token_ids and out.logprobs == reference.logprobs
    assert Sampler(set())(logits, greedy()).token_ids[0] == 10


def test_forced_tokens_replace_what_their_rows_sample():
    """A forced column (a spent thinking budget's end marker) wins over greedy, sampled and min_tokens-banned
    picks; its logprob is the forced token's; the other rows sample what they would without it."""
    logits = random_logits(4, 300, seed=12)
    forced = [7, -1, 5, 3]
    batch = lambda: [
        seq(temperature=0, logprobs=1),
        seq(seed=2),
        seq(seed=3),
        seq(temperature=0, min_tokens=2, stop_token_ids=[3]),
    ]
    free = Sampler(set())(logits, batch())
    seqs = batch()
    for s, token in zip(seqs, forced):
        s.forced = token
    out = Sampler(set())(logits, seqs)
    assert out.token_ids == [t if t >= 0 else f for t, f in zip(forced, free.token_ids)]
    assert out.token_ids[0] != free.token_ids[0]
    ref = torch.log_softmax(logits[0].double(), -1)
    assert out.logprobs[0][7].logprob == pytest.approx(ref[7].item(), abs=1e-5)


def test_sampler_leaves_logits_untouched_and_checks_shape():
    logits = random_logits(2, 50, seed=8)
    before = logits.clone()
    Sampler({1})(logits, [seq(min_tokens=2, repetition_penalty=1.5, output=[3]), seq(top_p=0.5, top_k=4)])
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="logits"):
        Sampler(set())(logits, [seq()])


# ---------------------------------------------------------------- penalties, min_tokens


def reference_penalties(row, prompt, output, rep, freq, pres):
    out = []
    for t, x in enumerate(row):
        if t in prompt or t in output:
            x = x / rep if x > 0 else x * rep
        count = output.count(t)
        out.append(x - freq * count - pres * (count > 0))
    return out


def test_penalties_match_formulas():
    vocab = 40
    logits = random_logits(4, vocab, seed=9)
    prompts = [[1, 2, 2, 5], [], [7, 30, 39], [0]]
    outputs = [[2, 3, 3, 3, 11], [4, 4, 8], [], [0, 0, 1]]
    rep, freq, pres = [1.3, 1.0, 0.7, 2.0], [0.5, -0.4, 1.0, 0.0], [0.25, 1.5, -2.0, 0.0]
    got = apply_penalties(logits, prompts, outputs, torch.tensor(rep), torch.tensor(freq), torch.tensor(pres))
    for r in range(4):
        expected = reference_penalties(logits[r].tolist(), prompts[r], outputs[r], rep[r], freq[r], pres[r])
        torch.testing.assert_close(got[r], torch.tensor(expected))


def test_penalties_change_the_greedy_choice():
    logits = torch.zeros(1, 10)
    logits[0, 5], logits[0, 7] = 3.0, 2.5
    seqs = [
        seq(temperature=0, output=[5]),
        seq(temperature=0, output=[5], frequency_penalty=1.0),
        seq(temperature=0, output=[5], presence_penalty=0.6),
        seq(temperature=0, output=[3]),
        seq(temperature=0, prompt=[5], repetition_penalty=1.5),
        seq(temperature=0, prompt=[5], frequency_penalty=1.0),
    ]  # frequency counts only output tokens
    assert Sampler(set())(logits.expand(len(seqs), -1).clone(), seqs).token_ids == [5, 7, 7, 5, 7, 5]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, 20)
    logits[0, 3], logits[0, 4], logits[0, 9] = 30.0, 20.0, 10.0  # 3 = EOS, 4 = stop id
    sampler = Sampler({3})
    run = lambda **kw: sampler(logits, [seq(temperature=0, stop_token_ids=[4], **kw)]).token_ids[0]
    assert run(min_tokens=2, output=[1]) == 9
    assert run(min_tokens=2, output=[1, 1]) == 3
    assert run(min_tokens=2, ignore_eos=True) == 3  # EOS is not a stop condition then, only the stop id is masked
    n = 3000
    out = sampler(logits.expand(n, -1).clone(), [seq(min_tokens=1, stop_token_ids=[4]) for _ in range(n)])
    assert not {3, 4} & set(out.token_ids)


# ---------------------------------------------------------------- logprobs


def test_logprobs_of_raw_logits_with_ranks():
    logits = random_logits(5, 200, seed=10)
    seqs = [
        seq(logprobs=5, temperature=0.7, repetition_penalty=1.8, output=[int(logits[0].argmax())]),
        seq(logprobs=0),
        seq(),
        seq(logprobs=20, temperature=0, frequency_penalty=2.0, output=[1, 2]),
        seq(logprobs=1, top_k=50, min_tokens=3),
    ]
    out = Sampler({0})(logits, seqs)
    ref = torch.log_softmax(logits.double(), -1)
    assert out.logprobs[2] is None
    for r, s in enumerate(seqs):
        if s.params.logprobs is None:
            continue
        entry, tok = out.logprobs[r], out.token_ids[r]
        top = ref[r].topk(s.params.logprobs).indices.tolist()
        assert set(entry) == set(top) | {tok}
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[r, t].item(), abs=1e-5)
            assert lp.rank == 1 + int((ref[r] > ref[r, t]).sum())
        if top:
            assert entry[top[0]].rank == 1


def test_logprob_ties_share_a_rank():
    logits = torch.tensor([[2.0, 5.0, 5.0, 1.0, 5.0, 0.0]])
    entry = Sampler(set())(logits, [seq(logprobs=4, temperature=0)]).logprobs[0]
    assert sorted(lp.rank for lp in entry.values()) == [1, 1, 1, 4]
    out = Sampler(set())(logits, [seq(logprobs=0, temperature=0)])  # only the sampled token, one of the tied
    assert list(out.logprobs[0].values())[0].rank == 1 and out.token_ids[0] in (1, 2, 4)


# ---------------------------------------------------------------- SamplingParams validation


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(n=0), "n"),
        (dict(n=1.5), "n"),
        (dict(n=True), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(presence_penalty=2.1), "presence_penalty"),
        (dict(presence_penalty=-2.1), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=-1), "repetition_penalty"),
        (dict(repetition_penalty=2.5), "repetition_penalty"),
        (dict(seed=1.5), "seed"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=2.0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=True), "logprobs"),
        (dict(stop=5), "stop"),
        (dict(stop=[1]), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(stop=["a", None]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=["1"]), "stop_token_ids"),
        (dict(stop_token_ids=3), "stop_token_ids"),
    ],
)
def test_invalid_params_raise_value_error(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        SamplingParams(**kwargs)


def test_valid_params_normalise():
    p = SamplingParams(top_k=-1, stop="x", stop_token_ids=(2,), max_tokens=None, min_tokens=100, logprobs=20)
    assert p.top_k == 0 and p.stop_strs == ["x"] and p.stop_token_ids == [2]
    assert SamplingParams(stop=["a", "b"]).stop_strs == ["a", "b"] and SamplingParams().stop_strs == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_min_tokens_masks_eos_of_greedy_rows_in_the_model_dtype(dtype):
    """All-greedy batches stay in the model's dtype (bf16 on CUDA): the -inf written over the banned columns must
    be of that dtype too (an fp32 index_put into bf16 logits failed: "dtypes must match")."""
    eos, stop = 7, 3
    logits = random_logits(3, 32, seed=5)
    logits[:, eos] = logits[:, stop] = 100.0  # the EOS and the stop token would win
    seqs = [
        seq(output=[1], temperature=0, min_tokens=2, stop_token_ids=[stop]),  # both banned
        seq(output=[1, 2], temperature=0, min_tokens=2, stop_token_ids=[stop]),  # min_tokens reached
        seq(temperature=0, min_tokens=1, ignore_eos=True, stop_token_ids=[stop]),  # only the stop token banned
    ]
    out = Sampler({eos}).__call__(logits.to(dtype), seqs)
    banned = logits.clone()
    banned[0, [eos, stop]] = banned[2, stop] = -math.inf
    assert out.token_ids == banned.to(dtype).float().argmax(-1).tolist()
    assert out.token_ids[0] not in (eos, stop) and out.token_ids[1] in (eos, stop) and out.token_ids[2] == eos

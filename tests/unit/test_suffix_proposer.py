import random
from collections import Counter, defaultdict
from collections.abc import Iterable

from tiffin.engine.core.sequence import Sequence
from tiffin.engine.llm import LLM
from tiffin.engine.sampling_params import SamplingParams
from tiffin.engine.spec_decode.suffix import ContextTrie, SuffixProposer
from tiffin.engine.speculative_config import SpeculativeConfig


def proposer(
    k: int = 4, depth: int = 24, min_prob: float = 0.1, max_cached: int = 1000, factor: float = 100
) -> SuffixProposer:
    """(`factor`: the tests of what is counted propose past the matched context's length)"""
    return SuffixProposer(
        SpeculativeConfig(
            method="suffix",
            num_speculative_tokens=k,
            suffix_decoding_max_tree_depth=depth,
            suffix_decoding_min_token_prob=min_prob,
            suffix_decoding_max_cached_requests=max_cached,
            suffix_decoding_max_spec_factor=factor,
        )
    )


def seq(prompt: list[int], outputs: Iterable[int] = (), request_id: str = "r") -> Sequence:
    s = Sequence(request_id, 0, prompt, SamplingParams(temperature=0), 100)
    for t in outputs:
        s.append_token(t)
    return s


def propose(p: SuffixProposer, s: Sequence) -> list[int]:
    p.propose([s])
    return s.spec_token_ids


def finished_request(p: SuffixProposer, request_id: str, prompt: list[int], outputs: list[int]) -> None:
    """A request `p` saw decode, then finish: its outputs reach the cache at `p`'s next call."""
    s = seq(prompt, outputs[:1], request_id)
    p.propose([s])
    for t in outputs[1:]:
        s.append_token(t)
    s.finish("stop")


def test_proposes_the_continuation_of_a_repeated_span():
    assert propose(proposer(), seq([5, 6, 7, 8, 9, 1, 2, 5, 6, 7])) == [8, 9, 1, 2]
    assert propose(proposer(), seq([5, 6, 7, 8, 9, 1, 2, 3, 4, 0])) == []  # nothing repeats


def test_learns_a_finished_requests_output_for_a_new_request():
    answer = list(range(10, 30))
    fresh = proposer()
    assert propose(fresh, seq([200, 201], answer[:2], "b")) == []
    p = proposer()
    finished_request(p, "a", [100, 101], answer)
    assert propose(p, seq([200, 201], answer[:2], "b")) == [12, 13, 14, 15]
    assert list(p.cached) == ["a"]


def test_the_longer_match_wins_and_the_own_one_on_a_tie():
    p = proposer()
    finished_request(p, "a", [0], [1, 2, 3, 4, 50, 51])
    assert propose(p, seq([1, 2, 3, 4, 60, 9, 3, 4], request_id="tie"))[0] == 60  # "3 4" in both
    assert propose(p, seq([7, 3, 4, 60, 1, 2, 3, 4], request_id="longer"))[0] == 50  # "1 2 3 4" in the cache


def test_an_ambiguous_context_proposes_nothing_or_stops():
    tokens = [9, 1, 2, 9, 1, 3, 9, 1]  # "9 1" was followed by 2 and by 3
    assert propose(proposer(min_prob=0.6), seq(tokens)) == []
    assert propose(proposer(min_prob=0.5), seq(tokens))[0] == 2  # a tie goes to the first
    tokens = [4, 9, 1, 2, 5, 9, 1, 3, 6, 4, 9]  # with 2-token contexts: "4 9" -> 1, then "9 1" is ambiguous
    assert propose(proposer(depth=2, min_prob=0.6), seq(tokens)) == [1]
    assert propose(proposer(depth=2, min_prob=0.5), seq(tokens))[:2] == [1, 2]


def test_respects_k_and_max_depth():
    span = list(range(40, 60))
    assert propose(proposer(k=2), seq([*span, *span[:3]])) == [43, 44]
    assert propose(proposer(k=7), seq([*span, *span[:3]])) == [43, 44, 45, 46, 47, 48, 49]
    tokens = [1, 2, 3, 10, 5, 2, 3, 11, 1, 2, 3]  # "1 2 3" -> 10, but "2 3" -> 10 or 11
    assert propose(proposer(depth=3, min_prob=0.6), seq(tokens))[0] == 10
    assert propose(proposer(depth=2, min_prob=0.6), seq(tokens)) == []


def test_the_cache_keeps_the_latest_requests():
    p = proposer(max_cached=2)
    answers = [list(range(100 * r + 10, 100 * r + 30)) for r in range(3)]
    for r, answer in enumerate(answers):
        finished_request(p, f"r{r}", [1000 + r], answer)
    assert propose(p, seq([7], answers[0][:3], "new0")) == []  # r0 was dropped, its counts with it
    assert propose(p, seq([7], answers[1][:3], "new1")) == answers[1][3:7]
    assert list(p.cached) == ["r1", "r2"]


def test_per_request_state_goes_with_the_requests():
    p = proposer()
    seqs = [seq([1, 2, 3], [4], f"r{i}") for i in range(3)]
    p.propose(seqs)
    p.propose(seqs[1:])  # seqs[0] preempted: it keeps its counts
    assert set(p.own) == {s.seq_id for s in seqs}
    for s in seqs:
        s.finish("stop")
    p.propose([])
    assert p.own == {}
    assert len(p.cached) == 3


def test_counting_token_by_token_proposes_as_counting_at_once():
    rng = random.Random(0)
    loop = [rng.randrange(50) for _ in range(12)]
    tokens = [rng.randrange(50) for _ in range(200)] + loop * 6 + [rng.randrange(5) for _ in range(100)]
    incremental, s = proposer(depth=6), seq(tokens[:3])
    proposals = 0
    for t in tokens[3:]:
        s.append_token(t)
        got = propose(incremental, s)
        assert got == propose(proposer(depth=6), seq(s.token_ids))
        proposals += bool(got)
    assert proposals > 50


def brute_force(lists: list[list[int]], depth: int) -> dict[tuple[int, ...], Counter]:
    follow = defaultdict(Counter)
    for tokens in lists:
        for i in range(1, len(tokens)):
            for n in range(1, min(i, depth) + 1):
                follow[tuple(tokens[i - n : i])][tokens[i]] += 1
    return follow


def test_trie_counts_as_brute_force_through_adds_and_removes():
    rng = random.Random(1)
    for _ in range(200):
        depth, vocab = rng.randint(1, 6), rng.randint(2, 5)
        trie, lists = ContextTrie(depth), []
        for _ in range(12):
            if lists and rng.random() < 0.3:
                trie.remove(lists.pop(rng.randrange(len(lists))))
            else:
                lists.append([rng.randrange(vocab) for _ in range(rng.randint(0, 15))])
                trie.add(lists[-1])
            follow = brute_force(lists, depth)
            for _ in range(20):
                context = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
                n, node = trie.match(context)
                suffixes = range(1, min(depth, len(context)) + 1)
                assert n == max((m for m in suffixes if tuple(context[-m:]) in follow), default=0)
                if n:
                    counts = follow[tuple(context[-n:])]
                    assert (node.total, counts[node.best]) == (counts.total(), max(counts.values()))
        for tokens in lists:
            trie.remove(tokens)
        assert trie.root.older == {}


def test_engine_generates_as_without_speculation(tiny_model):
    span = [11, 23, 35, 47, 59, 71]
    prompts = [{"prompt_token_ids": p} for p in ([*span * 4, 11, 23], [5, 6, 7, 8] * 3, [300, 301, 302], span)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=40)
    outputs = lambda llm: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    expected = outputs(LLM(tiny_model("llama"), dtype="float32"))
    llm = LLM(
        tiny_model("llama"), dtype="float32", speculative_config={"method": "suffix", "disable_by_batch_size": None}
    )
    assert outputs(llm) == expected
    assert outputs(llm) == expected  # now with the first round's outputs in the cache
    stats = llm.llm_engine.stats()
    assert stats.spec_accepted_tokens > 0
    assert stats.kv_blocks_used == 0


def test_proposals_at_most_max_spec_factor_times_the_match():
    """A context of 2 tokens matched: at most 2 tokens proposed at factor 1, 1 at 0.5, all 4 at 2."""
    span = [5, 6, 7, 8, 9, 10, 11]
    lengths = []
    for factor in (1.0, 0.5, 2.0):
        p, s = proposer(k=4, factor=factor), seq([*span, 1, 2, 3, 4, 5, 6])  # "5 6" matches the first two
        p.propose([s])
        lengths.append(len(s.spec_token_ids))
    assert lengths == [2, 1, 4]

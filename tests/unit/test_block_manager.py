"""Property-based tests of the block pool, prefix cache and scheduler invariants."""

from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tiffin.engine.config import EngineConfig
from tiffin.engine.core.block_manager import BlockManager
from tiffin.engine.core.scheduler import Scheduler
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.sampling_params import SamplingParams

BLOCK = 4


def make_seq(tokens, max_tokens=8):
    return Sequence("r", 0, tokens, SamplingParams(temperature=0, max_tokens=max_tokens), max_tokens)


def check_pool(bm: BlockManager, seqs) -> None:
    owners = Counter(b for s in seqs for b in s.block_table)
    for s in seqs:
        assert len(set(s.block_table)) == len(s.block_table), "a block appears twice in one table"
    for block in range(bm.num_blocks):
        assert bm.ref_cnt[block] == owners[block], "reference counts must match the block tables"
        assert (block in bm.free) == (bm.ref_cnt[block] == 0), "free exactly when unreferenced"
    for block_hash, block in bm.cached.items():
        assert bm.block_hash[block] == block_hash


def expected_hits(bm: BlockManager, seq: Sequence) -> list[int]:
    """Brute force: walk the seq's full blocks (all but its last token) and look each chain hash up."""
    blocks = []
    for i in range((seq.num_tokens - 1) // BLOCK):
        block = bm.cached.get(bm._hashes(seq, i + 1)[i])
        if block is None:
            break
        blocks.append(block)
    return blocks


tokens = st.lists(st.integers(0, 2), min_size=1, max_size=24)  # tiny alphabet: shared prefixes are common


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(tokens, st.booleans()), min_size=1, max_size=30), st.integers(4, 24))
def test_pool_invariants_and_prefix_lookup(ops, num_blocks):
    bm = BlockManager(num_blocks, BLOCK)
    live: list[Sequence] = []
    freed_at: dict[int, int] = {}  # block -> when it last became unreferenced (the test's own LRU clock)
    for step, (prompt, release) in enumerate(ops):
        if release and live:
            seq = live.pop(0)
            table = list(seq.block_table)
            bm.free_seq(seq)
            for i, block in enumerate(reversed(table)):  # a sequence frees its tail first
                if bm.ref_cnt[block] == 0:
                    freed_at[block] = step * 100 + i
        else:
            seq = make_seq(prompt)
            hits = bm.get_computed_blocks(seq)
            assert hits == expected_hits(bm, seq)
            assert len(hits) * BLOCK < seq.num_tokens, "the last token is always recomputed"
            free_before = set(bm.free) - set(hits)
            hashed_before = {b for b in free_before if bm.block_hash[b] is not None}
            if bm.allocate_slots(seq, seq.num_tokens - len(hits) * BLOCK, hits):
                seq.num_computed_tokens = seq.num_tokens
                live.append(seq)
                assert seq.block_table[: len(hits)] == hits
                taken = set(seq.block_table[len(hits) :])
                assert taken <= free_before, "took a referenced block"
                evicted = taken & hashed_before
                if evicted:  # unhashed blocks go first, then cached ones least recently freed first
                    assert free_before - hashed_before <= taken
                    kept = hashed_before - taken
                    assert not kept or max(freed_at.get(b, -1) for b in evicted) < min(
                        freed_at.get(b, -1) for b in kept
                    )
        check_pool(bm, live)
    for seq in live:
        bm.free_seq(seq)
    check_pool(bm, [])
    assert bm.num_used_blocks == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=12),
    st.integers(1, 48),
    st.integers(1, 8),
    st.booleans(),
    st.booleans(),
)
@example([(4, 1), (1, 2)], 1, 2, False, True)  # a prefill chunk cut to one token by the budget is not a decode
def test_scheduler_budgets_and_completion(requests, budget, max_seqs, prefix_caching, prefill_first):
    num_blocks = max(-(-(p + m) // BLOCK) for p, m in requests)  # the largest request alone just fits
    bm = BlockManager(num_blocks, BLOCK, prefix_caching)
    config = EngineConfig(
        model="-", max_num_seqs=max_seqs, max_num_batched_tokens=budget, block_size=BLOCK, prefill_first=prefill_first
    )
    scheduler = Scheduler(config, bm, max_model_len=1000)
    seqs = [make_seq([i % 3] * p, m) for i, (p, m) in enumerate(requests)]
    for seq in seqs[::2]:  # the rest arrive one per step, while the first ones decode
        scheduler.add(seq)
    arrivals, decodes_left_out = iter(seqs[1::2]), False
    for _ in range(10_000):
        if (seq := next(arrivals, None)) is not None:
            scheduler.add(seq)
        if not scheduler.has_unfinished():
            break
        decoding = [s for s in scheduler.running if s.num_tokens - s.num_computed_tokens == 1]
        out = scheduler.schedule()
        assert out.seqs, "no progress: the scheduler deadlocked"
        left_out = budget >= len(decoding) and any(s not in out.seqs and s in scheduler.running for s in decoding)
        assert not (left_out and (decodes_left_out or not prefill_first)), "decodes left out of two steps in a row"
        decodes_left_out = left_out
        assert sum(out.num_scheduled_tokens) <= budget
        assert len(scheduler.running) <= max_seqs
        assert len({s.seq_id for s in out.seqs}) == len(out.seqs)
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens + n
        check_pool(bm, scheduler.running)
        scheduler.update(out, [7] * sum(out.sampling))
    else:
        raise AssertionError("requests never finished")
    assert all(s.finished and s.num_output_tokens == s.max_tokens for s in seqs)
    assert bm.num_used_blocks == 0


def test_prefill_first_runs_a_new_prompt_without_the_decodes():
    def steps(prefill_first: bool) -> list[list[int]]:
        config = EngineConfig(model="-", block_size=BLOCK, prefill_first=prefill_first)
        scheduler = Scheduler(config, BlockManager(32, BLOCK), max_model_len=1000)
        running = [make_seq([1, 2, 3]), make_seq([4, 5])]
        for seq in running:
            scheduler.add(seq)
        scheduler.update(scheduler.schedule(), [7, 7])  # both prefilled: decoding now
        scheduler.add(make_seq([6, 7, 8, 9]))
        scheduled = []
        for _ in range(2):
            out = scheduler.schedule()
            scheduled.append(out.num_scheduled_tokens)
            scheduler.update(out, [7] * sum(out.sampling))
        return scheduled

    assert steps(prefill_first=True) == [[4], [1, 1, 1]]
    assert steps(prefill_first=False) == [[1, 1, 4], [1, 1, 1]]


def test_check_invariants_names_each_corruption():
    bm, seqs = BlockManager(8, BLOCK), [make_seq(list(range(10))), make_seq(list(range(10)) + [7])]
    for seq in seqs:
        assert bm.allocate_slots(seq, seq.num_tokens, bm.get_computed_blocks(seq))
    bm.check_invariants(seqs)
    corruptions = {
        "ref count": lambda: bm.ref_cnt.__setitem__(seqs[0].block_table[-1], 2),
        "stray refs": lambda: bm.ref_cnt.__setitem__(next(iter(bm.free)), 1),
        "referenced block is in the free queue": lambda: bm.free.__setitem__(seqs[0].block_table[0], None),
        "missing from the free queue": lambda: bm.free.pop(next(iter(bm.free))),
        "twice": lambda: seqs[1].block_table.append(seqs[1].block_table[-1]),
        "hash map": lambda: bm.cached.__setitem__(b"x", seqs[0].block_table[0]),
        "unmapped": lambda: bm.block_hash.__setitem__(next(iter(bm.free)), b"y"),
    }
    for message, corrupt in corruptions.items():
        saved = (list(bm.ref_cnt), dict(bm.free), dict(bm.cached), list(bm.block_hash), list(seqs[1].block_table))
        corrupt()
        with pytest.raises(AssertionError, match=message):
            bm.check_invariants(seqs)
        bm.ref_cnt, bm.cached, bm.block_hash, seqs[1].block_table = saved[0], saved[2], saved[3], saved[4]
        bm.free = type(bm.free)(saved[1])
        bm.check_invariants(seqs)

"""The scheduler with batches in flight (tiffin.engine.pipelined's invariant), on the Scheduler and BlockManager
alone: a batch's sequences are in no other batch until it returns, and none of them is preempted meanwhile."""

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from tiffin.engine.config import EngineConfig
from tiffin.engine.core.block_manager import BlockManager
from tiffin.engine.core.scheduler import Scheduler, SchedulerOutput
from tiffin.engine.core.sequence import Sequence, SequenceStatus
from tiffin.engine.sampling_params import SamplingParams

BLOCK = 4


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 20), st.integers(1, 10), st.integers(0, 2), st.sampled_from(["a", "b", None]))),
    st.sampled_from(["fcfs", "priority"]),
    st.booleans(),
    st.integers(0, 6),
    st.integers(2, 3),
)
def test_batches_in_flight_are_disjoint_and_never_preempted(requests, policy, fair_share, swap_blocks, depth):
    """Random prompts, priorities and clients on a pool that fits the largest request alone (preemptions forced),
    up to `depth` batches in flight, the oldest finished once that many are, or when nothing else can run."""
    num_blocks = max((-(-(p + m) // BLOCK) for p, m, _, _ in requests), default=1)
    config = EngineConfig(
        model="-",
        block_size=BLOCK,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        scheduling_policy=policy,
        fair_share=fair_share,
        preemption_mode="swap" if swap_blocks else "recompute",
    )
    scheduler = Scheduler(config, BlockManager(num_blocks, BLOCK, swap_blocks=swap_blocks), max_model_len=1000)
    seqs = [
        Sequence("r", 0, [i % 3] * p, SamplingParams(temperature=0, max_tokens=m, priority=prio), m, client=client)
        for i, (p, m, prio, client) in enumerate(requests)
    ]
    for seq in seqs:
        scheduler.add(seq)
    batches: deque[tuple[SchedulerOutput, list]] = deque()  # each with its sequences' block tables as scheduled
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            break
        out = scheduler.schedule() if len(batches) < depth else SchedulerOutput()
        assert not {s.seq_id for s in out.seqs} & {s.seq_id for b, _ in batches for s in b.seqs}
        if out.seqs:
            scheduler.block_manager.take_copies()
            batches.append((out, [list(s.block_table) for s in out.seqs]))
            scheduler.in_flight.update(out.seqs)
        if batches and (not out.seqs or len(batches) == depth):
            oldest, tables = batches.popleft()
            # untouched while in flight: still running on the very blocks it was scheduled with
            assert all(s.status is SequenceStatus.RUNNING for s in oldest.seqs)
            assert [s.block_table for s in oldest.seqs] == tables
            scheduler.in_flight.difference_update(oldest.seqs)
            scheduler.update(oldest, [7] * sum(oldest.sampling))
        scheduler.block_manager.check_invariants([*scheduler.running, *scheduler.waiting, *scheduler.swapped])
    else:
        raise AssertionError("requests never finished")
    assert all(s.finished and s.num_output_tokens == s.max_tokens for s in seqs)
    assert scheduler.block_manager.num_used_blocks == 0 and not batches and not scheduler.in_flight


def test_a_second_batch_takes_what_the_first_left():
    """Four prompts of a block each, eight tokens a step: two batches of two, then nothing until one returns."""
    config = EngineConfig(model="-", block_size=BLOCK, max_num_batched_tokens=8, prefill_first=False)
    scheduler = Scheduler(config, BlockManager(16, BLOCK), max_model_len=100)
    seqs = [Sequence("r", i, [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=4), 4) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    first = scheduler.schedule()
    scheduler.in_flight.update(first.seqs)
    second = scheduler.schedule()
    scheduler.in_flight.update(second.seqs)
    assert first.seqs == seqs[:2] and second.seqs == seqs[2:] and not scheduler.schedule().seqs
    scheduler.in_flight.difference_update(first.seqs)
    scheduler.update(first, [7, 7])
    assert scheduler.schedule().seqs == seqs[:2]  # their decodes; the second batch's are still in flight

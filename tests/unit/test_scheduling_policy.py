"""Scheduling policies on the Scheduler and BlockManager alone: priority admission and preemption, fair share."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tiffin.engine.config import EngineConfig
from tiffin.engine.core.block_manager import BlockManager
from tiffin.engine.core.scheduler import Scheduler
from tiffin.engine.core.sequence import Sequence, SequenceStatus
from tiffin.engine.sampling_params import SamplingParams

BLOCK = 4


def make_seq(priority: int = 0, client: str | None = None, max_tokens: int = 8) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, priority=priority)
    return Sequence("r", 0, [1, 2, 3, 4], params, max_tokens, client=client)  # one full block


def make_scheduler(
    policy: str = "priority", num_blocks: int = 64, max_num_seqs: int = 8, swap_blocks: int = 0, **config
) -> Scheduler:
    config = EngineConfig(
        model="-",
        block_size=BLOCK,
        max_num_seqs=max_num_seqs,
        scheduling_policy=policy,
        prefill_first=False,
        preemption_mode="swap" if swap_blocks else "recompute",
        **config,
    )
    return Scheduler(config, BlockManager(num_blocks, BLOCK, False, swap_blocks=swap_blocks), max_model_len=1000)


def step(scheduler: Scheduler, seats: list[Counter] | None = None) -> list[Sequence]:
    """Run one step; returns the sequences it admitted or resumed, in order. `seats`: gets the clients' seats
    as scheduled."""
    before = set(map(id, scheduler.running))
    out = scheduler.schedule()
    if seats is not None:
        seats.append(Counter(s.client for s in (*scheduler.running, *scheduler.swapped)))
    scheduler.block_manager.take_copies()  # the step's swap copies, as LLMEngine.step takes them
    scheduler.update(out, [7] * sum(out.sampling))
    return [s for s in out.seqs if id(s) not in before]


def drain(scheduler: Scheduler) -> list[Sequence]:
    """The waiting sequences in the order they would be admitted (emptying the queue)."""
    order = []
    while scheduler.waiting:
        seq = scheduler.waiting.peek(Counter())
        scheduler.waiting.pop(seq)
        order.append(seq)
    return order


def admission_order(policy: str, priorities: list[int]) -> list[int]:
    scheduler = make_scheduler(policy, max_num_seqs=1)
    seqs = [make_seq(p, max_tokens=1) for p in priorities]  # each finishes in the step that admits it
    for seq in seqs:
        scheduler.add(seq)
    order = []
    while scheduler.has_unfinished():
        order += [seqs.index(s) for s in step(scheduler)]
    return order


def test_priority_admits_lower_values_first_and_fcfs_within_a_level():
    assert admission_order("priority", [3, 1, 2, 1, 0, 3]) == [4, 1, 3, 2, 0, 5]
    assert admission_order("fcfs", [3, 1, 2, 1, 0, 3]) == [0, 1, 2, 3, 4, 5]


def preempt_one(policy: str, swap_blocks: int = 0) -> tuple[Scheduler, Sequence, Sequence, list[Sequence]]:
    """Three blocks: `low` (priority 5) runs, then `high` (priority 0) is admitted after it, then `queued`
    (priorities 3 and 7) wait for a seat; the next step needs a fourth block and preempts one of the two."""
    scheduler = make_scheduler(policy, num_blocks=3, max_num_seqs=2, swap_blocks=swap_blocks)
    low, high = make_seq(5), make_seq(0, max_tokens=4)
    scheduler.add(low)
    assert step(scheduler) == [low]
    scheduler.add(high)
    assert step(scheduler) == [high]  # low's decode takes a second block, high's prompt the third
    queued = [make_seq(3), make_seq(7)]
    for seq in queued:
        scheduler.add(seq)
    assert step(scheduler) == []  # high's decode needs another block
    assert scheduler.num_preemptions == 1
    return scheduler, low, high, queued


def test_priority_preempts_the_lowest_priority_not_the_last_admitted():
    scheduler, low, high, queued = preempt_one("priority")
    assert high.status is SequenceStatus.RUNNING and low.status is SequenceStatus.WAITING
    assert low.num_computed_tokens == 0 and not low.block_table
    assert drain(scheduler) == [queued[0], low, queued[1]]  # back at its place by priority, not at the head


def test_fcfs_preempts_the_last_admitted_and_requeues_it_at_the_head():
    scheduler, low, high, queued = preempt_one("fcfs")
    assert low.status is SequenceStatus.RUNNING and high.status is SequenceStatus.WAITING
    assert list(scheduler.waiting) == [high, *queued]


def test_swap_mode_resumes_by_priority():
    scheduler, low, high, queued = preempt_one("priority", swap_blocks=8)
    assert low.status is SequenceStatus.SWAPPED and scheduler.swapped == [low]
    admitted = []
    while scheduler.has_unfinished():
        admitted += step(scheduler)
    # queued[0] (priority 3) takes the seat high leaves before low (5) resumes; queued[1] (7) comes last (three
    # blocks for sequences of up to twelve tokens: the later swaps follow the same order)
    assert list(dict.fromkeys(admitted)) == [queued[0], low, queued[1]]
    assert scheduler.num_swapped_in == scheduler.num_swapped_out == scheduler.num_preemptions
    assert all(s.num_output_tokens == s.max_tokens for s in [low, high, *queued])


def test_fair_share_splits_the_seats_between_clients_whatever_their_load():
    def seats_while_both_wait(fair_share: bool) -> list[Counter]:
        scheduler = make_scheduler("fcfs", max_num_seqs=4, fair_share=fair_share)
        for i in range(100):  # the busy client's burst arrives first
            scheduler.add(make_seq(client="busy", max_tokens=2 + i % 5))
        for i in range(10):
            scheduler.add(make_seq(client=None, max_tokens=2 + i % 3))  # anonymous: one client too
        seats = []
        while {s.client for s in scheduler.waiting} == {"busy", None}:
            step(scheduler, seats)
        return seats

    fair = seats_while_both_wait(fair_share=True)
    assert len(fair) >= 10 and all(seats == {"busy": 2, None: 2} for seats in fair)
    assert all(seats == {"busy": 4} for seats in seats_while_both_wait(fair_share=False))


def test_fair_share_across_priority_levels():
    scheduler = make_scheduler("priority", max_num_seqs=3, fair_share=True)
    idle_client = make_seq(1, client="b")
    busy = [make_seq(0, client="a") for _ in range(2)]
    for seq in [idle_client, *busy, make_seq(1, client="a")]:
        scheduler.add(seq)
    # seats first: a's more urgent priority breaks the first tie only, then b holds fewer, then a tie again
    assert step(scheduler) == [busy[0], idle_client, busy[1]]
    scheduler.finish(idle_client, "abort")
    assert len(scheduler.waiting) == 1
    aborted = next(iter(scheduler.waiting))
    scheduler.finish(aborted, "abort")
    assert not scheduler.waiting and list(scheduler.waiting) == []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 20), st.integers(1, 10), st.integers(0, 2), st.sampled_from(["a", "b", None]))),
    st.sampled_from(["fcfs", "priority"]),
    st.booleans(),
    st.integers(0, 6),
    st.integers(1, 4),
)
def test_every_policy_finishes_every_request_within_its_limits(requests, policy, fair_share, swap_blocks, max_seqs):
    """Random prompts, priorities and clients, preemptions forced by a pool that fits the largest request alone."""
    num_blocks = max((-(-(p + m) // BLOCK) for p, m, _, _ in requests), default=1)
    config = EngineConfig(
        model="-",
        block_size=BLOCK,
        max_num_seqs=max_seqs,
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
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            break
        step(scheduler)
        assert len(scheduler.running) + len(scheduler.swapped) <= max_seqs
        scheduler.block_manager.check_invariants([*scheduler.running, *scheduler.waiting, *scheduler.swapped])
    else:
        raise AssertionError("requests never finished")
    assert all(s.finished and s.num_output_tokens == s.max_tokens for s in seqs)
    assert scheduler.block_manager.num_used_blocks == 0 and len(scheduler.waiting) == 0

"""The load a request sees on each data-parallel replica (tiffin.engine.replica_work), on fake work: plain fcfs sees
every token; priority only the work it cannot overtake; fair share its own key's backlog and as much of each other
key's; a replica that would not seat it at once is skipped while another would, so the router's cache hit never
keeps it waiting for a seat."""

from tiffin.engine.replica_work import INF, ReplicaWork
from tiffin.engine.router import Router

BOTH = [True, True]


def work(by_priority: bool, fair_share: bool, seats: int = 4, **groups) -> ReplicaWork:
    """Replicas 0 and 1 holding `groups`: name r0/r1 -> list of (client, priority, started, tokens, seqs)."""
    w = ReplicaWork(2, by_priority, fair_share, seats)
    for r in range(2):
        for client, priority, started, tokens, seqs in groups.get(f"r{r}", ()):
            w.add(r, (client, priority, started), tokens, seqs)
    return w


def test_fcfs_sees_every_token_and_skips_only_unusable_replicas():
    w = work(False, False, r0=[("a", 5, True, 300, 2)], r1=[("b", 0, False, 100, 1)])
    assert w.view("b", 0, 10, BOTH) == [300, 100] and w.totals == [300, 100]
    assert w.view("b", 0, 10, [True, False]) == [300, INF]


def test_priority_counts_only_the_work_it_cannot_overtake():
    # r0: much low-priority (5) work; r1: less work, but of the request's own priority
    w = work(True, False, seats=8, r0=[(None, 5, True, 600, 2), (None, 5, False, 900, 3)], r1=[(None, 0, True, 200, 2)])
    assert w.view(None, 0, 10, BOTH) == [10, 210]  # the high-priority request overtakes r0's work
    assert w.view(None, 5, 10, BOTH) == [1510, 210]  # a low-priority one waits behind it all
    assert w.view(None, -1, 10, BOTH) == [10, 10]  # a more urgent one overtakes both


def test_priority_goes_where_a_seat_is_free_for_it():
    # two seats each: r0's are taken by running low-priority work (no seat before one ends), r1 has one free
    w = work(True, False, seats=2, r0=[(None, 5, True, 100, 2)], r1=[(None, 0, True, 400, 1)])
    assert w.view(None, 0, 10, BOTH) == [INF, 410]
    # r1's free seat goes to its waiting request of the same priority first: neither seats it, so tokens decide
    w.add(1, (None, 0, False), 30, 1)
    assert w.view(None, 0, 10, BOTH) == [10, 440]
    assert w.view(None, 0, 10, [False, True]) == [INF, 440]  # the only usable replica, seat or not


def test_fair_share_counts_another_keys_flood_only_up_to_its_own_backlog():
    flood = [("a", 0, True, 4000, 2), ("a", 0, False, 9000, 30)]
    w = work(False, True, seats=2, r0=flood, r1=[*flood, ("b", 0, True, 50, 1)])
    # b holds no seat on r0 (a newcomer there: a's holder of two seats gives one), b's own work sits on r1
    assert w.view("b", 0, 20, BOTH) == [20 + 20, INF]
    # a's view: its own backlog and b's (all of it: less than a's)
    assert w.view("a", 0, 20, BOTH) == [13020, 13020 + 50]
    # with a priority policy too, b's lower-priority work on r1 is not ahead of its urgent request
    w = work(True, True, seats=4, r0=flood, r1=[("a", 0, True, 4000, 2), ("b", 3, False, 50, 1)])
    assert w.view("b", 0, 20, BOTH) == [40, 40]


def test_fair_share_seats_a_key_before_keys_holding_more():
    # r0: a holds 1 seat of 3 and waits with 5 more; b's request is seated before a's waiting ones (it holds none)
    w = work(False, True, seats=3, r0=[("a", 0, True, 100, 1), ("a", 0, False, 500, 5)], r1=[("c", 0, True, 300, 3)])
    assert w.view("b", 0, 10, BOTH)[0] == 20  # free: 2 seats; a is seated first only up to b's level + 1 (one)
    # c holds all of r1's seats but as a newcomer b gets one at once there too
    assert w.view("b", 0, 10, BOTH)[1] == 20
    w.add(0, ("b", 0, True), 40, 2)  # now b holds 2 of r0's 3 seats: a's waiting ones go first (it holds fewer)
    assert w.view("b", 0, 10, BOTH) == [INF, 20]


def test_the_cache_never_keeps_a_request_waiting_for_a_seat():
    """b's second request shares its first's prompt blocks (a hit on r0), but r0 would not seat it while r1 would."""
    router = Router(2, 4, "cache_aware", balance_threshold=8192)
    hashes = router.prompt_hashes(list(range(40)))
    w = work(False, True, seats=2, r0=[("a", 0, True, 400, 2)], r1=[("a", 0, True, 400, 2)])
    first = router.route(hashes, w.view("b", 0, 40, BOTH), tiebreak=w.totals)
    w.add(first, ("b", 0, True), 40, 1)  # seated: a newcomer preempted one of a's
    w.add(first, ("a", 0, True), -200, -1)
    w.add(first, ("a", 0, False), 200, 1)
    second = router.route(hashes, w.view("b", 0, 40, BOTH), tiebreak=w.totals)
    assert router.hit_blocks(first, hashes) == len(hashes) and second != first
    # without priorities or fair share the hit wins, as before (loads within the bound)
    router.finished(second, hashes)
    plain = work(False, False, seats=2, r0=[("a", 0, True, 400, 2)], r1=[("a", 0, True, 400, 2)])
    plain.add(first, ("b", 0, True), 40, 1)
    assert router.route(hashes, plain.view("b", 0, 40, BOTH), tiebreak=plain.totals) == first

"""The work a data-parallel front (tiffin.engine.data_parallel) has in flight on each replica, grouped as the
replicas' schedulers order it, and the load a new request would see on each replica: what the router compares.

Each replica runs its own scheduler (`scheduling_policy`, `fair_share`: tiffin.engine.core.scheduler) on the
requests it was sent, their `client` and `priority` with them, so a request overtakes and preempts lower-priority
work, and takes its key's share of the seats, on whichever replica it lands. What the front adds is the choice of
that replica by the work the request could not overtake there, not by all the work there:

- plain `fcfs`: every token in flight (it waits behind all of it): the replica's total load.
- `priority`: the tokens of requests of its priority or a more urgent one (lower-priority work gives way to it).
- `fair_share`: its own key's tokens, plus each other key's up to as many (keys share the seats evenly: another
  key's flood delays it by as much as its own backlog, not by the flood's size); a priority orders only its key's own.

And under `priority` or `fair_share`, a request first goes to a replica that would seat it at its next step, where
any would (others are infinitely loaded for it): one with a seat (`max_num_seqs`) free beyond the waiting sequences
seated before it, or, under fair share, where its key holds no seat while another key holds two (the replica
preempts one for it). The cache's hits, worth at most `router_balance_threshold` tokens of load, never keep a
request waiting for a seat that another replica would give it at once; a key's concurrent requests thus spread
over the replicas once one replica's share is taken.

The record is the front's own: a request counts from its routing until its finished output, as waiting until its
first output, then as running with all its `n` sequences (a replica's later preemption of it, or samples of it
still waiting for seats, are not seen). Invariant: for each replica and
group (client, priority, started), `tokens` and `seqs` are the sums over that group's requests in flight there, and
`totals` the sum of its `tokens`."""

from collections import Counter
from collections.abc import Sequence as Seq

Group = tuple[str | None, int, bool]  # (client, priority, started)
INF = float("inf")


class ReplicaWork:
    def __init__(self, num_replicas: int, by_priority: bool, fair_share: bool, max_num_seqs: int):
        self.by_priority, self.fair_share, self.max_num_seqs = by_priority, fair_share, max_num_seqs
        self.tokens: list[Counter[Group]] = [Counter() for _ in range(num_replicas)]
        self.seqs: list[Counter[Group]] = [Counter() for _ in range(num_replicas)]
        self.totals = [0] * num_replicas  # each replica's tokens in flight: its load as `fcfs` sees it (any thread)

    def add(self, replica: int, group: Group, tokens: int, seqs: int) -> None:
        """Count (or, negative, take away) `tokens` and `seqs` of `group` on `replica`."""
        self.tokens[replica][group] += tokens
        self.seqs[replica][group] += seqs
        self.totals[replica] += tokens
        if not self.seqs[replica][group]:
            del self.seqs[replica][group], self.tokens[replica][group]

    def clear(self, replica: int) -> None:
        """`replica` died: nothing of it is in flight any more."""
        self.tokens[replica].clear()
        self.seqs[replica].clear()
        self.totals[replica] = 0

    def view(self, client: str | None, priority: int, tokens: int, usable: Seq[bool]) -> list[float]:
        """The load a request of `client` at `priority` with `tokens` would see on each replica (infinite on one not
        `usable`: dead, or its queue full)."""
        if not (self.by_priority or self.fair_share):
            return [load if ok else INF for load, ok in zip(self.totals, usable)]
        seated, ahead = zip(*(self._ahead(r, client, priority, tokens) for r in range(len(self.tokens))))
        some_seat = any(s and ok for s, ok in zip(seated, usable))
        return [a if ok and (s or not some_seat) else INF for a, s, ok in zip(ahead, seated, usable)]

    def _ahead(self, replica: int, client: str | None, priority: int, tokens: int) -> tuple[bool, int]:
        """Whether `replica` would seat the request at its next step, and the tokens it could not overtake there."""
        before = lambda level: not self.by_priority or level <= priority  # a priority it does not overtake
        seqs, toks = self.seqs[replica], self.tokens[replica]
        running = Counter()  # seats held, by client
        waiting = Counter()  # sequences waiting that would be seated before it, by client
        for (c, p, started), n in seqs.items():
            if started:
                running[c] += n
            elif before(p) or (self.fair_share and c != client):
                waiting[c] += n
        free = self.max_num_seqs - sum(running.values())
        if not self.fair_share:
            return free > sum(waiting.values()), sum(t for g, t in toks.items() if before(g[1])) + tokens
        own_seats, own_waiting = running[client], waiting.pop(client, 0)
        level = own_seats + own_waiting  # its seats once its own earlier sequences have theirs
        # each other key is seated before it until it holds one seat more (its earlier arrival breaks the tie)
        ahead_of_it = own_waiting + sum(min(n, max(0, level - running[c] + 1)) for c, n in waiting.items())
        newcomer = level == 0 and max(running.values(), default=0) >= 2
        own = sum(t for g, t in toks.items() if g[0] == client and before(g[1])) + tokens
        others = Counter()
        for g, t in toks.items():
            if g[0] != client:
                others[g[0]] += t
        return newcomer or free > ahead_of_it, own + sum(min(t, own) for t in others.values())

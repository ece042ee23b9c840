"""The scheduler's waiting queues: plain fcfs's deque (`FCFSQueue`), and the heaps by `SchedulingKey` of the priority
policy and of fair share (`KeyedQueue`); the policies themselves are the scheduler's (`core.scheduler`)."""

import heapq
from collections import Counter, deque
from collections.abc import Callable, Iterator

from tiffin.engine.core.sequence import Sequence

SchedulingKey = tuple[int, int]  # (priority level, seq_id): lower is admitted first


class FCFSQueue:
    """Plain fcfs's waiting queue: a deque, `requeue` (a preempted sequence, or one passed over this step) at
    its head."""

    def __init__(self):
        self.seqs: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.seqs)

    def push(self, seq: Sequence) -> None:
        self.seqs.append(seq)

    def requeue(self, seq: Sequence) -> None:
        self.seqs.appendleft(seq)

    def peek(self, seats: Counter | None) -> Sequence:
        return self.seqs[0]

    def pop(self, seq: Sequence) -> None:
        self.seqs.popleft()

    def remove(self, seq: Sequence) -> None:
        self.seqs.remove(seq)


class KeyedQueue:
    """The waiting queue of the priority policy or of fair share: a heap by `key` per client (a single one
    without fair share), so a push or a pop costs O(log n) and a peek O(clients)."""

    def __init__(self, key: Callable[[Sequence], SchedulingKey], fair_share: bool):
        self.key, self.fair_share = key, fair_share
        self.heaps: dict[str | None, list[tuple[SchedulingKey, Sequence]]] = {}  # only clients with waiting ones
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for heap in self.heaps.values() for _, seq in heap)

    def _client(self, seq: Sequence) -> str | None:
        return seq.client if self.fair_share else None

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self.heaps.setdefault(self._client(seq), []), (self.key(seq), seq))
        self.size += 1

    requeue = push  # the key alone places it

    def heads(self) -> Iterator[Sequence]:
        """Each client's next sequence."""
        return (heap[0][1] for heap in self.heaps.values())

    def peek(self, seats: Counter | None) -> Sequence:
        """The next to admit: the best key, or with fair share the policy's pick among the clients' heads, `seats`
        counting each client's running and swapped sequences."""
        if len(self.heaps) == 1:
            return next(iter(self.heaps.values()))[0][1]
        heads = (heap[0] for heap in self.heaps.values())  # (key, seq)
        return min(heads, key=lambda head: (seats[head[1].client], head[0]))[1]  # seats, then (level, arrival)

    def pop(self, seq: Sequence) -> None:
        """Remove `seq`, the head `peek` just returned."""
        client = self._client(seq)
        heapq.heappop(self.heaps[client])
        self._removed(client)

    def remove(self, seq: Sequence) -> None:
        client = self._client(seq)
        heap = self.heaps[client]
        heap.remove((self.key(seq), seq))
        heapq.heapify(heap)
        self._removed(client)

    def _removed(self, client: str | None) -> None:
        self.size -= 1
        if not self.heaps[client]:
            del self.heaps[client]

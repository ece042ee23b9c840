"""What the data-parallel front (tiffin.engine.data_parallel) keeps of its replicas for a server: the adapters a
server added (the table its LoRA routes read, as they read one engine's `LoRARegistry`) and the
waiting queue of each replica (so that a full one is refused at the front, as one engine refuses it, with
QueueFull raised from `add_request` rather than a failed output).

Invariants: an adapter is in `AdapterTable` only once a replica read it (others read it when its requests come);
`QueueRoom`'s count of a
replica's waiting sequences is never below the truth: the count its last report gave plus the sequences sent
since that the replica had not yet taken (a sequence scheduled meanwhile is counted until the next report)."""

from collections import Counter
from dataclasses import dataclass, field

from tiffin.engine.errors import ParamError, QueueFull
from tiffin.engine.lora.request import LoRARequest
from tiffin.engine.outputs import EngineStats


class AdapterTable:
    """The adapters a server added, by name, with `LoRARegistry`'s lookups (`get`, `added`, `is_cached`,
    `next_int_id`); read from any thread, replaced on change, never mutated."""

    def __init__(self) -> None:
        self._added: dict[int, LoRARequest] = {}
        self.next_int_id = 1  # above every id added so far

    def add(self, lora: LoRARequest) -> None:
        self._added = {**self._added, lora.lora_int_id: lora}
        self.next_int_id = max(self.next_int_id, lora.lora_int_id + 1)

    def remove(self, lora_int_id: int) -> None:
        self._added = {i: r for i, r in self._added.items() if i != lora_int_id}

    def get(self, name: str) -> LoRARequest | None:
        return next((r for r in self._added.values() if r.lora_name == name), None)

    def added(self) -> list[LoRARequest]:
        return list(self._added.values())

    def is_cached(self, lora_int_id: int) -> bool:
        """An added adapter needs no `load_lora` before its requests: a replica holds it, any other reads it."""
        return lora_int_id in self._added


@dataclass
class QueueRoom:
    """`max_waiting_requests` and `max_waiting_per_client` kept per replica by the front (the replicas keep none)."""

    limit: int | None
    client_limit: int | None
    sent: list[int] = field(default_factory=list)  # sequences sent to each replica, in all
    taken: list[int] = field(default_factory=list)  # of those, the ones it had taken at its last report
    waiting: list[Counter] = field(default_factory=list)  # its waiting sequences by client (None: anonymous)

    @classmethod
    def of(cls, num_replicas: int, limit: int | None, client_limit: int | None) -> "QueueRoom":
        zeros = [0] * num_replicas
        return cls(limit, client_limit, zeros, list(zeros), [Counter() for _ in range(num_replicas)])

    def check(self, n: int, client: str | None) -> None:
        """ParamError if `n` sequences never fit one client's limit (as one engine refuses them)."""
        if client is not None and self.client_limit is not None and n > self.client_limit:
            raise ParamError("n", f"n={n} sequences never fit max_waiting_per_client={self.client_limit}")

    def full(self, replica: int, n: int, client: str | None) -> str | None:
        """Why `replica` has no room for `n` more waiting sequences of `client`; None if it has."""
        unseen = self.sent[replica] - self.taken[replica]
        waiting = sum(self.waiting[replica].values()) + unseen
        if self.limit is not None and waiting + n > self.limit:
            return f"{waiting} sequences are waiting (max_waiting_requests={self.limit} per replica); retry later"
        if client is not None and self.client_limit is not None:
            own = self.waiting[replica][client] + unseen  # any unseen one may be this client's
            if own + n > self.client_limit:
                return f"{own} of this client's sequences are waiting (max_waiting_per_client={self.client_limit})"
        return None

    def refuse(self, reasons: list[str]) -> None:
        """QueueFull, for the reasons `full` gave for each replica."""
        joined = reasons[0] if len(set(reasons)) == 1 else "every replica's queue is full: " + "; ".join(reasons)
        raise QueueFull(joined)

    def forget(self, replica: int) -> None:
        """`replica` was started again: nothing sent to it, nothing waiting."""
        self.sent[replica] = self.taken[replica] = 0
        self.waiting[replica] = Counter()

    def reported(self, replica: int, queue: tuple[int, Counter]) -> None:
        """`replica`'s report: the sequences it had taken in all, and those of them waiting by client."""
        self.taken[replica], self.waiting[replica] = queue


def health(replica: int, why: str | None, stats: EngineStats, load: int, restarts: int, node: str | None) -> dict:
    """A replica's state for a server's health detail and metrics: whether it serves (else why not), its batch,
    queue and KV pool as it last reported them, its load as the router sees it (a dead one holds nothing), how
    many times it was started again, and its node's address (a Ray replica's; None: this host's process)."""
    alive = why is None
    return {
        "replica": replica,
        "node": node,
        "alive": alive,
        "error": why,
        "num_running": stats.num_running if alive else 0,
        "num_waiting": stats.num_waiting if alive else 0,
        "kv_blocks_used": stats.kv_blocks_used if alive else 0,
        "kv_blocks_total": stats.kv_blocks_total,
        "load_tokens": load if alive else 0,
        "restarts": restarts,
    }

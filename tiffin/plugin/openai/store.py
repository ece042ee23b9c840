"""`ResponseStore`: the Responses API's stored responses (`store`, `previous_response_id`, GET and DELETE), in memory.

Invariants:
- It holds at most `max_entries` responses and `max_bytes` of their JSON, each for at most `ttl` seconds; a response
  larger than an owner's byte quota is not stored.
- Each owner (client) has a quota of its own: `max_entries // owners` responses and `max_bytes // owners` bytes,
  `owners` being how many clients the store is shared by (the configured API keys). A `put` over its owner's quota
  drops that owner's oldest responses, never another's: one client's churn evicts only its own entries. The global
  bounds stay the sum limit: should more owners than `owners` fill it, the owner holding the most pays (its oldest
  response is dropped), so a client with few responses keeps them while another churns.
- It holds each response and its conversation as their encoded JSON bytes, not as Python objects (which take 6-8
  times as much memory as their JSON): the bytes it counts are the bytes it holds, and a GET answers them as they
  are, with nothing to encode. `put` encodes, so it runs off the event loop (the answer's worker thread).
- A response is found only by its owner: the client (API key) that created it; to anyone else it does not exist."""

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from tiffin.plugin.openai.encoding import dumps


@dataclass
class StoredResponse:
    owner: str | None
    response: bytes  # the Response object as it was sent, as JSON
    messages: bytes  # JSON of the conversation through this response as chat messages (what a follow-up continues)
    expires: float  # time.monotonic()

    @property
    def size(self) -> int:
        return len(self.response) + len(self.messages)


@dataclass
class _Holding:
    """One owner's responses (ids, oldest first) and the bytes they hold."""

    ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    bytes: int = 0


class ResponseStore:
    def __init__(
        self, max_entries: int = 1000, max_bytes: int = 256 << 20, ttl: float = 3600.0, owners: int = 1
    ) -> None:
        self.max_entries, self.max_bytes, self.ttl = max_entries, max_bytes, ttl
        owners = max(owners, 1)
        self.owner_entries, self.owner_bytes = max_entries // owners, max_bytes // owners  # each owner's quota
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._owners: dict[str | None, _Holding] = {}
        self._bytes = 0
        self._lock = threading.Lock()  # requests finish on the event loop, but tests and threads may share one

    def put(self, owner: str | None, response: dict, messages: list[dict]) -> None:
        entry = StoredResponse(owner, dumps(response), dumps(messages), time.monotonic() + self.ttl)
        with self._lock:
            self._drop(response["id"])
            if entry.size > self.owner_bytes or self.owner_entries < 1:
                return
            now = time.monotonic()
            while self._entries and next(iter(self._entries.values())).expires < now:  # one ttl: oldest first
                self._drop(next(iter(self._entries)))
            self._entries[response["id"]] = entry
            self._bytes += entry.size
            holding = self._owners.setdefault(owner, _Holding())
            holding.ids[response["id"]] = None
            holding.bytes += entry.size
            while len(holding.ids) > self.owner_entries or holding.bytes > self.owner_bytes:  # its own quota
                self._drop(next(iter(holding.ids)))
            while len(self._entries) > self.max_entries:  # the sum limit: the owner holding the most pays
                self._drop(next(iter(max(self._owners.values(), key=lambda h: len(h.ids)).ids)))
            while self._bytes > self.max_bytes:
                self._drop(next(iter(max(self._owners.values(), key=lambda h: h.bytes).ids)))

    def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None and entry.expires < time.monotonic():
                self._drop(response_id)
                return None
            return entry if entry is not None and entry.owner == owner else None

    def delete(self, owner: str | None, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return False
            self._drop(response_id)
            return True

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def held_by(self, owner: str | None) -> tuple[int, int]:
        """How many responses `owner` has stored, and their bytes."""
        with self._lock:
            holding = self._owners.get(owner)
            return (len(holding.ids), holding.bytes) if holding else (0, 0)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return
        self._bytes -= entry.size
        holding = self._owners[entry.owner]
        del holding.ids[response_id]
        holding.bytes -= entry.size
        if not holding.ids:
            del self._owners[entry.owner]

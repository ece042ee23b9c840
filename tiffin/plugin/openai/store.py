"""`ResponseStore`: the Responses API's stored responses (`store`, `previous_response_id`, GET and DELETE), in memory.

Invariants:
- It holds at most `max_entries` responses and `max_bytes` of their JSON (the oldest dropped first), each for at
  most `ttl` seconds; a response larger than `max_bytes` is not stored.
- It holds each response and its conversation as their encoded JSON bytes, not as Python objects (which take 6-8
  times as much memory as their JSON): the bytes it counts are the bytes it holds, and a GET answers them as they
  are, with nothing to encode. `put` encodes, so it runs off the event loop (the answer's worker thread).
- A response is found only by its owner: the client (API key) that created it; to anyone else it does not exist."""

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

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


class ResponseStore:
    def __init__(self, max_entries: int = 1000, max_bytes: int = 256 << 20, ttl: float = 3600.0) -> None:
        self.max_entries, self.max_bytes, self.ttl = max_entries, max_bytes, ttl
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()  # requests finish on the event loop, but tests and threads may share one

    def put(self, owner: str | None, response: dict, messages: list[dict]) -> None:
        entry = StoredResponse(owner, dumps(response), dumps(messages), time.monotonic() + self.ttl)
        with self._lock:
            self._drop(response["id"])
            if entry.size > self.max_bytes or self.max_entries < 1:
                return
            self._entries[response["id"]] = entry
            self._bytes += entry.size
            now = time.monotonic()
            while (  # one ttl for all: the oldest expires first
                len(self._entries) > self.max_entries
                or self._bytes > self.max_bytes
                or next(iter(self._entries.values())).expires < now
            ):
                self._drop(next(iter(self._entries)))

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

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size

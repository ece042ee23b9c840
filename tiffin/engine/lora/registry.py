"""The engine's record of adapters."""

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from tiffin.engine.lora.request import LoRAModel, LoRARequest


class LoRARegistry:
    """The engine's record of adapters, the only one: those added (`add`; a server's named adapters, kept until
    removed) and a host LRU cache of the `capacity` most recently used parsed ones, which also takes adapters
    that requests name without adding them first (offline use). An adapter evicted from the cache is read
    again when a request names it.

    Engine thread only, except `load` (no mutable state) and the lookups `get`, `added` and `is_cached`, which
    any thread may call: the table of added adapters is replaced on change, never mutated."""

    def __init__(self, load: Callable[[LoRARequest], LoRAModel], capacity: int):
        self.load, self.capacity = load, capacity
        self._added: dict[int, LoRARequest] = {}
        self._cache: OrderedDict[int, LoRAModel] = OrderedDict()  # least recently used first
        self._first_read: dict[int, tuple] = {}  # lora_int_id -> (directory, identity) until removed
        self.next_int_id = 1  # above every id added so far

    def add(self, lora: LoRARequest | LoRAModel) -> bool:
        """Add and cache an adapter (loading it if given a request). False if it was cached already;
        ValueError if it cannot be served, or its id or name belongs to another adapter."""
        request = _request_of(lora)
        cached = self._cache_adapter(lora)
        if request.lora_int_id not in self._added:
            self._added = {**self._added, request.lora_int_id: request}
            self.next_int_id = max(self.next_int_id, request.lora_int_id + 1)
        return cached

    def resolve(self, lora: LoRARequest | LoRAModel) -> LoRAModel:
        """The adapter for a new request: cached (refreshed in the LRU), else loaded now (or taken as given)."""
        self._cache_adapter(lora)
        self._cache.move_to_end(_request_of(lora).lora_int_id)
        return self._cache[_request_of(lora).lora_int_id]

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests already using it run to completion. False if it was neither added nor
        cached."""
        known = self._cache.pop(lora_int_id, None) is not None or lora_int_id in self._added
        self._first_read.pop(lora_int_id, None)
        self._added = {i: r for i, r in self._added.items() if i != lora_int_id}
        return known

    def get(self, name: str) -> LoRARequest | None:
        return next((r for r in self._added.values() if r.lora_name == name), None)

    def added(self) -> list[LoRARequest]:
        return list(self._added.values())

    def is_cached(self, lora_int_id: int) -> bool:
        return lora_int_id in self._cache

    def cached_ids(self) -> set[int]:
        return set(self._cache)

    def _cache_adapter(self, lora: LoRARequest | LoRAModel) -> bool:
        """Cache the adapter unless it is; False if it was."""
        request = _request_of(lora)
        self._check_free(request)
        if request.lora_int_id in self._cache:
            return False
        model = self.load(lora) if lora is request else lora
        first = self._first_read.setdefault(model.int_id, (model.directory, model.identity))
        if first != (model.directory, model.identity):
            raise ValueError(
                f"LoRA adapter {model.name!r}: the files at {model.path} changed since it was loaded; unload it "
                f"and load it again to serve them"
            )
        self._cache[request.lora_int_id] = model
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return True

    def _check_free(self, request: LoRARequest) -> None:
        """ValueError if the request's id or name belongs to a different adapter."""
        known = [*self._added.values(), *map(_request_of, self._cache.values())]
        for other in known:
            same_path = not request.path or Path(request.path).expanduser() == Path(other.path).expanduser()
            if other.lora_int_id == request.lora_int_id and (other.lora_name != request.lora_name or not same_path):
                raise ValueError(
                    f"lora_int_id {other.lora_int_id} is already loaded as {other.name!r} from {other.path}"
                )
        for other in known:
            if other.lora_name == request.lora_name and other.lora_int_id != request.lora_int_id:
                raise ValueError(f"LoRA name {other.name!r} is already loaded with lora_int_id {other.lora_int_id}")


def _request_of(lora: LoRARequest | LoRAModel) -> LoRARequest:
    return lora if isinstance(lora, LoRARequest) else LoRARequest(lora.name, lora.int_id, lora.path)

"""A bounded thread pool for tokenizing, one per engine: long texts tokenize there, never in the event loop's
default executor (where request bodies are parsed), and the engine is not ready while a call has waited too long."""

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

# Threads that tokenize prompts, a pool of each engine's own: a long text to pool takes seconds, and in asyncio's
# default executor it would hold up what else runs there (request bodies parsed, responses encoded).
THREADS = 4
# While a tokenization has waited longer than this for a thread, the engine is not `ready` (the Bento's /readyz 503).
READY_WAIT = 10.0


class TokenizePool:
    """A bounded thread pool for tokenizing that knows how long its oldest queued call has waited."""

    def __init__(self, threads: int = THREADS):
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="tiffin-tokenize")
        self._queued: dict[int, float] = {}  # a queued call's id -> when it was queued, oldest first
        self._lock = threading.Lock()

    async def run(self, fn: Callable, *args):
        """`fn(*args)` on one of the pool's threads."""
        key, queued = object(), time.monotonic()
        with self._lock:
            self._queued[id(key)] = queued

        def call():
            with self._lock:
                self._queued.pop(id(key), None)
            return fn(*args)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        finally:
            with self._lock:
                self._queued.pop(id(key), None)  # cancelled before it started

    def waited(self) -> float:
        """Seconds the oldest call still queued has waited for a thread (0: none waits)."""
        with self._lock:
            oldest = next(iter(self._queued.values()), None)
        return 0.0 if oldest is None else time.monotonic() - oldest

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

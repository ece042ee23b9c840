"""The engine watchdog: liveness that proves progress. While the engine holds work, each step must finish within
`engine_stall_timeout` seconds; past that the engine is stalled.

`StepWatchdog` times the engine thread: `busy()` as it takes up work (each step, with the inbox batch and the
outputs around it), `idle()` as it waits for work, so an idle engine never trips it and a slow engine whose steps
each finish never does either: the timeout bounds one step, not a request. One thread per engine (not per request)
checks the age of the work in progress every quarter of the timeout (at most a second), reports it (`on_age`: the
`tiffin_engine_last_step_age_seconds` gauge) and, past the timeout, calls `trip` once per stall.

`StallHandling` is AsyncLLMEngine's side: a trip fails the requests in flight, and those still in the inbox, with
EngineStalled naming the stall, and reports the engine `dead` (the Bento's /livez and /readyz 503) while new
requests are refused. The step itself cannot be interrupted: if it ever ends, the engine thread aborts the failed
requests (freeing their KV blocks) and the engine serves again; if not, /livez stays 503 until the orchestrator
restarts the replica, as after an engine failure.

What it covers: a step wedged in Python code or in a blocking wait that releases the GIL (a lock, an event, a
socket, a collective or CUDA synchronize waiting on the device, a sleep): the watchdog thread runs meanwhile. Not
covered: a step wedged in C code that holds the GIL, which stops every Python thread, the watchdog and the HTTP
event loop with it (/livez then times out rather than answering 503, which orchestrators count as a failure too);
and the engine thread wedged outside a step while holding the engine's lock (an inbox batch), where the stall is
reported but the requests in flight are not failed."""

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tiffin.engine.errors import EngineStalled

logger = logging.getLogger(__name__)
CHECK_INTERVAL = 1.0  # seconds between checks at most; a quarter of a shorter timeout
LOCK_WAIT = 1.0  # seconds a trip waits for the engine thread's lock


class StepWatchdog:
    def __init__(
        self,
        timeout: float | None,
        trip: Callable[[float], None],
        on_age: Callable[[float], None] | None = None,
    ):
        self.timeout = timeout or None  # 0: off
        self._trip, self._on_age = trip, on_age
        self._since: float | None = None  # when the work in progress started; None: idle
        self._tripped: float | None = None  # the `_since` of the work that tripped it last
        self._stop = threading.Event()
        self.interval = min(CHECK_INTERVAL, self.timeout / 4) if self.timeout else CHECK_INTERVAL
        if self.timeout or on_age is not None:
            threading.Thread(target=self._watch, name="tiffin-watchdog", daemon=True).start()

    def busy(self) -> None:
        """The engine thread takes up work (a step, with its inbox batch): a new age starts now."""
        self._since = time.monotonic()

    def idle(self) -> None:
        """The engine thread waits for work: nothing to time."""
        self._since = None

    def age(self) -> float:
        """Seconds the work in progress has run: since the last step finished while work is held; 0 when idle."""
        since = self._since
        return 0.0 if since is None else time.monotonic() - since

    def stalled(self) -> bool:
        return self.timeout is not None and self.age() > self.timeout

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            since, age = self._since, self.age()
            if self._on_age is not None:
                try:
                    self._on_age(age)
                except Exception:
                    logger.exception("on_step_age callback failed")
            if self.timeout is not None and since is not None and age > self.timeout and since != self._tripped:
                self._tripped = since
                try:
                    self._trip(age)
                except Exception:
                    logger.exception("the engine watchdog's trip failed")


class StallHandling:
    """AsyncLLMEngine's stall handling; it holds `_lock` (taken by the engine thread around everything but
    `engine.step()`), `_active`, `_inbox` and `engine`."""

    def _init_watchdog(self, timeout: float | None, on_age: Callable[[float], None] | None) -> None:
        self._lock = threading.Lock()
        self._stalled: int | None = None  # while stalled: the requests that were in flight when it tripped
        self._orphans: list[str] = []  # failed by a trip, still in the engine until the step ends
        self._watchdog = StepWatchdog(timeout, self._trip, on_age)

    def _stall_message(self) -> str | None:
        """Why the engine is stalled, naming how long the step in progress has run; None if it is not."""
        count = self._stalled
        if count is None:
            return None
        return (
            f"engine stalled: no engine step finished for {self._watchdog.age():.1f} s (engine_stall_timeout="
            f"{self._watchdog.timeout:g} s) while {count} request{'s were' if count != 1 else ' was'} in flight"
        )

    def _trip(self, age: float) -> None:
        """Watchdog thread: fail what is in flight with EngineStalled and report the engine dead."""
        locked = self._lock.acquire(timeout=LOCK_WAIT)
        try:
            if locked and not self._watchdog.stalled():
                return  # a step finished meanwhile
            count = len(self._active) + sum(op[0] == "add" for op in list(self._inbox))
            self._stalled = count
            timeout = self._watchdog.timeout
            s = "s were" if count != 1 else " was"
            error = EngineStalled(f"no engine step finished in {timeout:g} s while {count} request{s} in flight")
            if not locked:  # the engine thread is stuck holding the lock: report the stall, touch nothing
                logger.error("engine watchdog: %s (engine_stall_timeout), outside a step: reported only", error)
                return
            logger.error("engine watchdog: %s (engine_stall_timeout); failing them", error)
            self._orphans.extend(self._active)
            for active in self._active.values():
                _call_soon(active.loop, active.stream.queue.put_nowait, error)
            self._active.clear()
            self._fail_pending(error)
        finally:
            if locked:
                self._lock.release()

    def _fail_pending(self, error: EngineStalled) -> None:
        """Settle the adds and engine calls still in the inbox with `error`; keep the rest (aborts, shutdown)."""
        kept: deque = deque()
        while self._inbox:
            op = self._inbox.popleft()
            if op[0] == "add":
                _call_soon(op[7], _fail, op[8], error)
            elif op[0] == "call":
                _call_soon(op[3], _fail, op[4], error)
            else:
                kept.append(op)
        self._inbox.extendleft(reversed(kept))

    def _wait_for_work(self, timeout: float | None = None) -> bool:
        """Engine thread: wait, idle, until there is something to do (True) or `timeout` seconds passed (False)."""
        self._watchdog.idle()
        woken = self._wakeup.wait(timeout)
        self._watchdog.busy()
        return woken

    @contextmanager
    def _stepped(self) -> Iterator[None]:
        """Engine thread, after a step: hold the lock, `_recover`, and start the next step's age."""
        with self._lock:
            self._recover()
            self._watchdog.busy()
            yield

    def _recover(self) -> None:
        """Engine thread, with the lock, after a step: if the watchdog failed requests meanwhile, abort them in the
        engine (their outputs go nowhere) and serve again."""
        if self._orphans:
            self.engine.abort_request(self._orphans)
            self._orphans.clear()
        if self._stalled is not None:
            age = self._watchdog.age()
            logger.warning("engine watchdog: the stalled step finished after %.1f s; serving again", age)
            self._stalled = None


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed
        pass


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():  # the caller was cancelled meanwhile
        future.set_exception(error)

"""The processes of a data-parallel engine's replicas (tiffin.engine.data_parallel; or their Ray actors,
tiffin.engine.ray_replicas, watched alike): started, watched, and started again when one dies.

A watcher thread waits on the replicas' processes. When one exits (killed, crashed, or its engine failed and it
stopped), the watcher starts a new process for that rank, at most `max_restarts` times within RESTART_WINDOW
seconds (a start that fails counts too, and the next try comes RETRY_DELAY later); replicas that die together are
started one after the other. A model load takes seconds, so the engine thread goes on serving with the others
meanwhile: a replacement that said it is ready waits in `ready` until the engine thread takes it in
(`DataParallelEngine._adopt`, at its next step, request or call). Failing the dead replica's requests is the engine
thread's part: it learns of the death from the pipe.

Invariants: `procs[r]` and `conns[r]` are replica r's current process and pipe, replaced only by the engine thread
(`adopt`), read by the watcher; a rank is in at most one of `restarting`, `ready` and `gave_up` (a rank leaves
`restarting` only after it entered one of the others); nothing is started once `close` began."""

import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

logger = logging.getLogger(__name__)

START_TIMEOUT = 600.0
RESTART_WINDOW = 600.0  # seconds over which `max_restarts` counts a replica's starts
RETRY_DELAY = 1.0  # seconds between a failed start and the next
POLL = 0.2  # seconds between the watcher's looks at `close` (and at processes it adopted meanwhile)


@dataclass
class Started:
    """A replica process that said it is ready, with what it said (its `info`)."""

    conn: Connection
    proc: BaseProcess
    info: dict


def exit_cause(proc) -> str:
    """How `proc` ended, in words: the signal that killed it, or its exit code (a Ray replica: its `cause`)."""
    if not isinstance(proc, BaseProcess):
        return proc.cause()
    code = proc.exitcode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def wait_ready(conn: Connection, proc: BaseProcess, rank: int, closing: threading.Event | None = None) -> dict:
    """What replica `rank`'s process sent once its engine was built; RuntimeError naming the rank if it failed, exited,
    took over START_TIMEOUT, or `closing` was set meanwhile."""
    deadline = time.monotonic() + START_TIMEOUT
    while not wait([conn, proc.sentinel], POLL):
        if closing is not None and closing.is_set():
            raise RuntimeError(f"data-parallel replica {rank}: the engine is shutting down")
        if time.monotonic() > deadline:
            raise RuntimeError(f"data-parallel replica {rank} did not start within {START_TIMEOUT:g} s")
    try:
        kind, value = conn.recv()  # once the process exited, its pipe reads what it sent, then EOF
    except (EOFError, OSError):
        proc.join(5)
        raise RuntimeError(f"data-parallel replica {rank} exited while starting ({exit_cause(proc)})") from None
    if kind == "error":
        raise RuntimeError(f"data-parallel replica {rank} failed to start: {value}")
    return value


def stop(conns: list[Connection], procs: list[BaseProcess]) -> None:
    """Ask each process to stop, kill those that do not within 10 s, close the pipes."""
    for conn in conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):  # gone already
            pass
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    for conn in conns:
        conn.close()


class Supervisor:
    def __init__(self, start: Callable[[int], tuple[Connection, BaseProcess]], num_replicas: int, max_restarts: int):
        """Start the replicas (`start(rank)`: its pipe and process, or a Ray replica's pipe and actor, the `start`
        object's `close` called once every replica stopped); `started()` waits for them."""
        self._start, self.max_restarts = start, max_restarts
        self.conns, self.procs = [], []
        try:
            for rank in range(num_replicas):
                conn, proc = start(rank)
                self.conns.append(conn)
                self.procs.append(proc)
        except BaseException:
            stop(self.conns, self.procs)
            self._close_start()
            raise
        self.restarts = [0] * num_replicas  # replacements started, per rank
        self.restarting: set[int] = set()
        self.ready: dict[int, Started] = {}  # replacements the engine thread has not taken in yet
        self.gave_up: dict[int, str] = {}  # ranks not started again, why
        self._starts = [deque() for _ in range(num_replicas)]  # monotonic times of each rank's restarts
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tiffin-dp-supervisor", daemon=True)

    def started(self) -> list[dict]:
        """Each replica's ready info, then the watcher starts; RuntimeError naming the first replica that did not
        start (every replica stopped)."""
        try:
            infos = [wait_ready(conn, proc, rank) for rank, (conn, proc) in enumerate(zip(self.conns, self.procs))]
        except BaseException:
            self.close()
            raise
        self._thread.start()
        return infos

    def adopt(self, rank: int) -> Started:
        """Take replica `rank`'s replacement (in `ready`) in place of its dead process (engine thread)."""
        new = self.ready[rank]
        self.conns[rank].close()
        self.conns[rank], self.procs[rank] = new.conn, new.proc
        del self.ready[rank]  # after the swap: a reader sees the rank ready or its new process, never neither
        return new

    def note(self, rank: int) -> str:
        """What becomes of dead replica `rank`, to follow why it died."""
        if rank in self.gave_up:
            return f"; {self.gave_up[rank]}"
        return "; restarting it" if rank in self.restarting else ""

    def will_serve(self, rank: int) -> bool:
        """Whether replica `rank` serves, or will once started again (any thread)."""
        return rank not in self.gave_up

    def _watch(self) -> None:
        while not self._closing.is_set():
            watched = {
                self.procs[r].sentinel: r
                for r in range(len(self.procs))
                if r not in self.ready and r not in self.gave_up and r not in self.restarting
            }
            if not watched:
                self._closing.wait(POLL)
                continue
            for sentinel in wait(list(watched), POLL):
                if not self._closing.is_set():
                    self._restart(watched[sentinel])

    def _restart(self, rank: int) -> None:
        """Start replica `rank` again, trying while the budget allows; `ready` or `gave_up` at the end."""
        self.restarting.add(rank)
        logger.warning("data-parallel replica %d stopped: restarting it", rank)
        starts = self._starts[rank]
        while not self._closing.is_set():
            while starts and time.monotonic() - starts[0] > RESTART_WINDOW:
                starts.popleft()
            if len(starts) >= self.max_restarts:
                within = f" within {RESTART_WINDOW:g} s" if self.max_restarts else ""
                self.gave_up[rank] = f"not restarted (data_parallel_max_restarts={self.max_restarts}{within})"
                logger.error("data-parallel replica %d %s", rank, self.gave_up[rank])
                break
            starts.append(time.monotonic())
            conn = proc = None
            try:
                conn, proc = self._start(rank)  # a Ray replica's actor may fail to start (RuntimeError)
                info = wait_ready(conn, proc, rank, self._closing)
            except RuntimeError as e:
                logger.warning("%s", e)
                if proc is not None:
                    stop([conn], [proc])
                self._closing.wait(RETRY_DELAY)
                continue
            self.restarts[rank] += 1
            self.ready[rank] = Started(conn, proc, info)
            logger.warning("data-parallel replica %d restarted (%d so far)", rank, self.restarts[rank])
            break
        self.restarting.discard(rank)

    def close(self) -> None:
        """Stop the watcher, then every replica, replacements not taken in included (also at exit)."""
        self._closing.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(30)
        ready = list(self.ready.values())
        stop(self.conns + [s.conn for s in ready], self.procs + [s.proc for s in ready])
        self._close_start()

    def _close_start(self) -> None:
        """Release what `start` holds beyond the replicas (a Ray placement group)."""
        if hasattr(self._start, "close"):
            self._start.close()

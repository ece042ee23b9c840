"""The data-parallel replicas' supervisor over stand-in replica processes (a few lines each, forked): a killed one is
started again and waits until taken in; a start that fails is retried and counted; past max_restarts it gives up,
naming why; closing stops the replacements not taken in too."""

import multiprocessing as mp
import os
import signal
import time

import pytest

from tiffin.engine import replica_supervisor
from tiffin.engine.replica_supervisor import Supervisor

pytestmark = pytest.mark.subprocess


def stand_in(conn, fail: bool) -> None:
    """A replica's process: refuses to start, or says it is ready and waits for its stop."""
    if fail:
        conn.send(("error", "no model here"))
        return
    conn.send(("ready", {"pid": os.getpid()}))
    conn.recv()


class Starts:
    """`start` for the Supervisor: each rank's starts counted, the ones listed in `failing` refusing."""

    def __init__(self, failing: set[int] = frozenset()):
        self.count, self.failing = [], set(failing)

    def __call__(self, rank: int):
        self.count.append(rank)
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=stand_in, args=(child, len(self.count) in self.failing), daemon=True)
        proc.start()
        child.close()
        return parent, proc


def until(condition, what: str) -> None:
    deadline = time.monotonic() + 30  # a hang guard, not a timing bar
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def quick_retry(monkeypatch):
    monkeypatch.setattr(replica_supervisor, "RETRY_DELAY", 0.01)


def test_a_killed_replica_is_started_again_and_taken_in():
    starts = Starts()
    sup = Supervisor(starts, 2, max_restarts=2)
    try:
        infos = sup.started()
        old = sup.procs[1]
        os.kill(old.pid, signal.SIGKILL)
        until(lambda: 1 in sup.ready, "no replacement")
        assert sup.procs[1] is old and sup.will_serve(1) and sup.restarts == [0, 1]  # not taken in yet
        new = sup.adopt(1)
        assert sup.procs[1] is new.proc and new.info["pid"] != infos[1]["pid"] and not sup.ready
        assert new.proc.is_alive() and sup.procs[0].pid == infos[0]["pid"] and starts.count == [0, 1, 1]
    finally:
        sup.close()
    assert not any(proc.is_alive() for proc in sup.procs)


def test_failed_starts_are_retried_counted_and_bounded():
    starts = Starts(failing={3})  # the first restart refuses; the second succeeds; then the budget is spent
    sup = Supervisor(starts, 2, max_restarts=2)
    try:
        sup.started()
        os.kill(sup.procs[0].pid, signal.SIGKILL)
        until(lambda: 0 in sup.ready, "no replacement")
        assert starts.count == [0, 1, 0, 0] and sup.restarts == [1, 0]
        sup.adopt(0)
        os.kill(sup.procs[0].pid, signal.SIGKILL)
        until(lambda: 0 in sup.gave_up, "restarted past its budget")
        assert starts.count == [0, 1, 0, 0] and not sup.will_serve(0) and sup.will_serve(1)
        assert sup.note(0) == "; not restarted (data_parallel_max_restarts=2 within 600 s)"
    finally:
        sup.close()


def test_close_stops_a_replacement_not_taken_in():
    sup = Supervisor(Starts(), 1, max_restarts=1)
    sup.started()
    os.kill(sup.procs[0].pid, signal.SIGKILL)
    until(lambda: 0 in sup.ready, "no replacement")
    waiting = sup.ready[0].proc
    sup.close()
    assert not waiting.is_alive()


def test_a_replica_that_cannot_start_is_named():
    with pytest.raises(RuntimeError, match="replica 1 failed to start: no model here"):
        Supervisor(Starts(failing={2}), 2, max_restarts=1).started()

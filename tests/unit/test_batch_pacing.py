"""The Batch API's worker threads leave the GIL to the event loop while they work through a large file
(tiffin.plugin.openai.batch_store.paced, nth_line). Timing-free: with the interpreter's forced GIL switches turned
off, a thread doing pure Python work lets another run only where it gives the GIL up itself."""

import sys
import threading
import time

import pytest

from tiffin.plugin.openai.batch_store import SLICE, nth_line, paced


def bystander_turns(items) -> int:
    """How many turns a bystander thread had while another thread worked through `items` (pure Python work on
    each), with forced GIL switches off."""
    turns, stop = [0], threading.Event()

    def bystander() -> None:
        while not stop.is_set():
            turns[0] += 1
            time.sleep(0.0001)

    seen = []

    def worker() -> None:
        for i, _ in enumerate(items):
            if i == 0:
                seen.append(turns[0])
            sum(range(300))  # about as long as parsing a short line
        seen.append(turns[0])

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000)
    try:
        thread = threading.Thread(target=bystander)
        thread.start()
        time.sleep(0.01)
        working = threading.Thread(target=worker)
        working.start()
        working.join()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    return seen[1] - seen[0]


def test_a_paced_thread_gives_the_gil_up_between_slices_and_an_unpaced_one_does_not():
    n = 40 * SLICE
    assert bystander_turns(range(n)) == 0  # the control: without pauses the bystander never runs
    assert bystander_turns(paced(range(n))) >= 1
    assert list(paced(range(n + 7))) == list(range(n + 7))


@pytest.mark.parametrize("n, expected", [(1, 2), (3, 5), (4, 6), (5, None)])
def test_nth_line_counts_non_blank_lines(tmp_path, n, expected):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n{}\n \n{}\n{}\n{}")  # the last line without a newline counts too
    assert nth_line(path, n) == expected

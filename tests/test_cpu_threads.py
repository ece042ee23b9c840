"""Thread sizing: CPUs from affinity and cgroup quota; the tuner follows synthetic step costs (no timing)."""

import os

import pytest

from tiffin.engine import cpu_threads
from tiffin.engine.cpu_threads import PROBE_EVERY_MAX, ThreadTuner, usable_cpus


@pytest.mark.parametrize(
    "files,want",
    [
        ({"cpu.max": "max 100000"}, None),
        ({"cpu.max": "150000 100000"}, 1),
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        ({"cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "100000"}, 1),
        ({}, None),
    ],
)
def test_usable_cpus_caps_affinity_by_cgroup_quota(tmp_path, files, want):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == (affinity if want is None else min(affinity, want))


def run(tuner, threads_now, cost_at, steps, tokens=64):
    """Feed `steps` steps whose per-token cost depends on the thread count in force."""
    for _ in range(steps):
        tuner.record(cost_at(threads_now[0]) * tokens, tokens)


@pytest.fixture
def threads_now(monkeypatch):
    monkeypatch.setenv("TIFFIN_THREAD_TUNING", "1")
    now = [0]
    monkeypatch.setattr(cpu_threads.torch, "set_num_threads", lambda n: now.__setitem__(0, n))
    return now


def test_tuner_follows_a_neighbour_down_and_back_up(threads_now):
    tuner = ThreadTuner(4)
    assert threads_now[0] == 4
    run(tuner, threads_now, lambda n: 1.0 / n, 2000)  # idle machine: more threads are faster
    assert tuner.threads == 4 and threads_now[0] == 4
    assert tuner.interval == PROBE_EVERY_MAX  # losing probes back off
    run(tuner, threads_now, lambda n: {4: 5.0, 3: 2.0, 2: 1.0, 1: 1.5}[n], 400)  # a neighbour: 2 is best
    assert tuner.threads == 2
    run(tuner, threads_now, lambda n: 1.0 / n, 400)  # it left
    assert tuner.threads == 4


def test_tuner_ignores_probes_of_another_size_and_can_be_disabled(threads_now, monkeypatch):
    tuner = ThreadTuner(2)
    for _ in range(300):  # every probe lands on a step of another size class: no verdict, count kept
        tokens = 64 if tuner.probe is None else 4096
        tuner.record((1.0 if threads_now[0] == 2 else 0.1) * tokens, tokens)
    assert tuner.threads == 2
    monkeypatch.setenv("TIFFIN_THREAD_TUNING", "0")
    tuner = ThreadTuner(2)
    run(tuner, threads_now, lambda n: float(n), 500)
    assert tuner.threads == 2 and threads_now[0] == 2

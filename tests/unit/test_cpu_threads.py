"""Thread sizing: CPUs from affinity and cgroup quota; the sizer follows a fake /proc/stat (no timing)."""

import os

import pytest

from tiffin.engine.worker import cpu_threads
from tiffin.engine.worker.cpu_threads import usable_cpus


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


class Machine:
    """A fake /proc/stat and clocks: `advance(seconds, ours, others)` moves time on with this process using
    `ours` CPUs and other processes `others` CPUs of this process's affinity mask."""

    def __init__(self, tmp_path, monkeypatch):
        self.stat, self.wall, self.own, self.busy = tmp_path / "stat", 100.0, 5.0, 7.0
        self.cpus = sorted(os.sched_getaffinity(0))
        self.threads = [0]
        monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(cpu_threads.time, "process_time", lambda: self.own)
        monkeypatch.setattr(cpu_threads.torch, "set_num_threads", lambda n: self.threads.__setitem__(0, n))
        self.write()

    def write(self):
        hz = os.sysconf("SC_CLK_TCK")
        per_cpu = round(self.busy * hz / len(self.cpus))  # busy seconds, spread over the mask's CPUs
        lines = [f"cpu  {per_cpu * len(self.cpus)} 0 0 999999 0 0 0 0 0 0"]
        lines += [f"cpu{i} {per_cpu} 0 0 {hz * 1000} 7 0 0 {hz * 50} 0 0" for i in self.cpus]  # steal: not busy
        lines += [f"cpu{max(self.cpus) + 1} {hz * 10**6} 0 0 0 0 0 0 0 0 0", "intr 1 2 3"]  # outside the mask
        self.stat.write_text("\n".join(lines) + "\n")

    def advance(self, seconds, ours, others):
        self.wall += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds
        self.write()


@pytest.fixture
def machine(tmp_path, monkeypatch):
    monkeypatch.delenv("TIFFIN_THREAD_SIZING", raising=False)
    return Machine(tmp_path, monkeypatch)


def test_sizer_follows_a_neighbour_down_and_back_up(machine):
    cpus = len(machine.cpus)
    if cpus < 2:
        pytest.skip("needs 2 CPUs in the affinity mask")
    sizer = cpu_threads.ThreadSizer(cpus, machine.stat)
    assert machine.threads[0] == cpus and sizer.enabled
    picked = set()
    for others, want in [(0.0, cpus), (0.3, cpus), (0.7, cpus - 1), (1.0, cpus - 1), (cpus, 1), (0.0, cpus)]:
        machine.advance(cpu_threads.SIZING_INTERVAL, cpus - others if others < cpus else 1, others)
        sizer.update()
        assert (sizer.threads, machine.threads[0]) == (want, want), others
        picked.add(sizer.threads)
    assert picked <= set(sizer.counts()) == set(range(1, cpus + 1))  # the counts warm-up builds oneDNN kernels at


def test_sizer_looks_only_every_interval_and_counts_no_own_time(machine):
    cpus = len(machine.cpus)
    sizer = cpu_threads.ThreadSizer(cpus, machine.stat)
    machine.advance(cpu_threads.SIZING_INTERVAL / 4, 0, cpus)  # too soon to look
    sizer.update()
    assert sizer.threads == cpus
    machine.advance(cpu_threads.SIZING_INTERVAL, cpus, 0)  # this process busy on every CPU: nobody else
    sizer.update()
    assert sizer.threads == cpus


def test_sizer_ignores_a_window_that_spans_an_idle_engine(machine):
    cpus = len(machine.cpus)
    sizer = cpu_threads.ThreadSizer(cpus, machine.stat)
    machine.advance(60.0, 0, cpus)  # no steps for a minute while another process was busy: not evidence of now
    sizer.update()
    assert sizer.threads == cpus
    machine.advance(cpu_threads.SIZING_INTERVAL, 1, cpus - 1)  # still there at the next look: followed
    sizer.update()
    assert sizer.threads == 1
    machine.advance(10 * cpu_threads.SIZING_INTERVAL, 1, 0)  # one long step, busy: it counts
    sizer.update()
    assert sizer.threads == cpus


def test_sizer_stays_within_its_ceiling_and_can_be_disabled(machine, monkeypatch):
    sizer = cpu_threads.ThreadSizer(1, machine.stat)
    machine.advance(1.0, 0, 0)
    sizer.update()
    assert sizer.threads == 1 and not sizer.enabled
    for off in [{"stat": machine.stat.parent / "missing"}, {"env": "0"}]:
        if "env" in off:
            monkeypatch.setenv("TIFFIN_THREAD_SIZING", off["env"])
        sizer = cpu_threads.ThreadSizer(2, off.get("stat", machine.stat))
        machine.advance(1.0, 0, 2.0)
        sizer.update()
        assert not sizer.enabled and sizer.threads == 2 and list(sizer.counts()) == [2]

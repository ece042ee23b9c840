"""How many threads torch may use on CPU, and keeping that count at the CPUs other processes leave free.

Torch's OpenMP threads meet at a barrier after every parallel op, so when another process takes one of their
cores, every op waits for the descheduled thread: beside one busy process two threads run slower than one.
`ThreadSizer` therefore measures how busy the CPUs this process may use are, less its own use, and runs as many
threads as that leaves free. It measures rather than probes: steps run at another thread count to compare them
cost what they lose (figures for both: benchmarks/README.md).
"""

import logging
import math
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger("tiffin.threads")

SIZING_INTERVAL = 0.5  # seconds between looks: a neighbour costs at most this long at the old count
_BUSY_FIELDS = (0, 1, 2, 5, 6)  # user, nice, system, irq, softirq of a /proc/stat cpu line; not idle, iowait, steal


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota (CFS quota of a pod).
    A fractional quota rounds down: a thread beyond it only waits to be throttled."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_cpu_quota(cgroup_root)
    return max(1, min(cpus, math.floor(quota))) if quota else cpus


def _cgroup_cpu_quota(root: Path) -> float | None:
    """CPUs' worth of time per period the cgroup grants (v2 `cpu.max`, v1 `cpu.cfs_quota_us`); None: no limit."""
    try:
        if (root / "cpu.max").exists():
            quota, period = (root / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if (root / "cpu/cpu.cfs_quota_us").exists():
            quota = int((root / "cpu/cpu.cfs_quota_us").read_text())
            return None if quota <= 0 else quota / int((root / "cpu/cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        pass
    return None


class ThreadSizer:
    """Call `update()` before each step. Every SIZING_INTERVAL it reads the busy time of the CPUs in this
    process's affinity mask (/proc/stat) and this process's own CPU time: what others used is subtracted from
    the CPUs, and the rest, rounded, is the thread count (between 1 and `max_threads`). A window that spans an
    idle engine (over two intervals, this process using under half a CPU) only starts the next; a long step
    does not. Off where /proc/stat cannot be read, or with TIFFIN_THREAD_SIZING=0."""

    def __init__(self, max_threads: int, stat: Path = Path("/proc/stat")):
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        self.stat = stat
        self.cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else set()
        self.last = self._sample()
        self.enabled = (
            self.max_threads > 1 and self.last[2] is not None and os.environ.get("TIFFIN_THREAD_SIZING", "1") != "0"
        )
        torch.set_num_threads(self.threads)

    def counts(self) -> range:
        """Every thread count `update` may pick (oneDNN builds its kernels per thread count: warm-up runs each)."""
        return range(1, self.max_threads + 1) if self.enabled else range(self.threads, self.threads + 1)

    def update(self) -> None:
        if not self.enabled or time.monotonic() - self.last[0] < SIZING_INTERVAL:
            return
        sample = self._sample()
        if sample[2] is None:
            return
        wall, own, busy = (now - then for now, then in zip(sample, self.last))
        self.last = sample
        if wall > 2 * SIZING_INTERVAL and own < wall / 2:  # the engine sat idle: that says little about now
            return
        others = max(0.0, busy - own) / wall
        threads = min(self.max_threads, max(1, math.floor(len(self.cpus) - others + 0.5)))
        if threads != self.threads:
            logger.info("tiffin: %d -> %d torch threads (other processes use %.1f CPUs)", self.threads, threads, others)
            self.threads = threads
            torch.set_num_threads(threads)

    def _sample(self) -> tuple[float, float, float | None]:
        """(wall clock, this process's CPU seconds, busy CPU seconds of its CPUs or None)."""
        wall, own = time.monotonic(), time.process_time()
        try:
            with open(self.stat) as f:
                lines = [line.split() for line in f if line.startswith("cpu")]
        except OSError:
            return wall, own, None
        ticks = sum(int(line[1 + i]) for line in lines if line[0] in self.cpus for i in _BUSY_FIELDS)
        return wall, own, ticks / os.sysconf("SC_CLK_TCK")

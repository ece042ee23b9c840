"""How many threads torch may use on CPU, and keeping that count at what currently runs steps fastest.

Torch's OpenMP threads meet at a barrier after every parallel op, so when another process takes one of their
cores, every op waits for the descheduled thread: beside one busy process, two threads on two cores run a step
slower than one thread does. `ThreadTuner` therefore times steps and now and then runs one at a neighbouring
thread count (one fewer, or one more up to the CPUs this process may use), moving there when it is clearly
faster per token; a neighbour that comes and goes is followed both ways. It is opt-in (TIFFIN_THREAD_TUNING=1):
on an idle 2-core Intel AMX machine its probes cost W64 bf16 throughput 755 -> 553 output tok/s.
"""

import logging
import math
import os
import statistics
from collections import deque
from pathlib import Path

import torch

logger = logging.getLogger("tiffin.threads")

# Steps at the current count before the next probe: short after a change, doubling while probes lose, so that
# on a steady machine the worse count costs PROBE_STEPS / PROBE_EVERY_MAX of the steps.
PROBE_EVERY_MIN, PROBE_EVERY_MAX = 4, 512  # early: under contention the first steps are the costliest
PROBE_STEPS = 2
HISTORY = 8  # recent steps of a size class that a probe is compared with
MARGIN = 0.9  # a probe must cost under this fraction of the current per-token time to take over


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


class ThreadTuner:
    """Call `record(seconds, tokens)` after every step. Steps are compared per token and only within a size
    class (log2 of the tokens), so a prefill step is never measured against decode steps."""

    def __init__(self, max_threads: int):
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        self.enabled = self.max_threads > 1 and os.environ.get("TIFFIN_THREAD_TUNING", "0") == "1"
        self.history: dict[int, deque] = {}  # size class -> per-token seconds at self.threads
        self.steps = 0
        self.interval = PROBE_EVERY_MIN
        self.probe: int | None = None  # thread count under trial
        self.probe_size = 0
        self.probe_costs: list[float] = []
        self.probes = 0
        torch.set_num_threads(self.threads)

    def record(self, seconds: float, tokens: int) -> None:
        if not self.enabled:
            return
        size, cost = tokens.bit_length(), seconds / tokens
        if self.probe is not None:
            if size != self.probe_size:  # the batch changed shape under the trial: no verdict
                self.probe = None
                torch.set_num_threads(self.threads)
            else:
                self.probe_costs.append(cost)
                if len(self.probe_costs) == PROBE_STEPS:
                    self._decide()
            return
        history = self.history.setdefault(size, deque(maxlen=HISTORY))
        history.append(cost)
        self.steps += 1
        if self.steps >= self.interval and len(history) >= HISTORY // 2:
            self.steps = 0
            self.probes += 1
            # down from the top, up from the bottom, otherwise alternate
            down = self.threads == self.max_threads or (self.threads > 1 and self.probes % 2)
            self.probe, self.probe_costs, self.probe_size = self.threads + (-1 if down else 1), [], size
            torch.set_num_threads(self.probe)

    def _decide(self) -> None:
        current = statistics.median(self.history[self.probe_size])
        trial = statistics.fmean(self.probe_costs)
        if trial < MARGIN * current:
            logger.info(
                "tiffin: %d -> %d torch threads (%.0f%% less time per token)",
                self.threads,
                self.probe,
                100 * (1 - trial / current),
            )
            self.threads = self.probe
            self.history.clear()
            self.interval = PROBE_EVERY_MIN
        else:
            self.interval = min(2 * self.interval, PROBE_EVERY_MAX)
        self.probe = None
        torch.set_num_threads(self.threads)

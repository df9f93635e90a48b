"""The machine a benchmark runs on: usable cores, and the CPU other processes take meanwhile.

A benchmark on a shared machine measures the other jobs as much as the model. The machine's CPU
time comes from ``/proc/stat``; the benchmark's own (this process and its ranks, alive or not yet
started) from ``/proc/<pid>/stat``; the difference is what others used. Linux only: elsewhere the
load reads as unknown (``nan``), and the report says so.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

_PROC = Path("/proc")
# The kernel counts CPU time in ticks of 10 ms (USER_HZ = 100): a window shorter than this holds
# too few ticks for a share of its own (it still counts toward the total).
_MIN_WINDOW_S = 0.5


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota. Local."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            # A quota of 1.5 CPUs throttles a second busy thread: count whole CPUs only.
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def _machine_busy_s() -> float | None:
    """CPU seconds every CPU of the machine spent busy since boot, or ``None`` without /proc."""
    try:
        fields = [int(x) for x in (_PROC / "stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already in user


def _process_cpu_s(pid: int) -> float | None:
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ")".
    rest = text.rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


#: Share of the machine's CPUs other processes may use before the bench and the advisor withhold
#: their verdict: at 10 % a 2-core machine already lends a fifth of a core to someone else.
MAX_LOAD = 0.10


def trust_line(load: float, max_load: float = MAX_LOAD) -> str:
    """What a figure or a report says about the machine it was measured on."""
    if math.isnan(load):
        return "confidence: unknown (the machine's load from other processes was not measured)"
    if load > max_load:
        return (
            f"confidence: low: other processes used {load:.0%} of this machine's CPUs while it measured "
            f"(more than {max_load:.0%}); measure again on an idle machine"
        )
    return f"confidence: measured on an idle machine (other processes used {load:.0%} of its CPUs)"


class LoadMeter:
    """Measure the share of the machine's CPUs that processes other than ours use.

    ``own_pids()`` names our processes at each reading (this one and every rank). A process first
    seen at the end of a window counts from zero, so ranks started inside a window are ours too.
    """

    def __init__(self, own_pids: Callable[[], Iterable[int]]) -> None:
        self.own_pids = own_pids
        self.cpus = os.cpu_count() or 1
        self.available = _machine_busy_s() is not None
        self.before = math.nan
        self.worst = math.nan
        self._foreign_s = 0.0
        self._wall_s = 0.0
        self._start: tuple[float, float, dict[int, float]] | None = None

    def _reading(self) -> tuple[float, float, dict[int, float]]:
        own = {}
        for pid in {os.getpid(), *self.own_pids()}:
            cpu = _process_cpu_s(pid)
            if cpu is not None:
                own[pid] = cpu
        return time.monotonic(), _machine_busy_s() or 0.0, own

    def _share(self, start: tuple[float, float, dict[int, float]]) -> tuple[float, float]:
        wall0, busy0, own0 = start
        wall1, busy1, own1 = self._reading()
        own = sum(cpu - own0.get(pid, 0.0) for pid, cpu in own1.items())
        foreign_s = max(0.0, busy1 - busy0 - own)
        return foreign_s, max(wall1 - wall0, 1e-9)

    def sample_before(self, duration_s: float) -> float:
        """Watch the machine for ``duration_s`` seconds while we are idle; the foreign share."""
        if not self.available:
            return math.nan
        start = self._reading()
        time.sleep(duration_s)
        foreign_s, wall_s = self._share(start)
        self.before = min(1.0, foreign_s / (wall_s * self.cpus))
        return self.before

    def start(self) -> None:
        """Open a window (one measured run)."""
        if self.available:
            self._start = self._reading()

    def stop(self) -> float:
        """Close the window; the share of the CPUs others used during it.

        ``nan`` when unknown, or when the window was too short to tell (under half a second).
        """
        if not self.available or self._start is None:
            return math.nan
        foreign_s, wall_s = self._share(self._start)
        self._start = None
        self._foreign_s += foreign_s
        self._wall_s += wall_s
        if wall_s < _MIN_WINDOW_S:
            return math.nan
        share = min(1.0, foreign_s / (wall_s * self.cpus))
        self.worst = share if math.isnan(self.worst) else max(self.worst, share)
        return share

    @property
    def during(self) -> float:
        """The foreign share over every window so far (``nan`` if unknown or none)."""
        if not self.available or self._wall_s == 0:
            return math.nan
        return min(1.0, self._foreign_s / (self._wall_s * self.cpus))

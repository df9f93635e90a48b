"""Which rank holds the job back, and in which phase of the step: :class:`StepTimer` (each rank's
time per phase, about a microsecond a step) and :class:`StragglerDetector` (the ranks' sums of a
logging window compared, a rank named when it is consistently slower than the median rank).

In a synchronous data-parallel job every rank's step takes as long as the slowest rank's: the fast
ranks wait for it in the gradient reduction. So a straggler shows as *more* time in one of its own
phases (waiting for data, forward, optimizer) than the median rank, while the others show more time
in the phase that holds the reduction. That phase is timed and reported, but nobody is named for it.

Timings are host times (``time.perf_counter``), with no device synchronisation: on CUDA a phase
measures how long the host took to launch its work, plus any wait the host did (a ``.item()``, a
full launch queue). See ``docs/scaling.md``, "Stragglers".
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from distkit import runtime
from distkit.collectives import all_reduce

__all__ = ["PHASES", "WAIT_PHASE", "StepTimer", "Straggler", "StragglerDetector"]

PHASES: tuple[str, ...] = ("data", "forward", "backward", "optimizer")
"""The phases of a step, in the order of :attr:`StepTimer.sums`."""

WAIT_PHASE = "backward"
"""The phase that holds the gradient reduction (DDP's all-reduce finishes at the end of backward):
where the fast ranks wait for a straggler, so a rank is never named for it."""

_INDEX = {name: i for i, name in enumerate(PHASES)}


class StepTimer:
    """Time each phase of a step on this rank. Local: no communication.

    Call :meth:`lap` at the end of each phase: the time since the previous lap (or :meth:`start`)
    goes to that phase. A lap costs about 0.2 us (one ``perf_counter`` and an addition).

    Example:
        >>> import distkit
        >>> timer = distkit.StepTimer()
        >>> timer.start()
        >>> for step in range(3):
        ...     batch = [1.0, 2.0]        # next(iterator)
        ...     timer.lap("data")
        ...     loss = sum(batch)         # model(batch), loss_fn(...)
        ...     timer.lap("forward")
        ...     timer.lap("backward")     # loss.backward(): DDP's all-reduce ends here
        ...     timer.lap("optimizer")    # optimizer.step(), zero_grad()
        ...     timer.step()
        >>> timer.steps
        3
    """

    def __init__(self) -> None:
        self.sums: list[float] = [0.0] * len(PHASES)
        """Seconds per phase (in the order of :data:`PHASES`) since the last :meth:`reset`."""
        self.steps = 0
        """Steps counted by :meth:`step` since the last :meth:`reset`."""
        self._mark = time.perf_counter()

    def start(self) -> None:
        """Start timing from now (the time before is no phase's: set-up, validation, logging)."""
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Add the time since the last lap (or :meth:`start`) to ``phase``, one of :data:`PHASES`."""
        now = time.perf_counter()
        try:
            self.sums[_INDEX[phase]] += now - self._mark
        except KeyError:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}.") from None
        self._mark = now

    def step(self) -> None:
        """Count one optimizer step."""
        self.steps += 1

    def reset(self) -> None:
        """Zero the sums and the step count (a new window)."""
        self.sums[:] = [0.0] * len(PHASES)  # in place: a loop may hold the list
        self.steps = 0


@dataclass(frozen=True)
class Straggler:
    """A rank consistently slower than the median rank in one phase."""

    rank: int
    phase: str
    # Per step, in the latest window: this rank's time in the phase, and the median rank's.
    seconds: float
    median_s: float
    # Consecutive windows in which this rank was slow in this phase.
    windows: int

    @property
    def slowdown(self) -> float:
        """``seconds / median_s`` (``inf`` when the median rank spent no time in the phase)."""
        return self.seconds / self.median_s if self.median_s > 0 else float("inf")

    def message(self) -> str:
        """One line for the log."""
        return (
            f"straggler: rank {self.rank} is slow in '{self.phase}': {self.seconds * 1e3:.2f} ms a step "
            f"against {self.median_s * 1e3:.2f} ms for the median rank ({self.slowdown:.2f}x), "
            f"{self.windows} logging windows in a row"
        )


class StragglerDetector:
    """Name the rank that is consistently slower than the median rank in one phase.

    A rank is *slow* in a phase in a window when its time in that phase exceeds the median rank's by
    more than ``margin`` (a fraction of the median) and by more than ``min_excess_s`` per step; it
    is *named* once it was slow in the same phase in ``windows`` consecutive windows. Of several,
    the one with the largest excess is named. :data:`WAIT_PHASE` never names a rank (the fast ranks
    wait there for the slow one). A job of one process names nobody.

    :meth:`observe` is local (it takes every rank's sums); :meth:`check` is the collective a hand
    loop calls at its logging steps.

    Args:
        margin: How much slower than the median rank counts as slow (0.2: 20% slower).
        windows: Consecutive windows a rank must be slow in, in the same phase, to be named.
        min_excess_s: Excess per step below which a rank is not slow whatever the ratio: 1 ms,
            above what a descheduled process adds to a short window on a loaded host, so that a
            balanced job's logged metrics stay free of spurious names.

    Raises:
        ValueError: ``margin`` is negative, ``windows`` < 1 or ``min_excess_s`` negative.

    Example:
        >>> import distkit
        >>> detector = distkit.StragglerDetector(margin=0.2, windows=2)
        >>> fast, slow = [0.010, 0.020, 0.060, 0.005], [0.050, 0.020, 0.020, 0.005]
        >>> detector.observe([fast, slow], steps=10) is None  # the first window
        True
        >>> detector.observe([fast, slow], steps=10).rank
        1
    """

    def __init__(self, *, margin: float = 0.2, windows: int = 3, min_excess_s: float = 1e-3) -> None:
        if not margin >= 0:
            raise ValueError(f"margin must be >= 0, got {margin!r}.")
        if windows < 1:
            raise ValueError(f"windows must be >= 1, got {windows!r}.")
        if not min_excess_s >= 0:
            raise ValueError(f"min_excess_s must be >= 0, got {min_excess_s!r}.")
        self.margin = margin
        self.windows = windows
        self.min_excess_s = min_excess_s
        # (rank, phase index) -> consecutive slow windows.
        self._streaks: dict[tuple[int, int], int] = {}
        self.totals: list[list[float]] = []
        """Every rank's seconds per phase over all the windows observed (rows: ranks)."""
        self.total_steps = 0
        """Steps over all the windows observed."""

    def observe(self, per_rank: Sequence[Sequence[float]], *, steps: int) -> Straggler | None:
        """Take one window's sums (one row per rank, phases in the order of :data:`PHASES`).

        Local: no communication; every rank given the same sums decides alike.

        Args:
            per_rank: Each rank's seconds per phase over the window.
            steps: Steps in the window (the same on every rank).

        Returns:
            The straggler named after this window, or ``None``.
        """
        if not self.totals:
            self.totals = [[0.0] * len(PHASES) for _ in per_rank]
        for total, row in zip(self.totals, per_rank, strict=True):
            for i, value in enumerate(row):
                total[i] += value
        self.total_steps += steps
        if len(per_rank) < 2 or steps < 1:
            return None
        slow: dict[tuple[int, int], tuple[float, float, float]] = {}
        for p, name in enumerate(PHASES):
            if name == WAIT_PHASE:
                continue
            times = [row[p] / steps for row in per_rank]
            median = statistics.median(times)
            for rank, t in enumerate(times):
                if t > median * (1 + self.margin) and t - median > self.min_excess_s:
                    slow[(rank, p)] = (t - median, t, median)
        self._streaks = {key: self._streaks.get(key, 0) + 1 for key in slow}
        named = [key for key, streak in self._streaks.items() if streak >= self.windows]
        if not named:
            return None
        rank, p = max(named, key=lambda key: slow[key][0])
        _, seconds, median = slow[(rank, p)]
        return Straggler(rank, PHASES[p], seconds, median, self._streaks[(rank, p)])

    def check(self, timer: StepTimer) -> Straggler | None:
        """Gather every rank's ``timer`` sums, :meth:`observe` them, and reset ``timer``.

        Collective: call on every rank at the same steps (one ``all_reduce`` of
        ``world_size * 4`` numbers). Without a process group, it names nobody.

        Args:
            timer: This rank's timer over the window.

        Returns:
            The straggler named after this window (the same on every rank), or ``None``.
        """
        world, rank = runtime.get_world_size(), runtime.get_rank()
        slots = torch.zeros(world * len(PHASES), dtype=torch.float64)
        slots[rank * len(PHASES) : (rank + 1) * len(PHASES)] = torch.tensor(timer.sums, dtype=torch.float64)
        if world > 1:
            slots = all_reduce(slots)
        steps = timer.steps
        timer.reset()
        return self.observe(slots.view(world, len(PHASES)).tolist(), steps=steps)

    def summary(self) -> str:
        """The phases over every window observed: the median rank's time per step and the slowest rank's."""
        if not self.totals or not self.total_steps:
            return "profile: no step was timed"
        steps = self.total_steps
        lines = [f"profile ({steps} steps, {len(self.totals)} ranks; ms per step, host time):"]
        lines.append(f"  {'phase':<10} {'median':>9} {'slowest':>9}  rank")
        for p, name in enumerate(PHASES):
            times = [row[p] / steps * 1e3 for row in self.totals]
            worst = max(range(len(times)), key=times.__getitem__)
            lines.append(f"  {name:<10} {statistics.median(times):9.3f} {times[worst]:9.3f}  {worst}")
        return "\n".join(lines)

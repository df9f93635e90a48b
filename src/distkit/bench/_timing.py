"""How many times to repeat a measured operation, agreed by every rank."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from distkit import collectives

# Three runs give a median that one descheduled run cannot skew.
_CALIBRATION_RUNS = 3
# A bound on a degenerate estimate (an operation that takes no measurable time).
_MAX_RUNS = 100_000


def sync(device: torch.device) -> None:
    """Wait for ``device`` (CUDA runs asynchronously); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agreed_count(run: Callable[[], object], minimum: int, min_time_s: float, device: torch.device) -> int:
    """How many runs of ``run`` fill ``min_time_s`` seconds, and at least ``minimum``.

    Collective: every rank of the current group calls it with the same ``run`` at the same point
    (``run`` may itself be collective), and every rank gets rank 0's answer, so collectives inside
    the measured loops stay matched. A scheduler time slice is several milliseconds, so a
    measurement must span far more than that to be stable on a shared machine; counting steps
    alone would give a 1 ms model only tens of milliseconds.
    """
    if min_time_s <= 0:
        return minimum
    times = []
    for _ in range(_CALIBRATION_RUNS):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    estimate = statistics.median(times)
    wanted = _MAX_RUNS if estimate <= 0 else max(minimum, math.ceil(min_time_s / estimate))
    return int(collectives.broadcast_object(min(wanted, _MAX_RUNS)))

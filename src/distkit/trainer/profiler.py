"""``Trainer(profiler=...)``: ``"simple"`` (a per-phase summary at the end of ``fit``, from the
straggler report's phase times: :mod:`distkit.stragglers`) or :class:`TorchProfiler` (one Chrome
trace per rank of a window of optimizer steps, through ``torch.profiler``). See docs/scaling.md,
"Profiling"."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distkit import runtime
from distkit.trainer.callbacks import Callback, TrainerView

__all__ = ["TorchProfiler"]


@dataclass(frozen=True)
class TorchProfiler:
    """Profile a window of optimizer steps with ``torch.profiler``; one Chrome trace per rank.

    The steps of ``fit`` are counted from its first (a resumed fit counts from where it resumed):
    ``wait`` steps are skipped, ``warmup`` steps profiled and thrown away (the profiler's own
    start-up), then ``active`` steps recorded and written, ``repeat`` times. Each rank writes
    ``rank{R}.steps{A}-{B}.pt.trace.json`` under ``dir`` (A, B: the first and last global step of
    the window, 1-based as ``trainer.global_step`` counts), whatever launched it; a fit that ends
    inside a window writes what it recorded.

    Local: each rank profiles itself, no communication.

    Args:
        wait: Steps skipped before each window.
        warmup: Steps profiled and discarded before each window.
        active: Steps recorded in each window.
        repeat: Windows (0: until ``fit`` ends).
        dir: Where the traces go; ``None``: ``<default_root_dir>/profiler``.
        record_shapes: Record the inputs' shapes of each operator.
        profile_memory: Record tensor allocations.
        with_stack: Record the Python stack of each operator (large files).

    Raises:
        ValueError: A count is negative, or ``active`` < 1.

    Example:
        >>> from distkit.trainer import TorchProfiler
        >>> TorchProfiler(wait=1, warmup=1, active=3, dir="runs/profile").active
        3
    """

    wait: int = 1
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    dir: str | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False

    def __post_init__(self) -> None:
        for name in ("wait", "warmup", "repeat"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"TorchProfiler({name}=...) must be an int >= 0, got {value!r}.")
        if not isinstance(self.active, int) or self.active < 1:
            raise ValueError(f"TorchProfiler(active=...) must be an int >= 1, got {self.active!r}.")


def check_profiler(profiler: object) -> str | TorchProfiler | None:
    """``profiler`` as the Trainer keeps it (``"torch"``: a :class:`TorchProfiler` of defaults)."""
    if profiler is None or isinstance(profiler, TorchProfiler):
        return profiler
    if profiler == "simple":
        return profiler
    if profiler == "torch":
        return TorchProfiler()
    meant = " Did you mean TorchProfiler()?" if profiler is TorchProfiler else ""  # the class
    raise ValueError(
        f"profiler must be None, 'simple', 'torch' or a distkit.trainer.TorchProfiler, got "
        f"{profiler!r}.{meant}"
    )


class _TorchProfilerCallback(Callback):
    """Runs a :class:`TorchProfiler` during ``fit``: started at its start, stepped after each
    optimizer step, stopped at its end (or when ``fit`` fails: :meth:`close`)."""

    def __init__(self, options: TorchProfiler, default_dir: Path) -> None:
        self.options = options
        self.dir = Path(options.dir) if options.dir is not None else default_dir / "profiler"
        self._profiler: Any = None
        self._offset = 0

    def on_fit_start(self, trainer: TrainerView) -> None:
        o = self.options
        self.dir.mkdir(parents=True, exist_ok=True)
        self._offset = trainer.global_step
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=o.wait, warmup=o.warmup, active=o.active, repeat=o.repeat),
            on_trace_ready=self._write,
            record_shapes=o.record_shapes,
            profile_memory=o.profile_memory,
            with_stack=o.with_stack,
        )
        self._profiler.start()

    def on_train_step_end(self, trainer: TrainerView, loss: torch.Tensor) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def on_fit_end(self, trainer: TrainerView) -> None:
        self.close()

    def close(self) -> None:
        """Stop the profiler (writing a window in progress); nothing when it is not running."""
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()

    def _write(self, profiler: Any) -> None:
        # step_num: the steps stepped so far; the window ends at the last of them (a window cut
        # short by the end of fit ends at the last step taken) and starts where the schedule's
        # cycle (wait, warmup, active) of that step put its first active step.
        o = self.options
        cycle = o.wait + o.warmup + o.active
        last = self._offset + profiler.step_num
        first = self._offset + (profiler.step_num - 1) // cycle * cycle + o.wait + o.warmup + 1
        path = self.dir / f"rank{runtime.get_rank()}.steps{first}-{last}.pt.trace.json"
        profiler.export_chrome_trace(os.fspath(path))

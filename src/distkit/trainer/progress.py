"""Progress on the main process: a tqdm bar in a terminal, plain lines in a log file (SLURM, CI,
``| tee``), never bar frames there. Local: no collective; other ranks print nothing."""

from __future__ import annotations

import datetime
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import torch

from distkit.trainer.callbacks import Callback, TrainerView

__all__ = ["ProgressLog"]


class ProgressLog(Callback):
    """Plain progress lines for logs that are not a terminal (SLURM, CI, ``| tee``): no bar frames.

    Local: the main process writes, the other ranks do nothing, and no collective is added. One
    line, flushed, every ``every_n_steps`` optimizer steps and/or once ``interval_s`` seconds
    have passed since the previous line (the clock is read after as many steps as take about a
    twentieth of ``interval_s``, at most 64: a line by time comes that much late at most, while
    the step rate holds); one at the end of every epoch with the epoch's metrics (``train_loss_epoch``,
    ``val_loss``, ...), one after each mid-epoch validation, and one when ``fit`` ends::

        step 1200/33748 | epoch 0 | loss 3.2150 | 983.0 samples/s | elapsed 0:20:01 | ETA 9:03:10
        step 1210/33748 | epoch 0 | loss 3.2088 (rank 0) | 990.2 samples/s | elapsed 0:20:11 | ETA 9:02:49
        epoch 0 end | step 33748/33748 | val_loss 2.9514 | train_loss_epoch 2.9021 | elapsed 9:23:07

    ``loss`` is the job's mean over the ranks when the line falls on a logging step
    (``Trainer(log_every_n_steps=...)``; the line waits for that step's reduction), else the main
    process's own mean since the last logging step, marked ``(rank 0)`` when there are several
    processes. ``samples/s`` counts the whole job (``trainer.effective_batch_size`` per step) since
    the previous line or the epoch's start. ``ETA`` is the steps left to ``trainer.total_steps``
    (``max_steps`` or ``max_epochs x steps_per_epoch``, whichever ends first) times the mean wall
    time per step since ``fit`` started (or resumed), validation and checkpoints included.

    The Trainer adds one on the main process when ``enable_progress_bar`` is ``None`` (the default)
    and stderr is not a terminal (or tqdm is not installed), unless ``callbacks`` hold one; in a
    terminal it shows the tqdm bar instead. Pass your own to change the rhythm or the stream.

    Args:
        every_n_steps: A line at every step that is a multiple of this; ``None``: by time only.
        interval_s: A line when this many seconds have passed since the previous one; ``None``:
            by steps only.
        stream: Where lines go: a text stream with ``write`` and ``flush``; ``None`` is
            ``sys.stderr`` (looked up at each line, so redirections apply).

    Raises:
        ValueError: Both ``every_n_steps`` and ``interval_s`` are ``None``, or one is not positive.

    Example:
        >>> import distkit
        >>> from distkit.trainer import ProgressLog
        >>> trainer = distkit.Trainer(callbacks=[ProgressLog(every_n_steps=100, interval_s=None)],
        ...                           max_epochs=1)
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        interval_s: float | None = 30.0,
        *,
        stream: TextIO | None = None,
    ) -> None:
        if every_n_steps is None and interval_s is None:
            raise ValueError(
                "ProgressLog needs every_n_steps or interval_s (or both), got None for both; e.g. "
                "ProgressLog(interval_s=30.0)."
            )
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1
        ):
            raise ValueError(f"every_n_steps must be an int >= 1 or None, got {every_n_steps!r}.")
        if interval_s is not None and (
            isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s > 0
        ):
            raise ValueError(f"interval_s must be a number of seconds > 0 or None, got {interval_s!r}.")
        self.every_n_steps = every_n_steps
        self.interval_s = None if interval_s is None else float(interval_s)
        self.stream = stream
        self._reset()

    def _reset(self) -> None:
        # Set by on_fit_start; until then (and on the other ranks) nothing is ever due.
        self._main = False
        self._next_step: float = math.inf
        self._next_time = math.inf
        self._start_time = 0.0
        self._start_step = 0
        # Where samples/s counts from: the previous line, or the epoch's start.
        self._rate_time = 0.0
        self._rate_step = 0
        # The step of the latest reduced training loss (on_log), and a line waiting for it.
        self._logged_step = -1
        self._logged_loss = math.nan
        self._waiting_step = -1
        # The latest clock read after a step, and the steps to let pass before the next one.
        self._read_time = 0.0
        self._read_step = 0
        self._stride = 1

    def __getstate__(self) -> dict[str, Any]:
        # fit() may send its callbacks to the processes it starts: the standard streams travel by name.
        state = dict(self.__dict__)
        if self.stream is sys.stdout:
            state["stream"] = "stdout"
        elif self.stream is sys.stderr:
            state["stream"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state.get("stream") == "stdout":
            state["stream"] = sys.stdout
        self.__dict__.update(state)

    def on_fit_start(self, trainer: TrainerView) -> None:
        self._reset()
        self._main = trainer.is_main_process
        if not self._main:
            return
        now = time.monotonic()
        step = trainer.global_step
        self._start_time, self._start_step = now, step
        self._rate_time, self._rate_step = now, step
        self._read_time, self._read_step = now, step
        if self.every_n_steps is not None:
            self._next_step = (step // self.every_n_steps + 1) * self.every_n_steps
        if self.interval_s is not None:
            self._next_time = now + self.interval_s

    def on_train_epoch_start(self, trainer: TrainerView) -> None:
        if self._main:  # samples/s of training only, not of the validation before this epoch
            self._rate_time, self._rate_step = time.monotonic(), trainer.global_step

    def on_train_step_end(self, trainer: TrainerView, loss: torch.Tensor) -> None:
        # The Trainer calls it at the steps _next_step_end names; called at every step, it prints the same.
        step = trainer.global_step
        if step < self._next_step and (not self._main or not self._time_is_due(step)):
            return
        if self.every_n_steps is not None:
            self._next_step = (step // self.every_n_steps + 1) * self.every_n_steps
        if trainer.log_pending:
            # A logging step whose reduction comes after the step-end callbacks: print with it.
            self._waiting_step = step
            return
        self._print_step(trainer)

    def _next_step_end(self, trainer: TrainerView) -> float:
        """The next step whose end may print: the next multiple of ``every_n_steps``, or sooner the
        step of the next clock read (main process). The Trainer calls :meth:`on_train_step_end`
        there, not at the steps between."""
        if not self._main or self.interval_s is None:
            return self._next_step
        return min(self._next_step, trainer.global_step + self._stride)

    def _time_is_due(self, step: int) -> bool:
        """Whether ``interval_s`` has passed since the previous line; sets from the step rate since
        the previous read how many steps pass before the next (about ``interval_s / 20``, 1 to 64)."""
        if self.interval_s is None:
            return False
        now = time.monotonic()
        if step > self._read_step and now > self._read_time:
            per_step = (now - self._read_time) / (step - self._read_step)
            self._stride = max(1, min(_MAX_STRIDE, int(self.interval_s / 20 / per_step)))
        self._read_time, self._read_step = now, step
        return now >= self._next_time

    def on_log(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        if not self._main:
            return
        self._logged_step, self._logged_loss = trainer.global_step, metrics.get("train_loss", math.nan)
        if self._waiting_step == trainer.global_step:
            self._print_step(trainer)

    def on_validation_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        # At an epoch's end the epoch line carries these metrics (they come with train_loss_epoch).
        if self._main and "train_loss_epoch" not in metrics:
            parts = ["validation", *self._position(trainer), *_metric_parts(metrics)]
            self._write(trainer, parts, time.monotonic())

    def on_train_epoch_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        if self._main:
            total = trainer.total_steps
            step = f"step {trainer.global_step}" + (f"/{total}" if total else "")
            parts = [f"epoch {trainer.current_epoch} end", step, *_metric_parts(metrics)]
            self._write(trainer, parts, time.monotonic())

    def on_fit_end(self, trainer: TrainerView) -> None:
        if self._main:
            now = time.monotonic()
            self._emit(f"fit ended at step {trainer.global_step} after {_duration(now - self._start_time)}")

    def _position(self, trainer: TrainerView) -> list[str]:
        total = trainer.total_steps
        return [
            f"step {trainer.global_step}" + (f"/{total}" if total else ""),
            f"epoch {trainer.current_epoch}",
        ]

    def _print_step(self, trainer: TrainerView) -> None:
        now = time.monotonic()
        step = trainer.global_step
        self._waiting_step = -1
        if self._logged_step == step:
            loss = f"loss {self._logged_loss:.4f}"
        elif trainer.running_loss is not None:
            where = " (rank 0)" if trainer.world_size > 1 else ""
            loss = f"loss {trainer.running_loss:.4f}{where}"
        else:
            loss = "loss n/a"  # every step since the last logging step was skipped (non-finite)
        parts = [*self._position(trainer), loss]
        if now > self._rate_time and step > self._rate_step:
            rate = (step - self._rate_step) * trainer.effective_batch_size / (now - self._rate_time)
            parts.append(f"{rate:,.1f} samples/s")
        self._rate_time, self._rate_step = now, step
        if self.interval_s is not None:
            self._next_time = now + self.interval_s
        self._write(trainer, parts, now)

    def _write(self, trainer: TrainerView, parts: list[str], now: float) -> None:
        parts.append(f"elapsed {_duration(now - self._start_time)}")
        total, done = trainer.total_steps, trainer.global_step - self._start_step
        if total is None:
            parts.append("no ETA (a stream of unknown length: max_steps gives one)")
        elif total and done > 0 and trainer.global_step < total:
            parts.append(f"ETA {_duration((total - trainer.global_step) * (now - self._start_time) / done)}")
        self._emit(" | ".join(parts))

    def _emit(self, line: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        stream.write(line + "\n")
        stream.flush()


# The most steps between two clock reads of a ProgressLog by time: how late a line may come when
# the steps slow down at once (a line falls due at most this many of the slower steps late).
_MAX_STRIDE = 64
# How often the tqdm bar moves at most: a step's end that moves it reads the clock, and the bar
# is moved again after as many steps as took this long (tqdm redraws at most every 0.1 s).
_BAR_REFRESH_S = 0.05


def _metric_parts(metrics: Mapping[str, float]) -> list[str]:
    return [
        f"{name} {value:.4f}" if "loss" in name else f"{name} {value:.4g}"
        for name, value in metrics.items()
        if name not in ("epoch", "skipped_steps")
    ]


def _duration(seconds: float) -> str:
    """``H:MM:SS`` (``1 day, H:MM:SS`` past a day)."""
    return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))


class _ProgressBar(Callback):
    """A tqdm bar per epoch on the main process, showing the latest logged losses and accuracies."""

    def __init__(self) -> None:
        self._bar: Any = None
        # The global step the bar shows, when it was shown, and the steps to let pass before the
        # next update (_next_step_end): about _BAR_REFRESH_S of steps, 1 to _MAX_STRIDE.
        self._shown_step = 0
        self._shown_time = 0.0
        self._stride = 1

    def on_train_epoch_start(self, trainer: TrainerView) -> None:
        from tqdm.auto import tqdm

        done = -(-trainer.batches_in_epoch // trainer.accumulate_grad_batches)
        self._bar = tqdm(
            total=trainer.steps_per_epoch,
            initial=done,
            desc=f"epoch {trainer.current_epoch}",
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self._shown_step, self._shown_time, self._stride = trainer.global_step, time.monotonic(), 1

    def on_train_step_end(self, trainer: TrainerView, loss: torch.Tensor) -> None:
        # The Trainer calls it at the steps _next_step_end names; called at every step, it shows the same.
        self._catch_up(trainer)

    def _next_step_end(self, trainer: TrainerView) -> float:
        """The next step at whose end the bar moves (the steps since its last update at once)."""
        return math.inf if self._bar is None else trainer.global_step + self._stride

    def _catch_up(self, trainer: TrainerView) -> None:
        """Move the bar to ``trainer.global_step``."""
        step = trainer.global_step
        if self._bar is None or step <= self._shown_step:
            return
        now = time.monotonic()
        per_step = (now - self._shown_time) / (step - self._shown_step)
        self._stride = max(1, min(_MAX_STRIDE, int(_BAR_REFRESH_S / per_step))) if per_step > 0 else 1
        self._bar.update(step - self._shown_step)
        self._shown_step, self._shown_time = step, now

    def on_log(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        self._catch_up(trainer)
        self._show(metrics)

    def on_train_epoch_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        self._catch_up(trainer)
        self._show(metrics)
        self.close()

    def on_fit_end(self, trainer: TrainerView) -> None:
        self.close()

    def _show(self, metrics: Mapping[str, float]) -> None:
        if self._bar is not None:
            shown = {k: f"{v:.4g}" for k, v in metrics.items() if k.endswith(("loss", "acc", "loss_epoch"))}
            self._bar.set_postfix(shown, refresh=False)

    def close(self) -> None:
        """Close the bar (also when fit fails)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _default_progress(
    enable_progress_bar: bool | None, callbacks: Sequence[Callback] = ()
) -> Callback | None:
    """The progress display the Trainer adds on the main process, for its ``enable_progress_bar``. Local.

    ``True``: the tqdm bar (``ImportError`` without tqdm). ``False``: none. ``None``: none when
    ``callbacks`` already hold a :class:`ProgressLog`; else the tqdm bar when stderr is a terminal
    and tqdm is installed, else a :class:`ProgressLog` with its defaults: a log file never gets
    bar frames, and a terminal without tqdm still sees the run progress.
    """
    if enable_progress_bar is False:
        return None
    if enable_progress_bar is None and any(isinstance(cb, ProgressLog) for cb in callbacks):
        return None
    try:
        import tqdm  # noqa: F401
    except ImportError:
        if enable_progress_bar:
            raise ImportError(
                "enable_progress_bar=True needs tqdm: pip install 'distkit[progress]'."
            ) from None
        return ProgressLog()
    if enable_progress_bar or (_is_terminal(sys.stderr) and _columns(sys.stderr) > 0):
        return _ProgressBar()
    # A pipe or a file; or a terminal of no known width (a pty made without a size, as CI runners
    # and `script` give), where tqdm would draw nothing until the end.
    return ProgressLog()


def _columns(stream: Any) -> int:
    """The width of the terminal ``stream`` writes to; 0 when it has none."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # None (pythonw), a closed or a wrapped stream
        return False

"""Hooks into :meth:`distkit.Trainer.fit`, and the built-in callbacks.

Every hook runs on every rank, in the order the callbacks were given (``ModelCheckpoint`` last, so
the checkpoint it writes holds the other callbacks' state after their own hooks ran). Metrics
handed to hooks are already reduced across ranks and are the same on every rank, so decisions taken
from them (stop, save) agree without further communication.
"""

from __future__ import annotations

import difflib
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from distkit import runtime
from distkit._utils.slips import names_slips
from distkit.collectives import any_rank

__all__ = [
    "Callback",
    "EarlyStopping",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ThroughputMonitor",
    "TrainerView",
]


class TrainerView(Protocol):
    """What a callback may read of the :class:`~distkit.Trainer`, and the one thing it may set.

    The hooks of :class:`Callback` receive the Trainer itself; this protocol is the contract: every
    built-in callback, logger and progress display of distkit uses only these members (a type
    checker holds them to it), so a callback of yours can do whatever ours do. Everything is
    read-only but ``should_stop``; the Trainer's attributes with a leading underscore are not part
    of it and change without notice.

    Example:
        >>> class PrintBest(Callback):
        ...     def on_train_step_end(self, trainer: TrainerView, loss):
        ...         if trainer.last_validation_step == trainer.global_step:
        ...             print(trainer.last_validation_metrics)
    """

    # Set to True to stop every rank after the current optimizer step (agreed through the step).
    should_stop: bool

    @property
    def global_step(self) -> int: ...  # optimizer steps taken or skipped so far
    @property
    def current_epoch(self) -> int: ...  # the epoch being trained, 0-based
    @property
    def skipped_steps(self) -> int: ...  # steps skipped for a non-finite loss on some rank
    @property
    def callback_metrics(self) -> dict[str, float]: ...  # the latest logged metrics, reduced
    @property
    def batches_in_epoch(self) -> int: ...  # this rank's batches of the current epoch so far
    @property
    def running_loss(self) -> float | None: ...  # this rank's mean loss since the last logging step
    @property
    def last_validation_step(self) -> int | None: ...
    @property
    def last_validation_metrics(self) -> dict[str, float]: ...
    @property
    def log_pending(self) -> bool: ...  # an on_log call for this step follows the step-end hooks
    @property
    def is_main_process(self) -> bool: ...
    @property
    def world_size(self) -> int: ...
    @property
    def num_training_batches(self) -> int | None: ...  # None: a stream
    @property
    def steps_per_epoch(self) -> int | None: ...
    @property
    def total_steps(self) -> int | None: ...
    @property
    def effective_batch_size(self) -> int: ...
    @property
    def accumulate_grad_batches(self) -> int: ...
    @property
    def log_every_n_steps(self) -> int: ...
    @property
    def check_val_every_n_epoch(self) -> int | None: ...
    @property
    def max_epochs(self) -> int | None: ...
    @property
    def max_steps(self) -> int | None: ...
    @property
    def default_root_dir(self) -> Path: ...
    @property
    def callbacks(self) -> list[Callback]: ...
    @property
    def model(self) -> torch.nn.Module | None: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...
    @property
    def lr_scheduler(self) -> Any: ...
    @property
    def device(self) -> torch.device | None: ...

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint of the run holds (model, optimizer, progress, callbacks' state). Collective."""
        ...


class Callback:
    """Base class of Trainer callbacks: override the hooks you need; each does nothing by default.

    Hooks run on every rank (a hook that writes files should check ``trainer.is_main_process``).
    Metrics passed to hooks are reduced across ranks and identical on every rank. A callback that
    sets ``trainer.should_stop = True`` stops training on every rank after the current optimizer
    step: the next step tells the other ranks and is discarded (see ``docs/trainer.md``).
    Callbacks with state implement :meth:`state_dict` and :meth:`load_state_dict`; checkpoints then
    carry it.

    Example:
        >>> import distkit
        >>> class StopAtLoss(distkit.Callback):
        ...     def on_log(self, trainer, metrics):
        ...         if metrics["train_loss"] < 0.1:
        ...             trainer.should_stop = True
        >>> trainer = distkit.Trainer(callbacks=[StopAtLoss()], max_epochs=10)
    """

    def on_fit_start(self, trainer: TrainerView) -> None:
        """After set-up (model wrapped, loaders made, checkpoint restored), before the first step."""

    def on_train_epoch_start(self, trainer: TrainerView) -> None:
        """At the start of every training epoch (``trainer.current_epoch``)."""

    def on_train_step_end(self, trainer: TrainerView, loss: torch.Tensor) -> None:
        """After every optimizer step (taken or skipped); ``trainer.global_step`` counts it.

        Args:
            trainer: The trainer.
            loss: This rank's loss of the step (the mean over its accumulated micro-batches),
                detached and not reduced across ranks.
        """

    def on_log(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        """At every logging step (``log_every_n_steps``), before the loggers write ``metrics``.

        Callbacks may add entries to ``metrics`` (the learning-rate and throughput monitors do);
        added values are not reduced across ranks, and the loggers write the main process's dict.
        """

    def on_validation_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        """After validation; ``metrics`` holds the exact validation metrics (``val_*``)."""

    def on_train_epoch_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        """At the end of every epoch, with the epoch's training and validation metrics."""

    def on_fit_end(self, trainer: TrainerView) -> None:
        """When ``fit`` finishes (also after an early stop or a preemption)."""

    def state_dict(self) -> dict[str, Any]:
        """State to save in checkpoints; plain numbers, strings and lists. Local."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. Local."""


# The hooks the Trainer calls: every other on_* method of a callback would never run.
_HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_"))
# Lightning's callback hooks that are named otherwise here, or have no counterpart.
_LIGHTNING_HOOKS = {
    "on_train_batch_end": "on_train_step_end(trainer, loss), after every optimizer step",
    "on_train_batch_start": "on_train_step_end of the step before, or on_train_epoch_start",
    "on_train_start": "on_fit_start(trainer)",
    "on_train_end": "on_fit_end(trainer)",
    "on_validation_epoch_end": "on_validation_end(trainer, metrics), with the exact val_* metrics",
    "on_save_checkpoint": "state_dict(self), whose result the checkpoints carry",
    "on_load_checkpoint": "load_state_dict(self, state)",
}


def check_hooks(callback: Callback) -> None:
    """Refuse a callback with an ``on_*`` method the Trainer never calls (Lightning's
    ``on_train_batch_end``, a misspelt ``on_fit_ends``): it would never run, in silence."""
    for name in sorted(dir(type(callback))):
        if not name.startswith("on_") or name in _HOOKS or not callable(getattr(callback, name, None)):
            continue
        if name in _LIGHTNING_HOOKS:
            instead = f"Lightning's name; here it is {_LIGHTNING_HOOKS[name]}"
        else:
            close = difflib.get_close_matches(name, _HOOKS, n=1)
            instead = f"did you mean {close[0]}?" if close else "no hook of the Trainer has that name"
        raise TypeError(
            f"callback {type(callback).__name__} defines {name}(), which distkit's Trainer never calls "
            f"({instead}). The Trainer's hooks: {', '.join(_HOOKS)}, and state_dict/load_state_dict. "
            f"Rename the method (a helper of your own: give it a name that does not start with on_)."
        )


# Lightning's ModelCheckpoint names, and what they are here.
_CHECKPOINT_MEANT = {
    "save_top_k": "keep_best=k (the best k by monitor=), beside keep_last=n (the newest n)",
    "save_last": "the newest checkpoints are always kept: keep_last=n says how many",
    "every_n_train_steps": "it is every_n_steps= here",
    "train_time_interval": "every_n_minutes= (a number of minutes)",
    "filename": "the checkpoints are named by their step (step_000001000) inside dirpath",
}


class ModelCheckpoint(Callback):
    """Save resumable checkpoints through :class:`distkit.CheckpointManager`.

    Collective: the Trainer runs it on every rank; the manager writes from the main process. A
    checkpoint holds the model, optimizer, scheduler, gradient scaler, every rank's RNG state, the
    data loader's position and the callbacks' state, so ``Trainer(resume="auto")`` continues exactly
    where it stopped. The Trainer adds one (in ``<default_root_dir>/checkpoints``, every epoch and
    every 30 minutes of training, last 3 kept) unless you pass your own or
    ``enable_checkpointing=False``.

    Saves by time keep a long epoch safe by default: a nanoGPT-style run of one 33,748-step epoch
    would otherwise save nothing before its end. The main process's clock decides (the ranks'
    clocks differ) and one collective shares the decision, at logging steps only
    (``Trainer(log_every_n_steps=...)``, 50 by default): a save comes at the first logging step
    after ``every_n_minutes`` have passed since the previous save (of any kind), or since ``fit``
    started. The question rides on the logging step's collective of the training metrics (made
    before the step-end callbacks run) and costs nothing more; the saves themselves are the cost.
    Pass ``every_n_minutes=None`` to turn it off. A Trainer takes one ModelCheckpoint.

    Args:
        dirpath: Directory of the checkpoints, local or an fsspec URL (``s3://bucket/run``);
            ``None`` means ``<default_root_dir>/checkpoints``.
        monitor: Metric that ranks checkpoints for ``keep_best`` (e.g. ``"val_loss"``): the
            epoch-end ones, and mid-epoch ones (``every_n_steps``, ``every_n_minutes``) saved at a
            step just validated (``Trainer(val_check_interval=...)``); other mid-epoch ones are
            kept by ``keep_last`` only.
        mode: ``"min"`` or ``"max"``: which way ``monitor`` improves.
        keep_last: How many of the newest checkpoints to keep.
        keep_best: How many of the best checkpoints by ``monitor`` to keep as well.
        every_n_epochs: Save at the end of every n-th epoch; ``0`` turns epoch saves off.
        every_n_steps: Also save every n optimizer steps (mid-epoch, resumable exactly).
        every_n_minutes: Also save when this many minutes of wall time have passed since the last
            save (mid-epoch, resumable exactly, kept by ``keep_last``), checked at logging steps as
            told above; ``None`` turns saves by time off. Default: 30.
        async_save: Write in the background; training waits only for the copy to CPU memory.
        overwrite: **Destructive.** When a fit starts a new run (no ``resume``) in a directory that
            already holds checkpoints, delete them instead of refusing to start with a
            :class:`distkit.CheckpointConflictError`. A fit that resumes deletes nothing.

    Attributes:
        manager: The :class:`distkit.CheckpointManager`, once ``fit`` has started.

    Example:
        >>> import distkit
        >>> from distkit.trainer import ModelCheckpoint
        >>> checkpoint = ModelCheckpoint("runs/ckpt", monitor="val_loss", keep_best=1, every_n_steps=500)
        >>> trainer = distkit.Trainer(callbacks=[checkpoint], resume="auto", max_epochs=10)
        >>> hourly = ModelCheckpoint("runs/ckpt", every_n_epochs=0, every_n_minutes=60, keep_last=2)
    """

    @names_slips(_CHECKPOINT_MEANT)
    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        monitor: str | None = None,
        mode: str = "min",
        keep_last: int = 3,
        keep_best: int | None = None,
        every_n_epochs: int = 1,
        every_n_steps: int | None = None,
        every_n_minutes: float | None = 30.0,
        async_save: bool = False,
        overwrite: bool = False,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}.")
        if keep_best is not None and monitor is None:
            raise ValueError(
                f"keep_best={keep_best} ranks checkpoints by a metric; pass monitor='val_loss' too."
            )
        if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 0:
            # None (Lightning's "not by epochs") would fail later, at the first epoch's end.
            raise ValueError(
                f"every_n_epochs must be an int >= 0 (0 turns epoch saves off), got {every_n_epochs!r}."
            )
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1
        ):
            raise ValueError(f"every_n_steps must be an int >= 1 or None, got {every_n_steps!r}.")
        if every_n_minutes is not None and (
            isinstance(every_n_minutes, bool)
            or not isinstance(every_n_minutes, (int, float))
            or not every_n_minutes > 0
        ):
            raise ValueError(
                f"every_n_minutes must be a number of minutes > 0 (e.g. 30) or None for no saves by "
                f"time, got {every_n_minutes!r}."
            )
        # A URL stays a string: Path("s3://bucket/run") is "s3:/bucket/run", a local directory.
        self.dirpath: str | Path | None = None
        if dirpath is not None:
            self.dirpath = os.fspath(dirpath) if "://" in os.fspath(dirpath) else Path(dirpath)
        self.monitor = monitor
        # Checked above; spelled out as the Literal that CheckpointManager is annotated to take.
        self.mode: Literal["min", "max"] = "max" if mode == "max" else "min"
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.every_n_epochs = every_n_epochs
        self.every_n_steps = every_n_steps
        self.every_n_minutes = every_n_minutes
        self.async_save = async_save
        self.overwrite = overwrite
        self.manager: Any = None
        self.directory: str | Path | None = None
        self._last_saved_step: int | None = None
        # time.monotonic() of the last save (or of fit's start): only the main process's counts.
        self._last_save_time = 0.0
        # (step, decision) of the saves-by-time check when it rode on the Trainer's collective of
        # that logging step (the Trainer's own ModelCheckpoint); otherwise the check all-reduces.
        self._time_agreed: tuple[int, bool] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The manager belongs to one process (its writer lock, its save in flight): the processes
        # fit() starts get this callback pickled and make their own in setup().
        state = dict(self.__dict__)
        state["manager"] = None
        return state

    def setup(self, trainer: TrainerView) -> None:
        """Make the manager (called by the Trainer before it restores a checkpoint). Local."""
        from distkit.checkpoint import CheckpointManager

        self.directory = self.dirpath or Path(trainer.default_root_dir) / "checkpoints"
        self.manager = CheckpointManager(
            self.directory,
            keep_last=self.keep_last,
            keep_best=self.keep_best,
            monitor=self.monitor,
            mode=self.mode,
            async_save=self.async_save,
            overwrite=self.overwrite,
        )

    def save(self, trainer: TrainerView, metrics: Mapping[str, float] | None = None) -> None:
        """Save a checkpoint at ``trainer.global_step`` (once per step). Collective: every rank."""
        if trainer.global_step == self._last_saved_step:
            return
        self._last_saved_step = trainer.global_step
        self.manager.save(trainer.global_step, trainer.checkpoint_state(), metrics=metrics)
        self._last_save_time = time.monotonic()

    def on_fit_start(self, trainer: TrainerView) -> None:
        # A resumed run starts at the restored checkpoint's step: no need to write it again.
        self._last_saved_step = trainer.global_step
        self._last_save_time = time.monotonic()
        self._time_agreed = None

    def on_train_step_end(self, trainer: TrainerView, loss: torch.Tensor) -> None:
        step = trainer.global_step
        # By time only at logging steps, and not at a step saved anyway: the same steps on every rank.
        if (self.every_n_steps and step % self.every_n_steps == 0) or (
            self.every_n_minutes is not None
            and step % trainer.log_every_n_steps == 0
            and self._time_is_due(step)
        ):
            # Ranked for keep_best only when validation ran at this very step (val_check_interval
            # validates before the step-end callbacks); older metrics describe an older model.
            validated_now = trainer.last_validation_step == step
            self.save(trainer, self._monitored(trainer.last_validation_metrics) if validated_now else None)

    def _next_step_end(self, trainer: TrainerView) -> float:
        """The next step whose end may save (by steps, or by time at a logging step): the Trainer
        calls :meth:`on_train_step_end` there, not at the steps between."""
        step, due = trainer.global_step, math.inf
        if self.every_n_steps:
            due = (step // self.every_n_steps + 1) * self.every_n_steps
        if self.every_n_minutes is not None:
            every = trainer.log_every_n_steps
            due = min(due, (step // every + 1) * every)
        return due

    def _time_is_due(self, step: int) -> bool:
        """Whether ``every_n_minutes`` have passed on the main process's clock: the same answer on
        every rank, as the other ranks' clocks take no part. The Trainer hands the answer over from
        its logging step's collective (``_time_agreed``); called at any other step (a hook driven
        by other code), it all-reduces a flag itself, so it is collective then."""
        agreed = self._time_agreed
        if agreed is not None and agreed[0] == step:
            return agreed[1]
        return any_rank(self._time_due_here())

    def _time_due_here(self) -> bool:
        """This process's part of :meth:`_time_is_due`: True on the main process once
        ``every_n_minutes`` have passed since the last save, False elsewhere. Local."""
        if self.every_n_minutes is None:
            return False
        interval_s = 60.0 * float(self.every_n_minutes)
        return runtime.is_main_process() and time.monotonic() - self._last_save_time >= interval_s

    def on_train_epoch_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        if self.monitor is not None and self.monitor not in metrics and _validated_epoch(trainer):
            # A monitor that names no metric would rank nothing, in silence: keep_best would keep
            # no best and ckpt_path="best" find none (a typo, or validation that gives another name).
            raise KeyError(_missing_metric("ModelCheckpoint", self.monitor, metrics))
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer, self._monitored(metrics))

    def on_fit_end(self, trainer: TrainerView) -> None:
        self.manager.close()  # waits for a save in flight, then lets go of the directory

    def _monitored(self, metrics: Mapping[str, float]) -> dict[str, float] | None:
        # A checkpoint ranks for keep_best only when the monitored metric exists at that step.
        if self.monitor is None or self.monitor not in metrics:
            return None
        return dict(metrics)


def _validated_epoch(trainer: TrainerView) -> bool:
    """Whether validation was due at the end of the epoch that just ended."""
    every = trainer.check_val_every_n_epoch
    return every is not None and (trainer.current_epoch + 1) % every == 0


def _missing_metric(who: str, monitor: str, metrics: Mapping[str, float]) -> str:
    """Why ``who``'s ``monitor`` names no metric of the epoch's ``metrics``, and the closest that does."""
    close = difflib.get_close_matches(monitor, list(metrics), n=1, cutoff=0.6)
    meant = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"{who} monitors {monitor!r}, which is not among this epoch's metrics {sorted(metrics)}.{meant} "
        f"Pass a val_data to fit() for 'val_*' metrics, or monitor one of these."
    )


class EarlyStopping(Callback):
    """Stop when a metric has stopped improving; every rank stops at the same epoch.

    Local decision on identical inputs: the metric comes reduced across ranks, so every rank
    counts the same epochs without improvement (the Trainer also agrees on stopping in one
    collective per epoch).

    Args:
        monitor: Metric name, e.g. ``"val_loss"`` or ``"val_acc"``.
        mode: ``"min"`` or ``"max"``.
        patience: Epochs without improvement before stopping.
        min_delta: Smallest change that counts as an improvement.
        stop_on_nonfinite: Also stop when the metric is ``nan`` or infinite.

    Example:
        >>> import distkit
        >>> from distkit.trainer import EarlyStopping
        >>> trainer = distkit.Trainer(callbacks=[EarlyStopping("val_loss", patience=3)], max_epochs=100)
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        *,
        mode: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        stop_on_nonfinite: bool = True,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}.")
        if patience < 0:
            raise ValueError(f"patience must be >= 0, got {patience}.")
        if min_delta < 0:
            raise ValueError(f"min_delta must be >= 0, got {min_delta}.")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = min_delta
        self.stop_on_nonfinite = stop_on_nonfinite
        self.best: float | None = None
        self.wait = 0
        self.stopped_epoch: int | None = None

    def on_fit_start(self, trainer: TrainerView) -> None:
        if trainer.global_step == 0:  # a resumed run keeps the restored counters
            self.best, self.wait, self.stopped_epoch = None, 0, None

    def on_train_epoch_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        if self.monitor not in metrics:
            if not _validated_epoch(trainer):
                return  # no validation at this epoch's end (check_val_every_n_epoch > 1 or None)
            raise KeyError(_missing_metric("EarlyStopping", self.monitor, metrics))
        value = metrics[self.monitor]
        if not math.isfinite(value):
            if self.stop_on_nonfinite:
                self._stop(trainer)
            return
        better = (
            self.best is None
            or (self.mode == "min" and value < self.best - self.min_delta)
            or (self.mode == "max" and value > self.best + self.min_delta)
        )
        if better:
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self._stop(trainer)

    def _stop(self, trainer: TrainerView) -> None:
        self.stopped_epoch = trainer.current_epoch
        trainer.should_stop = True
        runtime.get_logger("distkit.trainer", main_process_only=True).info(
            "early stopping at epoch %d: %s has not improved for %d epoch(s) (best %s)",
            trainer.current_epoch,
            self.monitor,
            self.wait,
            self.best,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.wait, self.stopped_epoch = state["best"], state["wait"], state["stopped_epoch"]


class LearningRateMonitor(Callback):
    """Log the learning rate at every logging step: ``lr``, or ``lr/group<i>`` for several groups.

    Local: the learning rate is the same on every rank.

    Example:
        >>> import distkit
        >>> from distkit.trainer import LearningRateMonitor
        >>> trainer = distkit.Trainer(callbacks=[LearningRateMonitor()], max_epochs=1)
    """

    def on_log(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        assert trainer.optimizer is not None  # on_log runs inside fit(), after set-up
        groups = trainer.optimizer.param_groups
        if len(groups) == 1:
            metrics["lr"] = float(groups[0]["lr"])
            return
        for index, group in enumerate(groups):
            metrics[f"lr/group{index}"] = float(group["lr"])


class ThroughputMonitor(Callback):
    """Log training throughput at every logging step: ``samples_per_s`` (whole job) and ``steps_per_s``.

    Local: measured on each rank over the optimizer steps since the previous logging step. Time
    spent in validation is not counted, mid-epoch (``val_check_interval``) or between epochs, nor
    are the checkpoints saved between epochs: the step whose interval holds a validation is left
    out. The loggers write the main process's figures. Samples are ``steps x effective batch size``.

    Example:
        >>> import distkit
        >>> from distkit.trainer import ThroughputMonitor
        >>> trainer = distkit.Trainer(callbacks=[ThroughputMonitor()], max_epochs=1)
    """

    def __init__(self) -> None:
        self._last = 0.0  # when the step now running started: the previous step's end
        self._seconds = 0.0
        self._steps = 0
        self._validated = False  # a validation ran since the previous step's end

    def on_train_epoch_start(self, trainer: TrainerView) -> None:
        self._last, self._validated = time.perf_counter(), False

    def on_train_step_end(self, trainer: TrainerView, loss: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self._validated:
            self._seconds += now - self._last
            self._steps += 1
        self._last, self._validated = now, False

    def on_validation_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        self._validated = True

    def on_log(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        if self._steps and self._seconds > 0:
            metrics["steps_per_s"] = self._steps / self._seconds
            metrics["samples_per_s"] = self._steps * trainer.effective_batch_size / self._seconds
        self._seconds, self._steps = 0.0, 0

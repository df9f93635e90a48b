"""The state of one ``fit``: a :class:`Run`, made fresh once set-up has built what the loop needs,
and the :class:`Outcome` a Trainer shows when no run of its own is there (before any ``fit``, and
after a ``fit`` that ran in processes it started).

The loop's functions (:mod:`distkit.trainer._loop`) take the run explicitly; nothing in it is
optional once made, so the loop needs no checks that set-up happened. The Trainer's documented
attributes (``global_step``, ``model``, ...) are properties over the run or the outcome. The loop
sees the Trainer itself only as :class:`Options`: its configuration, and what callbacks receive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from distkit.stragglers import StepTimer, StragglerDetector
from distkit.trainer.callbacks import Callback, ModelCheckpoint, TrainerView

if TYPE_CHECKING:
    from distkit.trainer.loggers import Logger
    from distkit.trainer.precision import Precision
    from distkit.trainer.profiler import TorchProfiler
    from distkit.trainer.strategies import DDPStrategy, FSDPStrategy, _Plan
    from distkit.trainer.strategies._base import Strategy

__all__: list[str] = []


class Options(TrainerView, Protocol):
    """The Trainer as the loop sees it: its configuration (fixed at construction) and the view that
    callbacks get (the loop hands it to their hooks)."""

    strategy: str | DDPStrategy | FSDPStrategy
    devices: int | str | tuple[int, ...]
    precision: str
    batch_size: int
    val_batch_size: int
    num_workers: int
    gradient_clip_val: float | None
    gradient_clip_algorithm: str
    val_check_interval: int | float | None
    loggers: list[Logger]
    enable_progress_bar: bool | None
    resume: str | None
    seed: int | None
    seed_per_rank: bool
    scale_lr: str | None
    base_batch_size: int | None
    max_consecutive_nonfinite: int
    hang_timeout_s: float | str | None
    compile: bool
    straggler_margin: float | None
    profiler: str | TorchProfiler | None
    run_config: dict[str, Any] | None


class Scheduled(Protocol):
    """One of the Trainer's own step-end callbacks, which say at which step they next act: the
    Trainer calls their ``on_train_step_end`` there, not at the steps between (issue 29)."""

    def on_train_step_end(self, trainer: TrainerView, loss: torch.Tensor) -> None: ...

    def _next_step_end(self, trainer: TrainerView) -> float: ...


@dataclass(eq=False)
class Run:
    """One ``fit``: what set-up built (never missing) and where the loop is. Local to its process."""

    # The Trainer (configuration, and what callbacks receive) and what set-up built.
    trainer: Options
    plan: _Plan
    strategy: Strategy
    precision: Precision
    device: torch.device
    world_size: int
    model: nn.Module
    # The model's class as given (FSDP changes it: MLP becomes FSDPMLP).
    model_class: type[nn.Module]
    # The step module (model and loss) as the strategy wrapped it; per_device: nn.DataParallel's
    # one loss per GPU.
    wrapped: nn.Module
    per_device: bool
    optimizer: torch.optim.Optimizer
    # The loader fit() was given (any object a loop can iterate) or the DistributedLoader it made;
    # None without validation data.
    train_loader: Any
    val_loader: Any
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    metric_fns: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]]
    scheduler_interval: str
    # What a poisoned backward pass turns to nan, and what is read to see it: one element of the
    # sentinel's gradient (None: no parameter has one on this rank), or of every gradient when some
    # parameters may go unused in a step.
    params: list[nn.Parameter]
    sentinel: nn.Parameter | None
    scan_all: bool
    # How the sentinel's gradient is read (Strategy.sentinel_reader; None without a sentinel).
    read_sentinel: Callable[[torch.Tensor], float] | None
    # The generators a forward pass draws from (CPU, and this rank's CUDA device).
    generators: list[torch.Generator]
    # Batches per epoch on this rank (None: a stream, whose length is known once read), samples
    # per loader batch, data-parallel replicas (ranks, or GPUs under DP) for the effective batch size.
    num_batches: int | None
    per_replica_batch: int
    replicas: int
    # The ModelCheckpoint among the Trainer's callbacks (None without one).
    checkpoint: ModelCheckpoint | None
    # Validation every so many optimizer steps across epochs (val_check_interval an int), or at
    # these steps within the validated epochs, counted from 1 (a fraction of an epoch, which then
    # replaces the epoch-end validation); None: not this way.
    val_every: int | None = None
    val_steps_in_epoch: frozenset[int] | None = None
    # Made after the run (a factory may read trainer.total_steps, which reads the run).
    lr_scheduler: Any = None
    # The callbacks of this fit() (a progress display included); those overriding
    # on_train_step_end, in order; of these, the Trainer's own that say at which step they next act
    # (_next_step_end: called at the steps schedule_events picks), and the others, called every step.
    callbacks: list[Callback] = field(default_factory=list)
    step_end_callbacks: list[Callback] = field(default_factory=list)
    scheduled_callbacks: list[Scheduled] = field(default_factory=list)
    every_step_callbacks: list[Callback] = field(default_factory=list)
    # The first global step whose end may have work beyond the every-step callbacks (a validation,
    # logging, max_steps, a scheduled callback): _loop.step.schedule_events. 0: the next step's.
    next_event: float = 0

    # Progress (saved in checkpoints) and the latest reduced metrics.
    global_step: int = 0
    current_epoch: int = 0
    skipped_steps: int = 0
    callback_metrics: dict[str, float] = field(default_factory=dict)
    should_stop: bool = False
    # Position inside the epoch: batches consumed, and whether the epoch ran to its end.
    batches_done: int = 0
    epoch_finished: bool = False
    # Optimizer steps by which the global step at the resume differs from this job's grid of
    # steps per epoch: nonzero when the checkpoint was saved by another number of ranks (other
    # steps per epoch), so that trainer.total_steps counts the steps this run really takes.
    steps_offset: int = 0
    # Stop requests: this rank wants every rank to stop (SIGTERM or should_stop); SIGTERM seen on
    # this rank; agreed by the job; handled (checkpoint saved).
    request_stop: bool = False
    preempt_requested: bool = False
    # This rank poisoned a backward pass of the current optimizer step (what a world of one reads
    # instead of the sentinel: it has no other rank to agree with).
    poisoned: bool = False
    job_preempt: bool = False
    preempted: bool = False
    # The steps of the current run of consecutive non-finite ones.
    nonfinite_run: list[int] = field(default_factory=list)
    # The generators' states at the start of the step in flight (given back when a stop request
    # discards that step), and the batches a discarded step gave back to the loader.
    states_at_step: list[torch.Tensor] = field(default_factory=list)
    given_back: int = 0
    # Training loss since the last logging step and over the epoch (this rank's step losses, as
    # Python floats: reduced across ranks when logged), and extra training_step metrics as
    # on-device sums.
    window_sum: float = 0.0
    window_count: int = 0
    epoch_sum: float = 0.0
    epoch_count: int = 0
    extra_sums: dict[str, torch.Tensor | float] = field(default_factory=dict)
    extra_count: int = 0
    # (global_step, sums, count) of the extra metrics before the step in flight: what a discarded
    # step gives back (taken only when training_step returns extra metrics).
    extras_at_step: tuple[int, dict[str, torch.Tensor | float], int] | None = None
    # This optimizer step is a logging step whose metrics are not logged yet (between the step-end
    # callbacks and the log): a checkpoint saved then logs them first. Its reduced metrics and
    # each rank's phase times (logs.reduce_window), until logged.
    log_pending: bool = False
    window_reduced: tuple[dict[str, float], list[list[float]]] | None = None
    # The step of the latest validation and its metrics (an epoch end at that step reuses them).
    last_validation: tuple[int, dict[str, float]] = (-1, {})
    # This rank's time per phase of the steps since the last logging step, and the comparison of
    # the ranks' times at logging steps (None: neither the straggler report nor profiler="simple").
    timer: StepTimer = field(default_factory=StepTimer)
    stragglers: StragglerDetector | None = None

    def finished(self) -> bool:
        """Whether ``max_steps`` or ``max_epochs`` is reached."""
        max_steps, max_epochs = self.trainer.max_steps, self.trainer.max_epochs
        if max_steps is not None and self.global_step >= max_steps:
            return True
        return max_epochs is not None and self.current_epoch >= max_epochs


@dataclass(eq=False)
class Outcome:
    """What a Trainer shows without a run of its own in this process: the values before any
    ``fit``, or rank 0's final ones after a ``fit`` that ran in processes the Trainer started (and
    the device and group size of a ``validate``/``test``/``predict`` run here)."""

    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None
    device: torch.device | None = None
    world_size: int = 1
    global_step: int = 0
    current_epoch: int = 0
    skipped_steps: int = 0
    should_stop: bool = False
    callback_metrics: dict[str, float] = field(default_factory=dict)
    # The sizes a scheduler factory reads (num_batches None: a stream; 0 before any fit).
    num_batches: int | None = 0
    effective_batch_size: int | None = None


def checkpoint_callback(callbacks: list[Callback]) -> ModelCheckpoint | None:
    """The :class:`ModelCheckpoint` among ``callbacks``, or ``None``."""
    return next((cb for cb in callbacks if isinstance(cb, ModelCheckpoint)), None)

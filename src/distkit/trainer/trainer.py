"""The Trainer: one training loop for one device, ``nn.DataParallel``, DDP and FSDP, built from
distkit's public helpers only (a user who outgrows it can read :meth:`Trainer.fit` and write the same
loop).

One optimizer step, in every strategy::

    for each micro-batch (the strategy's accumulation context: DDP's no_sync, FSDP's sync flag):
        with autocast:  loss = wrapped(batch)        # loss_fn(model(x), y) or training_step(...)
        value = loss.item()                          # where a hand-written loop reads it
        backward(loss / accumulate_grad_batches)     # through the GradScaler under fp16;
                                                     # poisoned if value is nan/inf or a stop is due
    read one element of one gradient (the sentinel)  # reduced: the same on every rank
    if it is finite: unscale once, clip, step, schedule; else agree why, then skip or stop

The loop never asks which wrapper it holds: what differs between strategies sits behind
:class:`distkit.trainer._strategy.Strategy`. How a bad step or a stop request reaches every rank
is told in :mod:`distkit.trainer._nonfinite`; set-up in :mod:`distkit.trainer._setup`; the metric sums
between logging steps in :mod:`distkit.trainer._logs`, validation in :mod:`distkit.trainer._evaluate`.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distkit import runtime
from distkit._hang import check_timeout
from distkit.checkpoint import ResumeState
from distkit.collectives import any_rank, reduce_metrics
from distkit.trainer import _evaluate, _logs, _nonfinite, _preemption, _setup, launch, strategies
from distkit.trainer._preemption import _Preempted
from distkit.trainer._state import _CallbackStates, _Counters, _GivenBack
from distkit.trainer._step import _mean_over_devices, _StepModule, _to_device
from distkit.trainer._strategy import Strategy
from distkit.trainer.callbacks import Callback, ModelCheckpoint, _ProgressBar
from distkit.trainer.loggers import CSVLogger, Logger
from distkit.trainer.precision import Precision, check_precision
from distkit.trainer.strategies import DDPStrategy, FSDPStrategy

__all__ = ["Trainer"]

_log = runtime.get_logger("distkit.trainer", main_process_only=True)


class Trainer:
    """Train a model on one device, over the GPUs of one process (DP), or over many processes (DDP or
    FSDP, which shards the model, its gradients and optimizer state over them).

    ``fit`` runs the same loop everywhere. Outside any launcher, ``strategy="ddp"`` (or ``"fsdp"``) with
    ``devices=N`` starts N local processes itself (through torch's elastic launcher, as
    ``torchrun --standalone`` does); under ``torchrun``, ``srun`` or ``mpirun`` it joins the job it
    is in. The model is a plain ``nn.Module`` trained with ``loss_fn(model(inputs), target)``, or a
    module with ``training_step(batch, batch_idx)`` (and optionally ``validation_step``) for
    custom logic.

    Local to construct (it validates its arguments, and refuses ``"dp"`` or ``"16-mixed"``
    without CUDA); :meth:`fit` is collective. See ``docs/trainer.md``.

    Args:
        strategy: ``"auto"`` (DDP under a multi-process launcher or for several devices, else one
            device), ``"single"``, ``"dp"`` (``nn.DataParallel``, CUDA only), ``"ddp"``, ``"fsdp"``
            (torch's FSDP2; ``docs/fsdp.md``), or a :class:`DDPStrategy` / :class:`FSDPStrategy`
            carrying the strategy's options.
        devices: ``"auto"``, a count (DDP: processes, one device each; DP: GPUs), or a list of
            CUDA indices (as ``--gpu-ids 0,1,3``). DDP outside a launcher with ``"auto"`` starts
            one process per visible GPU, and needs a count without CUDA.
        precision: ``"32"``, ``"bf16-mixed"`` (CPU or CUDA) or ``"16-mixed"`` (CUDA, with a
            ``GradScaler``).
        max_epochs: Epochs to train; at least one of ``max_epochs`` and ``max_steps`` is needed.
        max_steps: Optimizer steps to train (stops mid-epoch if reached first).
        batch_size: Samples per batch on each rank (DP: on each GPU).
        val_batch_size: Batch size of validation; ``batch_size`` when ``None``.
        num_workers: DataLoader worker processes per rank.
        accumulate_grad_batches: Micro-batches per optimizer step (``no_sync`` on all but the last
            under DDP, each loss scaled by ``1/N``; the last step of an epoch may have fewer).
        gradient_clip_val: Clip gradients to this norm (or value) before each optimizer step.
        gradient_clip_algorithm: ``"norm"`` or ``"value"``.
        log_every_n_steps: Optimizer steps between logged training metrics (at most one
            collective per logging step).
        check_val_every_n_epoch: Epochs between validations.
        callbacks: :class:`Callback` objects (hooks run on every rank, in order).
        logger: ``True`` for a :class:`CSVLogger` in ``default_root_dir``, ``False`` for none, or
            :class:`Logger` objects. Loggers write on the main process only.
        enable_checkpointing: Add a :class:`ModelCheckpoint` (every epoch, last 3 kept) unless one
            is among ``callbacks``.
        enable_progress_bar: A tqdm bar on the main process; ``None``: when tqdm is installed and
            stderr is a terminal.
        default_root_dir: Directory of logs and checkpoints.
        resume: ``"auto"`` to continue from the latest valid checkpoint when there is one, a
            checkpoint path, or ``None`` to start fresh.
        seed: ``distkit.seed_everything(seed)`` at the start of ``fit``, and the seed of the
            loaders ``fit`` makes; ``None`` leaves the RNGs alone and the loaders on distkit's
            default seed (``seed_everything``'s, else 0).
        max_consecutive_nonfinite: Consecutive optimizer steps with a non-finite loss or gradient
            norm (skipped on every rank) after which ``fit`` raises.
        hang_timeout_s: The hang doctor's watchdog during ``fit`` (several processes only; see
            ``docs/debugging.md``): when a rank has waited in a collective this many seconds, one
            rank prints where every rank is (and writes it to ``default_root_dir``) and every rank
            exits with code 124. ``"auto"`` (the default): ``DISTKIT_HANG_TIMEOUT_S`` when set,
            else the setting of an earlier ``distkit.init(hang_timeout_s=...)``, else ten times the
            slowest step seen so far and never less than five minutes. ``None`` or 0: off.
        compile: ``torch.compile`` the model's forward (DDP, single; put back after ``fit``) or
            each FSDP sharding unit's forward before sharding. Parameter names and checkpoints stay
            free of ``_orig_mod.``. Not with ``"dp"``.

    Attributes:
        global_step: Optimizer steps taken or skipped so far.
        current_epoch: The epoch being trained (0-based); after ``fit``, the completed epochs.
        should_stop: Set to ``True`` (e.g. from a callback) to stop every rank after this step.
        callback_metrics: The latest logged metrics, reduced across ranks.
        skipped_steps: Steps skipped because a loss was non-finite on some rank.

    Raises:
        ValueError: An argument is out of range (the message names it).
        DistkitError: ``strategy="dp"`` or ``precision="16-mixed"`` without CUDA.

    Example:
        >>> import distkit, torch
        >>> trainer = distkit.Trainer(strategy="ddp", devices=2, precision="bf16-mixed", max_epochs=5)
        >>> trainer.fit(model, train_dataset, val_dataset,
        ...             optimizer=torch.optim.Adam(model.parameters(), 1e-3),
        ...             loss_fn=torch.nn.functional.cross_entropy)  # doctest: +SKIP
    """

    # Configuration, fixed at construction.
    strategy: str | DDPStrategy | FSDPStrategy
    devices: int | str | tuple[int, ...]
    precision: str
    max_epochs: int | None
    max_steps: int | None
    batch_size: int
    val_batch_size: int
    num_workers: int
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    gradient_clip_algorithm: str
    log_every_n_steps: int
    check_val_every_n_epoch: int
    callbacks: list[Callback]
    loggers: list[Logger]
    enable_progress_bar: bool | None
    default_root_dir: Path
    resume: str | None
    seed: int | None
    max_consecutive_nonfinite: int
    hang_timeout_s: float | str | None
    compile: bool

    # What fit() set up: the user's objects, this process's device and the job's size.
    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    device: torch.device | None
    world_size: int

    # Progress (saved in checkpoints) and the latest reduced metrics. `should_stop` is a property
    # over `_should_stop`, so that setting it also tells the other ranks.
    global_step: int
    current_epoch: int
    skipped_steps: int
    callback_metrics: dict[str, float]

    def __init__(
        self,
        *,
        strategy: str | DDPStrategy | FSDPStrategy = "auto",
        devices: int | str | Sequence[int] = "auto",
        precision: str | int = "32",
        max_epochs: int | None = None,
        max_steps: int | None = None,
        batch_size: int = 32,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        log_every_n_steps: int = 50,
        check_val_every_n_epoch: int = 1,
        callbacks: Sequence[Callback] | None = None,
        logger: bool | Logger | Sequence[Logger] = True,
        enable_checkpointing: bool = True,
        enable_progress_bar: bool | None = None,
        default_root_dir: str | os.PathLike[str] = "runs",
        resume: str | os.PathLike[str] | None = None,
        seed: int | None = None,
        max_consecutive_nonfinite: int = 5,
        hang_timeout_s: float | str | None = "auto",
        compile: bool = False,
    ) -> None:
        self.strategy = strategies.check_strategy(strategy)
        self.devices = strategies.check_devices(devices)
        if precision == "16-mixed" and (strategy == "fsdp" or isinstance(strategy, FSDPStrategy)):
            raise ValueError(
                "precision='16-mixed' is not supported with strategy='fsdp' (fp16 needs a gradient scaler "
                "over sharded gradients); use precision='bf16-mixed' (FSDP's bfloat16 MixedPrecisionPolicy)."
            )
        self.precision = check_precision(precision)
        if self.strategy in ("dp", "single"):
            # Fail here, not after the data is loaded: DP without CUDA would silently run the plain
            # module (FACTS.md), and a device list needs the devices to exist.
            strategies.resolve(self.strategy, self.devices)
        _setup.check_options(
            self.strategy,
            self.precision,
            max_epochs=max_epochs,
            max_steps=max_steps,
            batch_size=batch_size,
            val_batch_size=val_batch_size,
            num_workers=num_workers,
            accumulate_grad_batches=accumulate_grad_batches,
            log_every_n_steps=log_every_n_steps,
            check_val_every_n_epoch=check_val_every_n_epoch,
            max_consecutive_nonfinite=max_consecutive_nonfinite,
            gradient_clip_val=gradient_clip_val,
            gradient_clip_algorithm=gradient_clip_algorithm,
            compile=compile,
        )
        if resume is not None and not isinstance(resume, (str, os.PathLike)):
            raise TypeError(f"resume must be 'auto', a checkpoint path or None, got {resume!r}.")

        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_workers = num_workers
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.log_every_n_steps = log_every_n_steps
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.default_root_dir = Path(default_root_dir)
        self.resume = None if resume is None else os.fspath(resume)
        self.seed = seed
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.enable_progress_bar = enable_progress_bar
        self.hang_timeout_s = check_timeout(hang_timeout_s)
        self.compile = compile

        given = list(callbacks or [])
        for cb in given:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks must be distkit.Callback objects, got {type(cb).__name__}.")
        if enable_checkpointing and not any(isinstance(cb, ModelCheckpoint) for cb in given):
            given.append(ModelCheckpoint())
        # Checkpoints last: what they save includes the other callbacks' state after their hooks.
        self.callbacks = [cb for cb in given if not isinstance(cb, ModelCheckpoint)] + [
            cb for cb in given if isinstance(cb, ModelCheckpoint)
        ]
        if logger is True:
            self.loggers = [CSVLogger()]
        elif logger is False or logger is None:
            self.loggers = []
        else:
            self.loggers = [logger] if isinstance(logger, Logger) else list(logger)
            for item in self.loggers:
                if not isinstance(item, Logger):
                    raise TypeError(
                        f"logger must be True, False or Logger objects, got {type(item).__name__}."
                    )

        self.model = None
        self.optimizer = None
        self.lr_scheduler = None
        self.device = None
        self.world_size = 1
        self.global_step = 0
        self.current_epoch = 0
        self.skipped_steps = 0
        self.callback_metrics = {}
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        # What one fit() sets up and uses; none of it is configuration.
        self._should_stop = False
        self._plan: strategies._Plan | None = None
        self._strategy: Strategy | None = None
        self._model_class: type = nn.Module
        self._step_module: _StepModule | None = None
        self._wrapped: nn.Module | None = None
        self._precision: Precision | None = None
        self._train_loader: Any = None
        self._val_loader: Any = None
        self._loss_fn: Callable[..., torch.Tensor] | None = None
        self._metric_fns: dict[str, Callable[..., Any]] = {}
        self._scheduler_interval = "step"
        self._active_callbacks: list[Callback] = []
        # The callbacks that override on_train_step_end, called every step.
        self._step_end_callbacks: list[Callback] = []
        # Batches per epoch on this rank, samples per loader batch, and data-parallel replicas
        # (ranks, or GPUs under DP) for the effective batch size.
        self._num_batches = 0
        self._per_replica_batch = self.batch_size
        self._replicas = 1
        # Position inside the epoch: batches consumed, and whether the epoch ran to its end.
        self._batches_done = 0
        self._epoch_finished = False
        # Stop requests: this rank wants every rank to stop (SIGTERM or should_stop); SIGTERM seen on
        # this rank; agreed by the job; handled (checkpoint saved).
        self._request_stop = False
        self._preempt_requested = False
        self._job_preempt = False
        self._preempted = False
        self._nonfinite_run: list[int] = []
        # What a poisoned backward pass turns to nan, and what is read to see it: one element of the
        # sentinel's gradient, or of every gradient when some parameters may go unused in a step.
        self._params: list[nn.Parameter] = []
        self._sentinel: nn.Parameter | None = None
        self._sentinel_is_vector = False
        self._scan_all = False
        # The generators a forward pass draws from (CPU, and this rank's CUDA device), their states
        # at the start of the step in flight (given back when a stop request discards that step),
        # and the batches a discarded step gave back to the loader.
        self._generators: list[torch.Generator] = []
        self._states_at_step: list[torch.Tensor] = []
        self._given_back = 0
        # Training loss since the last logging step and over the epoch (this rank's step losses, as
        # Python floats: reduced across ranks when logged), and extra training_step metrics as
        # on-device sums.
        self._window_sum = 0.0
        self._window_count = 0
        self._epoch_sum = 0.0
        self._epoch_count = 0
        self._extra_sums: dict[str, Any] = {}
        self._extra_count = 0
        # (global_step, sums, count) of the extra metrics before the step in flight: what a
        # discarded step gives back (taken only when training_step returns extra metrics).
        self._extras_at_step: tuple[int, dict[str, Any], int] | None = None
        # This optimizer step is a logging step whose metrics are not logged yet (between the
        # step-end callbacks and the log): a checkpoint saved then logs them first.
        self._log_pending = False
        # Puts the hang doctor's settings back as they were before this fit() (see _setup).
        self._restore_hang: Callable[[], None] | None = None

    # ------------------------------------------------------------------------------------------
    # Read-only views for callbacks

    @property
    def should_stop(self) -> bool:
        """Whether training stops; setting it to ``True`` stops every rank after the current step."""
        return self._should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._should_stop = bool(value)
        if value:
            self._request_stop = True

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0. Local."""
        return runtime.is_main_process()

    @property
    def num_training_batches(self) -> int:
        """Batches per epoch on each rank."""
        return self._num_batches

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (the last one may accumulate fewer micro-batches)."""
        return -(-self._num_batches // self.accumulate_grad_batches)

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step in the job: batch x replicas (ranks; GPUs under DP) x accumulation."""
        return self._per_replica_batch * self._replicas * self.accumulate_grad_batches

    # ------------------------------------------------------------------------------------------
    # fit

    def fit(
        self,
        model: nn.Module,
        train_data: Any,
        val_data: Any = None,
        *,
        optimizer: torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        lr_scheduler: Any = None,
        scheduler_interval: str = "step",
        metrics: Mapping[str, Callable[[torch.Tensor, torch.Tensor], Any]] | None = None,
    ) -> None:
        """Train ``model`` on ``train_data``, validating on ``val_data`` every epoch.

        Collective: call on every rank (under a launcher). Outside a launcher, with
        ``strategy="ddp"`` and several devices, it starts the processes itself, each from this
        process's random generators and seeding (as every rank of ``torchrun`` running the script
        would be), and when they finish this process takes over rank 0's final state: the weights
        in ``model``, the optimizer and scheduler (the objects passed, or made here by the factories
        passed, as ``trainer.optimizer`` and ``trainer.lr_scheduler``), the callbacks'
        ``state_dict()``, the counters, ``callback_metrics`` and rank 0's random generators. Without
        a process group (one device) it trains in this process.

        Args:
            model: A plain ``nn.Module`` (batches are ``(inputs, target)``, the loss is
                ``loss_fn(model(inputs), target)``), or one with ``training_step(batch, batch_idx)``
                returning the loss (or a dict with ``"loss"`` and more metrics to log) and optionally
                ``validation_step(batch, batch_idx)`` returning a dict of metrics (numbers or
                tensors as batch means, per-sample tensors, or ``(sum, count)`` pairs).
            train_data: A map-style dataset (loaded with :func:`distkit.distributed_dataloader`:
                this rank's share, seeded, resumable mid-epoch), or a DataLoader used as it is.
            val_data: Like ``train_data``; loaded with ``evaluation=True`` so that every sample is
                seen exactly once across ranks and validation metrics are exact.
            optimizer: An optimizer over ``model``'s parameters, or a function making one from them.
            loss_fn: ``loss_fn(output, target) -> loss`` (the batch mean) for plain models.
            lr_scheduler: A scheduler of ``optimizer``, or a function making one from it.
            scheduler_interval: Step the scheduler after every optimizer ``"step"`` or every ``"epoch"``.
            metrics: Extra validation metrics of plain models: ``name -> fn(output, target)``
                returning per-sample values (e.g. :func:`distkit.trainer.accuracy`); logged as
                ``val_<name>`` beside ``val_loss``.

        Raises:
            DistkitError: The loss (or, when clipping by norm, the gradients) was non-finite for
                ``max_consecutive_nonfinite`` consecutive steps (the message lists them), the
                strategy does not fit the job (``devices="auto"`` for DDP without CUDA outside a
                launcher included), the objects cannot be sent to the processes ``fit`` starts,
                or the script starting them has no ``if __name__ == "__main__":`` guard.
            TypeError, ValueError: A misshapen argument (the message names it).
            SystemExit: Code 0 after a SIGTERM on any rank: every rank stopped after the same
                completed step, a checkpoint of it was saved, and the process should exit (a
                scheduler requeues it).

        Example:
            >>> trainer.fit(model, train_set, val_set, optimizer=lambda p: torch.optim.SGD(p, 0.1),
            ...             loss_fn=torch.nn.functional.cross_entropy)  # doctest: +SKIP
        """
        if scheduler_interval not in ("step", "epoch"):
            raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}.")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        if loss_fn is None and not callable(getattr(model, "training_step", None)):
            raise ValueError(
                f"{type(model).__name__} has no training_step(batch, batch_idx); pass loss_fn=... "
                f"(e.g. torch.nn.functional.cross_entropy) to train it as a plain model."
            )
        plan = strategies.resolve(self.strategy, self.devices)
        if plan.launch:
            kwargs = {
                "optimizer": optimizer,
                "loss_fn": loss_fn,
                "lr_scheduler": lr_scheduler,
                "scheduler_interval": scheduler_interval,
                "metrics": metrics,
            }
            launch.run_workers(self, plan, model, (train_data, val_data), kwargs)
            return

        self._reset_run_state()
        self._plan = plan
        self._loss_fn = loss_fn
        self._metric_fns = dict(metrics or {})
        self._scheduler_interval = scheduler_interval
        self.global_step, self.current_epoch, self.skipped_steps = 0, 0, 0
        self.callback_metrics = {}
        try:
            _setup.setup(self, model, train_data, val_data, optimizer, lr_scheduler)
            # Only around the loop, where the flag is looked at every step: during set-up SIGTERM
            # keeps its usual meaning.
            previous_handler = _preemption.install_handler(self)
            try:
                self._run()
            finally:
                _preemption.restore_handler(self, previous_handler)
        except BaseException as err:
            # A collective that failed because a rank is gone: with the hang doctor on, one report
            # of where every rank is, and every rank exits (docs/debugging.md); else it goes on.
            runtime._on_collective_failure(err)
            # A failed fit lets go of the checkpoint directory now, without waiting on ranks that
            # may be gone (a successful one closes it in ModelCheckpoint.on_fit_end).
            checkpoint = self._checkpoint_callback()
            if checkpoint is not None and checkpoint.manager is not None:
                checkpoint.manager.__exit__(type(err), err, err.__traceback__)
            raise
        finally:
            if self._strategy is not None:
                self._strategy.teardown(model)
            if self._restore_hang is not None:
                self._restore_hang()
                self._restore_hang = None
            for cb in self._active_callbacks:
                if isinstance(cb, _ProgressBar):
                    cb.close()
            if runtime.is_main_process():
                for logger in self.loggers:
                    logger.finalize()
        if self._preempted:
            raise _Preempted()

    # ------------------------------------------------------------------------------------------
    # Set-up

    # ------------------------------------------------------------------------------------------
    # Checkpoints

    def checkpoint_state(self) -> dict[str, Any]:
        """The objects a checkpoint saves and restores.

        Model (the user's module, unwrapped), optimizer, scheduler, gradient scaler, the loop
        position with every rank's RNG state (a :class:`distkit.checkpoint.ResumeState`), the
        loader's position, the Trainer's counters and latest metrics with every rank's partial sums
        of the metrics it logs next, and the callbacks' state.

        Local to build; saving it is collective (the ResumeState gathers every rank's RNG state, the
        counters every rank's partial sums). Saved from ``on_train_step_end`` at a logging step, the
        save first logs that step's metrics (the log's collective), so that the checkpoint holds
        the state the run goes on from.

        Example:
            >>> manager.save(trainer.global_step, trainer.checkpoint_state())  # doctest: +SKIP
        """
        if self._epoch_finished:
            epoch, batches = self.current_epoch + 1, 0
        else:
            epoch, batches = self.current_epoch, self._batches_done
        state: dict[str, Any] = {
            "model": self.model,
            "optimizer": self.optimizer,
            "progress": ResumeState(epoch=epoch, global_step=self.global_step, batches_in_epoch=batches),
            "counters": _Counters(self),
            "callbacks": _CallbackStates(self.callbacks),
        }
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler
        if self._precision is not None and self._precision.scaler is not None:
            state["scaler"] = self._precision.scaler
        if callable(getattr(self._train_loader, "state_dict", None)):
            loader = self._train_loader
            state["train_loader"] = _GivenBack(loader, self._given_back) if self._given_back else loader
        return state

    def _checkpoint_callback(self) -> ModelCheckpoint | None:
        return next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)

    # ------------------------------------------------------------------------------------------
    # The loop

    def _run(self) -> None:
        while not self._finished():
            self._run_epoch()
            if self._preempted:
                break
            if self._epoch_finished:
                # After fit, current_epoch counts the completed epochs (as max_epochs does).
                self.current_epoch += 1
                self._batches_done = 0
            if self._should_stop:
                break
        for cb in self._active_callbacks:
            cb.on_fit_end(self)

    def _finished(self) -> bool:
        if self.max_steps is not None and self.global_step >= self.max_steps:
            return True
        return self.max_epochs is not None and self.current_epoch >= self.max_epochs

    def _run_epoch(self) -> None:
        loader = self._train_loader
        first = self._batches_done
        if callable(getattr(loader, "set_epoch", None)):
            loader.set_epoch(self.current_epoch)  # keeps a restored mid-epoch position
        elif callable(getattr(getattr(loader, "sampler", None), "set_epoch", None)):
            loader.sampler.set_epoch(self.current_epoch)
        self._epoch_finished = False
        if not first:  # a resumed epoch keeps the restored sums of its first steps
            self._epoch_sum, self._epoch_count = 0.0, 0
        self.model.train()  # type: ignore[union-attr]
        for cb in self._active_callbacks:
            cb.on_train_epoch_start(self)

        # Held until the epoch's end work is done: a distkit loader closes its pass (and moves to
        # the next epoch) when the iterator goes, and a checkpoint taken at the end of an epoch cut
        # short (max_steps, should_stop) must record this epoch's position.
        iterator: Iterable[Any] = iter(loader)
        if first and not callable(getattr(loader, "load_state_dict", None)):
            iterator = itertools.islice(iterator, first, None)
        # The hot loop reads locals only: on an overhead-bound model attribute lookups and calls are
        # a visible share of the step (benchmarks/bench_trainer.py).
        wrapped, precision, device = self._wrapped, self._precision, self.device
        assert wrapped is not None and precision is not None and device is not None
        move = device.type != "cpu"
        accumulate = self.accumulate_grad_batches
        strategy = self._strategy
        assert strategy is not None
        accumulation, poison, params = strategy.accumulation, strategy.poisoned_backward, self._params
        per_device = self._step_module.per_device  # type: ignore[union-attr]
        plain = precision.dtype is None and precision.scaler is None
        last_index = self._num_batches - 1
        generators = self._generators
        one_generator = len(generators) == 1
        cpu_generator = generators[0]
        micro_losses: list[torch.Tensor] = []
        micro_sum = 0.0
        for batch_idx, batch in enumerate(iterator, start=first):
            if move:
                batch = _to_device(batch, device)
            if accumulate == 1 or not micro_losses:
                # The step's first micro-batch: what a stop request would give back (about 1 us).
                self._states_at_step = (
                    [cpu_generator.get_state()] if one_generator else [gen.get_state() for gen in generators]
                )
            sync = accumulate == 1 or (batch_idx + 1) % accumulate == 0 or batch_idx == last_index
            with accumulation(wrapped, sync):
                if plain:
                    loss, extras = wrapped(batch, batch_idx)
                else:
                    with precision.autocast():
                        loss, extras = wrapped(batch, batch_idx)
                if per_device:
                    loss, extras = _mean_over_devices(loss, extras)
                # The one host sync of a micro-batch, after the forward pass.
                value = loss.item()
                scaled = loss / accumulate if accumulate > 1 else loss
                if self._request_stop or not math.isfinite(value):
                    poison(precision.backward, scaled, params)
                else:
                    precision.backward(scaled)
            if extras:
                _logs.add_extras(self, extras, first=accumulate == 1 or not micro_losses)
            self._batches_done = batch_idx + 1
            if accumulate == 1:
                if self._optimizer_step(loss.detach(), value, 1):
                    break
                continue
            micro_losses.append(loss.detach())
            micro_sum += value
            if not sync:
                continue
            micro = len(micro_losses)
            step_loss, step_value = torch.stack(micro_losses).mean(), micro_sum / micro
            micro_losses, micro_sum = [], 0.0
            if self._optimizer_step(step_loss, step_value, micro):
                break
        if not self._preempted:
            self._epoch_finished = self._batches_done >= self._num_batches
            self._end_epoch()
        del iterator
        # The pass is over, so the loader has moved on by itself: nothing more to give back.
        self._given_back = 0

    def _end_epoch(self) -> None:
        """Validate, reduce the epoch's metrics in one collective, run the epoch-end hooks, and agree
        on stopping."""
        validate = (
            self._val_loader is not None and (self.current_epoch + 1) % self.check_val_every_n_epoch == 0
        )
        local = _evaluate.validate(self) if validate else {}
        local["train_loss_epoch"] = (self._epoch_sum, float(self._epoch_count))
        # The epoch end's one collective for metrics: the training loss and every validation sum
        # and count at once.
        metrics = reduce_metrics(local)
        metrics["epoch"] = float(self.current_epoch)
        self.callback_metrics.update(metrics)
        if validate:
            for cb in self._active_callbacks:
                cb.on_validation_end(self, metrics)
        _logs.write(self, metrics)
        if self.lr_scheduler is not None and self._scheduler_interval == "epoch":
            self.lr_scheduler.step()
        for cb in self._active_callbacks:
            cb.on_train_epoch_end(self, metrics)
        # Built-in callbacks decide from identical metrics, a user's callback may not: agree once.
        self._should_stop = any_rank(self._should_stop)

    def _optimizer_step(self, loss: torch.Tensor, value: float, micro: int) -> bool:
        """Take, skip or discard the optimizer step after the last micro-batch; True when training
        stops now. ``loss``/``value``: this rank's loss of the step (mean over its micro-batches)."""
        precision, optimizer, strategy = self._precision, self.optimizer, self._strategy
        assert precision is not None and optimizer is not None and strategy is not None
        take_step, stop = True, False
        # One gradient element, non-finite on every rank if any rank poisoned its backward pass.
        grad = None if self._scan_all or self._sentinel is None else self._sentinel.grad
        if grad is None:
            flag = _nonfinite.scan_gradients(self)
        else:
            grad = strategy.local(grad)
            flag = strategy.agreed(grad[0] if self._sentinel_is_vector else grad.reshape(-1)[0])
        if math.isfinite(flag):
            if self._nonfinite_run:
                self._nonfinite_run.clear()
            self._window_sum += value
            self._window_count += 1
            self._epoch_sum += value
            self._epoch_count += 1
        else:
            take_step, stop = _nonfinite.agree(self, value, micro)
            if take_step is None:  # discarded for a stop request
                if self._job_preempt:
                    _preemption.preempt(self)
                return True

        if take_step and self.gradient_clip_val is not None and not self._clip_gradients():
            take_step = precision.scaler is not None  # the scaler skips it and lowers its scale
            if not take_step:
                _nonfinite.skip(self, "the gradients' norm was non-finite (every loss was finite)", [])
        if take_step:
            if precision.scaler is None:
                optimizer.step()
            else:
                precision.step(optimizer)
            if self.lr_scheduler is not None and self._scheduler_interval == "step":
                self.lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self.global_step += 1

        log = self.global_step % self.log_every_n_steps == 0
        if log:
            # A checkpoint saved by a step-end callback logs this step's metrics first (_Counters).
            self._log_pending = True
        for cb in self._step_end_callbacks:
            cb.on_train_step_end(self, loss)
        if log and self._log_pending:
            _logs.log_step(self)
        if self._job_preempt:
            _preemption.preempt(self)
            return True
        return stop or self._finished()

    def _clip_gradients(self) -> bool:
        """Clip (unscaling first under fp16); False when the gradients' norm is not finite."""
        assert self._precision is not None and self.optimizer is not None and self.model is not None
        self._precision.unscale(self.optimizer)  # fp16: exactly once per optimizer step
        params = [p for p in self.model.parameters() if p.grad is not None]
        # The norm is the same on every rank (the gradients are reduced), so every rank decides alike.
        return self._strategy.clip_gradients(  # type: ignore[union-attr]
            params,
            self.gradient_clip_val,
            self.gradient_clip_algorithm,  # type: ignore[arg-type]
        )

"""The Trainer: one training loop for one device, ``nn.DataParallel``, DDP and FSDP, built from
distkit's public helpers only (a user who outgrows it can read :meth:`Trainer.fit` and write the same
loop).

One optimizer step, in every strategy::

    for each micro-batch (the strategy's accumulation context: DDP's no_sync, FSDP's sync flag):
        with autocast:  loss = wrapped(batch)        # loss_fn(model(x), y) or training_step(...)
        value = loss.item()                          # where a hand-written loop reads it
        backward(loss / accumulate_grad_batches)     # through the GradScaler under fp16;
                                                     # poisoned if value is nan/inf or a stop is due
    read one element of one gradient (the sentinel)  # reduced: the same on every rank (in a
                                                     # world of one: whether it poisoned)
    if it is finite: unscale once, clip, step, schedule; else agree why, then skip or stop

The loop never asks which wrapper it holds: what differs between strategies sits behind
:class:`distkit.trainer.strategies._base.Strategy`. The loop itself is free functions in
:mod:`distkit.trainer._loop`: the epoch (``epoch``), the optimizer step (``step.optimizer_step``),
how a bad step or a stop request reaches every rank (``nonfinite``), set-up (``setup``), the metric
sums between logging steps (``logs``), validation (``evaluate``) and ``validate``/``test``/``predict``
(``inference``).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distkit import runtime
from distkit._doctor.doctor import check_timeout
from distkit._utils.slips import names_slips
from distkit.checkpoint import save_checkpoint
from distkit.collectives import all_gather_object
from distkit.data._checks import check_not_tensor_tuple
from distkit.errors import DistkitError
from distkit.trainer import launch, strategies
from distkit.trainer._loop import (
    epoch as _loop,
    inference as _inference,
    model_io as _model_io,
    preemption as _preemption,
    report as _report,
    setup as _setup,
    state as _state,
)
from distkit.trainer._loop.preemption import _Preempted
from distkit.trainer._run import Outcome, Run
from distkit.trainer.callbacks import Callback, TrainerView
from distkit.trainer.loggers import Logger
from distkit.trainer.precision import check_precision
from distkit.trainer.profiler import TorchProfiler, check_profiler
from distkit.trainer.strategies import DDPStrategy, FSDPStrategy

__all__ = ["Trainer"]

_log = runtime.get_logger("distkit.trainer", main_process_only=True)


# Lightning's names for what the Trainer's arguments are (and plain torch's habits).
_TRAINER_MEANT = {
    "gpus": "devices=N (processes under DDP/FSDP, GPUs under DP)",
    "accelerator": "the Trainer trains on CUDA when torch sees a GPU, else on the CPU; devices=N "
    "says how many",
    "num_nodes": "the nodes come from the launcher the Trainer joins (torchrun --nnodes, SLURM's srun)",
}
_FIT_MEANT = {
    "train_dataloaders": "pass the training data (a dataset or a DataLoader) as train_data, fit's "
    "second argument",
    "val_dataloaders": "pass the validation data as val_data, fit's third argument",
    "datamodule": "pass the datasets themselves: fit(model, train_data, val_data)",
    "criterion": "the loss function goes in loss_fn=",
}
_EVALUATE_MEANT = {
    "dataloaders": "pass the data (a dataset or a DataLoader) as data, the second argument",
    "datamodule": "pass the dataset itself as data, the second argument",
    "criterion": "the loss function goes in loss_fn=",
}


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
        max_epochs: Epochs to train; ``fit`` needs at least one of ``max_epochs`` and ``max_steps``
            (``validate``, ``test`` and ``predict`` need neither).
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
        check_val_every_n_epoch: Epochs between validations at the end of an epoch; ``None``:
            none there (only every ``val_check_interval`` steps).
        val_check_interval: An int: also validate every this many optimizer steps, counted across
            epochs, mid-epoch too (as nanoGPT's ``eval_interval``; Lightning's int counts batches
            within an epoch instead). A float ``f`` in (0, 1]: a fraction of an epoch, as Lightning's:
            ``round(1/f)`` validations in every epoch that ``check_val_every_n_epoch`` selects, at
            evenly spread optimizer steps, the last at the epoch's end (``0.25``: after each
            quarter), in place of its end-of-epoch validation. An epoch-end validation at a step
            just validated is not repeated. Validation comes before
            the step's checkpoint, so resuming stays exact.
        callbacks: :class:`Callback` objects (hooks run on every rank, in order), or one.
        logger: ``True`` for a :class:`CSVLogger` in ``default_root_dir``, ``False`` for none, or
            :class:`Logger` objects. Loggers write on the main process only.
        enable_checkpointing: Add a :class:`ModelCheckpoint` (every epoch and every 30 minutes of
            training, so a long epoch keeps a recent one; last 3 kept) unless one is among
            ``callbacks``.
        enable_progress_bar: ``True``: a tqdm bar on the main process; ``None``: the tqdm bar when
            stderr is a terminal and tqdm is installed, else plain lines (:class:`ProgressLog`:
            every 30 s, after each validation and at each epoch end; never bar frames in a log
            file); ``False``: neither.
        default_root_dir: Directory of logs and checkpoints.
        resume: ``"auto"`` to continue from the latest valid checkpoint when there is one, a
            checkpoint path, or ``None`` to start fresh. A near miss of ``"auto"`` (``"atuo"``,
            ``"Auto"``) that names no existing path raises ``ValueError`` here, as does one of
            ``"last"``/``"best"`` for a ``ckpt_path``.
        seed: ``distkit.seed_everything(seed)`` at the start of ``fit``, and the seed of the
            loaders ``fit`` makes; ``None`` leaves the RNGs alone and the loaders on distkit's
            default seed (``seed_everything``'s, else 0).
        scale_lr: ``"linear"`` or ``"sqrt"``: multiply the optimizer's learning rates by
            :func:`distkit.scale_lr`'s factor for the job's effective batch against
            ``base_batch_size`` (again after a resume on another number of ranks); ``None``: as given.
        base_batch_size: The effective batch size the given learning rates were tuned for.
        seed_per_rank: With ``seed``, give every rank its own random streams (dropout, augmentation)
            derived from ``seed`` and the rank, as nanoGPT's ``seed + rank``; the data order stays
            the common seed's. See :func:`distkit.seed_everything`.
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
        straggler_margin: The straggler report (``docs/scaling.md``, "Stragglers"): each rank
            times its steps by phase; at logging steps a rank slower than the median rank by more
            than this fraction in one phase, in three logging windows in a row, is named in the log
            and as the ``straggler_rank``/``straggler_slowdown`` metrics. The times ride on the
            logging step's one collective. ``None``: off.
        profiler: ``None``; ``"simple"``: the main process prints each phase's time per step (the
            median rank's and the slowest rank's) at the end of ``fit``; ``"torch"`` or a
            :class:`distkit.trainer.TorchProfiler`: one Chrome trace per rank of a window of steps
            (``docs/scaling.md``, "Profiling").

    Attributes:
        global_step: Optimizer steps taken or skipped so far.
        current_epoch: The epoch being trained (0-based); after ``fit``, the completed epochs.
        should_stop: Set to ``True`` (e.g. from a callback) to stop every rank after this step.
        callback_metrics: The latest logged metrics, reduced across ranks.
        skipped_steps: Steps skipped because a loss was non-finite on some rank.
        batches_in_epoch, running_loss, last_validation_step, last_validation_metrics,
            log_pending: read-only views of the loop for callbacks (see
            :class:`distkit.trainer.TrainerView`, the whole list of what a callback may read and set).
        run_config: The resolved configuration of a :class:`distkit.TrainerCLI` run: saved as
            ``<default_root_dir>/config.yaml`` by the main process, logged as the hyperparameters,
            compared across ranks and on resume; ``None`` for a Trainer built in Python.

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
    check_val_every_n_epoch: int | None
    val_check_interval: int | float | None
    callbacks: list[Callback]
    loggers: list[Logger]
    enable_progress_bar: bool | None
    default_root_dir: Path
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
    # The resolved configuration of a TrainerCLI run (None for a Trainer built in Python).
    run_config: dict[str, Any] | None

    # What the Trainer shows (model, counters, metrics, ...): the run of the latest fit() in this
    # process, or an Outcome (before any fit, and after one that ran in processes it started).
    _shown: Run | Outcome

    @names_slips(_TRAINER_MEANT)
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
        check_val_every_n_epoch: int | None = 1,
        val_check_interval: int | float | None = None,
        callbacks: Sequence[Callback] | Callback | None = None,
        logger: bool | Logger | Sequence[Logger] = True,
        enable_checkpointing: bool = True,
        enable_progress_bar: bool | None = None,
        default_root_dir: str | os.PathLike[str] = "runs",
        resume: str | os.PathLike[str] | None = None,
        seed: int | None = None,
        seed_per_rank: bool = False,
        scale_lr: str | None = None,
        base_batch_size: int | None = None,
        max_consecutive_nonfinite: int = 5,
        hang_timeout_s: float | str | None = "auto",
        compile: bool = False,
        straggler_margin: float | None = 0.2,
        profiler: str | TorchProfiler | None = None,
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
            val_check_interval=val_check_interval,
            max_consecutive_nonfinite=max_consecutive_nonfinite,
            gradient_clip_val=gradient_clip_val,
            gradient_clip_algorithm=gradient_clip_algorithm,
            compile=compile,
        )
        _setup.check_run_options(
            scale_lr=scale_lr,
            base_batch_size=base_batch_size,
            seed=seed,
            seed_per_rank=seed_per_rank,
            resume=resume,
        )
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
        self.val_check_interval = val_check_interval
        if not isinstance(default_root_dir, (str, os.PathLike)) or str(default_root_dir) in ("", "None"):
            # None from a config's `null` becomes "None" on the way: a directory ./None, in silence.
            raise TypeError(
                f"default_root_dir must be the path of the run's directory (default 'runs'), got "
                f"{default_root_dir!r}."
            )
        self.default_root_dir = Path(default_root_dir).expanduser()  # "~/runs", as a shell reads it
        self.resume = None if resume is None else os.fspath(resume)
        _setup.check_checkpoint_word(self.resume, "resume", ("auto",))
        self.seed = seed
        self.seed_per_rank = seed_per_rank
        self.scale_lr = scale_lr
        self.base_batch_size = base_batch_size
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.enable_progress_bar = enable_progress_bar
        self.hang_timeout_s = check_timeout(hang_timeout_s)
        self.compile = compile
        if straggler_margin is not None and not (
            isinstance(straggler_margin, (int, float)) and 0 <= straggler_margin < math.inf
        ):
            raise ValueError(
                f"straggler_margin must be a number >= 0 (0.2: 20% slower than the median rank) or None "
                f"to turn the straggler report off, got {straggler_margin!r}."
            )
        self.straggler_margin = None if straggler_margin is None else float(straggler_margin)
        self.profiler = check_profiler(profiler)
        self.run_config = None

        self.callbacks = _setup.callback_list(callbacks, enable_checkpointing)
        self.loggers = _setup.logger_list(logger)

        self._shown = Outcome()

    def __getstate__(self) -> dict[str, Any]:
        # The processes fit() starts get the Trainer's configuration; a run belongs to this process
        # (its loaders, wrapped model, strategy), and fit() makes a new one there.
        state = dict(self.__dict__)
        state["_shown"] = Outcome()
        return state

    # ------------------------------------------------------------------------------------------
    # What fit() set up and where it is: properties over the run (see distkit.trainer._run)

    @property
    def model(self) -> nn.Module | None:
        """The model of the latest ``fit`` (the module passed; after a ``fit`` that started its own
        processes, holding rank 0's final weights); ``None`` before."""
        return self._shown.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer of the latest ``fit`` (the one passed, or the one its factory made)."""
        return self._shown.optimizer

    @property
    def lr_scheduler(self) -> Any:
        """The learning-rate scheduler of the latest ``fit`` (``None`` without one)."""
        return self._shown.lr_scheduler

    @property
    def device(self) -> torch.device | None:
        """This process's device in the latest ``fit``/``validate``/``test``/``predict``."""
        return self._shown.device

    @property
    def world_size(self) -> int:
        """Processes in the job of the latest ``fit``/``validate``/``test``/``predict`` (1 before)."""
        return self._shown.world_size

    @property
    def global_step(self) -> int:
        """Optimizer steps taken or skipped so far."""
        return self._shown.global_step

    @property
    def current_epoch(self) -> int:
        """The epoch being trained (0-based); after ``fit``, the completed epochs."""
        return self._shown.current_epoch

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a loss was non-finite on some rank."""
        return self._shown.skipped_steps

    @property
    def callback_metrics(self) -> dict[str, float]:
        """The latest logged metrics, reduced across ranks (the dict itself: a callback may add
        entries, as Lightning's may)."""
        return self._shown.callback_metrics

    @property
    def should_stop(self) -> bool:
        """Whether training stops; setting it to ``True`` stops every rank after the current step."""
        return self._shown.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._shown.should_stop = bool(value)
        if value and isinstance(self._shown, Run):
            self._shown.request_stop = True

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0. Local."""
        return runtime.is_main_process()

    @property
    def num_training_batches(self) -> int | None:
        """Batches per epoch on each rank; ``None`` for a stream (an ``IterableDataset``), whose
        epoch ends when the stream does."""
        return self._shown.num_batches

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps per epoch (the last one may accumulate fewer micro-batches); ``None`` for
        a stream."""
        batches = self._shown.num_batches
        return None if batches is None else -(-batches // self.accumulate_grad_batches)

    @property
    def total_steps(self) -> int | None:
        """Optimizer steps ``fit`` takes in all: ``max_steps``, or ``max_epochs`` x
        ``steps_per_epoch`` when that is fewer (known once ``fit`` has made its loaders; before,
        ``max_steps`` or 0). A run resumed from a checkpoint of another number of ranks (other
        steps per epoch) counts the steps taken before, and those left at this job's steps per
        epoch. ``None`` for a stream trained by ``max_epochs`` alone (its length is known once
        read)."""
        steps = self.steps_per_epoch
        offset = getattr(self._shown, "steps_offset", 0)  # a resume from another number of ranks
        by_epochs = None if self.max_epochs is None or steps is None else self.max_epochs * steps + offset
        if self.max_steps is None:
            return None if steps is None else by_epochs or 0
        if by_epochs is None or not self._shown.num_batches:
            return self.max_steps
        return min(self.max_steps, by_epochs)

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step in the job: batch x replicas (ranks; GPUs under DP) x accumulation.

        Once ``fit`` has made its loader, the batch a step really takes: smaller than asked when
        ``batch_size`` is more than a rank's share of the data, or ``accumulate_grad_batches`` more
        than the batches of an epoch (the start-up report says which), so that throughput and
        ``scale_lr`` count the samples that are there."""
        shown = self._shown
        if isinstance(shown, Run):
            return _report.real_batch(shown)[1]
        if shown.effective_batch_size is not None:
            return shown.effective_batch_size
        return self.batch_size * self.accumulate_grad_batches

    @property
    def batches_in_epoch(self) -> int:
        """Batches (micro-batches under accumulation) of the current epoch this rank has consumed,
        the restored ones of a resumed run included; 0 at an epoch's start. Local."""
        return self._shown.batches_done if isinstance(self._shown, Run) else 0

    @property
    def running_loss(self) -> float | None:
        """This rank's mean training loss over the optimizer steps taken since the last logging
        step (not reduced across ranks: the logged ``train_loss`` is); ``None`` before the first
        step after a logging step, or when every step since was skipped. Local."""
        run = self._shown
        if not isinstance(run, Run) or not run.window_count:
            return None
        return run.window_sum / run.window_count

    @property
    def last_validation_step(self) -> int | None:
        """The ``global_step`` at which validation last ran in this ``fit`` (``None`` before it)."""
        step = self._shown.last_validation[0] if isinstance(self._shown, Run) else -1
        return None if step < 0 else step

    @property
    def last_validation_metrics(self) -> dict[str, float]:
        """The metrics of the last validation of this ``fit``, reduced across ranks (a copy; empty
        before it). Compare :attr:`last_validation_step` with :attr:`global_step` to tell whether
        they describe the model as it is now."""
        return dict(self._shown.last_validation[1]) if isinstance(self._shown, Run) else {}

    @property
    def log_pending(self) -> bool:
        """True in the step-end callbacks of a logging step whose metrics are not logged yet: an
        ``on_log`` call for this step follows them (a checkpoint saved in a step-end callback logs
        them first, and this turns False)."""
        return isinstance(self._shown, Run) and self._shown.log_pending

    # ------------------------------------------------------------------------------------------
    # fit

    @names_slips(_FIT_MEANT)
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
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Train ``model`` on ``train_data``, validating on ``val_data`` every epoch (and every
        ``val_check_interval`` steps).

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
                ``loss_fn(model(inputs), target)``); without ``loss_fn``, a model that computes its
                own loss: a ``forward`` with a parameter named ``targets``, ``target``, ``labels``
                or ``label`` is called ``model(inputs, targets=target)`` (nanoGPT), dict batches
                as ``model(**batch)`` (Hugging Face), and the loss is found in the output (the
                output itself, ``output["loss"]``/``output.loss``, or the one-element tensor of a
                ``(logits, loss)`` tuple); or a model with ``training_step(batch, batch_idx)``
                returning the loss (or a dict with ``"loss"`` and more metrics to log) and optionally
                ``validation_step(batch, batch_idx)`` returning a dict of metrics (numbers or
                tensors as batch means, per-sample tensors, or ``(sum, count)`` pairs).
            train_data: A map-style dataset (loaded with :func:`distkit.distributed_dataloader`:
                this rank's share, seeded, resumable mid-epoch), or a DataLoader used as it is.
            val_data: Like ``train_data``; loaded with ``evaluation=True`` so that every sample is
                seen exactly once across ranks and validation metrics are exact.
            optimizer: An optimizer over ``model``'s parameters, or a function making one from them.
            loss_fn: ``loss_fn(output, target) -> loss`` (the batch mean) for plain models.
            lr_scheduler: A scheduler of ``optimizer``, or a function making one from it: either
                ``fn(optimizer)`` or ``fn(optimizer, trainer)``, called once the loaders exist, so
                ``trainer.steps_per_epoch`` and ``trainer.total_steps`` are known (schedules in
                epochs: :func:`distkit.trainer.warmup_schedule`).
            scheduler_interval: Step the scheduler after every optimizer ``"step"`` or every ``"epoch"``.
            metrics: Extra validation metrics of plain models: ``name -> fn(output, target)``
                returning per-sample values (e.g. :func:`distkit.trainer.accuracy`); logged as
                ``val_<name>`` beside ``val_loss``.
            ckpt_path: Resume this ``fit`` from a checkpoint, in place of the Trainer's ``resume``
                (as Lightning's ``fit(ckpt_path=...)``): a path, ``"last"`` (the latest
                checkpoint of the ModelCheckpoint's directory; a fresh start when there is none,
                as ``resume="auto"``) or ``"best"`` (its best by ``monitor``).

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
        if self.max_epochs is None and self.max_steps is None:
            raise ValueError(
                "fit() needs to know when to stop: give the Trainer max_epochs or max_steps (or both). "
                "validate(), test() and predict() need neither."
            )
        if scheduler_interval not in ("step", "epoch"):
            raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}.")
        if ckpt_path is not None:
            resume, self.resume = self.resume, _setup.fit_resume(self, ckpt_path)
            try:
                self.fit(
                    model,
                    train_data,
                    val_data,
                    optimizer=optimizer,
                    loss_fn=loss_fn,
                    lr_scheduler=lr_scheduler,
                    scheduler_interval=scheduler_interval,
                    metrics=metrics,
                )
            finally:
                self.resume = resume
            return
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        if metrics is not None and not isinstance(metrics, Mapping):
            raise TypeError(
                f"metrics must map names to metric functions, e.g. {{'acc': distkit.trainer.accuracy}}, "
                f"got {type(metrics).__name__}."
            )
        _model_io.convention(model, loss_fn)  # raises when there is no way to a loss
        _model_io.check_trains(model)  # before any process starts
        check_not_tensor_tuple(train_data, "train_data")
        check_not_tensor_tuple(val_data, "val_data")
        plan = strategies.resolve(self.strategy, self.devices)
        if plan.launch:
            kwargs = {
                "optimizer": optimizer,
                "loss_fn": loss_fn,
                "lr_scheduler": lr_scheduler,
                "scheduler_interval": scheduler_interval,
                "metrics": metrics,
            }
            final = launch.run_workers(self, plan, model, (train_data, val_data), kwargs)
            self._shown = launch.outcome_of(final, model, plan.world_size)
            launch.take_objects(self, self._shown, model, kwargs, final)
            if final["preempted"]:
                raise _Preempted()
            return

        self._shown = Outcome()  # the counters and metrics start over
        with contextlib.ExitStack() as undo:  # what set-up did that fit undoes, also on failure
            undo.callback(_setup.finalize_loggers, self)
            try:
                run = _setup.setup(
                    self,
                    undo,
                    plan,
                    model,
                    (train_data, val_data),
                    optimizer,
                    lr_scheduler,
                    loss_fn=loss_fn,
                    metric_fns=dict(metrics or {}),
                    scheduler_interval=scheduler_interval,
                    on_run=self._show,
                )
                # Only around the loop, where the flag is looked at every step: during set-up
                # SIGTERM keeps its usual meaning.
                previous_handler = _preemption.install_handler(run)
                try:
                    _loop.train(run)
                finally:
                    _preemption.restore_handler(run, previous_handler)
            except BaseException as err:
                _setup.on_failure(self, err)
                raise
        if run.preempted:
            raise _Preempted()

    def _show(self, run: Run) -> None:
        self._shown = run

    # ------------------------------------------------------------------------------------------
    # validate, test, predict

    @names_slips(_EVALUATE_MEANT)
    def validate(
        self,
        model: nn.Module,
        data: Any,
        *,
        ckpt_path: str | os.PathLike[str] | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        metrics: Mapping[str, Callable[[torch.Tensor, torch.Tensor], Any]] | None = None,
    ) -> dict[str, float]:
        """Validate ``model`` on every sample of ``data`` once; the metrics equal one process's.

        Collective: call on every rank (under a launcher). Outside a launcher a multi-process
        strategy starts its processes as :meth:`fit` does and returns rank 0's result; with one
        device it runs here. Works with or without ``fit`` first (after ``fit`` under FSDP, on the
        sharded model). Metrics are ``val_loss`` and ``val_<name>`` (plain models; ``loss_fn`` or
        a forward that takes the target) or a ``validation_step``'s dict, each reduced exactly
        (sum and count over every sample) and also put in ``callback_metrics``.

        Args:
            model: The model (``validation_step(batch, batch_idx)`` optional).
            data: A map-style dataset (split over the ranks without padding) or a DataLoader.
            ckpt_path: A checkpoint to load the model's weights from first, or ``"best"``/``"last"``
                of the ModelCheckpoint's directory (as Lightning's; full or sharded,
                saved by any number of ranks).
            loss_fn: ``loss_fn(output, target)`` of a plain model.
            metrics: ``name -> fn(output, target)`` returning per-sample values.

        Returns:
            The metrics, the same on every rank.

        Example:
            >>> trainer.validate(model, val_set, loss_fn=F.cross_entropy,
            ...                  metrics={"acc": distkit.trainer.accuracy})  # doctest: +SKIP
            {'val_loss': 0.31, 'val_acc': 0.91}
        """
        return _inference.evaluate(
            self, self._shown, "val", model, data, ckpt_path=ckpt_path, loss_fn=loss_fn, metrics=metrics
        )

    @names_slips(_EVALUATE_MEANT)
    def test(
        self,
        model: nn.Module,
        data: Any,
        *,
        ckpt_path: str | os.PathLike[str] | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        metrics: Mapping[str, Callable[[torch.Tensor, torch.Tensor], Any]] | None = None,
    ) -> dict[str, float]:
        """:meth:`validate` on a test set: metrics named ``test_*``, from ``test_step`` when the
        model has one (else ``validation_step``). Collective, like :meth:`validate`.

        Example:
            >>> trainer.test(model, test_set, ckpt_path="runs/checkpoints/step-00001000",
            ...              loss_fn=F.cross_entropy)  # doctest: +SKIP
            {'test_loss': 0.29}
        """
        return _inference.evaluate(
            self, self._shown, "test", model, data, ckpt_path=ckpt_path, loss_fn=loss_fn, metrics=metrics
        )

    @names_slips(_EVALUATE_MEANT)
    def predict(
        self,
        model: nn.Module,
        data: Any,
        *,
        ckpt_path: str | os.PathLike[str] | None = None,
        all_ranks: bool = False,
    ) -> Any:
        """The model's output for every sample of ``data`` once, in dataset order.

        Collective: call on every rank (under a launcher); outside one, as :meth:`validate`. Each
        batch is ``model.predict_step(batch, batch_idx)`` when defined, else ``model(inputs)`` for
        ``(inputs, target)`` batches, ``model(batch)`` for tensors, ``model(**batch)`` for dicts.

        Args:
            model: The model.
            data: A map-style dataset (split over the ranks without padding) or a DataLoader.
            ckpt_path: A checkpoint to load the model's weights from first (a path, ``"best"`` or
                ``"last"``, as in :meth:`validate`).
            all_ranks: Return the predictions on every rank, not only the main process (under a
                launcher).

        Returns:
            Tensor outputs joined along the first dimension (dicts and tuples of tensors keep
            their structure), other outputs as a list; ``None`` on the other ranks unless
            ``all_ranks``.

        Example:
            >>> logits = trainer.predict(model, test_set)  # doctest: +SKIP
            >>> logits.shape
            torch.Size([10000, 10])
        """
        return _inference.predict(self, self._shown, model, data, ckpt_path=ckpt_path, all_ranks=all_ranks)

    # ------------------------------------------------------------------------------------------
    # Checkpoints

    def checkpoint_state(self) -> dict[str, Any]:
        """The objects a checkpoint saves and restores.

        Model (the user's module, unwrapped), optimizer, scheduler, gradient scaler, the loop
        position with every rank's RNG state (a :class:`distkit.checkpoint.ResumeState`), the
        loader's position, the Trainer's counters and latest metrics with every rank's partial sums
        of the metrics it logs next, the callbacks' state, and under
        ``DDPStrategy(comm_hook="powersgd")`` PowerSGD's state (``"comm_hook"``: every rank's error
        feedback and the warm-start matrices, gathered when saved).

        Local to build; saving it is collective (the ResumeState gathers every rank's RNG state, the
        counters every rank's partial sums). Saved from ``on_train_step_end`` at a logging step, the
        save first logs that step's metrics (the log's collective), so that the checkpoint holds
        the state the run goes on from.

        Example:
            >>> manager.save(trainer.global_step, trainer.checkpoint_state())  # doctest: +SKIP
        """
        if not isinstance(self._shown, Run):
            raise DistkitError(
                "checkpoint_state() describes a fit() in progress in this process: call it from a "
                "callback (or after a fit() that ran here); to save a model outside fit(), use "
                "distkit.save_checkpoint(path, {'model': model, 'optimizer': optimizer})."
            )
        return _state.checkpoint_state(self._shown)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> str:
        """Save the run as a committed checkpoint at ``path`` (as Lightning's
        ``trainer.save_checkpoint``): what :meth:`checkpoint_state` holds, so that
        ``Trainer(resume=path)`` continues exactly from it.

        Collective: call it on every rank, with the same path (from a callback, or after a ``fit``
        that ran in this process). Called on some ranks only (inside ``if trainer.is_main_process:``)
        it raises :class:`~distkit.CollectiveMismatchError` naming the ranks that never came, instead
        of waiting for them; ranks passing different paths raise ``ValueError``.

        Returns:
            ``path`` as a string.

        Example:
            >>> trainer.fit(model, train_set, optimizer=make_optimizer)  # doctest: +SKIP
            >>> trainer.save_checkpoint("runs/after-fit")  # on every rank  # doctest: +SKIP
        """
        where = os.fspath(path)
        paths = all_gather_object(where)  # every rank comes, with the same path
        if len(set(paths)) > 1:
            raise ValueError(
                f"save_checkpoint() is collective and writes one checkpoint, but the ranks passed "
                f"different paths: {paths}; pass the same path on every rank."
            )
        state = self.checkpoint_state()
        return save_checkpoint(where, state, step=self.global_step)


if TYPE_CHECKING:

    def _keeps_the_callback_contract(trainer: Trainer) -> TrainerView:
        # mypy checks here that the Trainer has every member TrainerView promises callbacks.
        return trainer

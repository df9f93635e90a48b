"""What ``fit`` does before the first step: process group, strategy, precision, optimizer,
scheduler, loaders, callbacks, the checkpoint directory's claim and the resume."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

from distkit import runtime
from distkit._utils.secrets import redact_text, redact_url
from distkit.checkpoint import CheckpointConflictError, load_checkpoint
from distkit.collectives import _outcomes, all_gather_object
from distkit.data import DistributedLoader, StreamLoader, distributed_dataloader
from distkit.errors import DistkitError
from distkit.seeding import _MAX_SEED, _check_seed, seed_everything
from distkit.stragglers import StragglerDetector
from distkit.trainer import schedules
from distkit.trainer._loop import model_io as _model_io, report as _report, state as _state
from distkit.trainer._loop.batches import length
from distkit.trainer._loop.state import (
    _is_inside,
    _is_same,
    _rebind,
    _track_optimizer_steps,
)
from distkit.trainer._loop.step import _StepModule
from distkit.trainer._run import Options, Run, Scheduled, checkpoint_callback
from distkit.trainer.callbacks import Callback, ModelCheckpoint, check_hooks
from distkit.trainer.config import run_config as _run_config
from distkit.trainer.loggers import CSVLogger, Logger, _failing
from distkit.trainer.precision import Precision
from distkit.trainer.profiler import TorchProfiler, _TorchProfilerCallback
from distkit.trainer.progress import ProgressLog, _default_progress, _ProgressBar
from distkit.trainer.strategies._base import DataParallelStrategy, DDPStrategyRunner, Strategy
from distkit.trainer.strategies._fsdp import FSDPStrategyRunner

if TYPE_CHECKING:
    from distkit.trainer import strategies
    from distkit.trainer.callbacks import TrainerView

__all__: list[str] = []

_log = runtime.get_logger("distkit.trainer", main_process_only=True)


def setup(
    trainer: Options,
    stack: contextlib.ExitStack,
    plan: strategies._Plan,
    model: nn.Module,
    data: tuple[Any, Any],
    optimizer: Any,
    lr_scheduler: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    metric_fns: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]],
    scheduler_interval: str,
    on_run: Callable[[Run], None],
) -> Run:
    """Everything ``fit`` sets up before the loop, in order; the run it made. Collective (process
    group, DDP's or FSDP's set-up, the checkpoint claim and the resume).

    What must be undone at the end of ``fit`` (the hang doctor's settings, the strategy's wrapping,
    a progress bar) goes on ``stack`` as soon as it is made, so a failure half-way undoes it too.
    ``on_run`` gets the run as soon as it exists, before the scheduler factory, the callbacks'
    set-up and the resume, which read the Trainer's properties over it.
    """
    train_data, val_data = data
    if plan.world_size > 1:
        join_job(plan)
        # From here on a rank that waits too long is reported (the set-up's own collectives
        # included: the checkpoint claim, the resume's gathers).
        stack.callback(runtime._watch_fit(trainer, trainer.hang_timeout_s, trainer.default_root_dir))
    world_size = runtime.get_world_size()
    # Before DDP compares the parameters' shapes: every rank parsed the same TrainerCLI config.
    _run_config.check_ranks_agree(trainer)
    device = plan.device()
    if trainer.seed is not None:
        # workers=False: the Trainer hands the seed to its own loaders; the process-wide default
        # seed of loaders made elsewhere stays as it was.
        seed_everything(trainer.seed, workers=False, per_rank=trainer.seed_per_rank)

    model_class = type(model)  # FSDP changes the class (MLP becomes FSDPMLP)
    strategy = _make_strategy(plan, compile=trainer.compile)
    precision = Precision(trainer.precision, device, autocast=strategy.uses_autocast())
    # Names of the parameters as given: a strategy that replaces them (FSDP shards them) gets
    # an optimizer made over the originals rebound to the replacements.
    names = {id(p): name for name, p in model.named_parameters()}
    stack.callback(strategy.teardown, model)
    strategy.prepare(model, device, trainer.precision)
    step_module = _StepModule(model, loss_fn, per_device=plan.kind == "dp")
    wrapped = strategy.wrap(step_module, device)
    optimizer = make_optimizer(model, optimizer, names)
    params = [p for p in model.parameters() if p.requires_grad]
    # Gradients the optimizer clears every step (a frozen-but-grad parameter outside it would
    # keep a poisoned gradient); without find_unused_parameters or static_graph DDP fails any
    # step in which a rank leaves a parameter unused, so one sentinel is then enough.
    # A one-dimensional sentinel (a bias) is the cheapest to read, the shortest one most of all
    # (Strategy.sentinel_reader).
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    # Under FSDP each rank reads its own shard: one that is not empty on this rank.
    candidates = [p for p in params if id(p) in stepped and strategy.local(p).numel() > 0]
    sentinel = min(candidates, key=lambda p: (p.dim() != 1, p.dim(), p.numel()), default=None)
    generators = [torch.default_generator]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generators.append(torch.cuda.default_generators[index])

    # Under DP one loader batch is split over the GPUs, each of which gets `batch_size`.
    replicas = len(plan.cuda_indices) if plan.kind == "dp" else world_size
    per_loader = trainer.batch_size * (replicas if plan.kind == "dp" else 1)
    train_loader = make_loader(trainer, train_data, per_loader, evaluation=False, world_size=world_size)
    per_replica_batch = (
        trainer.batch_size
        if makes_loader(train_data)
        else int(getattr(train_loader, "batch_size", None) or trainer.batch_size)
    )
    val_per_loader = trainer.val_batch_size * (replicas if plan.kind == "dp" else 1)
    val_loader = (
        None
        if val_data is None
        else make_loader(trainer, val_data, val_per_loader, evaluation=True, world_size=world_size)
    )
    # A stream (or a DataLoader over an IterableDataset) has no length: its epoch ends when it does.
    num_batches = length(train_loader)
    if world_size > 1 and not isinstance(train_loader, (DistributedLoader, StreamLoader)):
        num_batches = _shortest_epoch(num_batches)
    if num_batches == 0:
        raise ValueError("the training data gives no batch on this rank; use more data or a smaller batch.")
    val_every, val_steps_in_epoch = _validation_schedule(trainer, num_batches)
    run = Run(
        trainer=trainer,
        plan=plan,
        strategy=strategy,
        precision=precision,
        device=device,
        world_size=world_size,
        model=model,
        model_class=model_class,
        wrapped=wrapped,
        per_device=step_module.per_device,
        optimizer=optimizer,
        train_loader=train_loader,
        val_loader=val_loader,
        loss_fn=loss_fn,
        metric_fns=metric_fns,
        scheduler_interval=scheduler_interval,
        params=params,
        sentinel=sentinel,
        scan_all=strategy.scan_all,
        read_sentinel=None if sentinel is None else strategy.sentinel_reader(sentinel),
        generators=generators,
        num_batches=num_batches,
        per_replica_batch=per_replica_batch,
        replicas=replicas,
        checkpoint=checkpoint_callback(trainer.callbacks),
        val_every=val_every,
        val_steps_in_epoch=val_steps_in_epoch,
    )
    if (trainer.straggler_margin is not None and run.world_size > 1) or trainer.profiler == "simple":
        # margin=inf: the phases are compared (for the profile), nobody is named. A world of one
        # has no rank to compare: without the profile no one reads its phase times (and its loop
        # may take the lean step, epoch.py).
        margin = math.inf if trainer.straggler_margin is None else trainer.straggler_margin
        run.stragglers = StragglerDetector(margin=margin)
    on_run(run)
    # After the loaders: a factory may read trainer.steps_per_epoch and trainer.total_steps.
    schedules.apply_scaling(run)
    run.lr_scheduler = make_scheduler(trainer, optimizer, lr_scheduler)

    # A tqdm bar in a terminal, plain lines (ProgressLog) in a log file; main process only.
    run.callbacks = list(trainer.callbacks)
    progress = _default_progress(trainer.enable_progress_bar, trainer.callbacks)
    if progress is not None and runtime.is_main_process():
        run.callbacks.insert(0, progress)
    stack.callback(_close_progress_bars, run.callbacks)
    if isinstance(trainer.profiler, TorchProfiler):
        profiling = _TorchProfilerCallback(trainer.profiler, trainer.default_root_dir)
        run.callbacks.append(profiling)
        stack.callback(profiling.close)  # a failed fit stops it too
    checkpoint = run.checkpoint
    if checkpoint is not None:
        checkpoint.setup(trainer)
        claim(trainer, checkpoint)
    # A TrainerCLI run's config: the same on every rank, and a resume of a changed model refused
    # before its checkpoint is loaded; then saved beside the checkpoints (docs/config.md).
    changed = _run_config.check_resume(trainer)  # the optimizer settings a resume changes
    configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    resumed_from = restore(run)
    _run_config.save(trainer, resumed_from)
    if resumed_from is not None:
        schedules.apply_changed_settings(run, configured, changed)
        schedules.rescale_after_restore(run)
    if runtime.is_main_process():
        for logger in trainer.loggers:
            logger.setup(trainer.default_root_dir, resumed_from)
            logger.log_hyperparams(_report.hyperparams(run))
    runtime.rank_zero_print(_report.report(run, resumed_from))
    run.step_end_callbacks = [
        cb for cb in run.callbacks if type(cb).on_train_step_end is not Callback.on_train_step_end
    ]
    run.scheduled_callbacks = [cb for cb in run.step_end_callbacks if _scheduled(cb)]
    run.every_step_callbacks = [cb for cb in run.step_end_callbacks if not _scheduled(cb)]
    for cb in run.callbacks:
        cb.on_fit_start(trainer)
    return run


def _scheduled(cb: Callback) -> TypeGuard[Scheduled]:
    """Whether ``cb``'s step-end hook is one of the Trainer's own, which say at which step they
    next act (``_next_step_end``); a subclass that overrides the hook is called every step."""
    return any(
        isinstance(cb, kind) and type(cb).on_train_step_end is kind.on_train_step_end
        for kind in (ModelCheckpoint, ProgressLog, _ProgressBar)
    )


def _close_progress_bars(callbacks: list[Callback]) -> None:
    for cb in callbacks:
        if isinstance(cb, _ProgressBar):
            cb.close()


def join_job(plan: strategies._Plan) -> None:
    """Join the process group of a multi-process plan, on this rank's device (idempotent: a
    second call with the same options returns at once). Collective; nothing for one process."""
    if plan.world_size > 1:
        local_rank = runtime.get_env().local_rank
        explicit = torch.device("cuda", plan.cuda_indices[local_rank]) if plan.cuda_indices else None
        runtime.init(plan.options.backend, timeout_s=plan.options.timeout_s, device=explicit)


def on_failure(trainer: Options, err: BaseException) -> None:
    """What a failed ``fit`` does before its error goes on."""
    _model_io.note_lightning_habit(err)
    _note_schedule_end(trainer, err)
    # This rank's own error: the other ranks learn it first. A collective that failed because a
    # rank ended: one report of where every rank is, naming that rank, and this rank exits.
    runtime._on_failure(err)
    # A failed fit lets go of the checkpoint directory now, without waiting on ranks that may be
    # gone (a successful one closes it in ModelCheckpoint.on_fit_end).
    checkpoint = checkpoint_callback(trainer.callbacks)
    if checkpoint is not None and checkpoint.manager is not None:
        checkpoint.manager.__exit__(type(err), err, err.__traceback__)


def _note_schedule_end(trainer: Options, err: BaseException) -> None:
    """Say why a scheduler with a fixed length (OneCycleLR) ran out of steps: the checkpoint's
    scheduler was made for the job that saved it, whose number of ranks gave another number of
    steps per epoch. Local."""
    run = getattr(trainer, "_shown", None)
    scheduler = getattr(run, "lr_scheduler", None)
    if not (isinstance(err, ValueError) and "Tried to step" in str(err) and scheduler is not None):
        return
    length = getattr(scheduler, "total_steps", None)
    err.args = (
        f"{err}\ndistkit: the learning-rate scheduler ({type(scheduler).__name__}) was made for "
        f"{length} steps, and this run goes on past them at step {trainer.global_step + 1} "
        f"({trainer.steps_per_epoch} steps an epoch here). Make it as long as the run: "
        f"total_steps=trainer.total_steps, in a factory of (optimizer, trainer). A run resumed on "
        f"another number of ranks than the one that saved it takes another number of steps an "
        f"epoch, while the scheduler's state, its length included, comes from the checkpoint: "
        f"resume on the number of ranks that saved it, or train by max_steps (a length in "
        f"optimizer steps, the same on any number of ranks).",
    )


def finalize_loggers(trainer: Options) -> None:
    """Finalise the loggers on the main process, at the end of every ``fit`` (a failed one too)."""
    if not runtime.is_main_process():
        return
    # Every logger, even after one raised (a tracking server gone at the end): the others close
    # their files and let go of their directories' locks, or the next fit in this process (a
    # notebook's) would be refused as another run. The first error goes on.
    failing = _failing()  # fit's own error is on its way up: it is the one to see
    failed: BaseException | None = None
    for logger in trainer.loggers:
        try:
            logger.finalize()
        except BaseException as err:
            if failing:
                _log.warning("%s could not finish: %s", type(logger).__name__, redact_text(str(err)))
            failed = failed or err
    if failed is not None and not failing:
        raise failed


def named_checkpoint(trainer: Options, which: str) -> str | None:
    """The path of the ModelCheckpoint's ``"best"`` or ``"last"`` checkpoint (``None``: none there
    yet), as Lightning's ``ckpt_path="best"``/``"last"``. Local (reads the directory)."""
    checkpoint = checkpoint_callback(trainer.callbacks)
    if checkpoint is None:
        raise ValueError(
            f"ckpt_path={which!r} names a checkpoint of the ModelCheckpoint's directory, but "
            f"checkpointing is off; pass a checkpoint path, or enable_checkpointing=True (or a "
            f"ModelCheckpoint callback)."
        )
    if which == "best" and checkpoint.monitor is None:
        raise ValueError(
            "ckpt_path='best' picks the best checkpoint by a metric, and the ModelCheckpoint has none: "
            "give it one, ModelCheckpoint(monitor='val_loss', keep_best=1), or use ckpt_path='last'."
        )
    if checkpoint.manager is None:
        checkpoint.setup(trainer)  # reads the directory; claims nothing
    found = checkpoint.manager.best() if which == "best" else checkpoint.manager.latest()
    return None if found is None else str(found)


def check_checkpoint_word(value: str | None, name: str, words: tuple[str, ...]) -> None:
    """Refuse a slip of one of ``words`` (``resume='atuo'`` for ``'auto'``, ``ckpt_path='lats'``)
    that names no existing path, instead of looking for a checkpoint of that name. Local."""
    if value is None or value in words or "://" in value or os.path.exists(value):
        return
    if name == "resume" and value in ("last", "best"):
        # fit(ckpt_path=...)'s words, where the Trainer takes 'auto' or a path.
        raise ValueError(
            f"resume={value!r} is fit(ckpt_path={value!r})'s word, not Trainer(resume=...)'s: pass "
            f"resume='auto' to continue from the latest checkpoint"
            + (", or fit(..., ckpt_path='best') for the best one." if value == "best" else ".")
        )
    close = difflib.get_close_matches(value.lower(), words, n=1, cutoff=0.7)
    if close:
        named = " nor ".join(repr(word) for word in words)
        raise ValueError(
            f"{name}={value!r} is neither {named} nor an existing checkpoint path. Did you mean "
            f"{name}={close[0]!r}?"
        )


def fit_resume(trainer: Options, ckpt_path: str | os.PathLike[str]) -> str:
    """``fit(ckpt_path=...)`` as a ``resume`` value: ``"last"`` is ``"auto"`` (a fresh start when
    the directory holds none), ``"best"`` the best checkpoint's path, a path itself."""
    path = os.fspath(ckpt_path)
    check_checkpoint_word(path, "ckpt_path", ("last", "best"))
    if path == "last":
        return "auto"
    if path == "best":
        return evaluation_checkpoint(trainer, path)
    return path


def evaluation_checkpoint(trainer: Options, ckpt_path: str | os.PathLike[str]) -> str:
    """The checkpoint ``ckpt_path`` names: ``"best"``/``"last"`` of the ModelCheckpoint's
    directory (which must hold one), or the path itself."""
    path = os.fspath(ckpt_path)
    check_checkpoint_word(path, "ckpt_path", ("best", "last"))
    if path not in ("best", "last"):
        return path
    found = named_checkpoint(trainer, path)
    if found is None:
        checkpoint = checkpoint_callback(trainer.callbacks)
        where = redact_url(str(checkpoint.directory)) if checkpoint is not None else "?"
        what = (
            f"no checkpoint ranked by {checkpoint.monitor!r}"
            if path == "best" and checkpoint
            else "no checkpoint"
        )
        raise ValueError(
            f"ckpt_path={path!r}: {where} holds {what} yet (fit() with this ModelCheckpoint writes "
            f"them); pass a checkpoint path instead."
        )
    return found


def _validation_schedule(
    trainer: Options, num_batches: int | None
) -> tuple[int | None, frozenset[int] | None]:
    """``val_check_interval`` as ``(every so many optimizer steps, across epochs; the steps within
    an epoch)``: an int is the first; a fraction ``f`` of an epoch the second, ``round(1/f)`` steps
    spread evenly, the last one the epoch's last step (so the epoch-end checkpoint is ranked by it)."""
    interval = trainer.val_check_interval
    if not isinstance(interval, float):
        return interval, None
    if num_batches is None:
        raise ValueError(
            f"val_check_interval={interval} is a fraction of an epoch, and the training data is a stream "
            f"whose epoch length is unknown; give a number of optimizer steps (an int) instead."
        )
    steps = -(-num_batches // trainer.accumulate_grad_batches)
    times = max(1, round(1 / interval))
    return None, frozenset(max(1, round(k * steps / times)) for k in range(1, times + 1))


def _shortest_epoch(mine: int | None) -> int | None:
    """The batches of an epoch on every rank when the ranks loaded with loaders of their own (one
    small gather at set-up): the shortest rank's count, so that every rank ends the epoch at the
    same step instead of one waiting in a collective for a rank that ran out. Collective."""
    lengths = all_gather_object(mine)
    if len(set(lengths)) == 1:
        return mine
    if None in lengths:
        raise DistkitError(
            f"{runtime._rank_label()} the ranks' training loaders give "
            f"{lengths} batches (None: no length), so the ranks cannot agree where an epoch ends. "
            f"Pass the dataset itself (map-style or an IterableDataset) to have distkit split it, or "
            f"give every rank a loader of the same kind."
        )
    shortest = min(n for n in lengths if n is not None)
    _log.warning(
        "the ranks' own training loaders have different lengths (%s batches): every rank stops each "
        "epoch after %d, the shortest, so that none waits for a rank that ran out; the rest of the "
        "longer ones is not trained on. Pass the dataset itself to split it evenly.",
        lengths,
        shortest,
    )
    return shortest


def makes_loader(data: Any) -> bool:
    """Whether ``data`` is a dataset the Trainer loads itself (not a loader to use as it is)."""
    return not isinstance(data, (torch.utils.data.DataLoader, DistributedLoader, StreamLoader))


def make_optimizer(
    model: nn.Module, optimizer: Any, names: Mapping[int, str] | None = None
) -> torch.optim.Optimizer:
    """The optimizer passed (rebound to replaced parameters), or the one the factory makes; it must
    hold this model's parameters only. Local."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or a function of the parameters, got "
                f"{type(optimizer).__name__}."
            )
        optimizer = optimizer(model.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(optimizer).__name__}, not an Optimizer.")
    if names:
        _rebind(optimizer, model, names)
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in own)
    if foreign:
        raise ValueError(
            f"the optimizer holds {foreign} parameter(s) that are not parameters of the model given "
            f"to fit() (was it made for another copy of the model?). Make it from this model's "
            f"parameters, or pass a function: optimizer=functools.partial(torch.optim.Adam, lr=1e-3)."
        )
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(p.requires_grad for p in held):
        raise ValueError(
            f"the optimizer updates nothing: its {len(held)} parameter(s) all have "
            f"requires_grad=False (frozen), so fit() would not change the model. Make it from the "
            f"parameters that train, e.g. (p for p in model.parameters() if p.requires_grad), or "
            f"unfreeze them first (module.requires_grad_(True))."
        )
    return optimizer


def make_scheduler(trainer: TrainerView, optimizer: torch.optim.Optimizer, lr_scheduler: Any) -> Any:
    """The scheduler passed, or the one the factory makes over ``optimizer`` (the Trainer's).
    Local."""
    if lr_scheduler is None:
        return None
    if not callable(getattr(lr_scheduler, "step", None)):
        if not callable(lr_scheduler):
            raise TypeError(
                f"lr_scheduler must be a scheduler or a function of the optimizer, got {lr_scheduler!r}."
            )
        lr_scheduler = lr_scheduler(*((optimizer, trainer) if _takes_trainer(lr_scheduler) else (optimizer,)))
    if getattr(lr_scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError(
            "lr_scheduler belongs to another optimizer than the one given to fit(); make it from that "
            "optimizer, or pass a function of the optimizer."
        )
    _track_optimizer_steps(lr_scheduler)
    return lr_scheduler


def _takes_trainer(factory: Any) -> bool:
    """Whether a scheduler factory takes ``(optimizer, trainer)`` rather than ``(optimizer)``."""
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    # A bare (*args, **kwargs) is a wrapper (TrainerCLI's scheduler, made by jsonargparse, passes
    # them on to the class's __init__, where the Trainer would land in step_size): optimizer only.
    variadic = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    return len(positional) >= 2 or (variadic and len(positional) == 1)


def make_loader(trainer: Options, data: Any, batch_size: int, *, evaluation: bool, world_size: int) -> Any:
    """A distkit loader over a dataset, or a loader given as it is (warning when it is not sharded
    over ``world_size`` processes)."""
    if makes_loader(data):
        with warnings.catch_warnings():
            # batch_size=1 over a dataset the ranks do not divide gives ranks unequal batch counts,
            # against which the loader warns users of their own loops; the Trainer's evaluation
            # makes no collective per batch and runs as many forward passes on every rank where
            # the model needs it (evaluate.lockstep_batches).
            warnings.filterwarnings("ignore", message=r".*evaluation with batch_size=1 over \d+ samples")
            return distributed_dataloader(
                data,
                batch_size,
                shuffle=not evaluation,
                num_workers=trainer.num_workers,
                seed=trainer.seed,
                evaluation=evaluation,
            )
    sampler = getattr(data, "sampler", None)
    if (
        world_size > 1
        and isinstance(data, torch.utils.data.DataLoader)
        and not isinstance(sampler, torch.utils.data.DistributedSampler)
        and not isinstance(data.dataset, torch.utils.data.IterableDataset)
    ):
        _log.warning(
            "a DataLoader without a DistributedSampler was given to a %d-process fit(): every rank "
            "loads the whole dataset. Pass the dataset itself to have it sharded.",
            world_size,
        )
    return data


def claim(trainer: Options, checkpoint: ModelCheckpoint) -> None:
    """Take the checkpoint directory before training, not at the first save an epoch later.

    Collective. ``resume="auto"`` claims in ``restore()``; a checkpoint path inside the
    directory continues that directory's run; anything else is a fresh run, which must not
    inherit or destroy the checkpoints of another (issue 11).
    """
    if trainer.resume == "auto":
        return
    # The directory itself is no checkpoint, but names this run: restore's load says so and names
    # its steps (ForeignCheckpointError), where a claim would call it a fresh run's conflict.
    resuming = (
        trainer.resume is not None
        and checkpoint.directory is not None
        and (
            _is_inside(trainer.resume, checkpoint.directory) or _is_same(trainer.resume, checkpoint.directory)
        )
    )
    try:
        checkpoint.manager.claim(resuming=resuming)
    except CheckpointConflictError as err:
        if not err.steps:  # another writer holds the directory: the manager's message says so
            raise
        first, last = err.steps[0], err.steps[-1]
        steps = f"step {first}" if first == last else f"steps {first}..{last}"
        if trainer.run_config is not None:  # a TrainerCLI run: its options, as its user writes them
            given = (
                "--trainer.resume not given"
                if trainer.resume is None
                else f"--trainer.resume {trainer.resume}"
            )
            fixes = (
                "--trainer.resume auto",
                "--trainer.default_root_dir DIR",
                "a ModelCheckpoint with overwrite: true in trainer.callbacks",
            )
        else:
            given = f"resume={trainer.resume!r}"
            fixes = (
                "Trainer(resume='auto')",
                "Trainer(default_root_dir=...) or ModelCheckpoint(dirpath=...)",
                "callbacks=[ModelCheckpoint(overwrite=True)]",
            )
        raise CheckpointConflictError(
            f"{redact_url(str(checkpoint.directory))} already holds the checkpoints of another run "
            f"({steps}), and this fit() starts a new one ({given}). Continue that run with "
            f"{fixes[0]}; or write to another directory ({fixes[1]}); or start over with {fixes[2]}, "
            f"which deletes them.",
            directory=err.directory,
            steps=err.steps,
            label=err._label,
        ) from None


def restore(run: Run) -> int | None:
    """Restore from the Trainer's ``resume``; the step resumed from, or ``None`` for a fresh start.

    Collective with ``resume="auto"`` (the ranks check they restored the same step).
    """
    resume = run.trainer.resume
    if resume is None:
        return None
    state = _state.checkpoint_state(run)
    progress = state["progress"]
    checkpoint = run.checkpoint
    try:
        if resume != "auto":
            _load_on_every_rank(resume, state)
        elif checkpoint is None:
            raise ValueError(
                "resume='auto' restores from the ModelCheckpoint's directory, but checkpointing is "
                "off; pass enable_checkpointing=True or a ModelCheckpoint callback."
            )
        elif checkpoint.manager.restore(state) is None:
            _log.info(
                "resume='auto': no checkpoint in %s yet, starting from step 0",
                redact_url(str(checkpoint.directory)),
            )
            return None
    except Exception as err:
        # Every rank loads the same checkpoint into the same model, so every rank raises this.
        changed = _changed_parameters(err)
        if not changed:
            raise
        raise DistkitError(_changed_model_message(run, changed)) from err
    run.global_step = progress.global_step
    run.current_epoch = progress.epoch
    run.batches_done = progress.batches_in_epoch
    loader = run.train_loader
    if isinstance(loader, DistributedLoader) and loader.epoch == progress.epoch:
        # Saved by another number of ranks, the loader re-splits the rest of the epoch and numbers
        # its batches as the epoch's last ones (docs/data.md, "Resuming on another number of
        # ranks"); on the same number of ranks it holds the saved count.
        run.batches_done = loader.state_dict()["batches_consumed"]
    elif isinstance(loader, StreamLoader) and loader.epoch == progress.epoch:
        run.batches_done = loader.batches_consumed  # the stream's position in this job's batches
    if run.batches_done and "train_loader" not in state:
        # A plain DataLoader cannot seek: the epoch restarts and the consumed batches are skipped.
        _log.info("resuming epoch %d by skipping %d batch(es)", run.current_epoch, run.batches_done)
    if run.num_batches:
        # Steps taken before, against the steps this job's epochs would have taken to reach the
        # same position: 0 on the number of ranks that saved it. Fixed now, for the whole run.
        per_epoch = -(-run.num_batches // run.trainer.accumulate_grad_batches)
        left = -(-max(0, run.num_batches - run.batches_done) // run.trainer.accumulate_grad_batches)
        run.steps_offset = run.global_step - (run.current_epoch * per_epoch + per_epoch - left)
    return run.global_step


def _load_on_every_rank(path: str, state: Mapping[str, Any]) -> None:
    """``load_checkpoint(path, state)`` on every rank, then one gather of the outcomes (collective
    in a world of several): a rank that cannot read ``path`` (a node-local disk) ends every rank
    here, named, instead of leaving the others to train until their first collective waits for it.
    The failing rank raises its own error, the others a DistkitError naming it."""
    failure: Exception | None = None
    try:
        load_checkpoint(path, state)
    except Exception as err:
        failure = err
    ranks, failed = _outcomes(failure, runtime.get_rank())
    if not failed:
        return
    missing = [rank for rank, error in failed.items() if error.startswith("FileNotFoundError")]
    readers = [rank for rank in ranks if rank not in failed]
    why = (
        f" Rank(s) {missing} find nothing at that path where rank(s) {readers} read the checkpoint: "
        f"their hosts see a directory of their own there (a node-local disk). Put checkpoints on a "
        f"filesystem every node mounts (NFS, Lustre, GPFS...) or in an object store (an fsspec URL), "
        f"or copy the checkpoint to the same path on every node."
        if missing
        else " Every rank reads the checkpoint itself: fix the cause on those ranks."
    )
    errors = "; ".join(f"rank {rank}: {error}" for rank, error in failed.items()).rstrip(".")
    raise DistkitError(
        f"{runtime._rank_label()} resume={redact_url(str(path))!r} could "
        f"not be read on rank(s) {sorted(failed)}: {errors}.{why}"
    )


# What torch says when a checkpoint's module does not fit the model: load_state_dict (a full
# checkpoint) and torch.distributed.checkpoint's planner (a sharded one, keys under "model.").
_SHAPE = r"torch\.Size\(\[([^\]]*)\]\)"
_LOAD_STATE_DICT_SIZE = re.compile(
    rf"size mismatch for (\S+): copying a param with shape {_SHAPE} from checkpoint, the shape in "
    rf"current model is {_SHAPE}"
)
_DCP_SIZE = re.compile(rf"Size mismatch between saved {_SHAPE} and current: {_SHAPE} for model\.(\S+)")
_LOAD_STATE_DICT_KEYS = re.compile(r"(Missing|Unexpected) key\(s\) in state_dict: ((?:\"[^\"]+\"(?:, )?)+)")
_DCP_MISSING = re.compile(r"Missing key in checkpoint state_dict: model\.(\S+?)\.?(?:\s|$)")


def _changed_parameters(err: BaseException) -> list[tuple[str, str | None, str | None]]:
    """``(name, shape in the checkpoint, shape in the model)`` of every parameter (or buffer) that
    differs, ``None`` where one side lacks it, read from the messages of ``err``'s chain; empty
    when the failure was something else."""
    found: dict[str, tuple[str, str | None, str | None]] = {}
    seen: set[int] = set()
    link: BaseException | None = err
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        text = str(link)
        for name, saved, current in _LOAD_STATE_DICT_SIZE.findall(text):
            found.setdefault(name, (name, _shape(saved), _shape(current)))
        for saved, current, name in _DCP_SIZE.findall(text):
            found.setdefault(name, (name, _shape(saved), _shape(current)))
        for kind, names in _LOAD_STATE_DICT_KEYS.findall(text):
            for name in re.findall(r'"([^"]+)"', names):
                found.setdefault(name, (name, None, "") if kind == "Missing" else (name, "", None))
        for name in _DCP_MISSING.findall(text):
            found.setdefault(name, (name, None, ""))
        link = link.__cause__ or link.__context__
    return list(found.values())


def _shape(sizes: str) -> str:
    """``"16, 8"`` (inside torch.Size([...])) as ``"(16, 8)"``; ``"16"`` as ``"(16,)"``."""
    return str(tuple(int(size) for size in sizes.split(",") if size.strip()))


def _changed_line(name: str, saved: str | None, current: str | None) -> str:
    if saved is None:
        return f"{name}: in this model, not in the checkpoint"
    if current is None:
        return f"{name}: in the checkpoint, not in this model"
    return f"{name}: {saved} in the checkpoint, {current} in this model"


def _changed_model_message(run: Run, changed: list[tuple[str, str | None, str | None]]) -> str:
    """The refusal of a resume into a model that differs from the checkpoint's (as TrainerCLI's
    refusal of a changed ``model.*`` configuration, for the plain Trainer)."""
    trainer, checkpoint = run.trainer, run.checkpoint
    directory = redact_url(str(checkpoint.directory)) if checkpoint is not None else None
    source = (
        f"the checkpoints in {directory}" if trainer.resume == "auto" else redact_url(str(trainer.resume))
    )
    root = redact_url(os.fspath(trainer.default_root_dir)).rstrip("/")
    listed = "".join(f"\n  {_changed_line(*entry)}" for entry in changed[:_MAX_LISTED])
    if len(changed) > _MAX_LISTED:
        listed += f"\n  ... and {len(changed) - _MAX_LISTED} more"
    name, saved, _ = changed[0]
    was = f"{name} {'absent' if saved is None else 'of shape ' + saved}"
    here = (
        f"start over in {directory}: Trainer(resume=None, callbacks=[ModelCheckpoint(overwrite=True)]), "
        f"which deletes the checkpoints there"
        if directory is not None
        else "train it from its own initial weights: Trainer(resume=None)"
    )
    return (
        f"resume={trainer.resume!r} cannot load {source} into the model given to fit(): the model "
        f"changed since that checkpoint was saved:{listed}\n"
        f"The checkpoint holds the old model's weights and optimizer state. Three ways out:\n"
        f"  1. to continue that run, build the model as it was when it was saved ({was});\n"
        f"  2. to train the changed model, start a new run in another directory: "
        f"Trainer(default_root_dir={root + '-2'!r}) (or ModelCheckpoint(dirpath=...));\n"
        f"  3. or {here}."
    )


# A refusal lists this many changed parameters: enough to see the pattern; the rest are counted.
_MAX_LISTED = 10


def _what(value: Any) -> str:
    """What was given instead of an object: its type's name, or for a class the instance to pass."""
    if inspect.isclass(value):
        return f"the class {value.__name__}: pass an instance, {value.__name__}(...)"
    return type(value).__name__


def callback_list(callbacks: Any, enable_checkpointing: bool) -> list[Callback]:
    """The Trainer's callbacks: checked, a default :class:`ModelCheckpoint` added when wanted, and
    checkpoints last (what they save includes the other callbacks' state after their hooks)."""
    # One callback alone is taken too, as Lightning takes it.
    given = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
    for cb in given:
        if not isinstance(cb, Callback):
            raise TypeError(f"callbacks must be distkit.Callback objects, got {_what(cb)}.")
        check_hooks(cb)
    checkpoints = [cb for cb in given if isinstance(cb, ModelCheckpoint)]
    if len(checkpoints) > 1:
        # fit() sets up, resumes from and feeds one; a second would fail at its first save.
        directories = ", ".join(
            repr(redact_url(str(cb.dirpath))) if cb.dirpath is not None else "default" for cb in checkpoints
        )
        raise ValueError(
            f"callbacks hold {len(checkpoints)} ModelCheckpoint objects (directories: {directories}); "
            f"the Trainer drives one. Keep one and give it every rhythm you need: every_n_epochs, "
            f"every_n_steps and every_n_minutes combine (ModelCheckpoint(every_n_steps=500, "
            f"every_n_minutes=30))."
        )
    if enable_checkpointing and not checkpoints:
        given.append(ModelCheckpoint())
    return [cb for cb in given if not isinstance(cb, ModelCheckpoint)] + [
        cb for cb in given if isinstance(cb, ModelCheckpoint)
    ]


_LOGGER_NAMES = {
    "csv": "CSVLogger",
    "tensorboard": "TensorBoardLogger",
    "mlflow": "MLflowLogger",
    "wandb": "WandbLogger",
}


def logger_list(logger: Any) -> list[Logger]:
    """The Trainer's loggers from its ``logger`` argument: ``True`` is one :class:`CSVLogger`."""
    if logger is True:
        return [CSVLogger()]
    if logger is False or logger is None:
        return []
    if inspect.isclass(logger):
        raise TypeError(f"logger must be True, False or Logger objects, got {_what(logger)}.")
    if isinstance(logger, str):  # logger="tensorboard", as other tools take it
        named = _LOGGER_NAMES.get(logger.lower())
        meant = f": pass distkit.trainer.{named}(...)" if named else ""
        raise TypeError(f"logger must be True, False or Logger objects, got {logger!r}{meant}.")
    loggers = [logger] if isinstance(logger, Logger) else list(logger)
    for item in loggers:
        if not isinstance(item, Logger):
            raise TypeError(f"logger must be True, False or Logger objects, got {_what(item)}.")
    return loggers


def check_run_options(
    *, scale_lr: Any, base_batch_size: Any, seed: Any, seed_per_rank: Any, resume: Any
) -> None:
    """Validate the Trainer's learning-rate scaling, seeding and resume options. Local."""
    if scale_lr not in (None, "linear", "sqrt"):
        raise ValueError(f"scale_lr must be 'linear', 'sqrt' or None, got {scale_lr!r}.")
    if (scale_lr is None) != (base_batch_size is None):
        raise ValueError(
            "scale_lr and base_batch_size go together: scale_lr='linear' scales the learning rates "
            "from the effective batch size they were tuned for, base_batch_size=..."
        )
    if base_batch_size is not None and (isinstance(base_batch_size, bool) or base_batch_size < 1):
        raise ValueError(f"base_batch_size must be an int >= 1, got {base_batch_size!r}.")
    if seed is not None:  # here, not when fit has loaded the data and started the processes
        _check_seed(seed, limit=_MAX_SEED)
    if seed_per_rank and seed is None:
        raise ValueError("seed_per_rank=True derives each rank's streams from seed: pass seed=... too.")
    if resume is not None and not isinstance(resume, (str, os.PathLike)):
        raise TypeError(f"resume must be 'auto', a checkpoint path or None, got {resume!r}.")


def check_options(
    strategy: Any,
    precision: str,
    *,
    max_epochs: Any,
    max_steps: Any,
    batch_size: Any,
    val_batch_size: Any,
    num_workers: Any,
    accumulate_grad_batches: Any,
    log_every_n_steps: Any,
    check_val_every_n_epoch: Any,
    val_check_interval: Any,
    max_consecutive_nonfinite: Any,
    gradient_clip_val: Any,
    gradient_clip_algorithm: Any,
    compile: Any,
) -> None:
    """Validate the Trainer's numeric and switch options; raise naming the first bad one. Local."""
    if isinstance(val_check_interval, float):
        if not 0.0 < val_check_interval <= 1.0:
            raise ValueError(
                f"val_check_interval={val_check_interval} as a float is a fraction of an epoch, in (0, 1] "
                f"(0.25: four times an epoch); an int is a number of optimizer steps."
            )
        if check_val_every_n_epoch is None:
            raise ValueError(
                f"val_check_interval={val_check_interval} validates within the epochs that "
                f"check_val_every_n_epoch selects, and it is None; set it (1: every epoch), or give "
                f"val_check_interval as a number of optimizer steps (an int)."
            )
    for name, value, low, optional in (
        ("max_epochs", max_epochs, 1, True),
        ("max_steps", max_steps, 1, True),
        ("batch_size", batch_size, 1, False),
        ("val_batch_size", val_batch_size, 1, True),
        ("num_workers", num_workers, 0, False),
        ("accumulate_grad_batches", accumulate_grad_batches, 1, False),
        ("log_every_n_steps", log_every_n_steps, 1, False),
        ("check_val_every_n_epoch", check_val_every_n_epoch, 1, True),
        ("max_consecutive_nonfinite", max_consecutive_nonfinite, 1, False),
    ):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}.")
    if val_check_interval is not None and not isinstance(val_check_interval, float):
        if isinstance(val_check_interval, bool) or not isinstance(val_check_interval, int):
            raise TypeError(
                f"val_check_interval must be an int (optimizer steps) or a float in (0, 1] (a fraction "
                f"of an epoch), got {type(val_check_interval).__name__} {val_check_interval!r}."
            )
        if val_check_interval < 1:
            raise ValueError(
                f"val_check_interval must be >= 1 as a number of steps, got {val_check_interval}."
            )
    if gradient_clip_val is not None and (
        isinstance(gradient_clip_val, bool) or not isinstance(gradient_clip_val, (int, float))
    ):
        raise TypeError(
            f"gradient_clip_val must be a number > 0 or None, got {type(gradient_clip_val).__name__} "
            f"{gradient_clip_val!r}."
        )
    if gradient_clip_val is not None and not gradient_clip_val > 0:
        raise ValueError(f"gradient_clip_val must be > 0 or None, got {gradient_clip_val}.")
    if gradient_clip_algorithm not in ("norm", "value"):
        raise ValueError(
            f"gradient_clip_algorithm must be 'norm' or 'value', got {gradient_clip_algorithm!r}."
        )
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be True or False, got {compile!r}.")
    if compile and strategy == "dp":
        # DataParallel copies the module's attributes into its replicas, a compiled forward bound
        # to the original module included: every replica would run on the first GPU.
        raise ValueError("compile=True is not supported with strategy='dp'; use strategy='ddp' (or 'fsdp').")


def _make_strategy(plan: strategies._Plan, *, compile: bool = False) -> Strategy:
    """The strategy object of ``plan`` for this process (after the process group is up). Local."""
    if plan.kind == "dp":
        return DataParallelStrategy(plan, compile=compile)
    if plan.kind == "fsdp" and runtime.get_world_size() > 1:
        return FSDPStrategyRunner(plan, compile=compile)
    if plan.kind in ("ddp", "fsdp"):
        return DDPStrategyRunner(plan, compile=compile)
    return Strategy(plan, compile=compile)

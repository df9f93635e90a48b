"""What ``fit`` tells at start-up: the report printed by the main process, and the hyperparameters
given to the loggers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from distkit import runtime
from distkit._utils.secrets import redact_url
from distkit.data import DistributedLoader
from distkit.data._split import _per_rank_samples
from distkit.trainer import schedules
from distkit.trainer.config import run_config as _run_config
from distkit.trainer.strategies import DDPStrategy, FSDPStrategy

if TYPE_CHECKING:
    from distkit.trainer._run import Run

__all__: list[str] = []

_log = runtime.get_logger("distkit.trainer", main_process_only=True)


def hyperparams(run: Run) -> dict[str, Any]:
    """What the loggers record as the run's hyperparameters. Local."""
    plan, optimizer = run.plan, run.optimizer
    derived = {
        "strategy": plan.kind,
        "device": str(run.device),
        "world_size": run.world_size,
        "precision": run.trainer.precision,
        "batch_size": real_batch(run)[0],
        "effective_batch_size": real_batch(run)[1],
        "accumulate_grad_batches": run.trainer.accumulate_grad_batches,
        "max_epochs": run.trainer.max_epochs,
        "max_steps": run.trainer.max_steps,
        "gradient_clip_val": run.trainer.gradient_clip_val,
        "seed": run.trainer.seed,
        "optimizer": type(optimizer).__name__,
        # The run's learning rate, not the schedule's value at a resumed step: a scheduler keeps
        # the one it started from as initial_lr (saved with the optimizer).
        "lr": [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups],
    }
    # With a TrainerCLI config: the whole of it, these derived values under "run" (docs/config.md).
    return _run_config.hyperparams(run.trainer, derived)


def report(run: Run, resumed_from: int | None) -> str:
    """The start-up report the main process prints. Local."""
    plan, model = run.plan, run.model
    env = runtime.get_env()
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "none (one process)"
    if plan.kind == "dp":
        where = ", ".join(f"cuda:{i}" for i in plan.cuda_indices) + " (nn.DataParallel, one process)"
    elif plan.kind in ("ddp", "fsdp"):
        where = f"{run.device} per process; {env.local_world_size} process(es) x {env.num_nodes} node(s)"
    else:
        where = str(run.device)
    kind = plan.kind
    if isinstance(run.trainer.strategy, (DDPStrategy, FSDPStrategy)):
        default = type(run.trainer.strategy)()
        changed = {k: v for k, v in vars(run.trainer.strategy).items() if v != getattr(default, k)}
        if changed:
            kind += " (" + ", ".join(f"{k}={_shown(v)}" for k, v in changed.items()) + ")"
    unit = "GPU" if plan.kind == "dp" else "rank"
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lines = [
        "distkit.Trainer",
        f"  strategy       {kind} (launcher: {plan.launcher})",
        f"  devices        {where}",
        f"  world size     {run.world_size}",
        f"  backend        {backend}",
        f"  precision      {run.trainer.precision}",
        f"  batch size     {_batch_line(run, unit)}",
        f"  learning rate  {schedules.describe(run)}",
        f"  model          {run.model_class.__name__}: {n_params:,} parameters ({n_trainable:,} trainable)",
        f"  schedule       {_schedule_line(run)}",
    ]
    checkpoint = run.checkpoint
    if checkpoint is not None:
        resumed = "fresh start" if resumed_from is None else f"resumed at step {resumed_from}"
        if run.strategy.checkpoint_format == "sharded":
            resumed += "; sharded: every rank writes its shards"
        lines.append(f"  checkpoints    {redact_url(str(checkpoint.directory))} ({resumed})")
    return "\n".join(lines)


def _schedule_line(run: Run) -> str:
    trainer = run.trainer
    limits = f"max_epochs={trainer.max_epochs}, max_steps={trainer.max_steps}"
    if trainer.steps_per_epoch is None:
        total = (
            "max_steps ends the run" if trainer.max_steps is not None else "the number of steps is unknown"
        )
        return f"a stream: an epoch ends when it does; {total}; {limits}"
    return f"{trainer.steps_per_epoch} steps per epoch, {trainer.total_steps} in all; {limits}"


def real_batch(run: Run) -> tuple[int, int]:
    """The batch a step really takes: ``(per replica, effective)``. Smaller than asked when
    ``batch_size`` is more than a rank's share of the dataset (one batch of the share per epoch)
    or ``accumulate_grad_batches`` more than the batches of an epoch (a step at the epoch's end).
    Local."""
    per_replica = run.per_replica_batch
    loader = run.train_loader
    if isinstance(loader, DistributedLoader) and not loader.evaluation:
        share = _per_rank_samples(len(loader.dataset), loader.world_size, loader.drop_last)
        if share < loader.batch_size:
            # Under DP the loader's batch is split over the GPUs: the first gets the rounded-up part.
            per_replica = min(per_replica, -(-share // max(1, loader.batch_size // per_replica)))
    accumulate = run.trainer.accumulate_grad_batches
    micro = accumulate if run.num_batches is None else min(accumulate, max(1, run.num_batches))
    return per_replica, per_replica * run.replicas * micro


def _batch_line(run: Run, unit: str) -> str:
    per_replica, effective = real_batch(run)
    micro = effective // (per_replica * run.replicas)
    line = (
        f"{per_replica} per {unit}, {effective} effective ({per_replica} x {run.replicas} {unit}s x "
        f"{micro} accumulated)"
    )
    asked = []
    if per_replica != run.per_replica_batch:
        asked.append(f"batch_size={run.per_replica_batch} is more than a {unit}'s share of the data")
    if micro != run.trainer.accumulate_grad_batches:
        asked.append(
            f"accumulate_grad_batches={run.trainer.accumulate_grad_batches} is more than the "
            f"{run.num_batches} batch(es) of an epoch"
        )
    return line + (f"; {' and '.join(asked)}" if asked else "")


def _shown(value: Any) -> str:
    """An option as the report shows it: classes by name (``(Block,)``, not ``<class ...>``)."""
    if isinstance(value, tuple) and value and all(isinstance(v, type) for v in value):
        names = ", ".join(v.__name__ for v in value)
        return f"({names},)" if len(value) == 1 else f"({names})"
    return str(value)

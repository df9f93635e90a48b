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
    from distkit.trainer.trainer import Trainer

__all__: list[str] = []

_log = runtime.get_logger("distkit.trainer", main_process_only=True)


def hyperparams(trainer: Trainer) -> dict[str, Any]:
    """What the loggers record as the run's hyperparameters. Local."""
    plan, optimizer = trainer._plan, trainer.optimizer
    assert plan is not None and optimizer is not None
    derived = {
        "strategy": plan.kind,
        "device": str(trainer.device),
        "world_size": trainer.world_size,
        "precision": trainer.precision,
        "batch_size": real_batch(trainer)[0],
        "effective_batch_size": real_batch(trainer)[1],
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "max_epochs": trainer.max_epochs,
        "max_steps": trainer.max_steps,
        "gradient_clip_val": trainer.gradient_clip_val,
        "seed": trainer.seed,
        "optimizer": type(optimizer).__name__,
        "lr": [group["lr"] for group in optimizer.param_groups],
    }
    # With a TrainerCLI config: the whole of it, these derived values under "run" (docs/config.md).
    return _run_config.hyperparams(trainer, derived)


def report(trainer: Trainer, resumed_from: int | None) -> str:
    """The start-up report the main process prints. Local."""
    plan, optimizer, model = trainer._plan, trainer.optimizer, trainer.model
    assert plan is not None and optimizer is not None and model is not None
    env = runtime.get_env()
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "none (one process)"
    if plan.kind == "dp":
        where = ", ".join(f"cuda:{i}" for i in plan.cuda_indices) + " (nn.DataParallel, one process)"
    elif plan.kind in ("ddp", "fsdp"):
        where = f"{trainer.device} per process; {env.local_world_size} process(es) x {env.num_nodes} node(s)"
    else:
        where = str(trainer.device)
    kind = plan.kind
    if isinstance(trainer.strategy, (DDPStrategy, FSDPStrategy)):
        default = type(trainer.strategy)()
        changed = {k: v for k, v in vars(trainer.strategy).items() if v != getattr(default, k)}
        if changed:
            kind += " (" + ", ".join(f"{k}={_shown(v)}" for k, v in changed.items()) + ")"
    unit = "GPU" if plan.kind == "dp" else "rank"
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lines = [
        "distkit.Trainer",
        f"  strategy       {kind} (launcher: {plan.launcher})",
        f"  devices        {where}",
        f"  world size     {trainer.world_size}",
        f"  backend        {backend}",
        f"  precision      {trainer.precision}",
        f"  batch size     {_batch_line(trainer, unit)}",
        f"  learning rate  {schedules.describe(trainer)}",
        f"  model          {trainer._model_class.__name__}: {n_params:,} parameters "
        f"({n_trainable:,} trainable)",
        f"  schedule       {trainer.steps_per_epoch} steps per epoch, {trainer.total_steps} in all; "
        f"max_epochs={trainer.max_epochs}, max_steps={trainer.max_steps}",
    ]
    checkpoint = trainer._checkpoint_callback()
    if checkpoint is not None:
        resumed = "fresh start" if resumed_from is None else f"resumed at step {resumed_from}"
        if trainer._strategy is not None and trainer._strategy.checkpoint_format == "sharded":
            resumed += "; sharded: every rank writes its shards"
        lines.append(f"  checkpoints    {redact_url(str(checkpoint.directory))} ({resumed})")
    return "\n".join(lines)


def real_batch(trainer: Trainer) -> tuple[int, int]:
    """The batch a step really takes: ``(per replica, effective)``. Smaller than asked when
    ``batch_size`` is more than a rank's share of the dataset (one batch of the share per epoch)
    or ``accumulate_grad_batches`` more than the batches of an epoch (a step at the epoch's end).
    Local."""
    per_replica = trainer._per_replica_batch
    loader = trainer._train_loader
    if isinstance(loader, DistributedLoader) and not loader.evaluation:
        share = _per_rank_samples(len(loader.dataset), loader.world_size, loader.drop_last)
        if share < loader.batch_size:
            # Under DP the loader's batch is split over the GPUs: the first gets the rounded-up part.
            per_replica = min(per_replica, -(-share // max(1, loader.batch_size // per_replica)))
    micro = min(trainer.accumulate_grad_batches, max(1, trainer._num_batches))
    return per_replica, per_replica * trainer._replicas * micro


def _batch_line(trainer: Trainer, unit: str) -> str:
    per_replica, effective = real_batch(trainer)
    micro = effective // (per_replica * trainer._replicas)
    line = (
        f"{per_replica} per {unit}, {effective} effective ({per_replica} x {trainer._replicas} {unit}s x "
        f"{micro} accumulated)"
    )
    asked = []
    if per_replica != trainer._per_replica_batch:
        asked.append(f"batch_size={trainer._per_replica_batch} is more than a {unit}'s share of the data")
    if micro != trainer.accumulate_grad_batches:
        asked.append(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} is more than the "
            f"{trainer._num_batches} batch(es) of an epoch"
        )
    return line + (f"; {' and '.join(asked)}" if asked else "")


def _shown(value: Any) -> str:
    """An option as the report shows it: classes by name (``(Block,)``, not ``<class ...>``)."""
    if isinstance(value, tuple) and value and all(isinstance(v, type) for v in value):
        names = ", ".join(v.__name__ for v in value)
        return f"({names},)" if len(value) == 1 else f"({names})"
    return str(value)

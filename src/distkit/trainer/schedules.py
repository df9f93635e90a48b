"""Learning-rate schedules given in epochs, and the Trainer's learning-rate scaling.

:func:`warmup_schedule` returns a scheduler factory for ``Trainer.fit(lr_scheduler=...)``: the
Trainer calls it once its loaders exist, with ``trainer.steps_per_epoch`` and
``trainer.total_steps`` known, so warm-up and decay can be written in epochs and the schedule ends
where training ends.

With ``Trainer(scale_lr="linear", base_batch_size=B)`` the Trainer multiplies the optimizer's
learning rates by :func:`distkit.scale_lr`'s factor for the job's effective batch before the
scheduler is made, and again after a resume on another number of ranks, so a checkpoint saved on
two ranks and resumed on one goes on at the one-rank learning rate. The start-up report shows the
base rate and the scaled one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from distkit.optim import scale_lr as _scale_lr

if TYPE_CHECKING:
    from distkit.trainer._run import Run
    from distkit.trainer.callbacks import TrainerView

__all__ = ["warmup_schedule"]

# The key under which an optimizer's param group keeps its learning rate before the Trainer's
# scaling: saved with the optimizer, so a resume knows what it scaled.
BASE_LR_KEY = "distkit_base_lr"


class _WarmupDecay:
    # A callable object rather than a closure: LambdaLR.state_dict() saves its attributes (plain
    # numbers), so the schedule checkpoints and resumes with the scheduler.
    def __init__(self, warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.decay = decay
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.decay == "cosine" else 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


class _WarmupFactory:
    """What :func:`warmup_schedule` returns: ``factory(optimizer, trainer) -> LambdaLR``."""

    def __init__(
        self, warmup_epochs: float, warmup_steps: int | None, decay: str, min_lr_ratio: float
    ) -> None:
        self.warmup_epochs = warmup_epochs
        self.warmup_steps = warmup_steps
        self.decay = decay
        self.min_lr_ratio = min_lr_ratio

    def __call__(
        self, optimizer: torch.optim.Optimizer, trainer: TrainerView
    ) -> torch.optim.lr_scheduler.LambdaLR:
        warmup, steps_per_epoch, total = self.warmup_steps, trainer.steps_per_epoch, trainer.total_steps
        if warmup is None and steps_per_epoch is not None:
            warmup = round(self.warmup_epochs * steps_per_epoch)
        if total is None or warmup is None:
            raise ValueError(
                "warmup_schedule needs the run's length, and a stream (an IterableDataset) has none "
                "before it is read: pass Trainer(max_steps=...), and warmup_steps=... instead of "
                "warmup_epochs."
            )
        if self.decay != "constant" and warmup >= total:
            raise ValueError(
                f"warm-up of {warmup} optimizer steps ({self.warmup_epochs} epochs x "
                f"{steps_per_epoch} steps per epoch) leaves nothing of the {total} steps of "
                f"training to decay over; shorten the warm-up or train longer."
            )
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, _WarmupDecay(warmup, total, self.decay, self.min_lr_ratio)
        )


def warmup_schedule(
    *,
    warmup_epochs: float = 0.0,
    warmup_steps: int | None = None,
    decay: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> _WarmupFactory:
    """A scheduler factory: linear warm-up, then cosine, linear or no decay to the end of training.

    Local: no communication. Pass the result as ``Trainer.fit(lr_scheduler=...)`` with the default
    ``scheduler_interval="step"``. The Trainer calls it with the optimizer and itself once the
    loaders exist: warm-up in epochs becomes ``round(warmup_epochs * trainer.steps_per_epoch)``
    optimizer steps, and the decay ends at ``trainer.total_steps``. Optimizer step ``k`` (from 0)
    runs at ``lr * (k + 1) / warmup`` during warm-up (never at 0), then
    ``lr * (min_lr_ratio + (1 - min_lr_ratio) * shape)``. The step counts are fixed when the
    scheduler is made and saved with it: a run resumed on another number of ranks (other steps per
    epoch) keeps the saved ones.

    Args:
        warmup_epochs: Warm-up length in epochs (fractions allowed).
        warmup_steps: Warm-up length in optimizer steps; overrides ``warmup_epochs``.
        decay: ``"cosine"``, ``"linear"`` or ``"constant"`` after warm-up.
        min_lr_ratio: The learning rate at the end of the decay, as a fraction of the full one.

    Returns:
        A factory ``(optimizer, trainer) -> torch.optim.lr_scheduler.LambdaLR``.

    Raises:
        ValueError: A negative length, an unknown ``decay``, or ``min_lr_ratio`` outside [0, 1]
            (at the call); a warm-up as long as training (when ``fit`` makes the scheduler).

    Example:
        >>> import distkit, torch
        >>> from distkit.trainer import warmup_schedule
        >>> trainer = distkit.Trainer(max_epochs=20)
        >>> trainer.fit(model, train_set, optimizer=lambda p: torch.optim.AdamW(p, 4e-3),
        ...             lr_scheduler=warmup_schedule(warmup_epochs=2),
        ...             loss_fn=torch.nn.functional.cross_entropy)  # doctest: +SKIP
    """
    if not warmup_epochs >= 0:
        raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs!r}.")
    if warmup_steps is not None and (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int)):
        raise TypeError(f"warmup_steps must be an int or None, got {warmup_steps!r}.")
    if warmup_steps is not None and warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
    if decay not in ("cosine", "linear", "constant"):
        raise ValueError(f"decay must be 'cosine', 'linear' or 'constant', got {decay!r}.")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}.")
    return _WarmupFactory(float(warmup_epochs), warmup_steps, decay, float(min_lr_ratio))


def lr_factor(run: Run) -> float:
    """The Trainer's learning-rate scaling factor for this job (1.0 without ``scale_lr``). Local."""
    rule, base = run.trainer.scale_lr, run.trainer.base_batch_size
    if rule is None or base is None:  # the two go together (checked at construction)
        return 1.0
    # The effective batch is per-replica batch x replicas x accumulation, as scale_lr multiplies them.
    return _scale_lr(
        1.0,
        base_batch_size=base,
        batch_size=run.trainer.effective_batch_size,
        world_size=1,
        rule=rule,  # type: ignore[arg-type]
    )


def apply_scaling(run: Run) -> None:
    """Scale the optimizer's learning rates for this job, keeping each group's base rate. Local."""
    factor = lr_factor(run)
    for group in run.optimizer.param_groups:
        group.setdefault(BASE_LR_KEY, group["lr"])
        if run.trainer.scale_lr is not None:
            group["lr"] = group[BASE_LR_KEY] * factor


def rescale_after_restore(run: Run) -> None:
    """After a resume, bring the restored learning rates (scaled for the saved job) to this job's
    scaling: the optimizer's groups and the scheduler's base rates. Local."""
    optimizer, scheduler = run.optimizer, run.lr_scheduler
    factor = lr_factor(run)
    base_lrs = getattr(scheduler, "base_lrs", None)
    for index, group in enumerate(optimizer.param_groups):
        if BASE_LR_KEY not in group or run.trainer.scale_lr is None:
            continue
        now = group.get("initial_lr", group["lr"]) if base_lrs is None else base_lrs[index]
        ratio = group[BASE_LR_KEY] * factor / now
        if ratio == 1.0:
            continue
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
        if base_lrs is not None:
            base_lrs[index] *= ratio
        if scheduler is not None and hasattr(scheduler, "_last_lr"):
            scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def apply_changed_settings(run: Run, configured: list[dict[str, Any]], changed: list[str]) -> None:
    """After a resume whose configuration changed optimizer settings (``changed``, e.g.
    ``["lr", "weight_decay"]``): put this run's values (``configured``: the optimizer's groups as
    made, before the restore put the checkpoint's back) into the restored groups. A changed
    learning rate rescales the schedule by new / old: the rate of every step to come, the
    scheduler's base rates and the groups' ``initial_lr``, as if the run had started with it. Local.
    """
    if not changed:
        return
    optimizer, scheduler = run.optimizer, run.lr_scheduler
    base_lrs = getattr(scheduler, "base_lrs", None)
    for index, (group, made) in enumerate(zip(optimizer.param_groups, configured, strict=True)):
        for name in changed:
            if name == "lr":
                old = _base_lr(group)
                ratio = _base_lr(made) / old if old else 1.0
                group["lr"] = group["lr"] * ratio if old else made["lr"]
                if "initial_lr" in group:
                    group["initial_lr"] *= ratio
                if BASE_LR_KEY in made:
                    group[BASE_LR_KEY] = made[BASE_LR_KEY]
                if base_lrs is not None:
                    base_lrs[index] *= ratio
            elif name in group and name in made:
                group[name] = made[name]
    if scheduler is not None and hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _base_lr(group: dict[str, Any]) -> float:
    """A group's configured learning rate: before any scaling (scale_lr) or schedule."""
    return float(group.get(BASE_LR_KEY, group.get("initial_lr", group["lr"])))


def describe(run: Run) -> str:
    """The start-up report's learning-rate line: base rates, the scaling, and the rate of the
    first step to come when a schedule makes it differ (warm-up)."""
    optimizer = run.optimizer
    groups = optimizer.param_groups
    base = _shown_rates(g.get(BASE_LR_KEY, g.get("initial_lr", g["lr"])) for g in groups)
    scheduled = getattr(run.lr_scheduler, "base_lrs", None)
    full = _shown_rates(
        scheduled if scheduled is not None else (g.get("initial_lr", g["lr"]) for g in groups)
    )
    text = f"{base} base"
    if run.trainer.scale_lr is not None:
        trainer = run.trainer
        text += (
            f", scaled x{lr_factor(run):g} ({trainer.scale_lr}: {trainer.effective_batch_size} effective "
            f"batch / {trainer.base_batch_size} base) -> {full}"
        )
    now = _shown_rates(g["lr"] for g in groups)
    if now != full:
        text += f"; {now} at step {run.global_step} (schedule)"
    return f"{text} ({type(optimizer).__name__})"


def _shown_rates(rates: Any) -> str:
    return ", ".join(f"{rate:g}" for rate in sorted(set(rates)))

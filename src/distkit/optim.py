"""Learning rates for a larger effective batch: :func:`scale_lr` (the linear and square-root rules)
and :func:`linear_warmup`. Local: plain arithmetic and a scheduler factory."""

from __future__ import annotations

import math
from typing import Literal

import torch

from distkit._utils.checks import check_int as _check_int

__all__ = ["linear_warmup", "scale_lr"]


def scale_lr(
    base_lr: float,
    *,
    base_batch_size: int,
    batch_size: int,
    world_size: int,
    accumulation: int = 1,
    rule: Literal["linear", "sqrt"] = "linear",
) -> float:
    """The learning rate for an effective batch of ``batch_size * world_size * accumulation``.

    Local: no communication (pass ``world_size=distkit.get_world_size()`` for this job).

    ``rule="linear"`` multiplies ``base_lr`` by ``effective / base_batch_size`` (Goyal et al. 2017,
    for SGD; pair it with :func:`linear_warmup`); ``rule="sqrt"`` by the square root of that ratio
    (Hoffer et al. 2017; often better for Adam-type optimizers).

    Args:
        base_lr: The learning rate tuned for ``base_batch_size``.
        base_batch_size: The total batch size ``base_lr`` was tuned for.
        batch_size: Samples per batch on each rank.
        world_size: Number of ranks.
        accumulation: Batches accumulated per optimizer step.
        rule: ``"linear"`` or ``"sqrt"``.

    Returns:
        The scaled learning rate.

    Raises:
        TypeError: A size is not an int.
        ValueError: ``base_lr`` is not a positive finite number, a size is below 1, or ``rule`` is
            unknown.

    Example:
        >>> import distkit
        >>> distkit.scale_lr(0.1, base_batch_size=256, batch_size=64, world_size=8)
        0.2
        >>> distkit.scale_lr(1e-3, base_batch_size=32, batch_size=32, world_size=4, rule="sqrt")
        0.002
    """
    if (
        isinstance(base_lr, bool)
        or not isinstance(base_lr, (int, float))
        or not (math.isfinite(base_lr) and base_lr > 0)
    ):
        raise ValueError(f"base_lr must be a positive finite number, got {base_lr!r}.")
    for name, value in (
        ("base_batch_size", base_batch_size),
        ("batch_size", batch_size),
        ("world_size", world_size),
        ("accumulation", accumulation),
    ):
        _check_int(name, value, 1)
    if rule not in ("linear", "sqrt"):
        raise ValueError(f"rule must be 'linear' or 'sqrt', got {rule!r}.")
    ratio = batch_size * world_size * accumulation / base_batch_size
    return float(base_lr) * (ratio if rule == "linear" else math.sqrt(ratio))


class _LinearWarmup:
    # A callable object rather than a closure: LambdaLR.state_dict() saves its attributes (plain
    # ints), so the scheduler checkpoints and resumes.
    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        return 1.0 if step >= self.warmup_steps else (step + 1) / self.warmup_steps


def linear_warmup(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler that ramps the learning rate linearly up to its value over ``warmup_steps`` steps.

    Local: no communication. Call ``scheduler.step()`` after every ``optimizer.step()``. Optimizer
    step ``k`` (counting from 0) uses ``lr * (k + 1) / warmup_steps`` while ``k < warmup_steps``, then
    ``lr``; no step runs at a learning rate of 0. To decay afterwards, chain it:
    ``SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps])``.

    Args:
        optimizer: The optimizer whose learning rates (already scaled, e.g. by :func:`scale_lr`)
            are the targets.
        warmup_steps: Optimizer steps to reach the full learning rate; 0 for none.

    Returns:
        A ``torch.optim.lr_scheduler.LambdaLR`` (its ``state_dict`` checkpoints it).

    Raises:
        TypeError, ValueError: ``warmup_steps`` is not an int >= 0.

    Example:
        >>> import torch, distkit
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.4)
        >>> sched = distkit.linear_warmup(opt, warmup_steps=4)
        >>> lrs = []
        >>> for _ in range(5):
        ...     lrs.append(round(opt.param_groups[0]["lr"], 2)); opt.step(); sched.step()
        >>> lrs
        [0.1, 0.2, 0.3, 0.4, 0.4]
    """
    _check_int("warmup_steps", warmup_steps, 0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _LinearWarmup(warmup_steps))

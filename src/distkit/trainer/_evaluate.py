"""Validation: exact metrics over every validation sample once, on the unwrapped module."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from distkit import runtime
from distkit.collectives import all_reduce
from distkit.errors import DistkitError
from distkit.trainer._step import (
    _batch_size,
    _metric_value,
    _split_batch,
    _to_device,
)

if TYPE_CHECKING:
    from distkit.trainer.trainer import Trainer

__all__: list[str] = []

_log = runtime.get_logger("distkit.trainer", main_process_only=True)


@torch.no_grad()
def validate(trainer: Trainer) -> dict[str, tuple[Any, float]]:
    """Validation sums and counts of every metric on this rank (reduced by the caller). Collective
    under FSDP (see :func:`lockstep_repeats`)."""
    module, device, precision = trainer.model, trainer.device, trainer._precision
    assert module is not None and device is not None and precision is not None
    module.eval()
    sums: dict[str, list[Any]] = {}

    def add(name: str, value: Any, size: int) -> None:
        total, count = _metric_value(name, value, size)
        entry = sums.setdefault(name, [0.0, 0.0])
        entry[0] = entry[0] + total
        entry[1] += count

    validation_step = getattr(module, "validation_step", None)
    # Validation runs on the unwrapped module: DDP's forward may broadcast buffers (a collective)
    # and evaluation shards may differ in length by a batch. A sharded module's forward is
    # collective (it gathers the parameters): a rank short of a batch repeats its last one.
    repeats = lockstep_repeats(trainer) if trainer._strategy.lockstep_forward else 0  # type: ignore[union-attr]
    batches: Iterable[tuple[int, Any]] = enumerate(trainer._val_loader)
    if repeats:
        batches = itertools.chain(batches, ((-1, None) for _ in range(repeats)))
    last: Any = None
    for batch_idx, batch in batches:
        if batch_idx < 0:  # a repeat: the forward pass only, its results dropped
            with precision.autocast():
                if callable(validation_step):
                    validation_step(last, 0)
                else:
                    module(_split_batch(last)[0])
            continue
        batch = last = _to_device(batch, device)
        with precision.autocast():
            if callable(validation_step):
                out = validation_step(batch, batch_idx)
                if not isinstance(out, Mapping):
                    raise TypeError(
                        f"validation_step() must return a dict of metrics, got {type(out).__name__}."
                    )
                size = _batch_size(batch)
                for name, value in out.items():
                    add(name, value, size)
            elif trainer._loss_fn is not None:
                inputs, target = _split_batch(batch)
                output = module(inputs)
                size = _batch_size(target)
                add("val_loss", trainer._loss_fn(output, target), size)
                for name, fn in trainer._metric_fns.items():
                    add(f"val_{name}", fn(output, target), size)
    module.train()
    trainer._strategy.after_evaluation(module)  # type: ignore[union-attr]
    return {name: (total, count) for name, (total, count) in sums.items()}


def lockstep_repeats(trainer: Trainer) -> int:
    """Forward passes this rank adds to its validation so every rank runs as many. Collective."""
    mine = len(trainer._val_loader)
    most, negated_least = all_reduce(torch.tensor([mine, -mine]), op="max").tolist()
    if -negated_least == 0 < most:
        raise DistkitError(
            f"[rank {runtime.get_rank()}/{runtime.get_world_size()}] some rank has no validation batch "
            f"while others have up to {most}; a sharded model's forward pass runs on every rank at "
            f"once. Use more validation samples (at least one batch per rank) or a smaller "
            f"val_batch_size."
        )
    return int(most - mine)

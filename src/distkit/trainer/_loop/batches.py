"""Readers of batches, local and shared by training, evaluation and inference: moving a batch to
the device, counting its samples, and reading a validation value as a ``(sum, count)`` pair."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__: list[str] = []


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with its tensors on ``device`` (tensors, lists, tuples, named tuples, mappings)."""
    if device.type == "cpu":
        return batch  # loaders yield CPU tensors; .to() would only cost dispatch time
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [to_device(item, device) for item in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch


def length(loader: Any) -> int | None:
    """``len(loader)``, or ``None`` for a loader without one (a stream; a DataLoader over an
    ``IterableDataset`` that has no ``__len__``)."""
    try:
        return len(loader)
    except TypeError:
        return None


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        if isinstance(batch[0], (str, bytes, int, float)):
            return len(batch)  # a list of plain samples (a stream's lines, ids)
        return batch_size(batch[0])
    if isinstance(batch, Mapping) and batch:
        return batch_size(next(iter(batch.values())))
    raise TypeError(f"cannot tell the number of samples in a batch of type {type(batch).__name__}.")


def metric_value(name: str, value: Any, batch_size: int) -> tuple[torch.Tensor | float, float]:
    """A validation value as a ``(sum, count)`` pair: pairs pass, per-sample tensors are summed,
    scalars are batch means weighted by the batch size."""
    if isinstance(value, tuple) and len(value) == 2:
        total, count = value
        return (total.detach().double() if isinstance(total, torch.Tensor) else float(total)), float(count)
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.numel() == 1:
            return value.double().reshape(()) * batch_size, float(batch_size)
        return value.double().sum(), float(value.numel())
    if isinstance(value, (int, float)):
        return float(value) * batch_size, float(batch_size)
    raise TypeError(
        f"validation metric {name!r} must be a tensor (per sample, or the batch mean), a number or a "
        f"(sum, count) pair, got {type(value).__name__}."
    )

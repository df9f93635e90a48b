"""Metrics over an evaluation split: :func:`gather_for_metrics`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from distkit import collectives

__all__: list[str] = []


# ---------------------------------------------------------------------------------------------
# Metrics over an evaluation split


def _tensor_leaves(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, Mapping):
        return bool(data) and all(_tensor_leaves(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return bool(data) and all(_tensor_leaves(v) for v in data)
    return False


def _gather_tree(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        parts = collectives.all_gather(data)
        return torch.stack(parts) if data.dim() == 0 else torch.cat(parts)
    if isinstance(data, Mapping):
        return {key: _gather_tree(value) for key, value in data.items()}
    gathered = [_gather_tree(value) for value in data]
    if isinstance(data, tuple):
        return type(data)(*gathered) if hasattr(data, "_fields") else tuple(gathered)
    return gathered


def gather_for_metrics(data: Any) -> Any:
    """Everything every rank passed, concatenated in rank order, for computing a metric.

    Collective: call on every rank, the same number of times. Without a process group it returns
    ``data`` as a world of one would (tensors unchanged, 0-dim tensors as shape ``(1,)``).

    - A tensor: all ranks' tensors concatenated along the first dimension, which may differ
      between ranks (a 0-dim tensor per rank gives a tensor of shape ``(world_size,)``).
    - A dict, list or tuple whose leaves are all tensors: the same structure, each leaf gathered.
    - Anything else (a list of strings, numbers): gathered as objects; lists are concatenated,
      other objects come back as a list with one entry per rank.

    Over a distkit evaluation loader (``shuffle=False``), gathering each batch gives the batches'
    samples in dataset order, each exactly once, so a metric computed on the result equals the
    single-process metric. For a plain accuracy, ``reduce_metrics({"acc": (correct, count)})`` is
    cheaper: one collective after the loop.

    Example:
        >>> import torch, distkit
        >>> distkit.gather_for_metrics({"pred": torch.tensor([1, 0]), "label": torch.tensor([1, 1])})
        {'pred': tensor([1, 0]), 'label': tensor([1, 1])}
    """
    if _tensor_leaves(data):
        return _gather_tree(data)
    gathered = collectives.all_gather_object(data)
    if isinstance(data, list):
        return [item for part in gathered for item in part]
    return gathered

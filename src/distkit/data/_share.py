"""``split_between_processes``: this rank's contiguous share of a list, a tensor or a nested dict of
them, for work that is not a dataset (prompts to generate from, files to convert, a grid of
settings to evaluate)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from distkit import runtime

__all__ = ["split_between_processes"]

T = TypeVar("T")


def split_between_processes(inputs: T, *, pad: bool = False) -> T:
    """This rank's contiguous share of ``inputs``: a list, a tuple, a tensor (along its first
    dimension), or a dict (nested too) of them, each value split alike.

    Local: no communication. With ``n`` items over ``W`` ranks, rank ``r`` gets items
    ``[start, end)`` where the first ``n % W`` ranks get one item more than the others; the shares,
    in rank order, are ``inputs`` again, each item once. ``pad=True`` repeats the last item on the
    ranks with one item fewer, so every rank gets as many (to gather the results with
    :func:`all_gather` and drop the repeats). Without a process group the whole of ``inputs``.

    Args:
        inputs: What to split.
        pad: Give every rank the same number of items, repeating the last one.

    Returns:
        The same kind of object, holding this rank's items.

    Raises:
        TypeError: ``inputs`` (or a value of a dict) is none of those kinds.
        ValueError: The values of a dict have different lengths, so they cannot be split alike; or
            ``pad=True`` with nothing to repeat.

    Example:
        >>> import distkit
        >>> distkit.split_between_processes(["a cat", "a dog", "a bird"])  # one process: all of them
        ['a cat', 'a dog', 'a bird']
    """
    rank, world_size = runtime.get_rank(), runtime.get_world_size()
    if world_size == 1:
        return inputs
    n = _length(inputs)
    per, extra = divmod(n, world_size)
    start = rank * per + min(rank, extra)
    end = start + per + (1 if rank < extra else 0)
    width = per + (1 if extra else 0) if pad else None
    if pad and n == 0:
        raise ValueError("split_between_processes(pad=True) repeats the last item, but inputs are empty.")
    return _take(inputs, start, end, width)  # type: ignore[no-any-return]


def _length(inputs: Any) -> int:
    if isinstance(inputs, Mapping):
        lengths = {key: _length(value) for key, value in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"split_between_processes splits every value of a dict alike, so they need one "
                f"length; got {lengths}."
            )
        return next(iter(lengths.values()), 0)
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() == 0:
            raise TypeError("split_between_processes needs a tensor with a first dimension, got a scalar.")
        return int(inputs.shape[0])
    if isinstance(inputs, (list, tuple)):
        return len(inputs)
    raise TypeError(
        f"split_between_processes splits a list, a tuple, a tensor or a dict of them, got "
        f"{type(inputs).__name__}."
    )


def _take(inputs: Any, start: int, end: int, width: int | None) -> Any:
    if isinstance(inputs, Mapping):
        return type(inputs)({key: _take(value, start, end, width) for key, value in inputs.items()})  # type: ignore[call-arg]
    part = inputs[start:end]
    missing = 0 if width is None else width - (end - start)
    if not missing:
        return part
    last = inputs[-1:]
    if isinstance(inputs, torch.Tensor):
        return torch.cat([part, *([last] * missing)])
    return part + type(inputs)(list(last) * missing)

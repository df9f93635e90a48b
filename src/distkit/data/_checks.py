"""Checks of the arguments shared by the sampler and the loader. Local."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from distkit import collectives, runtime
from distkit.errors import DistkitError

__all__: list[str] = []


# ---------------------------------------------------------------------------------------------
# Validation shared by the sampler and the loader


def check_not_tensor_tuple(data: Any, name: str) -> None:
    """Refuse ``(inputs, targets)`` tensors given where a dataset is needed (as Keras's ``fit(x, y)``
    takes them): as a dataset that tuple is a few samples, the tensors themselves, which fails in
    the loader's collate or, worse, trains on them. A dict of tensor columns likewise. Local."""
    kind = type(data).__name__
    if type(data).__module__.split(".")[0] == "pandas" and kind in ("DataFrame", "Series"):
        # data[i] is a column (a DataFrame) or a label lookup (a Series), not the i-th row.
        raise TypeError(
            f"{name} is a pandas {kind}: as a dataset it is looked up by sample index ({name}[0]), "
            f"which pandas takes for a {'column' if kind == 'DataFrame' else 'label'}, not the first "
            f"row. Pass its values as tensors: TensorDataset(torch.tensor(df[features].to_numpy(), "
            f"dtype=torch.float32), torch.tensor(df[label].to_numpy())), or a Dataset whose "
            f"__getitem__ reads df.iloc[i]."
        )
    if _tensor_columns(data):
        rows = {int(value.shape[0]) for value in data.values()}
        names = ", ".join(f"{key!r}: {tuple(value.shape)}" for key, value in data.items())
        raise TypeError(
            f"{name} is a dict of tensors ({names}): as a dataset it is looked up by sample index "
            f"(dataset[0]) and has as many samples as keys. Pass a dataset of its "
            f"{'/'.join(map(str, sorted(rows)))} rows that returns one sample's dict, e.g. "
            f"[{{k: v[i] for k, v in {name}.items()}} for i in range(n)], or "
            f"TensorDataset(*{name}.values()) for tuples."
        )
    if not (isinstance(data, tuple) and 2 <= len(data) <= 4):
        return
    if not all(isinstance(item, torch.Tensor) and item.dim() >= 1 for item in data):
        return
    rows = {int(item.shape[0]) for item in data}
    if len(rows) == 1 and rows != {len(data)}:
        shapes = ", ".join(str(tuple(item.shape)) for item in data)
        raise TypeError(
            f"{name} is a tuple of {len(data)} tensors ({shapes}): as a dataset that is {len(data)} "
            f"samples, the tensors themselves. Pass torch.utils.data.TensorDataset(*{name}) for its "
            f"{rows.pop()} rows."
        )


def _tensor_columns(data: Any) -> bool:
    """A dict of named tensors, one row per sample (columns, as a dataframe's)."""
    return (
        isinstance(data, Mapping)
        and bool(data)
        and all(isinstance(key, str) for key in data)
        and all(isinstance(value, torch.Tensor) and value.dim() >= 1 for value in data.values())
    )


def check_state_mapping(state: Any, owner: str) -> None:
    """A loader's ``load_state_dict`` got something else than the dict its ``state_dict`` made."""
    if not isinstance(state, Mapping):
        none = " (was the loader's state saved?)" if state is None else ""
        raise TypeError(
            f"load_state_dict() needs the dict {owner}.state_dict() made, got {type(state).__name__}{none}."
        )


def _dataset_len(dataset: Any, what: str) -> int:
    # torch's DataLoader, or distkit's loaders (a dataset and a batch size, no __getitem__): its
    # batches would be the samples, a loader of batches of batches.
    loader_like = hasattr(dataset, "dataset") and hasattr(dataset, "batch_size")
    if isinstance(dataset, DataLoader) or (loader_like and not hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"{what} needs a dataset, got a {type(dataset).__name__}: pass its dataset "
            f"(loader.dataset) instead; a loader's items are whole batches."
        )
    check_not_tensor_tuple(dataset, "dataset")
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            f"{what} needs a map-style dataset (with __len__ and __getitem__), got the IterableDataset "
            f"{type(dataset).__name__}. distkit.distributed_dataloader() streams it, split over the "
            f'ranks and workers and resumable (docs/data.md, "Iterable and streaming data").'
        )
    try:
        return len(dataset)
    except TypeError as err:
        raise TypeError(
            f"{what} needs a map-style dataset with __len__ and __getitem__; "
            f"{type(dataset).__name__} has no __len__."
        ) from err


def _plural(count: int, singular: str, plural: str) -> str:
    return f"{count} {singular if count == 1 else plural}"


def _check_enough_samples(n: int, world_size: int, what: str) -> None:
    if n >= world_size:
        return
    if world_size == 1:  # then n == 0; a world of one has no ranks to talk about
        raise ValueError(f"{what}: the dataset is empty (0 samples); pass a dataset with at least 1 sample.")
    if n == 0:
        raise ValueError(
            f"{what}: the dataset is empty (0 samples), so none of the {world_size} ranks would get a "
            f"sample; pass a dataset with at least {world_size} samples (one per rank)."
        )
    raise ValueError(
        f"{what}: the dataset has {_plural(n, 'sample', 'samples')} but the job has {world_size} "
        f"ranks, so some rank would get none. Use a dataset of at least {world_size} samples, or run at most "
        f"{_plural(n, 'process', 'processes')}."
    )


def _check_same_on_every_rank(what: str, values: dict[str, object]) -> None:
    # Each rank computes the split on its own; ranks that disagree on the order or the sizes would
    # silently train on overlapping samples. One small gather at construction makes that an error.
    world_size = runtime.get_world_size()
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    gathered = collectives.all_gather_object(values)
    differing = [key for key in values if any(g[key] != values[key] for g in gathered)]
    if not differing:
        return
    per_rank = "; ".join(
        f"rank {rank}: " + ", ".join(f"{key}={g[key]!r}" for key in differing)
        for rank, g in enumerate(gathered)
    )
    raise DistkitError(
        f"[rank {runtime.get_rank()}/{world_size}] {what} needs the same {', '.join(differing)} on every "
        f"rank, got {per_rank}. Give every rank the same dataset and options, and seed every rank with "
        f"the same seed (seed_everything(seed), not seed + rank): each rank computes the split itself."
    )

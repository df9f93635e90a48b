"""Where a loader's time goes: :func:`profile_dataloader`."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from distkit import runtime
from distkit._utils.checks import check_int as _check_int
from distkit.data._loader import DistributedLoader
from distkit.data._sampler import DistributedSplitSampler
from distkit.seeding import (
    capture_rng_state,
    restore_rng_state,
)

__all__: list[str] = []


# ---------------------------------------------------------------------------------------------
# Data-loading profile


# Below this, time per batch is the loop's own overhead rather than loading: handing over a batch
# of an in-memory tensor dataset takes about 0.03-0.06 ms here (2-core CPU, torch 2.13).
_NOISE_S = 1e-4
# Worker start-up above this is worth keeping workers alive between epochs for.
_SLOW_START_S = 0.5


@dataclass(frozen=True)
class DataLoaderProfile:
    """Where a loader's time goes, per batch; returned by :func:`profile_dataloader`.

    Attributes:
        wait_s: Seconds spent waiting for each batch after the first.
        copy_s: Seconds spent moving each of those batches to ``device`` (0 on the CPU).
        first_batch_s: Seconds until the first batch (includes starting workers).
        device: Where batches were moved.
        loading_bound: Waiting for data costs more per batch than moving it to the device.
        suggestions: Plain-language changes that would make loading faster, most useful first.
    """

    wait_s: tuple[float, ...]
    copy_s: tuple[float, ...]
    first_batch_s: float
    device: torch.device
    loading_bound: bool
    suggestions: tuple[str, ...]

    @property
    def wait_ms(self) -> float:
        """Median milliseconds waiting for a batch."""
        return 1e3 * statistics.median(self.wait_s)

    @property
    def copy_ms(self) -> float:
        """Median milliseconds moving a batch to the device."""
        return 1e3 * statistics.median(self.copy_s)

    def __str__(self) -> str:
        lines = [
            f"data loading over {len(self.wait_s)} batches: waiting {self.wait_ms:.2f} ms/batch, "
            f"copying to {self.device} {self.copy_ms:.2f} ms/batch, first batch after "
            f"{self.first_batch_s:.2f} s",
            *(f"- {s}" for s in self.suggestions),
        ]
        return "\n".join(lines)


def _to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {key: _to_device(value, device, non_blocking) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(_to_device(value, device, non_blocking) for value in batch)
    return batch


def _cpus_per_process() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, runtime.get_local_world_size()))


def _suggest(
    loader: Any, wait: float, copy: float, first: float, device: torch.device, loading_bound: bool
) -> list[str]:
    workers = int(getattr(loader, "num_workers", 0) or 0)
    pinned = bool(getattr(loader, "pin_memory", False))
    persistent = bool(getattr(loader, "persistent_workers", False))
    cpus = _cpus_per_process()
    out: list[str] = []
    if loading_bound:
        if workers == 0:
            out.append(
                f"Batches are prepared in the training process itself ({1e3 * wait:.2f} ms each, while "
                f"the model waits). Pass num_workers={min(4, cpus)} (this process has {cpus} CPU "
                f"core(s)) so that workers prepare batches while the model trains."
            )
        elif workers < cpus:
            out.append(
                f"With {workers} workers a batch still takes {1e3 * wait:.2f} ms to arrive. Try "
                f"num_workers={min(2 * workers, cpus)} (this process has {cpus} CPU cores) or a larger "
                f"prefetch_factor, or make __getitem__ cheaper (decode and resize once, ahead of time)."
            )
        else:
            out.append(
                f"All {cpus} CPU cores of this process already load data and a batch still takes "
                f"{1e3 * wait:.2f} ms; make __getitem__ cheaper (decode and resize once, ahead of "
                f"time) or move augmentation to the GPU."
            )
    if device.type == "cuda" and not pinned and copy >= _NOISE_S:
        out.append(
            f"Copying a batch to {device} takes {1e3 * copy:.2f} ms from pageable memory; pass "
            f"pin_memory=True so that copies are faster and can overlap compute (non_blocking=True)."
        )
    if workers > 0 and not persistent and first - wait >= _SLOW_START_S:
        out.append(
            f"Starting the {workers} workers took about {first - wait:.2f} s before the first batch, "
            f"and it happens again every epoch; pass persistent_workers=True to pay it once."
        )
    return out


def _keep_position(owner: DistributedLoader | DistributedSplitSampler) -> tuple[Any, ...]:
    if isinstance(owner, DistributedLoader):
        return (
            owner._epoch,
            owner._consumed,
            owner._pass_start,
            owner._stopped,
            owner._rest,
            owner._passes.early,
        )
    return (owner.epoch, owner._passes.early)


def _put_back_position(owner: DistributedLoader | DistributedSplitSampler, kept: tuple[Any, ...]) -> None:
    owner._passes.reset()
    if isinstance(owner, DistributedLoader):
        owner._epoch, owner._consumed, owner._pass_start, owner._stopped, owner._rest = kept[:5]
        owner._passes.early = kept[5]
    else:
        owner.epoch, owner._passes.early = kept
    owner._generation += 1  # a pass running before profiling is over, as documented


def profile_dataloader(
    loader: Any, *, num_batches: int = 50, device: str | torch.device | None = None
) -> DataLoaderProfile:
    """Time spent waiting for each batch against time spent moving it to the device.

    Local: no communication; each rank profiles its own loader. Reads up to ``num_batches`` batches
    from one pass (the first is reported apart, as it includes starting workers) and leaves the
    loader and this process's RNG states as they were: a :class:`DistributedLoader` keeps its
    position, so training afterwards sees the same batches as without profiling. Call it between
    passes: a pass of the loader still being iterated is superseded.

    Args:
        loader: A :class:`DistributedLoader` or any iterable of batches (a torch DataLoader).
        num_batches: Batches to read, at least 2.
        device: Where to move batches; this rank's device (:func:`distkit.get_device`) when ``None``.

    Returns:
        A :class:`DataLoaderProfile`; ``str()`` of it is a short report with suggestions.

    Raises:
        ValueError: ``num_batches < 2``, or the loader yields fewer than 2 batches.

    Example:
        >>> import torch, distkit
        >>> loader = distkit.distributed_dataloader(torch.zeros(64, 3), batch_size=8)
        >>> profile = distkit.profile_dataloader(loader, num_batches=4)
        >>> len(profile.wait_s)
        3
    """
    _check_int("num_batches", num_batches, 2)
    target = runtime.get_device() if device is None else torch.device(device)
    pinned = bool(getattr(loader, "pin_memory", False))
    rng_state = capture_rng_state()
    # Positions are put back whole (not through load_state_dict): where the next pass starts, what
    # state_dict() reports, and the count of passes left early all stay as they were.
    found = loader if isinstance(loader, DistributedLoader) else getattr(loader, "sampler", None)
    owner = found if isinstance(found, (DistributedLoader, DistributedSplitSampler)) else None
    kept = _keep_position(owner) if owner is not None else None
    waits: list[float] = []
    copies: list[float] = []
    try:
        iterator = iter(loader)
        for _ in range(num_batches):
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                break
            fetched = time.perf_counter()
            _to_device(batch, target, pinned)
            if target.type == "cuda":
                torch.cuda.synchronize(target)
            waits.append(fetched - start)
            copies.append(time.perf_counter() - fetched)
        del iterator
    finally:
        restore_rng_state(rng_state)
        if owner is not None and kept is not None:
            _put_back_position(owner, kept)
    if len(waits) < 2:
        raise ValueError(
            f"profile_dataloader() needs at least 2 batches but the loader yielded {len(waits)}; "
            f"use a larger dataset or a smaller batch_size."
        )
    wait, copy = statistics.median(waits[1:]), statistics.median(copies[1:])
    loading_bound = wait > copy and wait >= _NOISE_S
    return DataLoaderProfile(
        wait_s=tuple(waits[1:]),
        copy_s=tuple(copies[1:]),
        first_batch_s=waits[0],
        device=target,
        loading_bound=loading_bound,
        suggestions=tuple(_suggest(loader, wait, copy, waits[0], target, loading_bound)),
    )

"""Distributed samplers and DataLoaders: seeded by default, exact evaluation, mid-epoch resume.

Three guarantees, each tested on real process groups:

- **Every rank sees the same number of batches.** Training pads by wrapping (``drop_last=False``)
  or drops the tail (``drop_last=True``), as ``DistributedSampler`` does, so no rank waits in a
  collective for a rank that ran out of data. Evaluation never pads: every sample is seen exactly
  once, and batches are laid out so that every rank still gets the same number of batches whenever
  ``batch_size >= 2``.
- **Every batch has its own random stream**, derived from (seed, rank, epoch, batch) and applied
  around fetching and collating it, in a worker or in the training process alike. A batch's content,
  random augmentations included, therefore does not depend on the number of workers or on what was
  loaded before it, which is what makes mid-epoch resume exact.
- **Epochs advance by themselves, and never apart.** A pass run to its end moves to the next epoch,
  so ``set_epoch`` is optional; a pass left early (``next(iter(loader))`` on one rank, a ``break``)
  leaves the epoch as it was, so a rank that looks at a batch alone stays on the others' split. The
  two cases no rank can align by itself (a full extra pass on some ranks; every rank stopping each
  epoch after a few steps) raise a ``DistkitError`` naming the fix.

The formulas are in ``docs/data.md``.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, get_worker_info

from distkit import collectives, runtime
from distkit._data_split import (
    _batch_plan,
    _continued,
    _epoch_order,
    _eval_counts,
    _padded,
    _per_rank_samples,
    _rank_batches,
    _Rest,
    _rest_of_epoch,
    _seen_after,
)
from distkit.errors import DistkitError
from distkit.seeding import (
    _STREAM_BATCH,
    _STREAM_LOADER,
    _STREAM_REST_BATCH,
    _STREAM_WORKER,
    _apply_stream_seed,
    _check_seed,
    _default_loader_seed,
    _run_on_stream,
    capture_rng_state,
    derive_seed,
    restore_rng_state,
)

__all__ = [
    "DataLoaderProfile",
    "DistributedLoader",
    "DistributedSplitSampler",
    "distributed_dataloader",
    "distributed_sampler",
    "gather_for_metrics",
    "linear_warmup",
    "profile_dataloader",
    "scale_lr",
]

_STATE_KEYS = ("epoch", "batches_consumed", "seed")
# Settings that fix which samples make up batch k of an epoch; a mid-epoch resume needs them equal.
_LAYOUT_KEYS = ("world_size", "batch_size", "dataset_len", "shuffle", "drop_last", "evaluation")


# ---------------------------------------------------------------------------------------------
# Validation shared by the sampler and the loader


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return value


def _dataset_len(dataset: Any, what: str) -> int:
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            f"{what} needs a map-style dataset (with __len__ and __getitem__), got the IterableDataset "
            f"{type(dataset).__name__}. Shard an iterable dataset inside its __iter__ by rank and "
            f"worker, and pass worker_init_fn=distkit.seed_worker to your own DataLoader."
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


# ---------------------------------------------------------------------------------------------
# Epochs: which passes move to the next epoch (docs/data.md, "Epochs")
#
# Every rank computes its share of an epoch from the epoch number alone, so the ranks must agree on
# it without talking: a pass run to its end moves to the next epoch, a pass left early does not (a
# look at a batch on one rank must not shift that rank's split). What no rank can settle alone is
# caught: a full extra pass on some ranks (_EpochCheck, through the store) and a loop that stops
# every epoch early on every rank (_Passes.begin). Both use the process groups' collective counters
# to tell passes the ranks made together from rank-local ones; all of it is per pass, not per batch.


def _collectives_so_far(*, every_group: bool) -> int | None:
    """Collectives this process has issued on the default group, or on every group it belongs to.

    ``None`` without a process group, or where the backend does not count them (gloo and NCCL do).
    The default group's count is the same on every rank at the same point of a program, since every
    rank issues the same collectives on it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        groups = (
            list(dist.distributed_c10d._world.pg_map)
            if every_group
            else [dist.distributed_c10d._get_default_group()]
        )
        return sum(int(group._get_sequence_number_for_group()) for group in groups)
    except Exception:  # a private torch API on a backend that may lack it: then we cannot tell
        return None


def _rank_prefix(rank: int, world_size: int) -> str:
    return f"[rank {rank}/{world_size}] " if world_size > 1 else ""


class _EpochCheck:
    """Tells the ranks apart when a full extra pass on some of them put them in different epochs.

    At the start of each pass a rank writes ``"<default-group collectives>,<epoch>"`` under its key
    in the job's store; at the end of a pass during which collectives ran, it reads its two
    neighbours' keys (ranks r-1 and r+1). Passes that started after the same collective and then
    ran collectives together are the same step of the same program, so they must have the same
    epoch. A rank still in a collective-free pass may lag a whole epoch legitimately, which is why
    a pass without collectives checks nothing. One store write when a pass starts, one check and one
    read when it ends, never a wait: every key exists from the loader's construction (written
    before its collective gather).
    """

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int, what: str) -> None:
        self.store: Any = store
        self.key = f"{prefix}/{rank}"
        self.neighbours = sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})
        self.neighbour_keys = [f"{prefix}/{other}" for other in self.neighbours]
        self.rank, self.world_size, self.what = rank, world_size, what
        self.start_count = -1

    def __getstate__(self) -> dict[str, Any]:
        # A store cannot be pickled or deep-copied; a copied sampler or loader just goes unchecked.
        return {**self.__dict__, "store": None}

    @classmethod
    def create(cls, what: str, shuffle: bool) -> _EpochCheck | None:
        """Before the construction gather, on every rank; ``None`` where there is nothing to check.

        Without shuffling every epoch splits the data alike, so ranks in different epochs still
        see disjoint, covering shares: only shuffled splits are checked.
        """
        world_size = runtime.get_world_size()
        if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return None
        store = runtime._store()
        state = runtime._runtime
        if state is None:
            return None
        # Taken on every rank whatever the options, so that ranks agree on the ids that follow.
        ident = state.next_id("data_epochs")
        if not shuffle or store is None or _collectives_so_far(every_group=False) is None:
            return None
        check = cls(store, f"data/epochs/{ident}", runtime.get_rank(), world_size, what)
        try:
            store.set(check.key, "-1,-1")  # before the gather, so every key exists after it
        except RuntimeError:
            return None
        return check

    def started(self, epoch: int) -> None:
        count = _collectives_so_far(every_group=False)
        if count is None or self.store is None:
            self.store = None
            return
        self.start_count = count
        try:
            self.store.set(self.key, f"{count},{epoch}")
        except RuntimeError:  # a store that stopped answering; the check is a safety net, not a need
            self.store = None

    def finished(self, epoch: int) -> None:
        count = _collectives_so_far(every_group=False)
        if self.store is None or count is None or count == self.start_count:
            return
        if "nccl" in str(dist.get_backend()).lower():
            # NCCL counts a collective when this host enqueues it, which may be long before the
            # other ranks reach it; once it has run on the device, every rank has issued it, so each
            # neighbour's latest pass is the one that ran alongside this one.
            torch.cuda.synchronize()
        try:
            if not self.store.check(self.neighbour_keys):
                return
            values = self.store.multi_get(self.neighbour_keys)
        except RuntimeError:
            self.store = None
            return
        for other, value in zip(self.neighbours, values, strict=True):
            other_count, other_epoch = (int(part) for part in bytes(value).decode().split(","))
            if other_count == self.start_count and other_epoch != epoch:
                raise DistkitError(
                    f"{_rank_prefix(self.rank, self.world_size)}{self.what}: this rank just ran epoch "
                    f"{epoch} while rank {other} ran epoch {other_epoch} alongside it (both passes "
                    f"started after the same collective), so their shares of the data overlap: some "
                    f"samples are seen twice in an epoch and others never. A pass run to its end moves "
                    f"a rank to the next epoch, so a full pass made on some ranks only (inspecting or "
                    f"evaluating on the training data) put them an epoch ahead. Call set_epoch(epoch) "
                    f"on every rank right before each epoch's loop, which realigns the ranks whatever "
                    f"passes ran before, or leave extra passes early (break)."
                )


class _Passes:
    """Per-pass bookkeeping of a loader or sampler: which pass is running, and whether passes left
    early keep restarting the same epoch (a loop that stops every epoch after a few steps)."""

    def __init__(self, what: str, rank: int, world_size: int, *, training: bool) -> None:
        self.what, self.rank, self.world_size, self.training = what, rank, world_size, training
        self.check: _EpochCheck | None = None
        # Whether a started pass has not ended yet (run to its end, left, or superseded).
        self.live = False
        # Collectives on every group when the live pass started: did the ranks make it together?
        self.count_at_start: int | None = None
        # Passes in a row, from the same position, left early while the ranks communicated.
        self.early = 0

    def begin(self, epoch: int, fix: str) -> None:
        """A pass starts at ``epoch``; raises if it would repeat two passes left early before it."""
        if self.early >= 2:
            together = " while the ranks communicated" if self.world_size > 1 else ""
            raise DistkitError(
                f"{_rank_prefix(self.rank, self.world_size)}{self.what}: the last {self.early} passes "
                f"over epoch {epoch} were left early{together} (a loop that stops every epoch after "
                f"some steps), and a pass left early does not move to the next epoch (so that a look "
                f"at a batch on one rank cannot shift that rank's share of the data): this pass would "
                f"hand out the same samples again. {fix}"
            )
        self.count_at_start = _collectives_so_far(every_group=True)
        if self.check is not None:
            self.check.started(epoch)
        self.live = True

    def end_full(self, epoch: int) -> None:
        """The live pass ran to its end at ``epoch``; raises if the ranks turn out to be misaligned."""
        self.live = False
        self.early = 0
        if self.check is not None:
            self.check.finished(epoch)

    def end_early(self, *, more_than_one_batch: bool) -> bool:
        """The live pass ended before its end; returns whether the ranks made it together.

        With several ranks, a pass during which this rank issued no collective was made by this rank
        alone (a look at a batch, a debugging pass); in a world of one every pass is the job's.
        """
        self.live = False
        if self.world_size == 1:
            shared = True
        else:
            now = _collectives_so_far(every_group=True)
            shared = now is None or self.count_at_start is None or now != self.count_at_start
        if shared and more_than_one_batch and self.training:
            self.early += 1
        return shared

    def reset(self) -> None:
        """``set_epoch`` or ``load_state_dict``: the epoch is the caller's, nothing repeats."""
        self.live = False
        self.early = 0


# ---------------------------------------------------------------------------------------------
# The sampler, for DataLoaders users make


class DistributedSplitSampler(DistributedSampler):  # type: ignore[type-arg]
    """This rank's share of a map-style dataset; made by :func:`distributed_sampler`.

    A :class:`torch.utils.data.DistributedSampler` (so tools that look for one find it) with
    distkit's seeding, an epoch that advances by itself when a pass runs to its end, and an unpadded
    ``evaluation`` split. Each rank gets one contiguous block of the epoch's order.

    A pass left early (a DataLoader iterator dropped before its end) leaves the epoch as it was, so a
    look at a batch on one rank keeps that rank on the others' split. With workers, a pass counts as
    run to its end once every index is drawn (torch draws ``prefetch_factor * num_workers`` batches
    ahead); with persistent workers, a pass left early is noticed when the next one starts.

    Attributes:
        epoch: The epoch of the current or next pass.
        evaluation: Whether the split is unpadded (every sample exactly once across ranks).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        world_size: int,
        rank: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        evaluation: bool,
    ) -> None:
        super().__init__(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.evaluation = evaluation
        n = len(dataset)
        if evaluation:
            counts = _eval_counts(n, world_size)
            self.num_samples = counts[rank]
            self.total_size = n
            self._start = sum(counts[:rank])
        else:
            self.num_samples = _per_rank_samples(n, world_size, drop_last)
            self.total_size = self.num_samples * world_size
            self._start = rank * self.num_samples
        self._n = n
        self._passes = _Passes("DistributedSplitSampler", rank, world_size, training=not evaluation)
        # Bumped by every iter() (and by set_epoch() during a pass): older iterators have ended.
        self._generation = 0

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass (optional: a pass run to its end moves on by itself). Local.

        Calling it on every rank right before each epoch's loop keeps the ranks aligned whatever
        passes ran before, as with torch's ``DistributedSampler``.
        """
        self.epoch = _check_int("epoch", epoch, 0)
        if self._passes.live:
            self._generation += 1  # the running pass is over: its end must not move the epoch
        self._passes.reset()

    def __iter__(self) -> Iterator[int]:
        if self._passes.live:
            # A started pass that a new one replaces before its end (persistent workers replace
            # their sampler iterator only when the next pass starts) was left early.
            self._passes.end_early(more_than_one_batch=True)
        self._generation += 1
        return self._indices(self._generation)

    def _indices(self, generation: int) -> Iterator[int]:
        # A generator, so nothing happens until the first index is drawn: torch's DataLoader may
        # call iter() on a sampler twice per pass and draw only from the second iterator.
        if generation != self._generation:
            raise DistkitError(
                "this iterator of a DistributedSplitSampler was superseded: iter() was called on the "
                "sampler again before its first index was drawn. Iterate one pass at a time."
            )
        passes = self._passes
        passes.begin(
            self.epoch,
            "Call sampler.set_epoch(epoch) at the start of each epoch (it picks each pass's epoch).",
        )
        order = _padded(_epoch_order(self._n, self.shuffle, self.seed, self.epoch), self.total_size)
        try:
            yield from order[self._start : self._start + self.num_samples].tolist()
        except GeneratorExit:  # closed before its end: the DataLoader iterator was dropped
            if generation == self._generation and passes.live:
                passes.end_early(more_than_one_batch=True)
            raise
        if generation == self._generation and passes.live:
            epoch = self.epoch
            self.epoch += 1
            passes.end_full(epoch)

    def __len__(self) -> int:
        return self.num_samples


def distributed_sampler(
    dataset: Any,
    *,
    shuffle: bool = True,
    seed: int | None = None,
    drop_last: bool = False,
    evaluation: bool = False,
) -> DistributedSplitSampler:
    """A sampler giving this rank its share of ``dataset``, for a DataLoader you make yourself.

    Collective: call on every rank (one small gather checks that every rank passed the same dataset
    length and options). Without a process group it samples the whole dataset.

    A pass run to its end moves the sampler to the next epoch's order, so forgetting ``set_epoch``
    no longer repeats epoch 0's order; calling it still works. A pass left early (a DataLoader
    iterator dropped before its end, as ``next(iter(loader))`` on one rank does) leaves the epoch as
    it was, so the ranks stay on the same split. A full extra pass on some ranks only, and every
    rank stopping each epoch early, raise :class:`DistkitError` (see ``docs/data.md``, "Epochs").
    Each rank gets a contiguous block of the epoch's order, so concatenating per-rank results in
    rank order gives the epoch's order.

    Args:
        dataset: A map-style dataset (``__len__`` and ``__getitem__``).
        shuffle: Shuffle with a fresh order each epoch, the same on every rank.
        seed: Seed of the order; ``None`` takes ``seed_everything(seed)``'s, else 0.
        drop_last: In training, drop the tail that does not divide by the world size instead of
            padding it with samples from the start of the order.
        evaluation: Split without padding: every sample exactly once across ranks; ranks' counts
            differ by at most one (so ranks may get different numbers of batches; use
            :func:`distributed_dataloader` for equal batch counts).

    Returns:
        A :class:`DistributedSplitSampler` (a ``torch.utils.data.DistributedSampler``).

    Raises:
        TypeError: ``dataset`` is iterable-style or has no ``__len__``; ``seed`` is not an int.
        ValueError: The dataset is empty or has fewer samples than there are ranks; ``evaluation``
            with ``drop_last=True``.

    Example:
        >>> import torch, distkit
        >>> sampler = distkit.distributed_sampler(range(10), shuffle=False)
        >>> loader = torch.utils.data.DataLoader(range(10), batch_size=4, sampler=sampler)
        >>> len(sampler)
        10
    """
    what = "distributed_sampler()"
    n = _dataset_len(dataset, what)
    seed = _default_loader_seed() if seed is None else _check_seed(seed)
    if evaluation and drop_last:
        raise ValueError(
            f"{what}: evaluation=True sees every sample exactly once, which drop_last=True would "
            f"break; pass drop_last=False."
        )
    world_size, rank = runtime.get_world_size(), runtime.get_rank()
    _check_enough_samples(n, world_size, what)
    check = _EpochCheck.create("DistributedSplitSampler", shuffle)
    _check_same_on_every_rank(
        what,
        {
            "len(dataset)": n,
            "shuffle": shuffle,
            "seed": seed,
            "drop_last": drop_last,
            "evaluation": evaluation,
        },
    )
    sampler = DistributedSplitSampler(
        dataset,
        world_size=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        evaluation=evaluation,
    )
    sampler._passes.check = check
    return sampler


# ---------------------------------------------------------------------------------------------
# The loader


def _identity(batch: Any) -> Any:
    # The collated batch comes out of _SeededDataset already; torch's own collate step passes it on.
    return batch


def _init_worker(
    seed: int, rank: int, epoch: int, user_fn: Callable[[int], None] | None, worker_id: int
) -> None:
    # The worker stream of docs/data.md, for randomness outside batches (a dataset that opens files
    # or draws in its own init); batches reseed from their own stream anyway.
    _apply_stream_seed(derive_seed(seed, _STREAM_WORKER, rank, worker_id, epoch))
    if user_fn is not None:
        user_fn(worker_id)


def _draws_nothing(dataset: Any) -> bool:
    """Whether fetching from ``dataset`` provably uses no RNG: a ``TensorDataset``, a tensor, a list,
    tuple or range, or a ``Subset`` of one. Exact types only: a subclass may augment."""
    if type(dataset) is torch.utils.data.Subset:
        return _draws_nothing(dataset.dataset)
    return type(dataset) in (torch.utils.data.TensorDataset, torch.Tensor, list, tuple, range)


class _SeededDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fetches and collates one batch on that batch's own random stream.

    The inner DataLoader's batch sampler yields ``(stream_seed, indices)``; torch hands that item
    to ``__getitems__`` unchanged, in a worker or in the training process. Batches that provably
    draw nothing (in-memory data, torch's default collate) skip the stream.
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        self._batched = bool(getattr(dataset, "__getitems__", None))
        self._no_stream = collate_fn is None and _draws_nothing(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def _fetch(self, indices: list[int]) -> Any:
        samples = self.dataset.__getitems__(indices) if self._batched else [self.dataset[i] for i in indices]
        return self.collate_fn(samples)

    def __getitems__(self, item: tuple[int, list[int]]) -> Any:
        stream_seed, indices = item
        if self._no_stream:
            return self._fetch(indices)
        if get_worker_info() is not None:
            # A worker process: its RNGs serve data loading only.
            _apply_stream_seed(stream_seed)
            return self._fetch(indices)
        # The training process: borrow the RNGs and put the training streams (dropout...) back.
        return _run_on_stream(stream_seed, functools.partial(self._fetch, indices))


class _BatchPlan:
    """The inner DataLoader's batch sampler: this rank's batches of one pass, from a start batch."""

    def __init__(self, n: int, batches: list[tuple[int, int]], total: int, shuffle: bool, rank: int) -> None:
        self.n = n
        self.batches = batches
        self.total = total
        self.shuffle = shuffle
        self.rank = rank
        # Set by DistributedLoader before each pass.
        self.seed = 0
        self.epoch = 0
        self.start = 0
        self.rest: _Rest | None = None

    def __len__(self) -> int:
        return len(self.batches) - self.start

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        seed, epoch, start, rank, rest = self.seed, self.epoch, self.start, self.rank, self.rest
        order = _epoch_order(self.n, self.shuffle, seed, epoch)
        if rest is not None:
            # The rest of an epoch begun on another number of ranks: its own layout and streams.
            order = _continued(order, rest.offset, rest.total)
            for index in range(start, len(self.batches)):
                position, size = rest.batches[index - rest.skip]
                yield (
                    derive_seed(seed, _STREAM_REST_BATCH, rank, epoch, rest.offset, index - rest.skip),
                    order[position : position + size].tolist(),
                )
            return
        order = _padded(order, self.total)
        for index in range(start, len(self.batches)):
            position, size = self.batches[index]
            yield (
                derive_seed(seed, _STREAM_BATCH, rank, epoch, index),
                order[position : position + size].tolist(),
            )


class _Pass:
    """One pass over a :class:`DistributedLoader`: counts the batches handed out."""

    def __init__(self, owner: DistributedLoader, generation: int) -> None:
        self._owner = owner
        self._generation = generation
        self._iterator: Iterator[Any] | None = None
        self._done = False

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        owner = self._owner
        if owner._generation != self._generation:
            self._done = True
            raise DistkitError(
                "this iterator of a DistributedLoader was superseded: iter(), set_epoch() or "
                "load_state_dict() was called on the loader since it started. Iterate one pass at a time."
            )
        if self._iterator is None:
            try:
                self._iterator = owner._start_pass()
            except BaseException:
                self._done = True  # nothing was handed out: the next pass starts at this same position
                raise
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._done = True
            self._iterator = None  # non-persistent workers shut down with their iterator
            if owner._generation == self._generation:
                owner._end_full_pass()  # may raise: the ranks turned out to be in different epochs
            raise
        owner._consumed += 1
        return batch

    def __del__(self) -> None:
        # Dropped before its end (`break`, or `next(iter(loader))`): the next pass starts where this
        # one started (docs/data.md, "Epochs").
        if not self._done and self._iterator is not None and self._owner._generation == self._generation:
            self._done = True
            self._owner._end_early()


class DistributedLoader:
    """A DataLoader over this rank's share of a dataset; made by :func:`distributed_dataloader`.

    Iterate it like a DataLoader. A pass run to its end moves the loader to the next epoch by itself
    (the first pass is epoch 0, or the epoch given to :meth:`set_epoch`); a pass left early (a
    ``break``, ``next(iter(loader))``) leaves the epoch as it was, and the next pass starts where it
    started, so a look at a batch on one rank keeps that rank on the others' split. The first pass
    after :meth:`load_state_dict` finishes the saved epoch from where it stopped, also when the state
    was saved by another number of ranks (the samples no old rank saw, re-split). A full extra pass
    on some ranks only, and every rank stopping each epoch early, raise :class:`DistkitError`
    naming the fix (``docs/data.md``, "Epochs").

    Attributes:
        dataset: The dataset, as given.
        batch_size: Samples per batch on this rank (the last batch of an epoch may be smaller).
        shuffle, drop_last, evaluation, seed: As given to :func:`distributed_dataloader`.
        num_workers, pin_memory, persistent_workers, prefetch_factor, multiprocessing_context: The
            DataLoader settings in use.
        batches_per_rank: Batches in one epoch on each rank, in rank order (all equal, except
            for evaluation with ``batch_size=1``).
        dataloader: The underlying ``torch.utils.data.DataLoader``; iterate this loader instead,
            which keeps the epoch and position that the underlying one relies on.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool,
        drop_last: bool,
        num_workers: int,
        pin_memory: bool,
        persistent_workers: bool,
        prefetch_factor: int | None,
        seed: int,
        evaluation: bool,
        collate_fn: Callable[[list[Any]], Any] | None,
        worker_init_fn: Callable[[int], None] | None,
        multiprocessing_context: str | None,
        world_size: int,
        rank: int,
        n: int,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.evaluation = evaluation
        self.seed = seed
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        self.collate_fn = collate_fn
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.world_size = world_size
        self.rank = rank
        self._n = n
        plan = _batch_plan(n, world_size, batch_size, drop_last=drop_last, evaluation=evaluation)
        total = n if evaluation else _per_rank_samples(n, world_size, drop_last) * world_size
        self._plan = _BatchPlan(n, _rank_batches(plan, rank), total, shuffle, rank)
        self.batches_per_rank = [len(sizes) for sizes in plan]
        # The loader's own generator: a new pass draws torch's worker base seed from it, not from
        # the global RNG, so loading never shifts the training process's random streams.
        self._generator = torch.Generator()
        self.dataloader = DataLoader(
            _SeededDataset(dataset, collate_fn),
            batch_sampler=self._plan,
            num_workers=num_workers,
            collate_fn=_identity,
            pin_memory=pin_memory,
            generator=self._generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
        )
        # Position: the epoch of the current (or next) pass and the batches handed out in it.
        self._epoch = 0
        self._consumed = 0
        # Where the current (or last) pass started: a pass left early starts again from there.
        self._pass_start = 0
        # Where the last pass left early stopped, when the ranks made it together: what
        # state_dict() reports, so that a run resumed from it goes on from there. None otherwise.
        self._stopped: int | None = None
        self._stopped_before: int | None = None  # _stopped when the live pass began (for a rank-local pass)
        # The rest of the current epoch when it was resumed from a state of another world size (or
        # restored from the state of such an epoch); None for an epoch laid out as a whole.
        self._rest: _Rest | None = None
        self._passes = _Passes("DistributedLoader", rank, world_size, training=not evaluation)
        # Bumped by every new pass, set_epoch() and load_state_dict(); older passes stop.
        self._generation = 0

    @property
    def epoch(self) -> int:
        """The epoch of the current pass, or of the next one when no pass is running."""
        return self._epoch

    def __len__(self) -> int:
        """Batches in one full epoch on this rank."""
        return len(self._plan.batches)

    def __iter__(self) -> Iterator[Any]:
        if self._passes.live:
            self._end_early()  # a started pass replaced before its end was left early
        self._generation += 1
        return _Pass(self, self._generation)

    def _start_pass(self) -> Iterator[Any]:
        if len(self.dataset) != self._n:
            raise DistkitError(
                f"the dataset now has {len(self.dataset)} samples but had {self._n} when this loader "
                f"was made; make a new loader (on every rank) after changing the dataset."
            )
        self._passes.begin(
            self._epoch,
            "Call loader.set_epoch(epoch) at the start of each epoch to move on to a new epoch, or "
            "loader.load_state_dict(loader.state_dict()) before a pass to go on where the last one "
            "stopped.",
        )
        self._pass_start, self._stopped_before, self._stopped = self._consumed, self._stopped, None
        self._plan.seed, self._plan.epoch, self._plan.start = self.seed, self._epoch, self._consumed
        self._plan.rest = self._rest
        self._generator.manual_seed(derive_seed(self.seed, _STREAM_LOADER, self.rank, self._epoch))
        self.dataloader.worker_init_fn = functools.partial(
            _init_worker, self.seed, self.rank, self._epoch, self.worker_init_fn
        )
        try:
            return iter(self.dataloader)
        except BaseException:
            self._passes.live = False
            self._stopped = self._stopped_before
            raise

    def _end_full_pass(self) -> None:
        epoch = self._epoch
        self._epoch += 1
        self._consumed = self._pass_start = 0
        self._stopped, self._rest = None, None
        self._passes.end_full(epoch)

    def _end_early(self) -> None:
        handed = self._consumed - self._pass_start
        shared = self._passes.end_early(more_than_one_batch=handed > 1)
        # A pass the ranks made together stopped training there; a rank-local one leaves no trace.
        self._stopped = self._consumed if shared and handed else self._stopped_before
        self._consumed = self._pass_start

    def set_epoch(self, epoch: int) -> None:
        """Start the next pass at ``epoch`` (optional: a pass run to its end moves on by itself).

        Local. Setting the epoch the loader is already positioned at, between passes, keeps its
        position (one restored by :meth:`load_state_dict`). Calling it on every rank right before
        each epoch's loop keeps the ranks aligned whatever passes ran before.
        """
        _check_int("epoch", epoch, 0)
        if epoch != self._epoch or self._passes.live:
            self._epoch, self._consumed, self._rest = epoch, 0, None
        self._pass_start, self._stopped = self._consumed, None
        self._passes.reset()
        self._generation += 1

    def state_dict(self) -> dict[str, Any]:
        """The loader's position: epoch, batches handed out in it, seed, and the layout settings.

        Local. Plain ints and bools (safe for ``torch.load(weights_only=True)``). In training every
        rank holds the same state, so saving the main process's is enough. Taken inside the loop
        body, the batch just received counts as consumed. After a pass run to its end it points at
        the next epoch. After a pass left early (``break`` at the last step) it is where that pass
        stopped, so a run resumed from it goes on exactly from there, when the ranks communicated
        during the pass (a training loop; in a world of one, always); a pass made without them (a
        look at a batch on one rank) leaves the state as it was.

        ``resume_offset`` is 0 unless the epoch was resumed from a state of another world size: it
        is then the number of samples at the start of the epoch's order that the earlier ranks had
        seen, and ``batches_consumed`` counts from the index the rest of the epoch started at (see
        :meth:`load_state_dict`).

        Example:
            >>> import distkit
            >>> loader = distkit.distributed_dataloader(range(10), 4)
            >>> passes = iter(loader)
            >>> batch = next(passes)
            >>> {k: loader.state_dict()[k] for k in ("epoch", "batches_consumed", "resume_offset")}
            {'epoch': 0, 'batches_consumed': 1, 'resume_offset': 0}
        """
        return {
            "epoch": self._epoch,
            "batches_consumed": self._consumed if self._stopped is None else self._stopped,
            "seed": self.seed,
            "resume_offset": 0 if self._rest is None else self._rest.offset,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "dataset_len": self._n,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "evaluation": self.evaluation,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next pass continues that epoch after its consumed batches.

        Local. Consumed samples are skipped in the sampler, not loaded and thrown away, and every
        batch has its own random stream, so the resumed batches equal those of an uninterrupted run,
        with any number of workers.

        A training state saved mid-epoch with **another world size** (each old rank had handed out
        the same number of batches, so together they had seen a prefix of the epoch's order)
        continues that epoch with exactly the samples no old rank had seen, split over this job's
        ranks as a whole epoch of that many samples would be (padded by wrapping around to the start
        of the order, or cut with ``drop_last``), each batch on a stream derived from the seed, this
        rank, the epoch and the prefix. Those ``R`` batches take the epoch's last indices
        (``batches_consumed`` becomes ``len(self) - R``); later epochs are this world size's usual
        ones (``docs/data.md``, "Resuming on another number of ranks").

        Raises:
            ValueError: A key is missing or invalid, or the state is mid-epoch and was taken with a
                different batch size, dataset length or split settings (or world size, for an
                evaluation loader).

        Example:
            >>> import distkit
            >>> loader = distkit.distributed_dataloader(range(10), 2, shuffle=False)
            >>> saved = {**loader.state_dict(), "world_size": 2, "batches_consumed": 1}
            >>> loader.load_state_dict(saved)  # 2 ranks saw samples 0..3; 3 batches of 2 are left
            >>> [batch.tolist() for batch in loader]
            [[4, 5], [6, 7], [8, 9]]
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(
                f"load_state_dict() got a state without {missing}; pass a dict made by "
                f"DistributedLoader.state_dict()."
            )
        epoch = _check_int("state['epoch']", state["epoch"], 0)
        consumed = _check_int("state['batches_consumed']", state["batches_consumed"], 0)
        seed = _check_seed(state["seed"], name="state['seed']")
        offset = _check_int("state['resume_offset']", state.get("resume_offset", 0), 0)
        current = self.state_dict()
        changed = [key for key in _LAYOUT_KEYS if key in state and state[key] != current[key]]
        elastic = changed == ["world_size"] and not self.evaluation
        if (consumed or offset) and changed and not elastic:
            described = ", ".join(f"{key}: saved {state[key]!r}, now {current[key]!r}" for key in changed)
            also = " and state['resume_offset'] = 0" if offset else ""
            only = "" if self.evaluation else " (only the world size may change)"
            raise ValueError(
                f"cannot resume mid-epoch ({consumed} batches into epoch {epoch}) with different "
                f"settings ({described}): batch {consumed} would hold other samples. Resume with the "
                f"saved settings{only}, or set state['batches_consumed'] = 0{also} to restart epoch "
                f"{epoch}."
            )
        if offset > self._n or (offset and self.evaluation):
            limit = (
                "an evaluation loader has no rest of an epoch"
                if self.evaluation
                else f"the dataset has {self._n} samples"
            )
            raise ValueError(
                f"state['resume_offset'] is {offset} but {limit}; pass a state made by "
                f"DistributedLoader.state_dict()."
            )
        rest = None
        if elastic and (consumed or offset):
            saved_world = _check_int("state['world_size']", state["world_size"], 1)
            rest = self._rest_of_epoch(self._seen(saved_world, offset, consumed))
            consumed = rest.skip
        elif offset:
            self._seen(self.world_size, offset, consumed)  # checks that `consumed` fits the rest
            rest = self._rest_of_epoch(offset)
        elif consumed > len(self):
            raise ValueError(
                f"state['batches_consumed'] is {consumed} but an epoch has only {len(self)} batches "
                f"on this rank; pass a state saved by this loader's job."
            )
        self.seed, self._epoch, self._consumed, self._rest = seed, epoch, consumed, rest
        self._pass_start, self._stopped = consumed, None
        self._passes.reset()
        self._generation += 1

    def _seen(self, world_size: int, offset: int, consumed: int) -> int:
        """Samples of the epoch's order seen by ``world_size`` ranks at a saved position."""
        return _seen_after(
            self._n, world_size, self.batch_size, drop_last=self.drop_last, offset=offset, consumed=consumed
        )

    def _rest_of_epoch(self, offset: int) -> _Rest:
        return _rest_of_epoch(
            self._n, self.world_size, self.rank, self.batch_size, drop_last=self.drop_last, offset=offset
        )


def distributed_dataloader(
    dataset: Any,
    batch_size: int,
    *,
    shuffle: bool | None = None,
    drop_last: bool = False,
    num_workers: int = 0,
    pin_memory: bool | None = None,
    persistent_workers: bool | None = None,
    prefetch_factor: int | None = None,
    seed: int | None = None,
    evaluation: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    worker_init_fn: Callable[[int], None] | None = None,
    multiprocessing_context: str | None = None,
) -> DistributedLoader:
    """A DataLoader over this rank's share of ``dataset``: seeded, resumable, and hang-free.

    Collective: call on every rank (one small gather checks that every rank passed the same dataset
    length and options). Without a process group it loads the whole dataset.

    - Training (``evaluation=False``): every rank gets the same number of samples, padded by
      wrapping around the epoch's order (``drop_last=False``) or cut to a multiple of the world size
      with the last incomplete batch dropped (``drop_last=True``), so every rank sees the same
      number of batches and no collective waits on a rank that ran out of data.
    - Evaluation (``evaluation=True``): no padding; every sample is loaded exactly once across
      ranks, and every rank gets the same number of batches whenever ``batch_size >= 2`` (the last
      batches may be smaller). Gathering each batch with :func:`gather_for_metrics` gives the
      samples in order; ``reduce_metrics`` of ``(sum, count)`` pairs gives the exact
      single-process metric.
    - A pass run to its end moves to the next epoch (a new order when shuffling); a pass left early
      leaves the epoch as it was, so a look at a batch on one rank never shifts its share
      (``docs/data.md``, "Epochs"). :meth:`DistributedLoader.state_dict` / ``load_state_dict``
      resume mid-epoch exactly.
    - Each batch is fetched and collated on its own random stream (``docs/data.md``), in a worker
      or here; the training process's RNG states are left as they were.

    Args:
        dataset: A map-style dataset (``__len__`` and ``__getitem__``, optionally ``__getitems__``).
        batch_size: Samples per batch on each rank.
        shuffle: A new order every epoch; ``None`` means ``True`` for training, ``False`` for evaluation.
        drop_last: Training only: drop samples instead of padding (see above).
        num_workers: Worker processes per rank (0: load in this process).
        pin_memory: Page-locked batches for faster copies to the GPU; ``None``: on when this rank's
            device is CUDA.
        persistent_workers: Keep workers alive between epochs; ``None``: on when ``num_workers > 0``.
        prefetch_factor: Batches each worker loads ahead (torch's default, 2, when ``None``).
        seed: Seed of the order and of every data stream; ``None`` takes ``seed_everything``'s, else 0.
        evaluation: Unpadded split for exact evaluation (see above).
        collate_fn: Turns a list of samples into a batch; torch's ``default_collate`` when ``None``.
        worker_init_fn: Called in each worker after distkit has seeded it.
        multiprocessing_context: How workers start: ``"fork"``, ``"spawn"`` or ``"forkserver"``;
            ``None`` is multiprocessing's default (fork on Linux before Python 3.14). Fork starts
            workers in milliseconds; spawn and forkserver re-import your modules in each worker and
            need a picklable dataset.

    Returns:
        A :class:`DistributedLoader`.

    Raises:
        TypeError: ``dataset`` is iterable-style or has no ``__len__``; a number is not an int.
        ValueError: ``batch_size < 1``; an empty dataset, or fewer samples than ranks;
            ``drop_last=True`` with so few samples per rank that some rank would get no batch;
            ``evaluation`` with ``drop_last``; ``num_workers < 0``; ``prefetch_factor`` or
            ``persistent_workers`` without workers.
        DistkitError: Ranks passed different dataset lengths, batch sizes, seeds or options. While
            iterating: the ranks ended up in different epochs, or passes left early keep
            restarting the same epoch (see ``docs/data.md``, "Epochs").

    Example:
        >>> import torch, distkit
        >>> loader = distkit.distributed_dataloader(torch.arange(10.0), batch_size=4, shuffle=False)
        >>> [batch.tolist() for batch in loader]
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
    """
    what = "distributed_dataloader()"
    n = _dataset_len(dataset, what)
    _check_int("batch_size", batch_size, 1)
    _check_int("num_workers", num_workers, 0)
    seed = _default_loader_seed() if seed is None else _check_seed(seed)
    if shuffle is None:
        shuffle = not evaluation
    if evaluation and drop_last:
        raise ValueError(
            f"{what}: evaluation=True loads every sample exactly once, which drop_last=True would "
            f"break; pass drop_last=False."
        )
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError(
            f"{what}: prefetch_factor={prefetch_factor} needs worker processes; pass num_workers > 0 "
            f"or leave prefetch_factor=None."
        )
    if prefetch_factor is not None:
        _check_int("prefetch_factor", prefetch_factor, 1)
    if persistent_workers and num_workers == 0:
        raise ValueError(
            f"{what}: persistent_workers=True needs worker processes; pass num_workers > 0 or "
            f"leave persistent_workers=None."
        )
    world_size, rank = runtime.get_world_size(), runtime.get_rank()
    _check_enough_samples(n, world_size, what)
    per_rank = _per_rank_samples(n, world_size, drop_last)
    if not evaluation and per_rank < batch_size:
        share = (
            f"the dataset has {_plural(n, 'sample', 'samples')}"
            if world_size == 1
            else f"each of the {world_size} ranks gets {per_rank} of the {n} samples"
        )
        if drop_last:
            raise ValueError(
                f"{what}: drop_last=True with batch_size={batch_size} leaves no batch: {share}. "
                f"Pass batch_size <= {per_rank} or drop_last=False."
            )
        # Evaluation is left alone: a validation set in fewer batches than asked changes nothing.
        overall = f" ({per_rank * world_size} over all ranks, not {batch_size * world_size})"
        overall = overall if world_size > 1 else ""
        warnings.warn(
            f"{what}: batch_size={batch_size} is more than a rank's share of the dataset ({share}), "
            f"so every batch holds {per_rank} samples, one batch per epoch{overall}. Pass "
            f"batch_size <= {per_rank}, or use more data.",
            stacklevel=2,
        )
    check = _EpochCheck.create("DistributedLoader", shuffle)
    _check_same_on_every_rank(
        what,
        {
            "len(dataset)": n,
            "batch_size": batch_size,
            "shuffle": shuffle,
            "seed": seed,
            "drop_last": drop_last,
            "evaluation": evaluation,
        },
    )
    loader = DistributedLoader(
        dataset,
        batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=runtime.get_device().type == "cuda" if pin_memory is None else bool(pin_memory),
        persistent_workers=num_workers > 0 if persistent_workers is None else bool(persistent_workers),
        prefetch_factor=prefetch_factor,
        seed=seed,
        evaluation=evaluation,
        collate_fn=collate_fn,
        worker_init_fn=worker_init_fn,
        multiprocessing_context=multiprocessing_context,
        world_size=world_size,
        rank=rank,
        n=n,
    )
    loader._passes.check = check
    if len(set(loader.batches_per_rank)) > 1:
        # Only batch_size=1 with a dataset size that the world size does not divide gets here.
        warnings.warn(
            f"{what}: evaluation with batch_size=1 over {n} samples on {world_size} ranks gives ranks "
            f"{min(loader.batches_per_rank)} or {max(loader.batches_per_rank)} batches; a collective "
            f"inside the loop would wait forever on the ranks that finished. Gather once after the "
            f"loop, or use batch_size >= 2 (equal batch counts on every rank).",
            stacklevel=2,
        )
    return loader


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
    owner = loader if isinstance(loader, DistributedLoader) else getattr(loader, "sampler", None)
    kept = _keep_position(owner) if isinstance(owner, (DistributedLoader, DistributedSplitSampler)) else None
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
        if kept is not None:
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


# ---------------------------------------------------------------------------------------------
# Learning rate for a larger effective batch


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

"""Iterable and streaming data: :class:`StreamLoader`, what ``distributed_dataloader`` returns for an
``IterableDataset`` (torch's, Hugging Face's streaming ``datasets.IterableDataset``, or
:class:`ShardFiles`: tar or line files, local or fsspec URLs).

The split rule (by sample). Every rank reads the same *global stream* of an epoch: the source's
samples in order (shard files in a seeded order per epoch when shuffling), through a seeded shuffle
buffer of ``buffer_size`` samples. A *global step* is the next ``world_size x batch_size`` samples
of it; rank ``r`` takes samples ``[r*B, (r+1)*B)`` of the step as its batch, and DataLoader worker
``w`` of ``n`` builds the rank's batches ``w, w+n, ...`` (the DataLoader yields them in order).

- Training ends the epoch at the last complete global step (the stream's tail of fewer than
  ``world_size x batch_size`` samples is dropped, as ``drop_last`` does), so every rank takes the
  same number of steps and no rank waits in a collective for one that ran out, with no
  communication: every rank reads the same stream, so every rank sees where it ends.
- Evaluation keeps the tail: the last global step is cut into the ranks' slices, so a rank may get
  a smaller last batch or none; every sample is evaluated exactly once.
- The position is one number, the samples of the epoch's global stream consumed (a multiple of
  ``world_size x batch_size``). A resume on any number of ranks goes on from there: nothing
  repeated, nothing skipped. Reaching it re-reads the stream from the epoch's start through the
  shuffle buffer (no sample is yielded on the way), so a resume costs one read of what the epoch
  had consumed.

Every rank (and every worker) reads the whole stream: simple and exact, at the price of reading it
``world_size x num_workers`` times. A source that is cheap to read (token files, local shards)
keeps up; one that is not should be pre-sharded into map-style data.
"""

from __future__ import annotations

import io
import os
import random
import tarfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from distkit import collectives, runtime
from distkit._utils.checks import check_int as _check_int
from distkit.data._checks import check_state_mapping
from distkit.errors import DistkitError
from distkit.seeding import _check_seed, _default_loader_seed

__all__ = ["ShardFiles", "StreamLoader"]

# Samples the shuffle buffer holds when none is given: enough to mix neighbouring records.
DEFAULT_BUFFER = 1000

_END = object()  # the end of an iterator (next(iterator, _END))


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is loaded as a stream: an ``IterableDataset`` (torch's, a Hugging Face
    ``datasets.IterableDataset``, or :class:`ShardFiles`)."""
    return isinstance(dataset, IterableDataset) or type(dataset).__name__ == "IterableDataset"


class ShardFiles(IterableDataset[Any]):
    """A stream of samples read from shard files, local paths or fsspec URLs: a ``.tar`` file as
    WebDataset samples (the members sharing a basename make one dict ``{"__key__": name,
    "__shard__": path, ext: bytes, ...}``), any other file as its lines (``str``, without the
    newline). Iterated directly, the shards come in the order given; :func:`distributed_dataloader`
    reads them in a seeded order per epoch when shuffling.

    A list of paths is not read as shards by itself (it is a map-style dataset of strings): wrap it.

    Example:
        >>> shards = distkit.ShardFiles(sorted(glob.glob("data/train-*.tar")))  # doctest: +SKIP
        >>> loader = distkit.distributed_dataloader(shards, batch_size=32)  # doctest: +SKIP
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]]) -> None:
        if isinstance(paths, (str, os.PathLike)) or not paths:
            raise ValueError(f"ShardFiles needs a non-empty list of paths or URLs, got {paths!r}.")
        self.paths = [os.fspath(path) for path in paths]

    def __iter__(self) -> Iterator[Any]:
        return self.samples(range(len(self.paths)))

    def samples(self, order: Sequence[int]) -> Iterator[Any]:
        """The samples of the shards, in ``order`` (indices into :attr:`paths`)."""
        for index in order:
            yield from _read_shard(self.paths[index])


def _read_shard(path: str) -> Iterator[Any]:
    import fsspec

    with fsspec.open(path, "rb") as raw:
        if path.endswith(".tar"):
            yield from _tar_samples(raw, path)
            return
        for line in io.TextIOWrapper(raw, encoding="utf-8"):
            yield line.rstrip("\n")


def _tar_samples(raw: Any, path: str) -> Iterator[dict[str, Any]]:
    current: dict[str, Any] | None = None
    with tarfile.open(fileobj=raw, mode="r|*") as archive:
        for member in archive:
            if not member.isfile():
                continue
            name = os.path.basename(member.name)
            key, _, ext = name.partition(".")
            key = os.path.join(os.path.dirname(member.name), key)
            handle = archive.extractfile(member)
            data = handle.read() if handle is not None else b""
            if current is not None and current["__key__"] != key:
                yield current
                current = None
            if current is None:
                current = {"__key__": key, "__shard__": path}
            current[ext] = data
    if current is not None:
        yield current


def _global_stream(source: Any, *, epoch: int, seed: int, shuffle: bool, buffer_size: int) -> Iterator[Any]:
    """The epoch's samples in the order every rank sees them."""
    rng = random.Random(f"distkit-stream:{seed}:{epoch}")
    if isinstance(source, ShardFiles):
        order = list(range(len(source.paths)))
        if shuffle:
            rng.shuffle(order)
        samples: Iterator[Any] = source.samples(order)
    elif _is_hugging_face(source):
        samples = _hugging_face_rows(source, epoch)
    else:
        samples = iter(source)
    if not shuffle:
        yield from samples
        return
    buffer: list[Any] = []
    for sample in samples:
        if len(buffer) < buffer_size:
            buffer.append(sample)
            continue
        index = int(rng.random() * buffer_size)  # randrange costs twice as much per sample
        yield buffer[index]
        buffer[index] = sample
    rng.shuffle(buffer)
    yield from buffer


def _is_hugging_face(source: Any) -> bool:
    return type(source).__module__.startswith("datasets.") and callable(getattr(source, "iter", None))


def _hugging_face_rows(dataset: Any, epoch: int) -> Iterator[Any]:
    """The rows of a Hugging Face ``datasets.IterableDataset``, all of them in every process.

    Its ``__iter__`` gives a DataLoader worker only the worker's shards (and a dataset split with
    ``split_dataset_by_node`` only the node's), where here every worker reads the whole stream and
    takes its batches: ``dataset.iter`` reads it whole, in batches of one row.
    """
    if getattr(dataset, "_distributed", None) is not None:  # set by split_dataset_by_node
        raise DistkitError(
            "this Hugging Face dataset was split with datasets.distributed.split_dataset_by_node, so "
            "every rank streams other rows; distkit splits the stream itself (every rank reads the "
            "whole stream and takes its slice of each step). Pass the dataset before the split."
        )
    dataset.set_epoch(epoch)  # its own shard shuffle (dataset.shuffle(...)) moves on per epoch
    for row in dataset.iter(batch_size=1):
        yield {key: value[0] for key, value in row.items()}


class _RankBatches(IterableDataset[Any]):
    """This rank's batches of one epoch from ``start`` on, as DataLoader worker ``w`` of ``n``
    builds them (batches ``w, w+n, ...``); collated."""

    def __init__(self, loader: StreamLoader, epoch: int, start: int) -> None:
        self.source = loader.source
        self.epoch, self.start = epoch, start
        self.seed, self.shuffle, self.buffer_size = loader.seed, loader.shuffle, loader.buffer_size
        self.batch_size, self.evaluation = loader.batch_size, loader.evaluation
        self.rank, self.world_size = loader.rank, loader.world_size
        self.collate_fn = loader.collate_fn

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        step_size = self.world_size * self.batch_size
        low, high = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        stream = _global_stream(
            self.source, epoch=self.epoch, seed=self.seed, shuffle=self.shuffle, buffer_size=self.buffer_size
        )
        position = 0
        step: list[Any] = []
        held: list[Any] = []  # evaluation: the last whole step, split with the tail at the end
        index = 0  # this rank's batch index from `start` on
        for sample in stream:
            position += 1
            if position <= self.start:
                continue  # consumed before the resume: read through the buffer, not yielded
            step.append(sample)
            if len(step) < step_size:
                continue
            if self.evaluation:
                step, held = held, step
                if not step:
                    continue
            if index % workers == worker:
                yield self.collate_fn(step[low:high])
            index += 1
            step = []
        if not self.evaluation:
            return
        # In halves when there was a whole step and a half holds a sample on every rank (a batch
        # size of 2 or more); with batch_size=1 each rank's part (1 or 2 samples) is one batch.
        halves = bool(held) and self.batch_size > 1
        for batch in _final_batches(held + step, self.rank, self.world_size, halves=halves):
            if index % workers == worker:
                yield self.collate_fn(batch)
            index += 1


def _final_batches(samples: list[Any], rank: int, world_size: int, *, halves: bool) -> list[list[Any]]:
    """This rank's last evaluation batches: ``samples`` (the last whole step and the tail) cut into
    ``world_size`` contiguous parts as even as can be, each part in two batches (``halves``) or one.
    Every rank then gets as many batches as the others whenever there was a whole step (its part
    holds at least ``batch_size`` samples), so a loop that gathers every batch never waits alone.
    With ``batch_size=1`` a part of two samples is one batch of two (halves would leave a rank of
    one sample a batch short)."""
    low = rank * len(samples) // world_size
    part = samples[low : (rank + 1) * len(samples) // world_size]
    if not halves:
        return [part] if part else []
    middle = (len(part) + 1) // 2
    return [batch for batch in (part[:middle], part[middle:]) if batch]


class StreamLoader:
    """A loader over this rank's share of a stream (``docs/data.md``, "Iterable and streaming
    data"): every rank takes the same number of training batches, evaluation sees every sample once,
    and :meth:`state_dict` resumes mid-epoch on any number of ranks.

    Made by :func:`distkit.distributed_dataloader` for an ``IterableDataset`` (:class:`ShardFiles`
    included). It has no ``len()``: a stream's length is known once it is read (train by ``max_steps``).

    Example:
        >>> shards = distkit.ShardFiles(["shard-0.txt", "shard-1.txt"])  # doctest: +SKIP
        >>> for lines in distkit.distributed_dataloader(shards, batch_size=8): ...  # doctest: +SKIP
    """

    def __init__(
        self,
        source: Any,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        evaluation: bool,
        buffer_size: int,
        num_workers: int,
        collate_fn: Callable[[list[Any]], Any] | None,
        pin_memory: bool,
        prefetch_factor: int | None,
        worker_init_fn: Callable[[int], None] | None,
        multiprocessing_context: str | None,
    ) -> None:
        self.source = source
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.evaluation, self.buffer_size, self.num_workers = evaluation, buffer_size, num_workers
        self.collate_fn: Callable[[list[Any]], Any] = collate_fn or torch.utils.data.default_collate
        self.pin_memory, self.prefetch_factor = pin_memory, prefetch_factor
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.rank, self.world_size = runtime.get_rank(), runtime.get_world_size()
        self._epoch = 0
        # Global samples of this epoch consumed before the current pass (a resume's position),
        # and batches this rank has taken in the current pass.
        self._start = 0
        self._taken = 0
        self._ends_epoch = False

    @property
    def epoch(self) -> int:
        """The epoch the next pass loads."""
        return self._epoch

    @property
    def dataset(self) -> Any:
        """The stream: the ``IterableDataset`` given, or the shard files."""
        return self.source

    @property
    def position(self) -> int:
        """Samples of this epoch's global stream consumed by every rank together."""
        return self._start + self._taken * self.world_size * self.batch_size

    @property
    def batches_consumed(self) -> int:
        """This rank's batches of the epoch so far, counted in this loader's world size and batch
        size (after a resume on another number of ranks, the restored position in its batches)."""
        return self.position // (self.world_size * self.batch_size)

    @property
    def ends_epoch(self) -> bool:
        """Whether the batch just handed out is the epoch's last (the stream has ended after it)."""
        return self._ends_epoch

    def set_epoch(self, epoch: int) -> None:
        """Load ``epoch`` next (a new shard order and shuffle when shuffling); setting the epoch a
        restored position belongs to keeps that position. Local."""
        _check_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch, self._start, self._taken = epoch, 0, 0

    def __iter__(self) -> Iterator[Any]:
        start = self.position
        self._start, self._taken = start, 0
        batches = _RankBatches(self, self._epoch, start)
        if self.num_workers == 0:
            iterator: Any = iter(batches)
        else:
            iterator = iter(
                torch.utils.data.DataLoader(
                    batches,
                    batch_size=None,
                    num_workers=self.num_workers,
                    pin_memory=self.pin_memory,
                    prefetch_factor=self.prefetch_factor,
                    worker_init_fn=self.worker_init_fn,
                    multiprocessing_context=self.multiprocessing_context,
                )
            )
        # One batch read ahead, so that the Trainer knows the epoch's last batch when it gets it
        # (it syncs an accumulation there); the position counts the batches handed out only.
        self._ends_epoch = False
        upcoming = next(iterator, _END)
        while upcoming is not _END:
            batch, upcoming = upcoming, next(iterator, _END)
            self._taken += 1
            self._ends_epoch = upcoming is _END
            yield batch
        # The stream ended: the next pass is the next epoch.
        self._epoch, self._start, self._taken = self._epoch + 1, 0, 0

    def state_dict(self) -> dict[str, Any]:
        """The stream's position: the epoch and the global samples consumed, with what they were
        counted in. Local (the same on every rank in training)."""
        return {
            "stream": True,
            "epoch": self._epoch,
            "position": self.position,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "buffer_size": self.buffer_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a saved position, on this or another number of ranks: the next pass yields the
        rest of the saved epoch, nothing repeated or skipped. Local.

        Raises:
            DistkitError: The state is not a stream's, or was saved with another seed, shuffle or
                buffer size (the stream's order would differ: the rest would not be the rest).
        """
        check_state_mapping(state, "StreamLoader")
        if not state.get("stream"):
            raise DistkitError(
                "this is a stream loader's state_dict() target, but the state was saved by a map-style "
                "DistributedLoader; load it into a loader over the same kind of dataset."
            )
        for key in ("seed", "shuffle", "buffer_size"):
            if state[key] != getattr(self, key):
                raise DistkitError(
                    f"the saved stream position was counted with {key}={state[key]!r}, this loader has "
                    f"{key}={getattr(self, key)!r}: the stream's order differs, so the rest of the "
                    f"epoch cannot be found. Make the loader with {key}={state[key]!r}."
                )
        self._epoch, self._start, self._taken = int(state["epoch"]), int(state["position"]), 0


def stream_dataloader(
    dataset: Any,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int | None,
    evaluation: bool,
    buffer_size: int | None,
    num_workers: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    pin_memory: bool,
    prefetch_factor: int | None,
    worker_init_fn: Callable[[int], None] | None,
    multiprocessing_context: str | None,
) -> StreamLoader:
    """What ``distributed_dataloader`` returns for a stream. Collective: checks the ranks agree."""
    seed = _default_loader_seed() if seed is None else _check_seed(seed)
    buffer = DEFAULT_BUFFER if buffer_size is None else buffer_size
    _check_int("buffer_size", buffer, 1)
    options = (batch_size, shuffle, seed, evaluation, buffer, type(dataset).__name__)
    if runtime.get_world_size() > 1:
        everyone = collectives.all_gather_object(options)
        if any(other != options for other in everyone):
            raise DistkitError(
                f"{runtime._rank_label()} the ranks made stream loaders "
                f"with different (batch_size, shuffle, seed, evaluation, buffer_size, dataset type): "
                f"{everyone}. Every rank reads the same stream and takes its slice of it: pass the "
                f"same options on every rank."
            )
    return StreamLoader(
        dataset,
        batch_size,
        shuffle=shuffle,
        seed=seed,
        evaluation=evaluation,
        buffer_size=buffer,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        worker_init_fn=worker_init_fn,
        multiprocessing_context=multiprocessing_context,
    )

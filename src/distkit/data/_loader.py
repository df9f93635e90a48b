"""The loader: :class:`DistributedLoader` and :func:`distributed_dataloader`."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, overload

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from distkit import runtime
from distkit._utils.checks import check_bool as _check_bool, check_int as _check_int
from distkit.data._checks import (
    _check_enough_samples,
    _check_same_on_every_rank,
    _dataset_len,
    _plural,
    check_state_mapping,
)
from distkit.data._epochs import _EpochCheck, _Passes
from distkit.data._split import (
    _batch_plan,
    _continued,
    _epoch_order,
    _padded,
    _per_rank_samples,
    _rank_batches,
    _Rest,
    _rest_of_epoch,
    _seen_after,
)
from distkit.data._stream import StreamLoader, is_stream, stream_dataloader
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
    derive_seed,
)

__all__: list[str] = []


_STATE_KEYS = ("epoch", "batches_consumed", "seed")
# Settings that fix which samples make up batch k of an epoch; a mid-epoch resume needs them equal.
_LAYOUT_KEYS = ("world_size", "batch_size", "dataset_len", "shuffle", "drop_last", "evaluation")


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


class _SettingsChanged(ValueError):
    """A mid-epoch loader state whose settings differ from this loader's (private: the Trainer,
    which makes the loader, says it in its own terms).

    Attributes:
        epoch: The saved epoch.
        consumed: Batches of it consumed when the state was saved.
        changed: ``{setting: (saved, now)}`` of each setting that differs.
    """

    def __init__(
        self, message: str, *, epoch: int, consumed: int, changed: dict[str, tuple[Any, Any]]
    ) -> None:
        super().__init__(message)
        self.epoch, self.consumed, self.changed = epoch, consumed, changed


class _DatasetResized(DistkitError):
    """The dataset's length changed after the loader was made (private, as :class:`_SettingsChanged`).

    Attributes:
        made: Its length when the loader was made.
        now: Its length now.
        evaluation: Whether the loader is an evaluation loader.
    """

    def __init__(self, message: str, *, made: int, now: int, evaluation: bool) -> None:
        super().__init__(message)
        self.made, self.now, self.evaluation = made, now, evaluation


class _SeededDataset(torch.utils.data.Dataset[Any]):
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
            # torch annotates batch_sampler as yielding lists; it hands any item (here a
            # (stream_seed, indices) pair) to the dataset's __getitems__ unchanged.
            batch_sampler=self._plan,  # type: ignore[arg-type]
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
            raise _DatasetResized(
                f"the dataset now has {len(self.dataset)} samples but had {self._n} when this loader "
                f"was made; make a new loader (on every rank) after changing the dataset.",
                made=self._n,
                now=len(self.dataset),
                evaluation=self.evaluation,
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
        check_state_mapping(state, "DistributedLoader")
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
            raise _SettingsChanged(
                f"cannot resume mid-epoch ({consumed} batches into epoch {epoch}) with different "
                f"settings ({described}): batch {consumed} would hold other samples. Resume with the "
                f"saved settings{only}, or set state['batches_consumed'] = 0{also} to restart epoch "
                f"{epoch}.",
                epoch=epoch,
                consumed=consumed,
                changed={key: (state[key], current[key]) for key in changed},
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


@overload
def distributed_dataloader(
    dataset: IterableDataset[Any],
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
    buffer_size: int | None = None,
) -> StreamLoader: ...


@overload
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
    buffer_size: int | None = None,
) -> DistributedLoader: ...


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
    buffer_size: int | None = None,
) -> DistributedLoader | StreamLoader:
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
    for flag, value, optional in (
        ("shuffle", shuffle, True),
        ("drop_last", drop_last, False),
        ("evaluation", evaluation, False),
        ("pin_memory", pin_memory, True),
        ("persistent_workers", persistent_workers, True),
    ):
        _check_bool(flag, value, optional=optional)
    if is_stream(dataset):
        return _stream_loader(
            dataset,
            batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            seed=seed,
            evaluation=evaluation,
            collate_fn=collate_fn,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            buffer_size=buffer_size,
        )
    if buffer_size is not None:
        raise ValueError(
            f"{what}: buffer_size is the shuffle buffer of a stream (an IterableDataset or ShardFiles); "
            f"{type(dataset).__name__} is map-style and is shuffled whole. Leave buffer_size=None."
        )
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


def _stream_loader(
    dataset: Any,
    batch_size: int,
    *,
    shuffle: bool | None,
    num_workers: int,
    pin_memory: bool | None,
    persistent_workers: bool | None,
    prefetch_factor: int | None,
    seed: int | None,
    evaluation: bool,
    collate_fn: Callable[[list[Any]], Any] | None,
    worker_init_fn: Callable[[int], None] | None,
    multiprocessing_context: str | None,
    buffer_size: int | None,
) -> StreamLoader:
    """``distributed_dataloader`` of a stream: its checks, then a :class:`StreamLoader`."""
    what = "distributed_dataloader()"
    _check_int("batch_size", batch_size, 1)
    _check_int("num_workers", num_workers, 0)
    if persistent_workers:
        raise ValueError(
            f"{what}: persistent_workers=True is not for a stream: each pass starts its workers at the "
            f"stream's position (after a resume, the restored one). Leave persistent_workers=None."
        )
    if prefetch_factor is not None and num_workers == 0:
        raise ValueError(
            f"{what}: prefetch_factor={prefetch_factor} needs worker processes; pass num_workers > 0 "
            f"or leave prefetch_factor=None."
        )
    return stream_dataloader(
        dataset,
        batch_size,
        shuffle=not evaluation if shuffle is None else bool(shuffle),
        seed=seed,
        evaluation=evaluation,
        buffer_size=buffer_size,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=runtime.get_device().type == "cuda" if pin_memory is None else bool(pin_memory),
        prefetch_factor=prefetch_factor,
        worker_init_fn=worker_init_fn,
        multiprocessing_context=multiprocessing_context,
    )

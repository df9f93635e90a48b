"""The sampler, for DataLoaders users make: :class:`DistributedSplitSampler`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler

from distkit import runtime
from distkit._utils.checks import check_bool as _check_bool, check_int as _check_int
from distkit.data._checks import (
    _check_enough_samples,
    _check_same_on_every_rank,
    _dataset_len,
)
from distkit.data._epochs import _EpochCheck, _Passes
from distkit.data._split import (
    _epoch_order,
    _eval_counts,
    _padded,
    _per_rank_samples,
)
from distkit.errors import DistkitError
from distkit.seeding import (
    _check_seed,
    _default_loader_seed,
)

__all__: list[str] = []


# ---------------------------------------------------------------------------------------------
# The sampler, for DataLoaders users make


class DistributedSplitSampler(DistributedSampler[int]):
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
    for flag, value in (("shuffle", shuffle), ("drop_last", drop_last), ("evaluation", evaluation)):
        _check_bool(flag, value)
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

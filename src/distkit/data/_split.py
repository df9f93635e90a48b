"""Which positions of an epoch's order each rank gets, and the rest of an epoch resumed elsewhere.

Pure functions of sizes (private; :mod:`distkit.data` builds its samplers and loaders on them).

An epoch is laid out step-major: step ``k`` holds rank 0's ``k``-th batch, then rank 1's, and so
on, over the epoch's (padded) order. Every rank of a training layout hands out the same number of
batches, so after ``k`` batches on each rank the ranks have seen a **prefix** of the order, whatever
the world size. That prefix is all an epoch resumed on another number of ranks needs: the rest of
the order is laid out over the new ranks exactly as a whole epoch of that many samples would be
(``docs/data.md``, "Resuming on another number of ranks").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distkit.seeding import _STREAM_SHUFFLE, derive_seed


def _epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    if not shuffle:
        return torch.arange(n)
    # Its own generator, so that shuffling never draws from (or depends on) torch's global RNG.
    generator = torch.Generator()
    generator.manual_seed(derive_seed(seed, _STREAM_SHUFFLE, epoch))
    return torch.randperm(n, generator=generator)


def _padded(order: torch.Tensor, total: int) -> torch.Tensor:
    # Wrap around to `total` positions (total < 2n because n >= world size).
    n = order.numel()
    return order if total <= n else torch.cat([order, order[: total - n]])


def _per_rank_samples(n: int, world_size: int, drop_last: bool) -> int:
    # Training: every rank gets the same count, padded up or cut down.
    return n // world_size if drop_last else -(-n // world_size)


def _eval_counts(n: int, world_size: int) -> list[int]:
    return [n // world_size + (1 if rank < n % world_size else 0) for rank in range(world_size)]


def _eval_batch_sizes(count: int, steps: int, batch_size: int) -> list[int]:
    """Split one rank's ``count`` samples into ``steps`` batches of at most ``batch_size``.

    Full batches first; when the last would be empty (the rank has exactly ``(steps-1)*batch_size``
    samples, which happens only when another rank has one more), the last two share one batch's
    worth. Zero-sized batches only arise for ``batch_size == 1`` and are dropped.
    """
    last = count - (steps - 1) * batch_size
    if last >= 1:
        sizes = [batch_size] * (steps - 1) + [last]
    else:
        rest = count - (steps - 2) * batch_size
        sizes = [batch_size] * (steps - 2) + [-(-rest // 2), rest // 2]
    return [size for size in sizes if size > 0]


def _batch_plan(
    n: int, world_size: int, batch_size: int, *, drop_last: bool, evaluation: bool
) -> list[list[int]]:
    """Batch sizes of every rank: ``plan[rank][step]``."""
    if evaluation:
        steps = -(-n // (world_size * batch_size))
        return [_eval_batch_sizes(c, steps, batch_size) for c in _eval_counts(n, world_size)]
    per_rank = _per_rank_samples(n, world_size, drop_last)
    full, rest = divmod(per_rank, batch_size)
    sizes = [batch_size] * full + ([rest] if rest and not drop_last else [])
    return [list(sizes) for _ in range(world_size)]


def _rank_batches(plan: list[list[int]], rank: int) -> list[tuple[int, int]]:
    """``(position, size)`` of each of ``rank``'s batches in the epoch's (padded) order.

    Step-major, then rank: step k holds rank 0's k-th batch, then rank 1's, and so on, so gathering
    one batch from every rank in rank order gives consecutive positions of the order.
    """
    mine: list[tuple[int, int]] = []
    position = 0
    for step in range(max(len(sizes) for sizes in plan)):
        for other, sizes in enumerate(plan):
            if step < len(sizes):
                if other == rank:
                    mine.append((position, sizes[step]))
                position += sizes[step]
    return mine


# ---------------------------------------------------------------------------------------------
# The rest of an epoch: training layouts only (evaluation splits are not step-major prefixes of
# equal steps, and a mid-epoch evaluation state is not worth the rule)


def _training_sizes(n: int, world_size: int, batch_size: int, drop_last: bool) -> list[int]:
    """Batch sizes of each rank (all ranks alike) in a training epoch of ``n`` samples."""
    return _batch_plan(n, world_size, batch_size, drop_last=drop_last, evaluation=False)[0]


@dataclass(frozen=True)
class _Rest:
    """This rank's share of the rest of an epoch whose first ``offset`` samples were seen before.

    The rest is ``order[offset:]``, laid out over this world size as a whole epoch of
    ``n - offset`` samples would be: padded by wrapping around to the start of the epoch's order (as
    a whole epoch's padding wraps), or cut with ``drop_last``. Its batches take the last indices
    of the epoch, ``skip .. len(epoch) - 1``, so batches handed out plus batches left is always the
    epoch's batch count at this world size.
    """

    offset: int
    skip: int  # the epoch's batch index of the rest's first batch
    total: int  # positions of the continued order, padding included
    batches: tuple[tuple[int, int], ...]  # this rank's (position, size) in the continued order


def _rest_of_epoch(
    n: int, world_size: int, rank: int, batch_size: int, *, drop_last: bool, offset: int
) -> _Rest:
    remaining = n - offset
    plan = _batch_plan(remaining, world_size, batch_size, drop_last=drop_last, evaluation=False)
    epoch_batches = len(_training_sizes(n, world_size, batch_size, drop_last))
    return _Rest(
        offset=offset,
        skip=epoch_batches - len(plan[0]),
        total=_per_rank_samples(remaining, world_size, drop_last) * world_size,
        batches=tuple(_rank_batches(plan, rank)),
    )


def _continued(order: torch.Tensor, offset: int, total: int) -> torch.Tensor:
    """Positions ``offset, offset + 1, ...`` of ``order``, ``total`` of them, wrapping to its start."""
    return order[(torch.arange(total) + offset) % order.numel()]


def _seen_after(
    n: int, world_size: int, batch_size: int, *, drop_last: bool, offset: int, consumed: int
) -> int:
    """Samples of the epoch's order seen once each of ``world_size`` ranks has handed out batches
    up to index ``consumed`` of an epoch whose first ``offset`` samples were seen before.

    Seen means handed out in a batch. The ranks' batches so far cover a prefix of the (continued)
    order; padding repeats samples from the order's start, which were seen already, and lies within
    the last step (it is shorter than ``world_size``), hence the cap at ``n``.

    Raises:
        ValueError: ``consumed`` is not a batch index of that layout's rest of the epoch.
    """
    epoch_batches = len(_training_sizes(n, world_size, batch_size, drop_last))
    rest = _training_sizes(n - offset, world_size, batch_size, drop_last)
    skip = epoch_batches - len(rest)
    if not skip <= consumed <= epoch_batches:
        raise ValueError(
            f"state['batches_consumed'] is {consumed}, but on {world_size} rank(s) with "
            f"state['resume_offset'] = {offset} an epoch is between batches {skip} and {epoch_batches}; "
            f"pass a state made by DistributedLoader.state_dict()."
        )
    return min(n, offset + world_size * sum(rest[: consumed - skip]))

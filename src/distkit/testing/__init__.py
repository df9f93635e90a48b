"""Run test functions on several spawned ranks: the ``ranks`` pytest fixture and :func:`run_ranks`.

Nothing in distkit's runtime imports this package, and importing it does not import pytest; the
pytest plugin (:mod:`distkit.testing.plugin`) is loaded by pytest itself through its entry point.

Example:
    >>> # test_sum.py
    >>> import torch, torch.distributed as dist
    >>> def all_reduce_one() -> float:
    ...     t = torch.ones(1)
    ...     dist.all_reduce(t)
    ...     return t.item()
    >>> def test_all_reduce(ranks):  # doctest: +SKIP
    ...     assert ranks.run(all_reduce_one, world_size=2) == [2.0, 2.0]
"""

from distkit.testing._runner import (
    DEFAULT_TIMEOUT_S,
    RankFailedError,
    RankFailure,
    RankPools,
    Ranks,
    run_ranks,
)

# Errors and reprs name the public home of these objects, not the private module that defines them.
for _obj in (RankFailedError, RankFailure, RankPools, Ranks, run_ranks):
    _obj.__module__ = __name__
del _obj

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RankFailedError",
    "RankFailure",
    "RankPools",
    "Ranks",
    "run_ranks",
]

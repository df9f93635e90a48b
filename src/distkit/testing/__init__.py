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

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RankFailedError",
    "RankFailure",
    "RankPools",
    "Ranks",
    "run_ranks",
]


def __getattr__(name: str) -> object:
    # Loaded on first use: pytest imports this package through the plugin entry point in every
    # session, also in projects whose tests never start a rank, and _runner imports torch.
    if name not in __all__:
        raise AttributeError(f"module 'distkit.testing' has no attribute {name!r}")
    from distkit.testing import _runner

    return getattr(_runner, name)

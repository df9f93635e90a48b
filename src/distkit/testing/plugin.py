"""pytest plugin of distkit: the ``ranks`` fixture.

pytest loads it through the ``pytest11`` entry point ``distkit.testing.plugin`` (named as the
module, so naming it again with ``-p`` or ``pytest_plugins`` changes nothing); disable it with
``-p no:distkit.testing.plugin``. The pools behind the fixture live for the test session and are
stopped at its end; each test gets a light handle on them.

Example:
    >>> def all_reduce_one() -> float:  # doctest: +SKIP
    ...     t = torch.ones(1)
    ...     torch.distributed.all_reduce(t)
    ...     return t.item()
    >>> def test_all_reduce(ranks):  # doctest: +SKIP
    ...     assert ranks.run(all_reduce_one, world_size=2) == [2.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from distkit.testing._runner import RankPools, Ranks

__all__ = ["ranks"]


@pytest.fixture(scope="session")
def _distkit_rank_pools() -> Iterator[RankPools]:
    # One set of pools per session (an inner pytester session gets its own), stopped at its end.
    # Imported here, not at module level: pytest loads this plugin in every session of every
    # project that has distkit installed, and the runner imports torch.
    from distkit.testing._runner import RankPools

    pools = RankPools()
    try:
        yield pools
    finally:
        pools.close()


@pytest.fixture
def ranks(_distkit_rank_pools: RankPools) -> Ranks:
    """Run a module-level function on N ranks: ``ranks.run(fn, *args, world_size=2, ...)``.

    Calls go to a session-wide pool of ranks that already joined their group, one pool per
    ``(world_size, backend)``, rebuilt after any failure; ``fresh=True`` starts ranks for that call
    only. See :func:`distkit.testing.run_ranks` for every option.

    Example:
        >>> def test_world(ranks):  # doctest: +SKIP
        ...     assert ranks.run(get_world_size, world_size=3) == [3, 3, 3]
    """
    from distkit.testing._runner import Ranks

    return Ranks(_distkit_rank_pools)

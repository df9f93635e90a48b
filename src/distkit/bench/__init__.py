"""Scaling benchmark and advisor: will more GPUs (or processes) make *this* model train faster?

:func:`profile_scaling` (also ``distkit.profile_scaling``) predicts; ``distkit bench`` measures.
The result types live in :mod:`distkit.bench.profile`, the presets and the ``Workload`` type of
``distkit bench --model`` in :mod:`distkit.bench.workloads`, the runner in
:mod:`distkit.bench.runner`, the statistics and the decision rule in :mod:`distkit.bench.stats`,
and the CSV/plots/recommendation in :mod:`distkit.bench.report`. Importing this package loads
nothing heavy (``distkit --help`` stays fast); torch loads with the first use of a name, plotting
(matplotlib) and progress bars (tqdm) only when used.

Example:
    >>> import torch
    >>> from distkit.bench import profile_scaling
    >>> model = torch.nn.Linear(64, 10)
    >>> batch = (torch.randn(32, 64), torch.randint(10, (32,)))
    >>> profile_scaling(model, batch, bandwidth_gbps=100, min_time_s=0).predict(2).world_size
    2
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distkit.bench.profile import profile_scaling as profile_scaling

__all__ = ["profile_scaling"]


def __getattr__(name: str) -> Any:
    # PEP 562: `from distkit.bench import profile_scaling` loads torch only then.
    if name == "profile_scaling":
        from distkit.bench.profile import profile_scaling

        return profile_scaling
    raise AttributeError(f"module 'distkit.bench' has no attribute {name!r}")

"""Scaling benchmark and advisor: will more GPUs (or processes) make *this* model train faster?

:func:`profile_scaling` (also ``distkit.profile_scaling``) predicts; ``distkit bench`` measures.
The result types live in :mod:`distkit.bench.profile`, the presets and the ``Workload`` type of
``distkit bench --model`` in :mod:`distkit.bench.workloads`, the runner in
:mod:`distkit.bench.runner` and the CSV/plots/recommendation in :mod:`distkit.bench.report`.
Plotting (matplotlib) and progress bars (tqdm) load only when used.

Example:
    >>> import torch
    >>> from distkit.bench import profile_scaling
    >>> model = torch.nn.Linear(64, 10)
    >>> batch = (torch.randn(32, 64), torch.randint(10, (32,)))
    >>> profile_scaling(model, batch, bandwidth_gbps=100, min_time_s=0).predict(2).world_size
    2
"""

from distkit.bench.profile import profile_scaling

__all__ = ["profile_scaling"]

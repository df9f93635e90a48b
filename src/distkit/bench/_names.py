"""Names ``distkit bench`` accepts, importable without torch (the CLI's ``--help`` must stay fast)."""

from __future__ import annotations

#: ``single``: one process, no wrapper. ``dp``: ``torch.nn.DataParallel`` over N GPUs in one
#: process. ``ddp``: ``DistributedDataParallel`` over N processes (gloo on CPU, NCCL on GPUs).
STRATEGIES = ("single", "dp", "ddp")

#: The built-in workloads of :data:`distkit.bench.workloads.PRESETS`, in the order they are listed.
PRESET_NAMES = ("tiny", "small", "medium", "conv", "transformer")

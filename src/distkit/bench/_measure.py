"""The rank side of ``distkit bench``: measure one configuration on every rank of a group.

Each call trains a fresh copy of the workload's model on one fixed batch (no data loading), so
the numbers are the model and the strategy only. A ddp configuration also measures the split of
its step into compute and communication with the advisor's own code (:class:`_timing.StepSplit`),
so that ``bench`` and ``bench --profile`` tell one story.
"""

from __future__ import annotations

import atexit
import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distkit import runtime
from distkit.bench import _timing
from distkit.bench.workloads import Workload, default_loss, load_workload, to_device
from distkit.monitor import memory_stats

# A group runs many configurations of one workload: build it once per process.
_workloads: dict[str, Workload] = {}


def _workload(spec: str) -> Workload:
    if spec not in _workloads:
        _workloads[spec] = load_workload(spec)
    return _workloads[spec]


def _destroy_group_of_one() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _ensure_group(device: torch.device) -> None:
    # DDP needs a process group even alone (distkit.init makes none for a world of one): an
    # in-memory store is enough for one rank, and the run measures DDP's own overhead.
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        atexit.register(_destroy_group_of_one)


def measure_config(
    spec: str,
    strategy: str,
    world_size: int,
    batch_size: int,
    steps: int,
    warmup_steps: int,
    min_time_s: float,
) -> dict[str, Any]:
    """Measure one configuration on this rank; the parent combines the ranks (the slowest sets the pace).

    Collective: every rank of the group calls it with the same arguments.

    Returns:
        ``timings`` (``step``, and for ddp ``compute``, ``comm`` and ``latency``, as
        :class:`_timing.Timing`), ``p90_s``, ``steps`` (measured step count) and ``memory_mib``.
    """
    workload = _workload(spec)
    device = runtime.get_device()
    doctor = runtime._doctor()
    if doctor is not None:  # a report from these ranks names what they measure, not "your code"
        doctor.workload = (
            f"distkit bench: workload {spec!r}, {strategy} on {world_size} ranks, batch {batch_size}"
        )
    loss_fn = workload.compute_loss or default_loss
    model = copy.deepcopy(workload.model).to(device)
    samples = batch_size
    if strategy == "ddp":
        _ensure_group(device)
        net: nn.Module = nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    elif strategy == "dp":
        net = nn.DataParallel(model, device_ids=list(range(world_size)))
        samples = batch_size * world_size  # DataParallel splits one batch over the devices
    else:
        net = model
    optimizer = workload.optimizer(net)
    batch = to_device(workload.make_batch(samples), device)

    # Memory first, before the split's extra copies exist: what this configuration itself holds.
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(max(1, warmup_steps)):
        _timing.train_step(net, batch, loss_fn, optimizer, device)
    memory = memory_stats(device)
    memory_mib = memory["peak_allocated_mib" if device.type == "cuda" else "rss_mib"]

    parts: dict[str, Any] = {"step": lambda: _timing.train_step(net, batch, loss_fn, optimizer, device)[0]}
    split = None
    if strategy == "ddp":
        plain = copy.deepcopy(workload.model).to(device)
        plain_optimizer = workload.optimizer(plain)
        split = _timing.StepSplit(
            _timing.gradient_layout(plain),
            device,
            steps={"compute": lambda: _timing.train_step(plain, batch, loss_fn, plain_optimizer, device)[0]},
        )
        parts.update(split.parts())
    records = _timing.measure_blocks(
        parts,
        steps=steps,
        warmup_steps=warmup_steps,
        min_time_s=min_time_s,
        device=device,
        weights={"latency": _timing.LATENCY_WEIGHT},
    )
    timings = {"step": _timing.Timing.of(records["step"])}
    if split is not None:
        timings.update(split.summarize(records))
    step_times = sorted(x for block in records["step"] for x in block)
    return {
        "timings": timings,
        "p90_s": step_times[min(len(step_times) - 1, int(0.9 * len(step_times)))],
        "steps": len(step_times),
        "memory_mib": memory_mib,
    }

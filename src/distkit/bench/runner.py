"""The scaling benchmark: train a workload under each strategy, rank count and batch size, and measure.

Each rank count runs in its own group of fresh local processes, one after the other, so runs never
compete for the machine. Every process trains a fresh copy of the model with plain SGD on one
fixed batch (no data loading), so the numbers are the model's compute and the strategy's
communication only.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distkit import collectives, runtime
from distkit.bench import _spawn, _timing
from distkit.bench.workloads import Workload, load_workload, to_device
from distkit.monitor import ThroughputMeter, memory_stats

__all__ = ["STRATEGIES", "BenchRow", "default_threads_per_rank", "run_benchmark"]

#: ``single``: one process, no wrapper. ``dp``: ``torch.nn.DataParallel`` over N GPUs in one
#: process. ``ddp``: ``DistributedDataParallel`` over N processes (gloo on CPU, NCCL on GPUs).
STRATEGIES = ("single", "dp", "ddp")


@dataclass(frozen=True)
class BenchRow:
    """One benchmark configuration and what was measured (one CSV row).

    Attributes:
        model: The workload's name.
        params: Trainable parameters.
        strategy: ``"single"``, ``"dp"`` or ``"ddp"``.
        world_size: Processes (ddp) or devices (dp); 1 for single.
        batch_size: Samples per process (ddp, single) or per device (dp) per step.
        global_batch: Samples per step for the whole job.
        status: ``"ok"`` or ``"skipped"``.
        note: Why a configuration was skipped.
        samples_per_s: Throughput of the job.
        step_time_p50_ms: Median step time, over every rank's steps.
        step_time_p90_ms: 90th percentile of the step time.
        speedup: ``samples_per_s`` over single's at the same batch size.
        efficiency: ``speedup / world_size``.
        memory_mib: Peak allocated CUDA memory, or the resident memory of the largest process on CPU.
        memory_kind: ``"cuda_peak_allocated"`` or ``"cpu_rss"``.
        device: ``"cuda"`` or ``"cpu"``.
        backend: ``"nccl"``, ``"gloo"`` or ``""``.
        threads_per_rank: torch threads in each process.
        steps: Measured steps per process (0 when skipped).
    """

    model: str
    params: int
    strategy: str
    world_size: int
    batch_size: int
    global_batch: int
    status: str
    note: str = ""
    samples_per_s: float = math.nan
    step_time_p50_ms: float = math.nan
    step_time_p90_ms: float = math.nan
    speedup: float = math.nan
    efficiency: float = math.nan
    memory_mib: float = math.nan
    memory_kind: str = ""
    device: str = ""
    backend: str = ""
    threads_per_rank: int = 0
    steps: int = 0

    @classmethod
    def columns(cls) -> list[str]:
        """The CSV header, in field order."""
        return [f.name for f in fields(cls)]

    def as_dict(self) -> dict[str, Any]:
        """The row as a dictionary (for JSON and CSV)."""
        return asdict(self)


def default_threads_per_rank(max_world_size: int) -> int:
    """torch threads per process on CPU: the cores shared evenly by the largest group, at least 1."""
    return max(1, (os.cpu_count() or 1) // max(1, max_world_size))


def _train_step(net: nn.Module, workload: Workload, batch: Any, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    workload.loss(batch, model=net).backward()
    optimizer.step()


def _measure(
    workload: Workload,
    strategy: str,
    world_size: int,
    batch_size: int,
    steps: int,
    warmup_steps: int,
    min_time_s: float,
) -> dict[str, float]:
    device = runtime.get_device()
    model = copy.deepcopy(workload.model).to(device)
    samples = batch_size
    if strategy == "ddp":
        net: nn.Module = nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    elif strategy == "dp":
        net = nn.DataParallel(model, device_ids=list(range(world_size)))
        samples = batch_size * world_size  # DataParallel splits one batch over the devices
    else:
        net = model
    # Plain SGD: the cheapest optimizer, so the numbers are the model and the communication.
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    batch = to_device(workload.make_batch(samples), device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup_steps):
        _train_step(net, workload, batch, optimizer)
    count = _timing.agreed_count(
        lambda: _train_step(net, workload, batch, optimizer), steps, min_time_s, device
    )
    runtime.barrier()
    # synchronize: exact step times on CUDA; a no-op on CPU.
    meter = ThroughputMeter(window=count, synchronize=True)
    meter.start()
    for _ in range(count):
        _train_step(net, workload, batch, optimizer)
        meter.update(samples)
    stats = meter.compute()
    memory = memory_stats(device)
    key = "peak_allocated_mib" if device.type == "cuda" else "rss_mib"
    stats["memory_mib"] = collectives.reduce_metrics({"m": memory[key]}, op="max")["m"]
    return stats


def _bench_rank(
    spec: str, tasks: list[tuple[str, int, int]], steps: int, warmup_steps: int, min_time_s: float
) -> list[dict[str, float]]:
    """Run every task of one group on this rank; each measurement is reduced across the group."""
    workload = load_workload(spec)
    alone = not dist.is_initialized() and any(task[0] == "ddp" for task in tasks)
    if alone:
        # DDP needs a process group even alone (distkit.init makes none for a world of one): an
        # in-memory store is enough for one rank, and the run measures DDP's own overhead.
        backend = "nccl" if runtime.get_device().type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = []
        for strategy, world_size, batch_size in tasks:
            results.append(
                _measure(workload, strategy, world_size, batch_size, steps, warmup_steps, min_time_s)
            )
            _spawn.progress((strategy, world_size, batch_size))
        return results
    finally:
        if alone:
            dist.destroy_process_group()


def _check_counts(name: str, values: Sequence[int]) -> list[int]:
    if not values:
        raise ValueError(f"{name} must not be empty.")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"each of {name} must be an integer >= 1, got {value!r}.")
    return sorted(set(values))


def run_benchmark(
    model: str = "tiny",
    *,
    strategies: Sequence[str] = ("single", "ddp"),
    world_sizes: Sequence[int] = (1, 2),
    batch_sizes: Sequence[int] = (32,),
    steps: int = 20,
    warmup_steps: int = 5,
    min_time_s: float = 1.0,
    threads_per_rank: int | None = None,
    timeout_s: float = 600.0,
    on_progress: Callable[[BenchRow | tuple[str, int, int]], None] | None = None,
) -> list[BenchRow]:
    """Measure a workload under each strategy, rank count and batch size.

    Local: starts its own groups of processes (call it from one process, not from every rank).
    On a machine without CUDA, ddp runs over gloo processes and dp is reported as skipped (on
    CPU, ``DataParallel`` silently runs the plain module, which would measure nothing). On GPUs,
    ddp uses NCCL with one GPU per process; configurations needing more GPUs than visible are
    skipped with a note.

    Args:
        model: A preset name or ``module:factory`` (see :func:`distkit.bench.load_workload`).
        strategies: Any of ``"single"``, ``"dp"``, ``"ddp"``.
        world_sizes: Process counts (ddp) or device counts (dp).
        batch_sizes: Samples per process (or per device for dp) per step.
        steps: Measured steps per configuration, at least (>= 1).
        warmup_steps: Unmeasured steps first (>= 0).
        min_time_s: Measure each configuration for at least this long (more steps for fast
            models): a scheduler time slice is milliseconds long, and a measurement that spans
            only a few of them is noise on a shared machine. 0 measures exactly ``steps``.
        threads_per_rank: torch threads per process; default :func:`default_threads_per_rank`
            of the largest world size on CPU, so that single and every ddp rank get the same.
        timeout_s: Deadline for each group of processes, in seconds.
        on_progress: Called with each finished ``(strategy, world_size, batch_size)`` and with
            each skipped :class:`BenchRow`.

    Returns:
        One row per configuration, in order of strategy, world size and batch size.

    Raises:
        ValueError: An unknown strategy, an empty or invalid count, or an unknown model.
        DistkitError: A benchmark process failed (its traceback is in the message).
        CollectiveTimeoutError: A group did not finish within ``timeout_s``.

    Example:
        >>> rows = run_benchmark("tiny", world_sizes=[2], steps=5)  # doctest: +SKIP
        >>> [(r.strategy, r.world_size, round(r.efficiency, 2)) for r in rows]  # doctest: +SKIP
        [('single', 1, 1.0), ('ddp', 2, 0.45)]
    """
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"strategies must be among {list(STRATEGIES)}, got {list(strategies)}.")
    sizes = _check_counts("world_sizes", world_sizes)
    batches = _check_counts("batch_sizes", batch_sizes)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}.")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}.")
    if not min_time_s >= 0:
        raise ValueError(f"min_time_s must be >= 0, got {min_time_s!r}.")
    workload = load_workload(model)  # fail here, before starting processes, on a bad name
    params = workload.num_parameters
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    device = "cuda" if cuda else "cpu"
    threads = threads_per_rank or (1 if cuda else default_threads_per_rank(max(sizes)))

    def row(strategy: str, n: int, b: int, status: str, note: str = "", **measured: Any) -> BenchRow:
        global_batch = b * n if strategy != "single" else b
        backend = {"ddp": "nccl" if cuda else "gloo"}.get(strategy, "")
        return BenchRow(
            model,
            params,
            strategy,
            n,
            b,
            global_batch,
            status,
            note,
            device=device,
            backend=backend,
            threads_per_rank=threads,
            **measured,
        )

    # Plan: which tasks each group of processes runs; skipped configurations are rows already.
    planned: list[tuple[str, int, int]] = []
    skipped: dict[tuple[str, int, int], BenchRow] = {}
    for strategy in STRATEGIES:
        if strategy not in strategies:
            continue
        for n in [1] if strategy == "single" else sizes:
            for b in batches:
                key = (strategy, n, b)
                planned.append(key)
                if strategy == "dp" and not cuda:
                    skipped[key] = row(*key, "skipped", "DataParallel needs CUDA GPUs and none is visible")
                elif strategy != "single" and cuda and n > gpus:
                    skipped[key] = row(*key, "skipped", f"needs {n} GPUs, {gpus} visible")
    groups: dict[int, list[tuple[str, int, int]]] = {}
    for key in planned:
        if key not in skipped:
            # ddp with N processes runs in a group of N; single and dp run in one process.
            groups.setdefault(key[1] if key[0] == "ddp" else 1, []).append(key)
    if on_progress is not None:
        for skipped_row in skipped.values():
            on_progress(skipped_row)

    measured: dict[tuple[str, int, int], dict[str, float]] = {}
    for world_size in sorted(groups):
        tasks = groups[world_size]
        results = _spawn.run_group(
            _bench_rank,
            (model, tasks, steps, warmup_steps, min_time_s),
            world_size=world_size,
            backend="nccl" if cuda else "gloo",
            threads=threads,
            timeout_s=timeout_s,
            on_progress=on_progress,
        )
        measured.update(zip(tasks, results[0], strict=True))

    baseline = {
        b: measured[("single", 1, b)]["samples_per_s"] for b in batches if ("single", 1, b) in measured
    }
    rows = []
    for key in planned:
        if key in skipped:
            rows.append(skipped[key])
            continue
        stats = measured[key]
        strategy, n, b = key
        speedup = stats["samples_per_s"] / baseline[b] if b in baseline else math.nan
        rows.append(
            row(
                strategy,
                n,
                b,
                "ok",
                samples_per_s=stats["samples_per_s"],
                step_time_p50_ms=stats["step_time_p50_s"] * 1e3,
                step_time_p90_ms=stats["step_time_p90_s"] * 1e3,
                steps=int(stats["steps"]),
                speedup=speedup,
                efficiency=speedup / n,
                memory_mib=stats["memory_mib"],
                memory_kind="cuda_peak_allocated" if cuda else "cpu_rss",
            )
        )
    return rows

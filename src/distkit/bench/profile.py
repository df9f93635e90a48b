"""The scaling advisor: measure compute and gradient communication of a model, predict N ranks.

Data-parallel training with a fixed batch per rank does the same compute on every rank and adds
one all-reduce of the gradients per step. :func:`profile_scaling` measures both for *this* model
and predicts the step time, speedup and efficiency on N ranks from them.
"""

from __future__ import annotations

import math
import pickle
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distkit import collectives, runtime
from distkit.bench import _spawn, _timing
from distkit.bench.workloads import LossFn, batch_size_of, default_loss, to_device
from distkit.errors import DistkitError

__all__ = ["CommProfile", "ScalingPrediction", "ScalingProfile", "profile_scaling"]

_MIB = 1024 * 1024
# DDP's default bucket layout (torch.nn.parallel.DistributedDataParallel): the gradients computed
# first go in a 1 MiB bucket, the rest in 25 MiB buckets, one all-reduce per bucket.
_DDP_FIRST_BUCKET_BYTES = 1 * _MIB
_DDP_BUCKET_BYTES = 25 * _MIB
# Efficiency from which scaling counts as near-linear.
_GOOD = 0.8
# Each rank added beyond the first must bring at least this share of a rank's own speed.
_MARGINAL = 0.5


def _pays(speedup: float, world_size: int) -> bool:
    """True when the ranks added beyond one each bring at least half of a rank's speed."""
    return world_size > 1 and speedup - 1 >= _MARGINAL * (world_size - 1)


def _gradient_layout(model: nn.Module) -> list[tuple[tuple[int, ...], torch.dtype]]:
    layout = [(tuple(p.shape), p.dtype) for p in model.parameters() if p.requires_grad]
    if not layout:
        raise ValueError(
            "the model has no trainable parameter, so data parallelism has nothing to all-reduce."
        )
    return layout


def _estimate_buckets(grad_bytes: int) -> int:
    if grad_bytes <= _DDP_FIRST_BUCKET_BYTES:
        return 1
    return 1 + math.ceil((grad_bytes - _DDP_FIRST_BUCKET_BYTES) / _DDP_BUCKET_BYTES)


@dataclass(frozen=True)
class CommProfile:
    """The cost of all-reducing one model's gradients through DDP, per training step.

    Attributes:
        world_size: The number of ranks it was measured at (2 for a bandwidth model).
        backend: ``"gloo"`` or ``"nccl"`` (or ``"model"`` for a bandwidth model).
        grad_bytes: Bytes of gradients all-reduced per step.
        num_buckets: DDP buckets, that is all-reduce calls, per step.
        step_s: Seconds per step that DDP adds to a step at ``world_size`` (all-reduces, bucket
            copies, hooks) when nothing overlaps with it.
        latency_s: Seconds of one tiny all-reduce at ``world_size``: the per-call part of
            ``step_s``.
        source: ``"measured"`` or ``"bandwidth model"``.

    Example:
        >>> comm = CommProfile(2, "gloo", 4_000_000, 1, 0.004, 0.0002, "measured")
        >>> round(comm.time_at(4) * 1e3, 2)  # ring all-reduce: latency x3, bytes x1.5
        6.3
    """

    world_size: int
    backend: str
    grad_bytes: int
    num_buckets: int
    step_s: float
    latency_s: float
    source: str

    def time_at(self, world_size: int) -> float:
        """Predicted seconds per step at ``world_size`` ranks, by the ring all-reduce model.

        A ring all-reduce of ``B`` bytes over ``N`` ranks takes ``2(N-1)`` latency-bound steps
        and moves ``2(N-1)/N * B`` bytes per rank. The measured time is split into its per-call
        part (``num_buckets * latency_s``) and the rest, and each is scaled from the measured
        world size to ``world_size`` by those factors.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}.")
        if world_size == 1:
            return 0.0
        measured = self.world_size
        per_call = min(self.num_buckets * self.latency_s, self.step_s)
        per_byte = self.step_s - per_call
        latency_scale = (world_size - 1) / (measured - 1)
        bytes_scale = ((world_size - 1) / world_size) / ((measured - 1) / measured)
        return per_call * latency_scale + per_byte * bytes_scale


@dataclass(frozen=True)
class ScalingPrediction:
    """Predicted data-parallel performance on ``world_size`` ranks, with the batch per rank fixed.

    Attributes:
        world_size: Number of ranks.
        step_s: Seconds per training step.
        comm_s: Seconds of that step spent on gradient communication that nothing hides.
        speedup: Throughput against one rank without DDP.
        efficiency: ``speedup / world_size`` (1.0 is perfect scaling).
        samples_per_s: Throughput of the job, when the batch size is known; else ``nan``.
    """

    world_size: int
    step_s: float
    comm_s: float
    speedup: float
    efficiency: float
    samples_per_s: float


@dataclass(frozen=True)
class ScalingProfile:
    """What :func:`profile_scaling` measured, and its predictions.

    Attributes:
        batch_size: Samples per rank per step (from the sample batch), or ``None``.
        compute_s: Seconds of one training step in one process alone (forward, backward, and the
            optimizer step when an optimizer was given): the one-rank baseline.
        rank_compute_s: Seconds of the same step on each rank while ``comm.world_size`` ranks
            compute at once on this machine. CPU ranks share cores, caches and memory bandwidth,
            so it can exceed ``compute_s``; ranks on their own GPUs (or in your own job) measure
            the same as ``compute_s``.
        forward_s: The forward part of ``compute_s``.
        backward_s: The backward part of ``compute_s`` (what DDP can overlap with).
        num_parameters: Trainable parameters.
        comm: The gradient communication measurement.
        overlap: Whether predictions let communication hide behind backward.
        device: The device the compute was measured on.
        num_threads: torch threads per process for the compute measurement on CPU, or ``None``.
        predictions: One prediction per world size asked for.

    Example:
        >>> profile = distkit.profile_scaling(model, batch)  # doctest: +SKIP
        >>> profile.ratio, profile.predict(4).efficiency  # doctest: +SKIP
        (3.1, 0.61)
    """

    batch_size: int | None
    compute_s: float
    rank_compute_s: float
    forward_s: float
    backward_s: float
    num_parameters: int
    comm: CommProfile
    overlap: bool
    device: str
    num_threads: int | None
    predictions: tuple[ScalingPrediction, ...] = field(default=())

    @property
    def ratio(self) -> float:
        """Compute over communication per step at the measured world size (higher scales better).

        Above about 3, data parallelism without overlap keeps 75 % efficiency or more.
        """
        return self.rank_compute_s / self.comm.step_s if self.comm.step_s > 0 else math.inf

    def predict(self, world_size: int) -> ScalingPrediction:
        """Predict one world size.

        One rank runs without DDP: its step is ``compute_s``. ``N > 1`` ranks take
        ``rank_compute_s + comm(N)`` per step without overlap; with overlap only communication
        that outlasts the backward pass counts: ``rank_compute_s + max(0, comm(N) - backward_s)``.
        Ranks beyond ``comm.world_size`` are assumed to compute as fast as the measured ones
        (their own cores or GPUs).
        """
        if world_size == 1:
            rate = self.batch_size / self.compute_s if self.batch_size else math.nan
            return ScalingPrediction(1, self.compute_s, 0.0, 1.0, 1.0, rate)
        comm_s = self.comm.time_at(world_size)
        if self.overlap:
            comm_s = max(0.0, comm_s - self.backward_s)
        step_s = self.rank_compute_s + comm_s
        speedup = world_size * self.compute_s / step_s
        rate = world_size * self.batch_size / step_s if self.batch_size else math.nan
        return ScalingPrediction(world_size, step_s, comm_s, speedup, speedup / world_size, rate)

    def recommendation(self) -> str:
        """A plain-language verdict: will more ranks help, up to how many, and what to change."""
        c_ms, m_ms = self.rank_compute_s * 1e3, self.comm.step_s * 1e3
        batch = f" at batch {self.batch_size} per rank" if self.batch_size else ""
        size = _size_text(self.comm.grad_bytes)
        lines = [
            f"Compute takes {c_ms:.2f} ms per step per rank{batch}; all-reducing {size} of gradients takes "
            f"{m_ms:.2f} ms at {self.comm.world_size} ranks over {self.comm.backend} "
            f"({self.comm.source}): compute/communication ratio {self.ratio:.1f}."
        ]
        many = [p for p in self.predictions if p.world_size > 1]
        if many:
            lines.append(
                "Predicted: "
                + ", ".join(f"{p.world_size} ranks {p.speedup:.2f}x ({p.efficiency:.0%})" for p in many)
                + "."
            )
            worth = [p for p in many if _pays(p.speedup, p.world_size)]
            best = max(many, key=lambda p: p.speedup)
            if best.speedup <= 1:
                lines.append(
                    "More ranks will make each epoch slower, not faster: communication outweighs "
                    "compute. Stay on one device, or raise the batch per rank (compute grows, "
                    "communication does not), or accumulate gradients over several steps with "
                    "DDP's no_sync() so the all-reduce runs once per several batches."
                )
            elif all(p.efficiency >= _GOOD for p in many):
                lines.append(f"Scales well: {many[-1].world_size} ranks are worth their cost.")
            elif worth:
                lines.append(
                    f"Worth it up to about {worth[-1].world_size} ranks, where each added rank still "
                    f"brings at least half of its speed; beyond, communication eats most of it. A "
                    f"larger batch per rank or gradient accumulation with no_sync() would go further."
                )
            else:
                lines.append(
                    f"Pays poorly: at best {best.speedup:.2f}x with {best.world_size} ranks, so each added "
                    f"rank brings less than half of its speed. Raise the batch per rank or accumulate "
                    f"gradients with no_sync() before scaling out."
                )
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary of every field, with ``ratio`` added."""
        out = asdict(self)
        out["ratio"] = self.ratio
        return out


def _size_text(num_bytes: int) -> str:
    if num_bytes < _MIB:
        return f"{num_bytes / 1024:.1f} KiB"
    return f"{num_bytes / _MIB:.1f} MiB"


def _train_step_parts(
    model: nn.Module,
    batch: Any,
    compute_loss: LossFn,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
) -> tuple[float, float, float]:
    """One training step; returns the seconds of (the whole step, forward, backward)."""
    model.zero_grad(set_to_none=True)
    _timing.sync(device)
    start = time.perf_counter()
    loss = compute_loss(model, batch)
    _timing.sync(device)
    forward_end = time.perf_counter()
    loss.backward()
    _timing.sync(device)
    backward_end = time.perf_counter()
    if optimizer is not None:
        optimizer.step()
        _timing.sync(device)
    return time.perf_counter() - start, forward_end - start, backward_end - forward_end


def _measure_compute(
    model: nn.Module,
    batch: Any,
    compute_loss: LossFn,
    optimizer: torch.optim.Optimizer | None,
    steps: int,
    warmup_steps: int,
    min_time_s: float,
    device: torch.device,
) -> tuple[float, float, float]:
    """Medians of (step, forward, backward) seconds over at least ``steps`` steps and ``min_time_s``."""
    for _ in range(warmup_steps):
        _train_step_parts(model, batch, compute_loss, optimizer, device)
    count = _timing.agreed_count(
        lambda: _train_step_parts(model, batch, compute_loss, optimizer, device), steps, min_time_s, device
    )
    parts = [_train_step_parts(model, batch, compute_loss, optimizer, device) for _ in range(count)]
    model.zero_grad(set_to_none=True)
    return tuple(statistics.median(column) for column in zip(*parts, strict=True))  # type: ignore[return-value]


class _GradientClone(nn.Module):
    """Parameters shaped like the model's, with a forward pass that costs next to nothing.

    Under DDP its backward pass produces the model's gradients all at once, so the step time is
    DDP's communication (all-reduces, bucket copies, hooks) with nothing to hide behind.
    """

    def __init__(self, layout: Sequence[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.zeros(shape, dtype=dtype, device=device)) for shape, dtype in layout
        )

    def forward(self) -> torch.Tensor:
        return torch.stack([w.sum().float() for w in self.weights]).sum()


def _timed(fn: Callable[[], Any], device: torch.device, count: int) -> list[float]:
    times = []
    for _ in range(count):
        _timing.sync(device)
        start = time.perf_counter()
        fn()
        _timing.sync(device)
        times.append(time.perf_counter() - start)
    return times


def _profile_rank(
    layout: Sequence[tuple[tuple[int, ...], torch.dtype]],
    compute_task: bytes | None,
    steps: int,
    warmup_steps: int,
    min_time_s: float,
) -> dict[str, float]:
    """On this rank of the current group: DDP's communication for ``layout``, and optionally the
    compute of the pickled ``(model, batch, compute_loss, optimizer class, its defaults)`` while
    every rank computes at once, step by step. Blocks of each part are interleaved, so a change in
    machine load during the measurement hits every part alike."""
    device = runtime.get_device()
    plain = _GradientClone(layout, device)
    ddp = nn.parallel.DistributedDataParallel(
        _GradientClone(layout, device), device_ids=[device] if device.type == "cuda" else None
    )
    tiny = torch.zeros(1, device=device)
    group = None if device.type == "cuda" else runtime._cpu_group()

    def ddp_step() -> None:
        ddp.zero_grad(set_to_none=True)
        ddp().backward()

    def plain_step() -> None:
        plain.zero_grad(set_to_none=True)
        plain().backward()

    lockstep: list[tuple[float, float]] = []
    parts: dict[str, Callable[[], Any]] = {
        "ddp_s": ddp_step,
        "plain_s": plain_step,
        "latency_s": lambda: dist.all_reduce(tiny, group=group),
    }
    try:
        task = None if compute_task is None else pickle.loads(compute_task)
    except (AttributeError, ImportError, pickle.UnpicklingError):
        # Defined in the caller's __main__, which a fresh interpreter does not have: every rank
        # fails alike, and the caller falls back to the compute it timed itself.
        task = None
    if task is not None:
        model, batch, loss_fn, optimizer_type, defaults = task
        model = model.to(device)
        batch = to_device(batch, device)
        optimizer = optimizer_type(model.parameters(), **defaults) if optimizer_type is not None else None

        def lockstep_compute() -> None:
            # Synchronous data parallelism waits for the slowest rank at every step; the tiny
            # all-reduce makes this loop wait the same way. Beyond its own latency, its time is
            # that wait.
            step_s = _train_step_parts(model, batch, loss_fn, optimizer, device)[0]
            start = time.perf_counter()
            dist.all_reduce(tiny, group=group)
            _timing.sync(device)
            lockstep.append((step_s, time.perf_counter() - start))

        parts["rank_compute_s"] = lockstep_compute

    blocks = max(1, min(5, steps))
    counts = {}
    for name, run in parts.items():
        for _ in range(warmup_steps):
            run()
        counts[name] = _timing.agreed_count(run, max(1, steps // blocks), min_time_s / blocks, device)
    lockstep.clear()  # (step, sync) pairs of the warm-up and calibration runs
    times: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(blocks):
        for name, run in parts.items():
            runtime.barrier()  # every rank starts each part together, as in a training step
            times[name] += _timed(run, device, counts[name])
    result = {name: statistics.median(values) for name, values in times.items()}
    if lockstep:
        latency = result["latency_s"]
        result["rank_compute_s"] = statistics.median(
            step + max(0.0, sync - latency) for step, sync in lockstep
        )
    return result


def _comm_from_bandwidth(grad_bytes: int, bandwidth_gbps: float, latency_us: float) -> CommProfile:
    # Expressed as if measured at 2 ranks: a ring of 2 makes 2 latency-bound steps and moves the
    # buffer once per rank.
    num_buckets = _estimate_buckets(grad_bytes)
    latency_s = 2 * latency_us * 1e-6
    step_s = num_buckets * latency_s + grad_bytes / (bandwidth_gbps * 1e9 / 8)
    return CommProfile(2, "model", grad_bytes, num_buckets, step_s, latency_s, "bandwidth model")


def _compute_task(
    model: nn.Module, batch: Any, compute_loss: LossFn, optimizer: torch.optim.Optimizer | None
) -> bytes | None:
    """The model's training step, pickled for the spawned ranks; ``None`` if it cannot travel."""
    opt_type = type(optimizer) if optimizer is not None else None
    defaults = dict(optimizer.defaults) if optimizer is not None else {}
    try:
        return pickle.dumps((model, batch, compute_loss, opt_type, defaults))
    except (pickle.PicklingError, AttributeError, TypeError):
        # A lambda loss or a module holding a lock: measure compute here only.
        return None


def _measure_ranks(
    layout: list[tuple[tuple[int, ...], torch.dtype]],
    grad_bytes: int,
    compute_task: bytes | None,
    *,
    device: torch.device,
    comm_world_size: int,
    backend: str | None,
    steps: int,
    warmup_steps: int,
    min_time_s: float,
    threads: int,
    timeout_s: float,
) -> tuple[CommProfile, float | None]:
    """Communication of ``layout`` (and, with a task, compute per rank) measured with several ranks."""
    if runtime.get_world_size() > 1:
        # Inside a job: measure with the job's own group, at its world size, on every rank.
        runtime._require_runtime("profile_scaling() in a multi-process job")
        measured = collectives.reduce_metrics(
            _profile_rank(layout, None, steps, warmup_steps, min_time_s), op="max"
        )
        world_size, used_backend = runtime.get_world_size(), str(dist.get_backend())
    else:
        used_backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if used_backend == "nccl" and torch.cuda.device_count() < comm_world_size:
            raise DistkitError(
                f"measuring NCCL at comm_world_size={comm_world_size} needs {comm_world_size} GPUs, "
                f"this machine has {torch.cuda.device_count()}. Call profile_scaling inside your "
                f"distributed job (it then measures with the job's group), or pass bandwidth_gbps "
                f"and latency_us of your interconnect."
            )
        results = _spawn.run_group(
            _profile_rank,
            (layout, compute_task, steps, warmup_steps, min_time_s),
            world_size=comm_world_size,
            backend=used_backend,
            threads=threads,
            timeout_s=timeout_s,
        )
        # The group runs at the pace of its slowest rank.
        measured = {key: max(r[key] for r in results) for key in results[0]}
        world_size = comm_world_size
    if compute_task is not None and "rank_compute_s" not in measured:
        warnings.warn(
            "profile_scaling could not time the model in the spawned ranks (its class or loss is "
            "defined in __main__, which they cannot import); predictions use the compute timed in "
            "this process alone, which leaves out the ranks sharing this machine's CPU. Move the "
            "model into an importable module for the shared-CPU measurement.",
            RuntimeWarning,
            stacklevel=3,
        )
    comm = CommProfile(
        world_size,
        used_backend,
        grad_bytes,
        _estimate_buckets(grad_bytes),
        max(measured["ddp_s"] - measured["plain_s"], 0.0),
        measured["latency_s"],
        "measured",
    )
    return comm, measured.get("rank_compute_s")


def _check_count(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")


def profile_scaling(
    model: nn.Module,
    sample_batch: Any,
    *,
    world_sizes: Sequence[int] = (1, 2, 4, 8),
    compute_loss: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    steps: int = 20,
    warmup_steps: int = 3,
    min_time_s: float = 1.0,
    comm_world_size: int = 2,
    backend: str | None = None,
    overlap: bool | None = None,
    num_threads: int | None = None,
    bandwidth_gbps: float | None = None,
    latency_us: float = 10.0,
    comm: CommProfile | None = None,
    timeout_s: float = 300.0,
) -> ScalingProfile:
    """Measure this model's compute and gradient communication, and predict N data-parallel ranks.

    Collective inside a distributed job: call on every rank; communication is then measured with
    the job's own group at its world size, and compute is the slowest rank's. Without a process
    group it measures compute here and communication by spawning ``comm_world_size`` local ranks
    (about 3 s to start them), or takes ``bandwidth_gbps``/``latency_us`` instead.

    Compute is the median time of a training step on ``sample_batch`` (forward, backward and,
    when ``optimizer`` is given, its step), in this process alone (``compute_s``, the one-rank
    baseline). For a CPU model the spawned ranks also time it all at once (``rank_compute_s``):
    ranks on one machine share its cores, caches and memory bandwidth. Communication is the time
    DDP adds to a step for gradients shaped like this model's, measured through DDP itself with
    the same bucket layout (all-reduces, bucket copies, hooks). The prediction for ``N`` ranks
    keeps the batch per rank fixed: ``step(N) = rank_compute + comm(N)``, where ``comm(N)`` scales
    the measurement by the ring all-reduce model; with ``overlap`` only communication that
    outlasts the backward pass counts. On this project's 2-core CPU machine the prediction for
    2 gloo ranks lands within 25 % of a measured DDP run (``benchmarks/bench_scaling_advisor.py``,
    figures in ``docs/scaling.md``).

    Args:
        model: The model, on the device it trains on. Its gradients are cleared afterwards; its
            weights change only if ``optimizer`` is given.
        sample_batch: One batch per rank as the training loop sees it (see ``compute_loss``).
        world_sizes: Rank counts to predict (``ScalingProfile.predict`` takes any other).
        compute_loss: ``(model, batch) -> loss``; the default handles ``(inputs, targets)``, a
            mapping for ``model(**batch)`` with a ``loss``, or a tensor
            (:func:`distkit.bench.workloads.default_loss`).
        optimizer: Include ``optimizer.step()`` in the compute time.
        steps: Measured steps (>= 1) for compute and for communication, at least.
        warmup_steps: Unmeasured steps first (>= 0).
        min_time_s: Measure each part for at least this long (more steps for fast models): a
            scheduler time slice is milliseconds long, and a measurement spanning only a few of
            them is noise on a shared machine. 0 measures exactly ``steps``.
        comm_world_size: Local ranks to measure communication with (>= 2), without a process group.
        backend: Backend of those ranks; default ``"nccl"`` for a CUDA model, else ``"gloo"``.
        overlap: Let communication hide behind backward, as DDP does on GPUs. Default: ``True``
            for a CUDA model, ``False`` on CPU, where the ranks' compute and gloo's reductions
            share the same cores (the case checked against measurement here).
        num_threads: torch threads for the compute measurement on CPU (restored afterwards) and
            for each spawned rank. Give it the threads each rank will have: on one CPU machine,
            cores divided by ranks. ``None``: the current setting here, 1 in spawned ranks.
        bandwidth_gbps: Use a bandwidth model (Gbit/s per rank) instead of measuring, e.g. to
            predict a multi-node job from one machine.
        latency_us: Per-hop latency of that model, in microseconds.
        comm: Reuse an earlier measurement (``profile.comm``) of the same model, e.g. for another
            batch size: communication does not depend on it. Nothing is spawned then, so
            ``rank_compute_s`` is ``compute_s``.
        timeout_s: Deadline for the spawned ranks, in seconds.

    Returns:
        The measurements, the ratio and the predictions.

    Raises:
        ValueError: A count is out of range, ``comm`` belongs to another model, or the model has
            no trainable parameter.
        DistkitError: The spawned ranks failed, or NCCL was asked for with too few GPUs.
        CollectiveTimeoutError: The spawned ranks did not finish within ``timeout_s``.

    Example:
        >>> import torch, distkit
        >>> model = torch.nn.Linear(512, 10)
        >>> batch = (torch.randn(64, 512), torch.randint(10, (64,)))
        >>> profile = distkit.profile_scaling(model, batch, bandwidth_gbps=100, latency_us=5)
        >>> profile.predict(8).speedup > 1
        True
    """
    _check_count("steps", steps, 1)
    _check_count("warmup_steps", warmup_steps, 0)
    _check_count("comm_world_size", comm_world_size, 2)
    for n in world_sizes:
        _check_count("each of world_sizes", n, 1)
    if num_threads is not None:
        _check_count("num_threads", num_threads, 1)
    if bandwidth_gbps is not None and not bandwidth_gbps > 0:
        raise ValueError(f"bandwidth_gbps must be > 0, got {bandwidth_gbps!r}.")
    if not min_time_s >= 0:
        raise ValueError(f"min_time_s must be >= 0, got {min_time_s!r}.")
    if not latency_us >= 0:
        raise ValueError(f"latency_us must be >= 0, got {latency_us!r}.")

    layout = _gradient_layout(model)
    grad_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout)
    if comm is not None and comm.grad_bytes != grad_bytes:
        raise ValueError(
            f"comm was measured for {comm.grad_bytes} bytes of gradients, this model has {grad_bytes}; "
            f"reuse a CommProfile only for the same model."
        )
    device = next(model.parameters()).device
    batch = to_device(sample_batch, device)
    loss_fn = compute_loss or default_loss
    # Ranks spawned on this machine share its CPU cores with each other: a CPU model's compute is
    # also timed on them, all at once, taken before the step below changes the weights.
    spawn = comm is None and bandwidth_gbps is None and runtime.get_world_size() == 1
    task = _compute_task(model, batch, loss_fn, optimizer) if spawn and device.type == "cpu" else None

    previous_threads = torch.get_num_threads()
    if num_threads is not None and device.type == "cpu":
        torch.set_num_threads(num_threads)
    try:
        compute_s, forward_s, backward_s = _measure_compute(
            model, batch, loss_fn, optimizer, steps, warmup_steps, min_time_s, device
        )
    finally:
        torch.set_num_threads(previous_threads)
    if runtime.get_world_size() > 1:
        # Every rank timed its compute at the same time; the job runs at its slowest rank's pace.
        worst = collectives.reduce_metrics(
            {"compute_s": compute_s, "forward_s": forward_s, "backward_s": backward_s}, op="max"
        )
        compute_s, forward_s, backward_s = worst["compute_s"], worst["forward_s"], worst["backward_s"]

    rank_compute_s = None
    if comm is None:
        if bandwidth_gbps is not None:
            comm = _comm_from_bandwidth(grad_bytes, bandwidth_gbps, latency_us)
        else:
            comm, rank_compute_s = _measure_ranks(
                layout,
                grad_bytes,
                task,
                device=device,
                comm_world_size=comm_world_size,
                backend=backend,
                steps=steps,
                warmup_steps=warmup_steps,
                min_time_s=min_time_s,
                threads=num_threads or 1,
                timeout_s=timeout_s,
            )
    profile = ScalingProfile(
        batch_size=batch_size_of(sample_batch),
        compute_s=compute_s,
        rank_compute_s=compute_s if rank_compute_s is None else rank_compute_s,
        forward_s=forward_s,
        backward_s=backward_s,
        num_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        comm=comm,
        overlap=device.type == "cuda" if overlap is None else overlap,
        device=str(device),
        num_threads=num_threads if device.type == "cpu" else None,
    )
    predictions = tuple(profile.predict(n) for n in sorted(set(world_sizes)))
    return replace(profile, predictions=predictions)

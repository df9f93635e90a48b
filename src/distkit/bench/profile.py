"""The scaling advisor: measure compute and gradient communication of a model, predict N ranks.

Data-parallel training with a fixed batch per rank does the same compute on every rank and adds
one all-reduce of the gradients per step. :func:`profile_scaling` measures both for *this* model,
with the timing code ``distkit bench`` uses (:mod:`distkit.bench._timing`), and predicts the step
time, speedup and efficiency on N ranks from them, each with an interval.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import statistics
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distkit import runtime
from distkit.bench import _load, _spawn, _timing
from distkit.bench._prediction import (
    CommOption,
    CommProfile,
    Prescription,
    ScalingPrediction,
    ScalingProfile,
    _estimate_buckets,
)
from distkit.bench._timing import Timing, Variant
from distkit.bench.workloads import LossFn, batch_size_of, default_loss, to_device
from distkit.errors import DistkitError

__all__ = [
    "CommOption",
    "CommProfile",
    "Prescription",
    "ScalingPrediction",
    "ScalingProfile",
    "profile_scaling",
]


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _step_parts(records: dict[str, list[list[Any]]], name: str) -> dict[str, Timing]:
    """Timings of a part whose runs returned ``(step, forward, backward)``."""
    return {
        key: Timing.of([[run[i] for run in block] for block in records[name]])
        for i, key in enumerate(("step", "forward", "backward"))
    }


_MIB = 1024 * 1024


@dataclass(frozen=True)
class _Option:
    """A DDP option the advisor measures: how, and how its prescription reads."""

    variant: Variant
    change: str
    setting: str
    cost: str
    exact: bool = False


def _options(grad_bytes: int) -> dict[str, _Option]:
    """The DDP options worth measuring for gradients of ``grad_bytes``."""
    options = {
        "fp16": _Option(
            Variant({}, "fp16"),
            "compress gradients to float16",
            'DDPStrategy(comm_hook="fp16")',
            "gradients are rounded to float16 for the sum (about 3 significant digits; a value beyond "
            "65504 overflows to inf, which clipping by norm or the fp16 scaler catches)",
        ),
        "bf16": _Option(
            Variant({}, "bf16"),
            "compress gradients to bfloat16",
            'DDPStrategy(comm_hook="bf16")',
            "gradients are rounded to bfloat16 for the sum (2 to 3 significant digits, float32's range)",
        ),
        "powersgd": _Option(
            Variant({}, "powersgd", powersgd_rank=1),
            "PowerSGD, rank 1",
            'DDPStrategy(comm_hook="powersgd", powersgd_rank=1)',
            "each weight matrix's gradient is sent as a rank-1 approximation with error feedback, "
            "which slows convergence on some models (try powersgd_rank=2 or 4); the first "
            "powersgd_warmup_steps steps (1000 by default) reduce plainly",
        ),
    }
    # DDP's first bucket holds 1 MiB, the others 25: with more than two, one bucket for the rest
    # saves an all-reduce call per extra bucket (a latency each); with two or fewer it changes nothing.
    if _estimate_buckets(grad_bytes) > 2:
        cap = math.ceil(grad_bytes / _MIB)
        options["bucket"] = _Option(
            Variant({"bucket_cap_mb": cap}),
            f"buckets of {cap} MiB (all after DDP's first in one)",
            f"DDPStrategy(bucket_cap_mb={cap})",
            "none: the same sums in fewer all-reduce calls (on GPUs, with less of the backward pass to "
            "hide them behind)",
            exact=True,
        )
    return options


def _option(name: str, option: _Option, comm: CommProfile) -> CommOption:
    return CommOption(name, option.change, option.setting, option.cost, option.exact, comm)


def _doubled(batch: Any, size: int | None) -> Any:
    """``batch`` with every tensor of ``size`` rows stacked on itself (twice the batch); ``None``
    when that does not give a batch of ``2 * size`` (no such tensor, or a container it cannot
    rebuild), so that the doubled batch is never silently the same one."""
    if size is None:
        return None

    def double(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return torch.cat([item, item]) if item.dim() and item.shape[0] == size else item
        if isinstance(item, Mapping):  # a dict, or a tokenizer's BatchEncoding (a UserDict)
            return {key: double(value) for key, value in item.items()}
        if isinstance(item, tuple) and hasattr(item, "_fields"):  # a namedtuple
            return type(item)(*(double(value) for value in item))
        if isinstance(item, (tuple, list)):
            return type(item)(double(value) for value in item)
        return item

    try:
        doubled = double(batch)
    except TypeError:  # a tuple or list subclass whose constructor takes other arguments
        return None
    return doubled if batch_size_of(doubled) == 2 * size else None


def _measure_compute(
    model: nn.Module,
    batch: Any,
    double: Any | None,
    compute_loss: LossFn,
    optimizer: torch.optim.Optimizer | None,
    steps: int,
    warmup_steps: int,
    min_time_s: float,
    device: torch.device,
) -> dict[str, Timing]:
    """``step``, ``forward`` and ``backward`` of a training step in this process; with a ``double``
    batch also ``double`` (its step), alternating with the other."""
    parts: dict[str, Callable[[], Any]] = {
        "alone": lambda: _timing.train_step(model, batch, compute_loss, optimizer, device, split=True)
    }
    if double is not None:
        parts["double"] = lambda: _timing.train_step(model, double, compute_loss, optimizer, device)[0]
    records = _timing.measure_blocks(
        parts, steps=steps, warmup_steps=warmup_steps, min_time_s=min_time_s, device=device
    )
    model.zero_grad(set_to_none=True)
    out = _step_parts(records, "alone")
    if double is not None:
        out["double"] = Timing.of(records["double"])
    return out


def _pack_task(
    model: nn.Module,
    batch: Any,
    double: Any | None,
    compute_loss: LossFn,
    optimizer: torch.optim.Optimizer | None,
) -> bytes | None:
    """The model's training step, pickled for the spawned ranks; ``None`` if it cannot travel.

    Model and optimizer go in one pickle, so the copy's optimizer holds the copy's parameters
    (pickle keeps shared objects shared): param groups, per-group hyperparameters, flags such as
    ``foreach`` or ``fused``, and the optimizer's state all arrive as they are. Rebuilding it from
    ``type(optimizer)(params, **optimizer.defaults)`` would not: ``defaults`` holds keys the
    constructor refuses (AdamW's ``decoupled_weight_decay``) and loses the groups.
    """
    try:
        return pickle.dumps((model, batch, double, compute_loss, optimizer))
    except (pickle.PicklingError, AttributeError, TypeError):
        # A lambda loss or a module holding a lock: measure compute here only.
        return None


def _unpack_task(
    payload: bytes,
) -> tuple[nn.Module, Any, Any | None, LossFn, torch.optim.Optimizer | None] | None:
    try:
        return pickle.loads(payload)  # type: ignore[no-any-return]
    except (AttributeError, ImportError, pickle.UnpicklingError):
        # Defined in the caller's __main__, which a fresh interpreter does not have: every rank
        # fails alike, and the caller falls back to the compute it timed itself.
        return None


def _check_optimizer(model: nn.Module, optimizer: Any) -> None:
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer built over the model's parameters, got "
            f"{type(optimizer).__name__}."
        )
    own = {id(p) for p in model.parameters()}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3])
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not the model's (shapes {shapes}"
            f"{', ...' if len(foreign) > 3 else ''}); pass the optimizer built over this model's parameters."
        )


def _profile_rank(
    layout: Sequence[tuple[tuple[int, ...], torch.dtype]],
    task: bytes | None,
    variants: Mapping[str, Variant],
    steps: int,
    warmup_steps: int,
    min_time_s: float,
) -> dict[str, Timing]:
    """On this rank of the current group: DDP's communication for ``layout``, plainly and with each
    of ``variants`` (``comm_<name>``); with a task (the pickled model, batch, doubled batch or
    ``None``, loss and optimizer) also its compute in lockstep on every rank (``compute``, and
    ``double`` at twice the batch), and (``alone_*``, rank 0's) alone while the other ranks wait.
    All parts alternate block by block, so a change in machine load hits every part alike."""
    device = runtime.get_device()
    unpacked = None if task is None else _unpack_task(task)
    own_steps: dict[str, Callable[[], float]] = {}
    parts: dict[str, Any] = {}
    if unpacked is not None:
        model, batch, double, loss_fn, optimizer = unpacked
        model = model.to(device)
        batch = to_device(batch, device)
        is_main = runtime.get_rank() == 0

        def alone() -> tuple[float, float, float] | None:
            # Rank 0 alone: the others skip to the next barrier and sleep there.
            if not is_main:
                return None
            return _timing.train_step(model, batch, loss_fn, optimizer, device, split=True)

        def own_step(batch: Any) -> Callable[[], float]:
            return lambda: _timing.train_step(model, batch, loss_fn, optimizer, device)[0]

        parts["alone"] = alone
        own_steps["compute"] = own_step(batch)
        if double is not None:
            own_steps["double"] = own_step(to_device(double, device))
    split = _timing.StepSplit(layout, device, steps=own_steps, variants=variants)
    parts.update(split.parts())
    records = _timing.measure_blocks(
        parts,
        steps=steps,
        warmup_steps=warmup_steps,
        min_time_s=min_time_s,
        device=device,
        weights={"latency": _timing.LATENCY_WEIGHT},
    )
    result = split.summarize(records)
    if unpacked is not None and runtime.get_rank() == 0:
        result.update({f"alone_{k}": v for k, v in _step_parts(records, "alone").items()})
    return result


def _comm_from_bandwidth(
    grad_bytes: int, bandwidth_gbps: float, latency_us: float, *, wire_bytes: int | None = None
) -> CommProfile:
    # Expressed as if measured at 2 ranks: a ring of 2 makes 2 latency-bound steps and moves the
    # buffer once per rank (``wire_bytes`` of it when compressed: DDP's buckets stay float32).
    num_buckets = _estimate_buckets(grad_bytes)
    latency_s = 2 * latency_us * 1e-6
    sent = grad_bytes if wire_bytes is None else wire_bytes
    step_s = num_buckets * latency_s + sent / (bandwidth_gbps * 1e9 / 8)
    return CommProfile(2, "model", grad_bytes, num_buckets, step_s, latency_s, "bandwidth model")


def _measure_ranks(
    layout: list[tuple[tuple[int, ...], torch.dtype]],
    grad_bytes: int,
    task: bytes | None,
    variants: Mapping[str, Variant],
    *,
    device: torch.device,
    comm_world_size: int,
    backend: str | None,
    steps: int,
    warmup_steps: int,
    min_time_s: float,
    threads: int,
    timeout_s: float,
) -> tuple[CommProfile, dict[str, Timing], float]:
    """Communication of ``layout`` measured with several ranks; with a task also the compute parts;
    and the share of the machine's CPUs other processes used meanwhile (``nan`` inside a job)."""
    load = math.nan
    if runtime.get_world_size() > 1:
        # Inside a job: measure with the job's own group, at its world size, on every rank.
        runtime._require_runtime("profile_scaling() in a multi-process job")
        measured = _timing.reduce_slowest(
            _profile_rank(layout, None, variants, steps, warmup_steps, min_time_s)
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
        with _spawn.RankGroup(
            comm_world_size, backend=used_backend, threads=threads, timeout_s=timeout_s
        ) as group:
            # As distkit bench does: what other processes take of the machine while ranks measure.
            meter = _load.LoadMeter(lambda: group.pids)
            meter.start()
            results = group.run(_profile_rank, (layout, task, variants, steps, warmup_steps, min_time_s))
            load = meter.stop()
        # The group runs at the pace of its slowest rank; "alone" is rank 0's only.
        shared = [key for key in results[0] if all(key in r for r in results)]
        measured = {key: Timing.slowest([r[key] for r in results]) for key in shared}
        measured.update({key: value for key, value in results[0].items() if key.startswith("alone_")})
        if "compute_wait" in measured:
            # The ranks' mean wait: the slowest rank hardly waits, the others wait for it.
            waits = [r["compute_wait"].value for r in results]
            measured["compute_wait"] = Timing(statistics.fmean(waits), statistics.fmean(waits), ())
        world_size = comm_world_size
    if task is not None and "compute" not in measured:
        warnings.warn(
            "profile_scaling could not time the model in the spawned ranks (its class or loss is "
            "defined in __main__, which they cannot import); predictions use the compute timed in "
            "this process alone, which leaves out the ranks sharing this machine's CPU. Move the "
            "model into an importable module for the shared-CPU measurement.",
            RuntimeWarning,
            stacklevel=3,
        )
    return _measured_comm(measured, "comm", world_size, used_backend, grad_bytes), measured, load


def _measured_comm(
    measured: Mapping[str, Timing], key: str, world_size: int, backend: str, grad_bytes: int, buckets: int = 0
) -> CommProfile:
    """The CommProfile of ``measured[key]`` (``buckets``: DDP's, when not its default layout)."""
    comm = measured[key]
    return CommProfile(
        world_size,
        backend,
        grad_bytes,
        buckets or _estimate_buckets(grad_bytes),
        comm.value,
        measured["latency"].value,
        "measured",
        step_low=comm.low,
        step_high=comm.high,
        step_blocks=comm.blocks,
    )


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
    options: bool = True,
    comm_options: Sequence[CommOption] | None = None,
    timeout_s: float = 300.0,
) -> ScalingProfile:
    """Measure this model's compute and gradient communication, and predict N data-parallel ranks.

    Collective inside a distributed job: call on every rank; communication is then measured with
    the job's own group at its world size, and compute is the slowest rank's. Without a process
    group it spawns ``comm_world_size`` local ranks (about 3 s to start them), or takes
    ``bandwidth_gbps``/``latency_us`` instead.

    Compute alone (``compute_s``, the one-rank baseline) is the median time of a training step on
    ``sample_batch`` (forward, backward and, when ``optimizer`` is given, its step). For a CPU
    model the spawned ranks time it: rank 0 alone while the others wait, then every rank at once
    in lockstep (``rank_compute_s``), as ranks on one machine share its cores, caches and memory
    bandwidth. Communication is the time DDP adds to a step for gradients shaped like this
    model's, measured through DDP itself with the same bucket layout. All parts alternate in
    blocks, and each comes with an interval. The prediction for ``N`` ranks keeps the batch per
    rank fixed: ``step(N) = rank_compute + comm(N)``, where ``comm(N)`` scales the measurement by
    the ring all-reduce model; with ``overlap`` only communication that outlasts the backward pass
    counts. ``distkit bench`` measures its ddp configurations with the same code.

    Args:
        model: The model, on the device it trains on. It is not changed: the spawned ranks train
            copies; only where compute is timed in this process (GPUs, inside a job, or a model
            that cannot travel by pickle) and an optimizer is given do its weights change.
        sample_batch: One batch per rank as the training loop sees it (see ``compute_loss``).
        world_sizes: Rank counts to predict (``ScalingProfile.predict`` takes any other).
        compute_loss: ``(model, batch) -> loss``; the default handles ``(inputs, targets)``, a
            mapping for ``model(**batch)`` with a ``loss``, or a tensor
            (:func:`distkit.bench.workloads.default_loss`).
        optimizer: Any ``torch.optim.Optimizer`` over the model's parameters (param groups,
            ``foreach``/``fused`` flags and state included): its ``step()`` is part of the compute.
            The ranks get a faithful copy (model and optimizer pickled together).
        steps: Measured steps (>= 1) for each part, at least.
        warmup_steps: Unmeasured steps first (>= 0).
        min_time_s: Measure each part for at least this long (more steps for fast models): a
            scheduler time slice is milliseconds long, and a measurement spanning only a few of
            them is noise on a shared machine. 0 measures exactly ``steps``.
        comm_world_size: Local ranks to measure with (>= 2), without a process group.
        backend: Backend of those ranks; default ``"nccl"`` for a CUDA model, else ``"gloo"``.
        overlap: Let communication hide behind backward, as DDP does on GPUs. Default: ``True``
            for a CUDA model, ``False`` on CPU, where the ranks' compute and gloo's reductions
            share the same cores (the case checked against measurement here).
        num_threads: torch threads of every CPU measurement, the one-rank baseline included (a
            baseline with more threads than a rank makes efficiencies meaningless). ``None``: on
            CPU, the usable cores divided by ``comm_world_size`` (the share each rank would get);
            inside a job, the current setting.
        bandwidth_gbps: Use a bandwidth model (Gbit/s per rank) instead of measuring, e.g. to
            predict a multi-node job from one machine.
        latency_us: Per-hop latency of that model, in microseconds.
        comm: Reuse an earlier measurement (``profile.comm``) of the same model, e.g. for another
            batch size: communication does not depend on it. Nothing is spawned then, so
            ``rank_compute_s`` is ``compute_s``.
        options: Also measure what the prescription weighs (:meth:`ScalingProfile.prescriptions`):
            the communication with each DDP option (gradients compressed to float16 and to
            bfloat16, PowerSGD of rank 1, and one large bucket when DDP would use more than two),
            through the hooks ``DDPStrategy(comm_hook=...)`` registers, and the step at twice the
            batch per rank. Each is one more part of the interleaved measurement (``min_time_s``
            more each) and holds the model's size twice more (weights and gradients of a stand-in)
            on each rank: pass ``options=False`` for a model near the memory limit. With a
            bandwidth model the compressed options are half the bytes, and PowerSGD is left out.
        comm_options: With ``comm``, reuse its options too (``profile.comm_options``).
        timeout_s: Deadline for the spawned ranks, in seconds.

    Returns:
        The measurements with their intervals, the ratio and the predictions.

    Raises:
        ValueError: A count is out of range, ``comm`` belongs to another model, the optimizer
            holds parameters that are not the model's, or the model has no trainable parameter.
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
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
    _check_optimizer(model, optimizer)

    layout = _timing.gradient_layout(model)
    grad_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout)
    if comm is not None and comm.grad_bytes != grad_bytes:
        raise ValueError(
            f"comm was measured for {comm.grad_bytes} bytes of gradients, this model has {grad_bytes}; "
            f"reuse a CommProfile only for the same model."
        )
    device = next(model.parameters()).device
    cpu = device.type == "cpu"
    batch = to_device(sample_batch, device)
    loss_fn = compute_loss or default_loss
    in_job = runtime.get_world_size() > 1
    threads = num_threads
    if threads is None and cpu and not in_job:
        # The share of the cores each rank gets, for the baseline too: like is compared with like.
        threads = max(1, _load.usable_cores() // comm_world_size)
    # Ranks spawned on this machine share its CPU cores with each other: a CPU model's compute is
    # timed on them, alone and all at once.
    spawn = comm is None and bandwidth_gbps is None and not in_job
    double = _doubled(batch, batch_size_of(batch)) if options else None
    task = _pack_task(model, batch, double, loss_fn, optimizer) if spawn and cpu else None
    chosen = _options(grad_bytes) if options else {}
    cores = _load.usable_cores()
    if task is not None and comm_world_size * (threads or 1) > cores:
        warnings.warn(
            f"profile_scaling: {comm_world_size} ranks x {threads or 1} thread(s) oversubscribe this "
            f"machine's {cores} usable core(s), so the ranks' compute is slowed by sharing cores and the "
            f"predictions are pessimistic. Lower comm_world_size or num_threads.",
            RuntimeWarning,
            stacklevel=2,
        )

    measured: dict[str, Timing] = {}
    load = math.nan
    found: Sequence[CommOption] = comm_options or ()
    if comm is None and bandwidth_gbps is not None:
        comm = _comm_from_bandwidth(grad_bytes, bandwidth_gbps, latency_us)
        # Half the bytes on the wire; PowerSGD's work and bytes depend on the shapes: not modelled.
        found = [
            _option(
                name,
                option,
                _comm_from_bandwidth(grad_bytes, bandwidth_gbps, latency_us, wire_bytes=grad_bytes // 2),
            )
            for name, option in chosen.items()
            if name in ("fp16", "bf16")
        ]
    elif comm is None:
        comm, measured, load = _measure_ranks(
            layout,
            grad_bytes,
            task,
            {name: option.variant for name, option in chosen.items()},
            device=device,
            comm_world_size=comm_world_size,
            backend=backend,
            steps=steps,
            warmup_steps=warmup_steps,
            min_time_s=min_time_s,
            threads=threads or 1,
            timeout_s=timeout_s,
        )
    if "alone_step" in measured:
        alone = {k: measured[f"alone_{k}"] for k in ("step", "forward", "backward")}
    else:
        with _torch_threads(threads if cpu else None):
            alone = _measure_compute(
                model, batch, double, loss_fn, optimizer, steps, warmup_steps, min_time_s, device
            )
        if in_job:
            # Every rank timed its compute at the same time; the job runs at its slowest rank's pace.
            alone = _timing.reduce_slowest(alone)
    rank_compute = measured.get("compute", alone["step"])
    doubled = measured.get("double", alone.get("double"))
    if measured:
        found = [
            _option(
                name,
                option,
                _measured_comm(
                    measured,
                    f"comm_{name}",
                    comm.world_size,
                    comm.backend,
                    grad_bytes,
                    2 if name == "bucket" else 0,
                ),
            )
            for name, option in chosen.items()
        ]
    profile = ScalingProfile(
        batch_size=batch_size_of(sample_batch),
        compute_s=alone["step"].value,
        rank_compute_s=rank_compute.value,
        forward_s=alone["forward"].value,
        backward_s=alone["backward"].value,
        num_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        comm=comm,
        overlap=device.type == "cuda" if overlap is None else overlap,
        device=str(device),
        num_threads=threads if cpu else None,
        compute_low=alone["step"].low,
        compute_high=alone["step"].high,
        rank_compute_low=rank_compute.low,
        rank_compute_high=rank_compute.high,
        load=load,
        comm_options=tuple(found),
        rank_wait_s=measured["compute_wait"].value if "compute_wait" in measured else 0.0,
        optimizer_s=max(0.0, alone["step"].value - alone["forward"].value - alone["backward"].value),
        # Paired with the communication's blocks only when measured with it, in the spawned ranks.
        rank_compute_blocks=measured["compute"].blocks if "compute" in measured else (),
        double_batch_blocks=measured["double"].blocks if "double" in measured else (),
        double_batch_s=math.nan if doubled is None else doubled.value,
        double_batch_low=math.nan if doubled is None else doubled.low,
        double_batch_high=math.nan if doubled is None else doubled.high,
    )
    predictions = tuple(profile.predict(n) for n in sorted(set(world_sizes)))
    return replace(profile, predictions=predictions)

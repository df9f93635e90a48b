"""One timing code for ``distkit bench`` and the advisor (``profile_scaling``, ``bench --profile``).

Both time a training step with :func:`train_step`, run their parts in interleaved blocks with
:func:`measure_blocks`, and split a data-parallel step into compute and communication with
:class:`StepSplit`, so that the two commands tell one story about the same model:

- **compute**: the model's own training step (no DDP) on every rank at once, in lockstep: after
  each step a tiny all-reduce, whose time beyond its own latency is the wait for the slowest rank
  (a synchronous job waits for it at every step);
- **communication**: what DDP adds to a step for gradients shaped like the model's: a stand-in with
  the model's parameter shapes and an almost free forward pass, through real
  ``DistributedDataParallel`` (buckets, all-reduces, copies, hooks), minus the same step without DDP.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distkit import collectives, runtime

# Three runs give a median that one descheduled run cannot skew.
_CALIBRATION_RUNS = 3
# A bound on a degenerate estimate (an operation that takes no measurable time).
_MAX_RUNS = 100_000
# Blocks per measurement: parts alternate block by block, so a change in machine load hits every
# part alike; five block medians give a range that covers the median with probability 94 %.
BLOCKS = 5
# The tiny all-reduce is stable and only corrects the lockstep wait: a quarter of the time suffices.
LATENCY_WEIGHT = 0.25


def sync(device: torch.device) -> None:
    """Wait for ``device`` (CUDA runs asynchronously); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agreed_count(run: Callable[[], object], minimum: int, min_time_s: float, device: torch.device) -> int:
    """How many runs of ``run`` fill ``min_time_s`` seconds, and at least ``minimum``.

    Collective: every rank of the current group calls it with the same ``run`` at the same point
    (``run`` may itself be collective), and every rank gets rank 0's answer, so collectives inside
    the measured loops stay matched. A scheduler time slice is several milliseconds, so a
    measurement must span far more than that to be stable on a shared machine; counting steps
    alone would give a 1 ms model only tens of milliseconds.
    """
    if min_time_s <= 0:
        return minimum
    times = []
    for _ in range(_CALIBRATION_RUNS):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    estimate = statistics.median(times)
    wanted = _MAX_RUNS if estimate <= 0 else max(minimum, math.ceil(min_time_s / estimate))
    return int(collectives.broadcast_object(min(wanted, _MAX_RUNS)))


def train_step(
    model: nn.Module,
    batch: Any,
    compute_loss: Callable[[nn.Module, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    *,
    split: bool = False,
) -> tuple[float, float, float]:
    """One training step: clear the gradients, loss, backward, ``optimizer.step()``.

    Returns ``(step, forward, backward)`` seconds. With ``split=False`` only the step is timed
    (forward and backward are ``nan``) and a CUDA device is waited for only at the end, as a
    training loop would; ``split=True`` waits after forward and backward too.
    """
    sync(device)
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    loss = compute_loss(model, batch)
    if split:
        sync(device)
    forward_end = time.perf_counter()
    loss.backward()
    if split:
        sync(device)
    backward_end = time.perf_counter()
    if optimizer is not None:
        optimizer.step()
    sync(device)
    step = time.perf_counter() - start
    if not split:
        return step, math.nan, math.nan
    return step, forward_end - start, backward_end - forward_end


def timed(fn: Callable[[], Any], device: torch.device) -> Callable[[], float]:
    """``fn`` wrapped to return its own seconds (waiting for ``device`` before and after)."""

    def run() -> float:
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - start

    return run


def measure_blocks(
    parts: Mapping[str, Callable[[], Any]],
    *,
    steps: int,
    warmup_steps: int,
    min_time_s: float,
    device: torch.device,
    blocks: int = BLOCKS,
    weights: Mapping[str, float] | None = None,
) -> dict[str, list[list[Any]]]:
    """Run each part in ``blocks`` interleaved blocks; return what each run returned, per block.

    Collective when a process group exists: every rank calls it with the same parts, which start
    each block together (a barrier), as the ranks of a training step do. Each part runs at least
    ``steps`` times and ``min_time_s * weight`` seconds in all (weights default to 1).
    """
    blocks = max(1, min(blocks, steps))
    weights = weights or {}
    counts = {}
    for name, run in parts.items():
        for _ in range(warmup_steps):
            run()
        share = min_time_s * weights.get(name, 1.0) / blocks
        counts[name] = agreed_count(run, max(1, steps // blocks), share, device)
    records: dict[str, list[list[Any]]] = {name: [] for name in parts}
    for _ in range(blocks):
        for name, run in parts.items():
            runtime.barrier()
            records[name].append([run() for _ in range(counts[name])])
    return records


@dataclass(frozen=True)
class Timing:
    """Seconds of one part: median and mean over all its runs, and the median of each block.

    Attributes:
        value: Median over every run.
        mean: Mean over every run.
        blocks: Median of each block, in order.
    """

    value: float
    mean: float
    blocks: tuple[float, ...]

    @classmethod
    def of(cls, blocks: Sequence[Sequence[float]]) -> Timing:
        """Summarize per-block lists of seconds."""
        flat = [x for block in blocks for x in block]
        return cls(
            statistics.median(flat),
            statistics.fmean(flat),
            tuple(statistics.median(block) for block in blocks if block),
        )

    def minus(self, other: Timing) -> Timing:
        """This part's time beyond ``other``'s, never below 0 (block by block)."""
        return Timing(
            max(0.0, self.value - other.value),
            max(0.0, self.mean - other.mean),
            tuple(max(0.0, a - b) for a, b in zip(self.blocks, other.blocks, strict=True)),
        )

    @property
    def low(self) -> float:
        """The fastest block's median."""
        return min(self.blocks, default=self.value)

    @property
    def high(self) -> float:
        """The slowest block's median."""
        return max(self.blocks, default=self.value)

    @staticmethod
    def slowest(timings: Sequence[Timing]) -> Timing:
        """The group's pace: the slowest rank's value, mean and blocks."""
        return Timing(
            max(t.value for t in timings),
            max(t.mean for t in timings),
            tuple(max(column) for column in zip(*(t.blocks for t in timings), strict=True)),
        )


def gradient_layout(model: nn.Module) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the model's trainable parameters (what DDP all-reduces).

    Raises:
        ValueError: The model has no trainable parameter.
    """
    layout = [(tuple(p.shape), p.dtype) for p in model.parameters() if p.requires_grad]
    if not layout:
        raise ValueError(
            "the model has no trainable parameter, so data parallelism has nothing to all-reduce."
        )
    return layout


class GradientClone(nn.Module):
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


@dataclass(frozen=True)
class Variant:
    """One way DDP could reduce the gradients, measured beside the plain one.

    Attributes:
        ddp_kwargs: Extra keyword arguments of ``DistributedDataParallel`` (``bucket_cap_mb``).
        comm_hook: A name ``DDPStrategy(comm_hook=...)`` takes, or ``None``.
        powersgd_rank: PowerSGD's matrix approximation rank, for ``comm_hook="powersgd"``.
    """

    ddp_kwargs: Mapping[str, Any]
    comm_hook: str | None = None
    powersgd_rank: int = 1


# PowerSGD compresses from this reduction on: the calibration runs of every part (3) come first,
# so the measured steps are compressed ones (torch needs at least 2: DDP rebuilds its buckets).
_POWERSGD_START = 2


class StepSplit:
    """The parts that split a data-parallel step into compute and communication, on this rank.

    Collective: built and measured on every rank of the current group. ``steps`` are training
    steps without DDP, by name, each returning its seconds (the model's own step is ``"compute"``);
    each is measured in lockstep on every rank. ``variants`` are other ways of reducing the same
    gradients (compression, bucket size), each measured through its own DDP wrapper as
    ``comm_<name>``, through the code the Trainer runs for them.
    """

    def __init__(
        self,
        layout: Sequence[tuple[tuple[int, ...], torch.dtype]],
        device: torch.device,
        steps: Mapping[str, Callable[[], float]] | None = None,
        variants: Mapping[str, Variant] | None = None,
    ) -> None:
        self.device = device
        self.steps = dict(steps or {})
        self.plain = GradientClone(layout, device)
        # No device_ids: the module is already on its device, and with them DDP's forward indexes
        # the moved inputs, which a forward without inputs does not have (IndexError, torch 2.11).
        self.ddp = nn.parallel.DistributedDataParallel(GradientClone(layout, device))
        self.variants = {name: self._wrap(layout, variant) for name, variant in (variants or {}).items()}
        self.tiny = torch.zeros(1, device=device)
        self.group = None if device.type == "cuda" else runtime._cpu_group()

    def _wrap(
        self, layout: Sequence[tuple[tuple[int, ...], torch.dtype]], variant: Variant
    ) -> nn.parallel.DistributedDataParallel:
        # The Trainer's own hooks (DDPStrategy(comm_hook=...)), so that what is measured is what
        # the prescription asks for. Imported here: only the advisor's options need them.
        from distkit.trainer.strategies import _comm

        ddp = nn.parallel.DistributedDataParallel(GradientClone(layout, self.device), **variant.ddp_kwargs)
        powersgd = None
        if variant.comm_hook == "powersgd":
            powersgd = _comm.PowerSGD(rank=variant.powersgd_rank, warmup_steps=_POWERSGD_START)
        _comm.register(ddp, variant.comm_hook, powersgd)
        return ddp

    def _lockstep(self, step: Callable[[], float]) -> tuple[float, float]:
        # Synchronous data parallelism waits for the slowest rank at every step; the tiny
        # all-reduce makes this loop wait the same way. Beyond its own latency, its time is that wait.
        step_s = step()
        start = time.perf_counter()
        dist.all_reduce(self.tiny, group=self.group)
        sync(self.device)
        return step_s, time.perf_counter() - start

    @staticmethod
    def _backward(module: nn.Module) -> None:
        module.zero_grad(set_to_none=True)
        module().backward()

    def parts(self) -> dict[str, Callable[[], Any]]:
        """The parts to measure: each step (``compute``, ...), ``comm_ddp``, ``comm_plain``, each
        variant's ``comm_<name>``, and ``latency``."""
        parts: dict[str, Callable[[], Any]] = {}
        for name, step in self.steps.items():
            parts[name] = functools.partial(self._lockstep, step)
        parts["comm_ddp"] = timed(functools.partial(self._backward, self.ddp), self.device)
        parts["comm_plain"] = timed(functools.partial(self._backward, self.plain), self.device)
        for name, ddp in self.variants.items():
            parts[f"comm_{name}"] = timed(functools.partial(self._backward, ddp), self.device)
        parts["latency"] = timed(lambda: dist.all_reduce(self.tiny, group=self.group), self.device)
        return parts

    def summarize(self, records: Mapping[str, list[list[Any]]]) -> dict[str, Timing]:
        """``comm`` (DDP's step minus the plain one), each variant's ``comm_<name>`` (the same),
        ``latency``, each step's lockstep time, and ``<step>_wait``, the part of it spent waiting
        for the slowest rank."""
        latency = Timing.of(records["latency"])
        plain = Timing.of(records["comm_plain"])
        out = {"latency": latency, "comm": Timing.of(records["comm_ddp"]).minus(plain)}
        for name in self.variants:
            out[f"comm_{name}"] = Timing.of(records[f"comm_{name}"]).minus(plain)
        for name in self.steps:
            waits = [[max(0.0, wait - latency.value) for _, wait in block] for block in records[name]]
            out[f"{name}_wait"] = Timing.of(waits)
            out[name] = Timing.of(
                [
                    [step + w for (step, _), w in zip(block, wait, strict=True)]
                    for block, wait in zip(records[name], waits, strict=True)
                ]
            )
        return out


def reduce_slowest(timings: Mapping[str, Timing]) -> dict[str, Timing]:
    """Every rank's timings reduced to the slowest rank's, in one collective (inside a job)."""
    flat = {}
    for name, t in timings.items():
        flat[f"{name}/value"] = t.value
        flat[f"{name}/mean"] = t.mean
        flat.update({f"{name}/{i}": b for i, b in enumerate(t.blocks)})
    worst = collectives.reduce_metrics(flat, op="max")
    return {
        name: Timing(
            worst[f"{name}/value"],
            worst[f"{name}/mean"],
            tuple(worst[f"{name}/{i}"] for i in range(len(t.blocks))),
        )
        for name, t in timings.items()
    }

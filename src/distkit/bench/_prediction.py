"""What the advisor predicts from its measurements: the result types and their plain-language verdict.

A data-parallel step on ``N`` ranks with a fixed batch per rank is the compute of one rank plus the
all-reduce of the gradients, scaled from the measured world size by the ring all-reduce model.
The types live in :mod:`distkit.bench.profile` for users; they are defined here, apart from the
measurement, because they are pure arithmetic on measured numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from distkit.bench._load import MAX_LOAD, trust_line

__all__ = ["CommOption", "CommProfile", "Prescription", "ScalingPrediction", "ScalingProfile"]

_MIB = 1024 * 1024
# DDP's default bucket layout (torch.nn.parallel.DistributedDataParallel): the gradients computed
# first go in a 1 MiB bucket, the rest in 25 MiB buckets, one all-reduce per bucket.
_DDP_FIRST_BUCKET_BYTES = 1 * _MIB
_DDP_BUCKET_BYTES = 25 * _MIB
# Efficiency from which scaling counts as near-linear.
_GOOD = 0.8
# Each rank added beyond the first must bring at least this share of a rank's own speed.
_MARGINAL = 0.5
# Batches accumulated per all-reduce in the advice (no_sync()): a common setting.
_ACCUMULATE = 4


def _pays(speedup: float, world_size: int) -> bool:
    """True when the ranks added beyond one each bring at least half of a rank's speed."""
    return world_size > 1 and speedup - 1 >= _MARGINAL * (world_size - 1)


def _estimate_buckets(grad_bytes: int) -> int:
    if grad_bytes <= _DDP_FIRST_BUCKET_BYTES:
        return 1
    return 1 + math.ceil((grad_bytes - _DDP_FIRST_BUCKET_BYTES) / _DDP_BUCKET_BYTES)


def _fill(value: float, default: float) -> float:
    return default if math.isnan(value) else value


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
        step_low: The fastest block's ``step_s`` (the interval's lower end; ``step_s`` if not given).
        step_high: The slowest block's.
        step_blocks: Each block's median, in the order measured (empty for a bandwidth model):
            blocks of parts measured together are paired by their position.

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
    step_low: float = math.nan
    step_high: float = math.nan
    step_blocks: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        # A difference of medians (DDP's step minus the plain one) can fall outside the range of the
        # blocks' differences: the interval is widened to hold the value it is the interval of.
        object.__setattr__(self, "step_low", min(_fill(self.step_low, self.step_s), self.step_s))
        object.__setattr__(self, "step_high", max(_fill(self.step_high, self.step_s), self.step_s))

    def _scaled(self, step_s: float, world_size: int) -> float:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}.")
        if world_size == 1:
            return 0.0
        measured = self.world_size
        per_call = min(self.num_buckets * self.latency_s, step_s)
        per_byte = step_s - per_call
        latency_scale = (world_size - 1) / (measured - 1)
        bytes_scale = ((world_size - 1) / world_size) / ((measured - 1) / measured)
        return per_call * latency_scale + per_byte * bytes_scale

    def time_at(self, world_size: int) -> float:
        """Predicted seconds per step at ``world_size`` ranks, by the ring all-reduce model.

        A ring all-reduce of ``B`` bytes over ``N`` ranks takes ``2(N-1)`` latency-bound steps
        and moves ``2(N-1)/N * B`` bytes per rank. The measured time is split into its per-call
        part (``num_buckets * latency_s``) and the rest, and each is scaled from the measured
        world size to ``world_size`` by those factors.
        """
        return self._scaled(self.step_s, world_size)

    def range_at(self, world_size: int) -> tuple[float, float]:
        """:meth:`time_at` for the interval's two ends, ``(low, high)``."""
        return self._scaled(self.step_low, world_size), self._scaled(self.step_high, world_size)


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
        speedup_low: The speedup when every measured part sits at its slowest end (compute alone
            at its fastest): the interval's lower end.
        speedup_high: The other way round: its upper end.
    """

    world_size: int
    step_s: float
    comm_s: float
    speedup: float
    efficiency: float
    samples_per_s: float
    speedup_low: float = math.nan
    speedup_high: float = math.nan

    def __post_init__(self) -> None:
        object.__setattr__(self, "speedup_low", _fill(self.speedup_low, self.speedup))
        object.__setattr__(self, "speedup_high", _fill(self.speedup_high, self.speedup))

    @property
    def efficiency_low(self) -> float:
        """``speedup_low / world_size``."""
        return self.speedup_low / self.world_size

    @property
    def efficiency_high(self) -> float:
        """``speedup_high / world_size``."""
        return self.speedup_high / self.world_size


@dataclass(frozen=True)
class CommOption:
    """The gradient communication of the same model measured with one DDP option instead of the
    plain float32 all-reduce: compression or a bucket size.

    Attributes:
        name: ``"fp16"``, ``"bf16"``, ``"powersgd"`` or ``"bucket"``.
        change: What changes, in words.
        setting: How to ask for it, e.g. ``DDPStrategy(comm_hook="fp16")``.
        cost: What it changes besides speed.
        exact: Whether the job then computes exactly what it did (only the bucket size does).
        comm: Its communication per step, measured as :attr:`ScalingProfile.comm` is (through
            real DDP with the hook the Trainer registers for it, alternating with the plain one).
    """

    name: str
    change: str
    setting: str
    cost: str
    exact: bool
    comm: CommProfile


@dataclass(frozen=True)
class Prescription:
    """One change to a data-parallel job with its predicted speed: a line of the advisor's prescription.

    Attributes:
        name: ``"fp16"``, ``"bf16"``, ``"powersgd"``, ``"bucket"``, ``"accumulate"`` or ``"batch"``.
        change: What changes, in words.
        setting: How to ask for it (a ``Trainer`` or ``DDPStrategy`` argument).
        cost: What it changes besides speed: the accuracy of the gradients, or the global batch.
        exact: Whether the job then computes exactly what it did.
        prediction: The predicted speed on ``prediction.world_size`` ranks with the change. Its
            ``speedup`` is samples per second against one process as the job is now (the batch
            you profiled, no DDP), so every change is compared with the same baseline.
        gain: Samples per second with the change over the job as it is, on the same ranks
            (1.25: a quarter more).
        gain_low: The lowest gain of the measurement's blocks. Each block measured the job and the
            change in the same stretch of time, so load that comes and goes hits both alike and
            cancels in their ratio; where nothing was measured in blocks (a bandwidth model), the
            two predictions' intervals at their least favourable ends.
        gain_high: The highest.

    Example:
        >>> best = profile.prescriptions(2)[0]  # doctest: +SKIP
        >>> best.setting, round(best.prediction.speedup, 2)  # doctest: +SKIP
        ('DDPStrategy(comm_hook="powersgd", powersgd_rank=1)', 1.52)
    """

    name: str
    change: str
    setting: str
    cost: str
    exact: bool
    prediction: ScalingPrediction
    gain: float
    gain_low: float
    gain_high: float


def _range_text(value: float, low: float, high: float, fmt: str, unit: str = "") -> str:
    text = format(value, fmt) + unit
    if low == high == value:
        return text
    return f"{text} [{format(low, fmt)}-{format(high, fmt)}]"


@dataclass(frozen=True)
class ScalingProfile:
    """What :func:`profile_scaling` measured, and its predictions.

    Every quantity comes with an interval: the range of the medians of the blocks it was measured
    in (five by default, interleaved with the other parts; the range of 5 covers the median with
    probability 94 %).

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
        num_threads: torch threads per process for every CPU measurement, or ``None``.
        predictions: One prediction per world size asked for.
        compute_low: The interval of ``compute_s`` (``compute_s`` when not given).
        compute_high: Its upper end.
        rank_compute_low: The interval of ``rank_compute_s``.
        rank_compute_high: Its upper end.
        load: The share of the machine's CPUs other processes used while the spawned ranks
            measured (``nan``: not measured: inside a job, a window under half a second, no /proc).
        comm_options: Communication measured with each DDP option (compression, bucket size),
            for :meth:`prescriptions`; empty with ``profile_scaling(options=False)``.
        double_batch_s: ``rank_compute_s`` at twice the batch per rank (``nan``: not measured;
            a batch that holds no tensor to double).
        double_batch_low: Its interval's lower end.
        double_batch_high: Its upper end.
        rank_wait_s: The part of ``rank_compute_s`` spent waiting for the slowest rank (0 where
            ``rank_compute_s`` is ``compute_s``). It comes once per all-reduce, so accumulation
            divides it as it divides the communication.
        optimizer_s: The part of ``compute_s`` after backward (``optimizer.step()`` and clearing
            the gradients), which accumulation also runs once per ``k`` batches.
        rank_compute_blocks: ``rank_compute_s`` of each block, when measured in the same blocks as
            the communication (the spawned ranks); empty otherwise.
        double_batch_blocks: ``double_batch_s`` of each block, likewise.

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
    compute_low: float = math.nan
    compute_high: float = math.nan
    rank_compute_low: float = math.nan
    rank_compute_high: float = math.nan
    load: float = math.nan
    comm_options: tuple[CommOption, ...] = ()
    double_batch_s: float = math.nan
    double_batch_low: float = math.nan
    double_batch_high: float = math.nan
    rank_wait_s: float = 0.0
    optimizer_s: float = 0.0
    rank_compute_blocks: tuple[float, ...] = ()
    double_batch_blocks: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name, value in (
            ("compute", self.compute_s),
            ("rank_compute", self.rank_compute_s),
            ("double_batch", self.double_batch_s),
        ):
            object.__setattr__(self, f"{name}_low", _fill(getattr(self, f"{name}_low"), value))
            object.__setattr__(self, f"{name}_high", _fill(getattr(self, f"{name}_high"), value))

    @property
    def ratio(self) -> float:
        """Compute over communication per step at the measured world size (higher scales better).

        Above about 3, data parallelism without overlap keeps 75 % efficiency or more.
        """
        return self.rank_compute_s / self.comm.step_s if self.comm.step_s > 0 else math.inf

    def _exposed(self, comm_s: float) -> float:
        return max(0.0, comm_s - self.backward_s) if self.overlap else comm_s

    def predict(self, world_size: int, *, accumulate: int = 1) -> ScalingPrediction:
        """Predict one world size, optionally with ``accumulate`` batches per all-reduce.

        One rank runs without DDP: its step is ``compute_s``. ``N > 1`` ranks take
        ``rank_compute_s + comm(N)`` per step without overlap; with overlap only communication
        that outlasts the backward pass counts: ``rank_compute_s + max(0, comm(N) - backward_s)``.
        With ``accumulate=k`` (gradient accumulation under DDP's ``no_sync()``) the all-reduce
        runs once per ``k`` batches, so each batch carries ``comm(N) / k``, and the ranks wait for
        the slowest one and step the optimizer once per ``k`` batches (``rank_wait_s / k``,
        ``optimizer_s / k``). Ranks beyond
        ``comm.world_size`` are assumed to compute as fast as the measured ones (their own cores
        or GPUs). The interval combines every part's interval in the least and the most favourable
        way.
        """
        if accumulate < 1:
            raise ValueError(f"accumulate must be >= 1, got {accumulate}.")
        if world_size == 1:
            rate = self.batch_size / self.compute_s if self.batch_size else math.nan
            return ScalingPrediction(1, self.compute_s, 0.0, 1.0, 1.0, rate)
        compute = (self.rank_compute_s, self.rank_compute_low, self.rank_compute_high)
        return self._forecast(
            world_size, self.comm, self._accumulated(compute, accumulate), accumulate=accumulate
        )

    def _accumulated(
        self, compute: tuple[float, float, float], accumulate: int
    ) -> tuple[float, float, float]:
        """A rank's compute per batch when it waits for the slowest rank and steps the optimizer once
        per ``accumulate`` batches."""
        saved = (self.rank_wait_s + self.optimizer_s) * (1 - 1 / accumulate)
        return (compute[0] - saved, compute[1] - saved, compute[2] - saved)

    def _forecast(
        self,
        world_size: int,
        comm: CommProfile,
        compute: tuple[float, float, float],
        *,
        accumulate: int = 1,
        batch_factor: int = 1,
    ) -> ScalingPrediction:
        """``world_size > 1`` ranks whose step computes ``compute`` (value, low, high) seconds on
        ``batch_factor`` times the profiled batch and reduces through ``comm`` once per
        ``accumulate`` steps; the speedup is against one process at the profiled batch."""
        value, low, high = compute
        comm_s = self._exposed(comm.time_at(world_size)) / accumulate
        comm_low, comm_high = (self._exposed(c) / accumulate for c in comm.range_at(world_size))
        step_s = value + comm_s
        samples = world_size * batch_factor
        speedup = samples * self.compute_s / step_s
        rate = samples * self.batch_size / step_s if self.batch_size else math.nan
        return ScalingPrediction(
            world_size,
            step_s,
            comm_s,
            speedup,
            speedup / world_size,
            rate,
            speedup_low=samples * self.compute_low / (high + comm_high),
            speedup_high=samples * self.compute_high / (low + comm_low),
        )

    def prescriptions(self, world_size: int | None = None) -> tuple[Prescription, ...]:
        """Each change the advisor weighs, with its predicted speed on ``world_size`` ranks, fastest first.

        The changes: each measured DDP option (:attr:`comm_options`: gradient compression to
        float16 or bfloat16, PowerSGD, larger buckets), accumulating :data:`_ACCUMULATE` batches
        per all-reduce (the communication of a step divided by that), and twice the batch per rank
        (when :attr:`double_batch_s` was measured). ``world_size`` defaults to the largest one
        predicted. Local: arithmetic on the measurements.

        Example:
            >>> for p in profile.prescriptions(8):  # doctest: +SKIP
            ...     print(p.change, p.prediction.speedup)
        """
        n = world_size or max((p.world_size for p in self.predictions), default=2)
        if n < 2:
            return ()
        plain = self.predict(n)

        def weigh(
            name: str,
            texts: tuple[str, str, str],
            exact: bool,
            comm: CommProfile,
            compute: tuple[float, float, float],
            blocks: tuple[float, ...],
            accumulate: int = 1,
            factor: int = 1,
        ) -> Prescription:
            compute = self._accumulated(compute, accumulate)
            prediction = self._forecast(n, comm, compute, accumulate=accumulate, batch_factor=factor)
            low, high = self._paired_gain(n, comm, compute[0], blocks, accumulate, factor)
            if math.isnan(low):
                low, high = (
                    prediction.speedup_low / plain.speedup_high,
                    prediction.speedup_high / plain.speedup_low,
                )
            change, setting, cost = texts
            gain = prediction.speedup / plain.speedup
            return Prescription(
                name, change, setting, cost, exact, prediction, gain, min(low, gain), max(high, gain)
            )

        compute = (self.rank_compute_s, self.rank_compute_low, self.rank_compute_high)
        own = self.rank_compute_blocks
        found = [
            weigh(o.name, (o.change, o.setting, o.cost), o.exact, o.comm, compute, own)
            for o in self.comm_options
        ]
        found.append(
            weigh(
                "accumulate",
                (
                    f"accumulate {_ACCUMULATE} batches per all-reduce (DDP's no_sync())",
                    f"Trainer(accumulate_grad_batches={_ACCUMULATE})",
                    f"each optimizer step then sees {_ACCUMULATE}x the samples: retune the learning rate, "
                    f"or divide the batch per rank by {_ACCUMULATE} to keep the optimizer's batch",
                ),
                False,
                self.comm,
                compute,
                own,
                accumulate=_ACCUMULATE,
            )
        )
        if not math.isnan(self.double_batch_s):
            batch = f" ({self.batch_size} to {2 * self.batch_size})" if self.batch_size else ""
            found.append(
                weigh(
                    "batch",
                    (
                        f"double the batch per rank{batch}",
                        "the DataLoader's batch_size"
                        + (f"={2 * self.batch_size}" if self.batch_size else " x2"),
                        "each optimizer step sees twice the samples (retune the learning rate), and a "
                        "rank holds twice the activations",
                    ),
                    False,
                    self.comm,
                    (self.double_batch_s, self.double_batch_low, self.double_batch_high),
                    self.double_batch_blocks,
                    factor=2,
                )
            )
        return tuple(sorted(found, key=lambda p: -p.gain))

    def _paired_gain(
        self,
        n: int,
        comm: CommProfile,
        compute: float,
        compute_blocks: tuple[float, ...],
        accumulate: int,
        factor: int,
    ) -> tuple[float, float]:
        """The lowest and highest gain over the blocks the job and a change were measured in
        together (``nan`` without blocks): ``factor * step_as_it_is / step_with_the_change`` per block."""
        count = len(self.comm.step_blocks)
        if not count or len(comm.step_blocks) != count:
            return math.nan, math.nan
        saved = (self.rank_wait_s + self.optimizer_s) * (1 - 1 / accumulate)
        gains = []
        for b in range(count):
            own = (
                self.rank_compute_blocks[b] if len(self.rank_compute_blocks) == count else self.rank_compute_s
            )
            changed = (compute_blocks[b] - saved) if len(compute_blocks) == count else compute
            as_is = own + self._exposed(self.comm._scaled(self.comm.step_blocks[b], n))
            step = changed + self._exposed(comm._scaled(comm.step_blocks[b], n)) / accumulate
            gains.append(factor * as_is / step)
        return min(gains), max(gains)

    def recommendation(self, *, max_load: float = MAX_LOAD) -> str:
        """A plain-language verdict: will more ranks help, up to how many, and what to change.

        Every number it quotes is one this profile measured or predicted; it says "raise the batch"
        only when comparing profiles of several batch sizes shows that a larger one is predicted
        to scale better (:func:`distkit.bench.report.recommend_profiles`). On a machine where other
        processes used more than ``max_load`` of the CPUs while it measured (``load``), it gives the
        numbers and withholds the verdict, as ``distkit bench`` does: their load inflates the
        compute time, so the verdict would be about them.
        """
        ms = 1e3
        batch = f" at batch {self.batch_size} per rank" if self.batch_size else ""
        size = _size_text(self.comm.grad_bytes)
        compute = _range_text(
            self.rank_compute_s * ms, self.rank_compute_low * ms, self.rank_compute_high * ms, ".2f"
        )
        comm = _range_text(self.comm.step_s * ms, self.comm.step_low * ms, self.comm.step_high * ms, ".2f")
        lines = [
            f"Compute takes {compute} ms per step per rank{batch}; all-reducing {size} of gradients takes "
            f"{comm} ms at {self.comm.world_size} ranks over {self.comm.backend} "
            f"({self.comm.source}): compute/communication ratio {self.ratio:.1f}."
        ]
        many = [p for p in self.predictions if p.world_size > 1]
        if not math.isnan(self.load) and self.load > max_load:
            lines.insert(0, f"No verdict ({trust_line(self.load, max_load)}).")
        if not many:
            return "\n".join(lines)
        lines.append(
            "Predicted: "
            + ", ".join(
                f"{p.world_size} ranks {_range_text(p.speedup, p.speedup_low, p.speedup_high, '.2f', 'x')} "
                f"({p.efficiency:.0%})"
                for p in many
            )
            + "."
        )
        if not math.isnan(self.load) and self.load > max_load:
            return "\n".join(lines)
        best = max(many, key=lambda p: p.speedup)
        accumulated = self.predict(best.world_size, accumulate=_ACCUMULATE)
        accumulate = (
            f"accumulating {_ACCUMULATE} batches per all-reduce with DDP's no_sync() is predicted to "
            f"give {accumulated.speedup:.2f}x ({accumulated.efficiency:.0%}) on {best.world_size} ranks"
        )
        worth = [p for p in many if _pays(p.speedup, p.world_size)]
        if best.speedup <= 1:
            lines.append(
                f"More ranks will make each epoch slower, not faster: communication outweighs compute "
                f"(ratio {self.ratio:.1f}). Stay on one device; or {accumulate}."
            )
        elif all(p.efficiency >= _GOOD for p in many):
            lines.append(f"Scales well: {many[-1].world_size} ranks are worth their cost.")
        elif worth:
            lines.append(
                f"Worth it up to about {worth[-1].world_size} ranks, where each added rank still brings "
                f"at least half of its speed; beyond, communication eats most of it ({accumulate})."
            )
        else:
            lines.append(
                f"Pays poorly: at best {best.speedup:.2f}x with {best.world_size} ranks, so each added "
                f"rank brings less than half of its speed; {accumulate}."
            )
        if best.speedup_low < 1 < best.speedup_high:
            lines.append(
                f"Within this measurement's spread, {best.world_size} ranks may be slower or faster than "
                f"one ({best.speedup_low:.2f}x to {best.speedup_high:.2f}x): measure longer (min_time_s) "
                f"or on a quieter machine before deciding."
            )
        lines.extend(self._prescription_lines(many[-1]))
        return "\n".join(lines)

    def prescribed(self, world_size: int | None = None) -> Prescription | None:
        """The change the advisor prescribes for ``world_size`` ranks (default: the largest predicted).

        A change is prescribed only when it is predicted faster than the job as it is in every block
        of the measurement (``gain_low > 1``); among those the fastest, or an exact one (the same
        sums: a bucket size) whose gain interval reaches the fastest one's. Nothing
        is prescribed when the job already scales well (efficiency 80 % or more) or on one rank.
        Local: arithmetic on the measurements.

        Example:
            >>> change = profile.prescribed(2)  # doctest: +SKIP
            >>> change.setting if change else "nothing to change"  # doctest: +SKIP
            'Trainer(accumulate_grad_batches=4)'
        """
        n = world_size or max((p.world_size for p in self.predictions), default=2)
        if n < 2 or self.predict(n).efficiency >= _GOOD:
            return None
        clear = [p for p in self.prescriptions(n) if p.gain_low > 1]
        if not clear:
            return None
        best = clear[0]
        exact = [p for p in clear if p.exact and p.gain_high >= best.gain_low]
        return exact[0] if exact and not best.exact else best

    def _prescription_lines(self, plain: ScalingPrediction) -> list[str]:
        """What would make ``plain.world_size`` ranks pay: a table of the changes, and the prescription
        (:meth:`prescribed`). Nothing when the job already scales well."""
        n = plain.world_size
        found = self.prescriptions(n)
        if plain.efficiency >= _GOOD or not found:
            return []

        def speed(p: ScalingPrediction) -> str:
            return _range_text(p.speedup, p.speedup_low, p.speedup_high, ".2f", "x")

        lines = [
            f"What each change is predicted to give on {n} ranks: samples/s against one process at this "
            f"batch (as it is: {speed(plain)}), and against the job as it is (range over the blocks):"
        ]
        width = max(len(p.change) for p in found)
        lines.extend(
            f"  {p.change:<{width}}  {speed(p.prediction)}  "
            f"{_range_text(p.gain, p.gain_low, p.gain_high, '.2f', 'x as it is')}  {p.setting}"
            for p in found
        )
        best = self.prescribed(n)
        if best is None:
            lines.append(
                f"No change is predicted faster than the job as it is on {n} ranks in every block of the "
                f"measurement: measure longer (min_time_s) or on a quieter machine, or use fewer ranks."
            )
            return lines
        pays = _pays(best.prediction.speedup, n)
        verdict = f"which makes {n} ranks worth their cost" if pays else f"though {n} ranks still pay poorly"
        lines.append(
            f"Prescription for {n} ranks: {best.change}: {best.setting}. Predicted {speed(best.prediction)} "
            f"against {speed(plain)} as it is ({best.gain:.2f}x its samples/s, "
            f"{best.gain_low:.2f}-{best.gain_high:.2f} over the blocks), {verdict}. "
            f"What it costs: {best.cost}."
        )
        return lines

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary of every field, with ``ratio``, ``prescriptions`` (for the largest
        predicted world size) and ``prescribed`` (the prescribed change's name, or ``None``) added."""
        out = asdict(self)
        out["ratio"] = self.ratio
        out["prescriptions"] = [asdict(p) for p in self.prescriptions()]
        prescribed = self.prescribed()
        out["prescribed"] = None if prescribed is None else prescribed.name
        return out


def _size_text(num_bytes: int) -> str:
    if num_bytes < _MIB:
        return f"{num_bytes / 1024:.1f} KiB"
    return f"{num_bytes / _MIB:.1f} MiB"

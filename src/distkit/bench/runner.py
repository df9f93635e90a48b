"""The scaling benchmark: every strategy, process count and batch size, repeated, interleaved, fair.

What a careful performance engineer would do by hand, and says how sure it is:

- **Fair**: every process of every configuration runs the same number of torch threads, the
  one-process baseline included; a configuration that oversubscribes the machine (on CPU,
  processes x threads > cores; on GPUs, more ranks than devices) is named and never recommended.
- **Repeated and interleaved**: ``repeats`` rounds, each measuring every configuration once (in
  alternating order), so that a change in machine load hits all of them alike. Each group of
  processes starts once and stays up between rounds.
- **Noise measured**: the baseline (one process, per batch size) is measured at the start and at
  the end of every round, an A/A test whose largest difference is the run's noise floor. Each
  round's speedups divide by that round's baseline. Other processes' CPU use is sampled before and
  during the run.
- **Implausible results re-measured**: a fixed batch per process cannot make an added process
  bring more than its own speed, so an efficiency above 100 % is noise or a disturbed baseline; such
  configurations are measured again (with their baseline) and flagged, never reported as a finding.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from distkit.bench import _load, _measure, _names
from distkit.bench._spawn import RankGroup
from distkit.bench._timing import Timing
from distkit.bench.stats import Interval, noise_floor, ratio_spread, spread
from distkit.bench.workloads import load_workload

__all__ = [
    "STRATEGIES",
    "BenchResult",
    "BenchRow",
    "default_threads_per_rank",
    "is_oversubscribed",
    "oversubscription",
    "run_benchmark",
]

#: ``single``: one process, no wrapper. ``dp``: ``torch.nn.DataParallel`` over N GPUs in one
#: process. ``ddp``: ``DistributedDataParallel`` over N processes (gloo on CPU, NCCL on GPUs).
STRATEGIES = _names.STRATEGIES

# Seconds of watching the machine before the run, for the load other processes put on it.
_LOAD_BEFORE_S = 1.0
# The fewest repetitions that give an interval (the range of 3 covers the median with 75 %).
MIN_REPEATS = 3

_Key = tuple[str, int, int]  # (strategy, world_size, batch_size)


@dataclass(frozen=True)
class BenchRow:
    """One benchmark configuration and what was measured (one CSV row).

    Every ``*_low``/``*_high`` pair is the interval of the value before it: the range of the
    repetitions, widened to the run's noise floor (:mod:`distkit.bench.stats`).

    Attributes:
        model: The workload's name.
        params: Trainable parameters.
        strategy: ``"single"``, ``"dp"`` or ``"ddp"``.
        world_size: Processes (ddp) or devices (dp); 1 for single.
        batch_size: Samples per process (ddp, single) or per device (dp) per step.
        global_batch: Samples per step for the whole job.
        status: ``"ok"`` or ``"skipped"``.
        note: Why a configuration was skipped, or what is wrong with it (oversubscribed,
            efficiency above 100 %).
        samples_per_s: Throughput of the job: samples per step over the median step time (a step
            another process delayed does not move it), median over repetitions.
        step_time_p50_ms: Median step time of the slowest rank.
        step_time_p90_ms: 90th percentile of the step time.
        speedup: ``samples_per_s`` over single's at the same batch size, measured in the same round.
        efficiency: ``speedup / world_size``.
        memory_mib: Peak allocated CUDA memory, or the resident memory of the largest process on CPU.
        memory_kind: ``"cuda_peak_allocated"`` or ``"cpu_rss"``.
        device: ``"cuda"`` or ``"cpu"``.
        backend: ``"nccl"``, ``"gloo"`` or ``""``.
        threads_per_rank: torch threads in each process.
        steps: Measured steps per process in one repetition (0 when skipped).
        samples_per_s_low: Lower end of the throughput interval.
        samples_per_s_high: Upper end.
        speedup_low: Lower end of the speedup interval.
        speedup_high: Upper end.
        efficiency_low: Lower end of the efficiency interval.
        efficiency_high: Upper end.
        compute_ms: ddp: the model's step per rank without DDP, all ranks computing at once
            (:mod:`distkit.bench._timing`, the advisor's code); single: the step.
        compute_ms_low: Lower end.
        compute_ms_high: Upper end.
        comm_ms: ddp: what DDP's gradient communication adds to a step; single: 0.
        comm_ms_low: Lower end.
        comm_ms_high: Upper end.
        repeats: Repetitions behind the values.
        oversubscribed: More processes x threads than cores (CPU) or ranks than devices (GPU).
        flag: ``""``, ``"superlinear"`` (efficiency above 100 % even after re-measuring: excluded
            from the recommendation) or ``"within noise of 100 %"``.
        foreign_cpu_pct: The most CPU other processes used while this configuration ran, in
            percent of the machine (``nan`` where unknown).
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
    samples_per_s_low: float = math.nan
    samples_per_s_high: float = math.nan
    speedup_low: float = math.nan
    speedup_high: float = math.nan
    efficiency_low: float = math.nan
    efficiency_high: float = math.nan
    compute_ms: float = math.nan
    compute_ms_low: float = math.nan
    compute_ms_high: float = math.nan
    comm_ms: float = math.nan
    comm_ms_low: float = math.nan
    comm_ms_high: float = math.nan
    repeats: int = 0
    oversubscribed: bool = False
    flag: str = ""
    foreign_cpu_pct: float = math.nan

    @classmethod
    def columns(cls) -> list[str]:
        """The CSV header, in field order."""
        return [f.name for f in fields(cls)]

    def as_dict(self) -> dict[str, Any]:
        """The row as a dictionary (for JSON and CSV)."""
        return asdict(self)

    @property
    def throughput(self) -> Interval:
        """``samples_per_s`` and its interval."""
        return Interval(self.samples_per_s, self.samples_per_s_low, self.samples_per_s_high)

    @property
    def speedup_interval(self) -> Interval:
        """``speedup`` and its interval."""
        return Interval(self.speedup, self.speedup_low, self.speedup_high)

    @property
    def efficiency_interval(self) -> Interval:
        """``efficiency`` and its interval."""
        return Interval(self.efficiency, self.efficiency_low, self.efficiency_high)

    @property
    def compute(self) -> Interval:
        """``compute_ms`` and its interval."""
        return Interval(self.compute_ms, self.compute_ms_low, self.compute_ms_high)

    @property
    def comm(self) -> Interval:
        """``comm_ms`` and its interval."""
        return Interval(self.comm_ms, self.comm_ms_low, self.comm_ms_high)

    @property
    def label(self) -> str:
        """The configuration in words, e.g. ``"ddp on 2 processes at batch 64"``."""
        if self.strategy == "single":
            return f"single (one process) at batch {self.batch_size}"
        unit = "GPU" if self.strategy == "dp" else "process"
        plural = "" if self.world_size == 1 else ("s" if unit == "GPU" else "es")
        return f"{self.strategy} on {self.world_size} {unit}{plural} at batch {self.batch_size}"


@dataclass(frozen=True)
class BenchResult:
    """Everything :func:`run_benchmark` measured, and how much to trust it.

    Attributes:
        rows: One row per configuration, in order of strategy, world size and batch size.
        repeats: Interleaved repetitions per configuration.
        threads_per_rank: torch threads in every process.
        cores: CPUs this process may use (affinity and cgroup quota).
        gpus: Visible CUDA devices.
        device: ``"cuda"`` or ``"cpu"``.
        noise_floor: The A/A noise floor: the largest relative difference between the two
            measurements of the baseline in one round (``nan`` without a baseline).
        load_before: Share of the machine's CPUs other processes used in the second before the run.
        load_during: Their share over the measured runs.
        load_worst: Their largest share during one run.
        notes: What the runner did on its own (the baseline added, configurations re-measured).
    """

    rows: tuple[BenchRow, ...]
    repeats: int
    threads_per_rank: int
    cores: int
    gpus: int
    device: str
    noise_floor: float = math.nan
    load_before: float = math.nan
    load_during: float = math.nan
    load_worst: float = math.nan
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary (rows as dictionaries)."""
        out = asdict(self)
        out["rows"] = [r.as_dict() for r in self.rows]
        return out


def default_threads_per_rank(max_world_size: int) -> int:
    """torch threads per process on CPU: the usable cores shared evenly by the largest group, at least 1.

    Example:
        >>> default_threads_per_rank(10_000)
        1
    """
    return max(1, _load.usable_cores() // max(1, max_world_size))


def oversubscription(
    strategy: str, world_size: int, *, threads_per_rank: int, cores: int, gpus: int, device: str
) -> str:
    """Why a configuration oversubscribes the machine, or ``""`` when it does not.

    On CPU: its processes times their threads exceed the cores. On GPUs (``device="cuda"``): dp or
    ddp asks for more devices than are visible.

    Example:
        >>> oversubscription("ddp", 4, threads_per_rank=1, cores=2, gpus=0, device="cpu")
        '4 processes x 1 thread > 2 cores'
        >>> oversubscription("ddp", 2, threads_per_rank=1, cores=2, gpus=0, device="cpu")
        ''
    """
    if device == "cuda":
        if strategy != "single" and world_size > gpus:
            return f"{world_size} ranks > {gpus} GPU{'s' if gpus != 1 else ''}"
        return ""
    processes = 1 if strategy in ("single", "dp") else world_size
    if processes * threads_per_rank > cores:
        return (
            f"{processes} process{'es' if processes != 1 else ''} x {threads_per_rank} "
            f"thread{'s' if threads_per_rank != 1 else ''} > {cores} core{'s' if cores != 1 else ''}"
        )
    return ""


def is_oversubscribed(
    strategy: str, world_size: int, *, threads_per_rank: int, cores: int, gpus: int, device: str
) -> bool:
    """True when the configuration needs more cores (CPU) or devices (GPU) than there are.

    Example:
        >>> is_oversubscribed("ddp", 3, threads_per_rank=1, cores=2, gpus=0, device="cpu")
        True
    """
    return bool(
        oversubscription(
            strategy, world_size, threads_per_rank=threads_per_rank, cores=cores, gpus=gpus, device=device
        )
    )


def _check_counts(name: str, values: Sequence[int]) -> list[int]:
    if not values:
        raise ValueError(f"{name} must not be empty.")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"each of {name} must be an integer >= 1, got {value!r}.")
    return sorted(set(values))


@dataclass
class _Run:
    round: int
    samples_per_s: float
    step: Timing
    compute: Timing | None
    comm: Timing | None
    p90_s: float
    steps: int
    memory_mib: float
    foreign: float


def _combine(key: _Key, results: list[dict[str, Any]], round_id: int, foreign: float) -> _Run:
    """The ranks' results as one run: the group moves at its slowest rank's pace."""
    strategy, n, b = key
    timings = {name: Timing.slowest([r["timings"][name] for r in results]) for name in results[0]["timings"]}
    global_batch = b if strategy == "single" else b * n
    return _Run(
        round=round_id,
        samples_per_s=global_batch / timings["step"].value,
        step=timings["step"],
        compute=timings.get("compute"),
        comm=timings.get("comm"),
        p90_s=max(r["p90_s"] for r in results),
        steps=int(results[0]["steps"]),
        memory_mib=max(r["memory_mib"] for r in results),
        foreign=foreign,
    )


def _label(key: _Key) -> str:
    strategy, n, b = key
    return f"{strategy} x{n} batch {b}"


def run_benchmark(
    model: str = "tiny",
    *,
    strategies: Sequence[str] = ("single", "ddp"),
    world_sizes: Sequence[int] = (1, 2),
    batch_sizes: Sequence[int] = (32,),
    steps: int = 20,
    warmup_steps: int = 5,
    min_time_s: float = 1.0,
    repeats: int = MIN_REPEATS,
    threads_per_rank: int | None = None,
    timeout_s: float = 600.0,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> BenchResult:
    """Measure a workload under each strategy, rank count and batch size, with intervals.

    Local: starts its own groups of processes (call it from one process, not from every rank).
    On a machine without CUDA, ddp runs over gloo processes and dp is reported as skipped (on
    CPU, ``DataParallel`` silently runs the plain module, which would measure nothing). On GPUs,
    ddp uses NCCL with one GPU per process; configurations needing more GPUs than visible are
    skipped as oversubscribed. Speedups need the one-process baseline: ``single`` is added when
    missing, with a note.

    Args:
        model: A preset name or ``module:factory`` (see :func:`distkit.bench.workloads.load_workload`).
        strategies: Any of ``"single"``, ``"dp"``, ``"ddp"``.
        world_sizes: Process counts (ddp) or device counts (dp).
        batch_sizes: Samples per process (or per device for dp) per step.
        steps: Measured steps per configuration and repetition, at least (>= 1).
        warmup_steps: Unmeasured steps first (>= 0).
        min_time_s: Measure each part of a configuration for at least this long (more steps for
            fast models): a scheduler time slice is milliseconds long, and a measurement that
            spans only a few of them is noise on a shared machine. 0 measures exactly ``steps``.
        repeats: Interleaved repetitions of every configuration (>= 3).
        threads_per_rank: torch threads per process, the same in every configuration; default
            :func:`default_threads_per_rank` of the largest world size on CPU, 1 on GPUs.
        timeout_s: Deadline for starting a group of processes and for each measurement, in seconds.
        on_progress: Called after each measured run with ``(runs done, runs planned, one line)``.

    Returns:
        The rows, the noise floor, the load and the notes (:class:`BenchResult`).

    Raises:
        ValueError: An unknown strategy, an empty or invalid count, or an unknown model.
        DistkitError: A benchmark process failed (its traceback is in the message).
        CollectiveTimeoutError: A group did not finish within ``timeout_s``.

    Example:
        >>> result = run_benchmark("tiny", world_sizes=[2], steps=5)  # doctest: +SKIP
        >>> [(r.strategy, r.world_size, round(r.efficiency, 2)) for r in result.rows]  # doctest: +SKIP
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
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < MIN_REPEATS:
        raise ValueError(
            f"repeats must be an integer >= {MIN_REPEATS} (an interval needs at least 3 repetitions), "
            f"got {repeats!r}."
        )
    notes: list[str] = []
    if "single" not in strategies:
        notes.append(
            "Added the single baseline (one process, no wrapper): speedup and efficiency compare "
            "against it, so it runs even when not asked for."
        )
    wanted = {"single", *strategies}
    workload = load_workload(model)  # fail here, before starting processes, on a bad name
    params = workload.num_parameters
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    device = "cuda" if cuda else "cpu"
    cores = _load.usable_cores()
    threads = threads_per_rank or (1 if cuda else default_threads_per_rank(max(sizes)))

    def row(key: _Key, status: str, note: str = "", **measured: Any) -> BenchRow:
        strategy, n, b = key
        return BenchRow(
            model,
            params,
            strategy,
            n,
            b,
            b * n if strategy != "single" else b,
            status,
            note,
            device=device,
            backend={"ddp": "nccl" if cuda else "gloo"}.get(strategy, ""),
            threads_per_rank=threads,
            **measured,
        )

    # Plan: every configuration; skipped ones are rows already.
    planned: list[_Key] = [
        (s, n, b)
        for s in STRATEGIES
        if s in wanted
        for n in ([1] if s == "single" else sizes)
        for b in batches
    ]
    skipped: dict[_Key, BenchRow] = {}
    oversubscribed: dict[_Key, str] = {}
    for key in planned:
        reason = oversubscription(
            key[0], key[1], threads_per_rank=threads, cores=cores, gpus=gpus, device=device
        )
        if reason:
            oversubscribed[key] = reason
        if key[0] == "dp" and not cuda:
            skipped[key] = row(key, "skipped", "DataParallel needs CUDA GPUs and none is visible")
        elif reason and cuda:
            skipped[key] = row(key, "skipped", f"oversubscribed: {reason}", oversubscribed=True)
    singles = [k for k in planned if k[0] == "single" and k not in skipped]
    others = [k for k in planned if k[0] != "single" and k not in skipped]

    runs: dict[_Key, list[_Run]] = {key: [] for key in planned}
    aa: dict[tuple[int, int], list[float]] = {}  # (batch, round) -> the baseline's two measurements
    groups: dict[int, RankGroup] = {}
    meter = _load.LoadMeter(lambda: [pid for g in groups.values() for pid in g.pids])
    progress = {"done": 0, "total": 0}

    def group_size(key: _Key) -> int:
        return key[1] if key[0] == "ddp" else 1

    with contextlib.ExitStack() as stack:
        # Every group starts at once and is waited for before the first measurement: starting
        # them one after the other would take as long again, and no run may share the machine
        # with a group still importing torch. The groups then stop all at once too.
        for n in sorted({group_size(k) for k in [*singles, *others]}):
            groups[n] = stack.enter_context(
                RankGroup(n, backend="nccl" if cuda else "gloo", threads=threads, timeout_s=timeout_s)
            )

        # Registered last, so it runs first on the way out: every group is asked to stop before
        # any is waited for.
        def request_stops() -> None:
            for group in groups.values():
                group.request_stop()

        stack.callback(request_stops)
        for group in groups.values():
            group.wait_ready()

        def measure(key: _Key, round_id: int, what: str) -> None:
            n = group_size(key)
            meter.start()
            results = groups[n].run(_measure.measure_config, (model, *key, steps, warmup_steps, min_time_s))
            run = _combine(key, results, round_id, meter.stop())
            runs[key].append(run)
            if key[0] == "single":
                aa.setdefault((key[2], round_id), []).append(run.samples_per_s)
            progress["done"] += 1
            if on_progress is not None:
                load = "" if math.isnan(run.foreign) else f"; other processes {run.foreign:.0%} CPU"
                on_progress(
                    progress["done"],
                    progress["total"],
                    f"{_label(key)}, {what}: {run.samples_per_s:,.0f} samples/s{load}",
                )

        def rounds(first: int, count: int, singles: list[_Key], others: list[_Key]) -> None:
            progress["total"] += count * (2 * len(singles) + len(others))
            for round_id in range(first, first + count):
                what = f"round {round_id + 1}"
                # The baseline opens and closes every round (the A/A pair); the others run in
                # between, in alternating order so that a drift in load hits them alike.
                for key in singles:
                    measure(key, round_id, what + " (A)")
                for key in others if round_id % 2 == 0 else others[::-1]:
                    measure(key, round_id, what)
                for key in singles:
                    measure(key, round_id, what + " (A/A)")

        meter.sample_before(_LOAD_BEFORE_S)
        rounds(0, repeats, singles, others)
        floor = noise_floor((v[0], v[1]) for v in aa.values() if len(v) == 2)
        stats = {key: _stats(key, runs[key], aa, floor) for key in others}
        suspect = [k for k in others if stats[k]["efficiency"].value > 1]
        if suspect:
            for key in suspect:
                notes.append(
                    f"Re-measured {row(key, 'ok').label}: its efficiency came out at "
                    f"{stats[key]['efficiency'].value:.0%}, above the 100 % that a fixed batch per "
                    f"process allows, so the first measurement was noise or its baseline was disturbed."
                )
                runs[key] = []
            batches_again = {k[2] for k in suspect}
            rounds(repeats, repeats, [k for k in singles if k[2] in batches_again], suspect)
            floor = noise_floor((v[0], v[1]) for v in aa.values() if len(v) == 2)
            stats = {key: _stats(key, runs[key], aa, floor) for key in others}

    rows = []
    for key in planned:
        if key in skipped:
            rows.append(skipped[key])
            continue
        found = runs[key]
        if key[0] == "single":
            throughput = spread([r.samples_per_s for r in found], floor=floor)
            speedup = efficiency = Interval(1.0, math.nan, math.nan)
            compute = spread([r.step.value * 1e3 for r in found], floor=floor)
            comm = Interval(0.0, 0.0, 0.0)
        else:
            s = stats[key]
            throughput, speedup, efficiency, compute, comm = (
                s["throughput"],
                s["speedup"],
                s["efficiency"],
                s["compute"],
                s["comm"],
            )
        flag = ""
        notes_here = []
        if key in oversubscribed:
            notes_here.append(f"oversubscribed: {oversubscribed[key]}")
        if key[0] != "single" and efficiency.value > 1:
            flag = "superlinear" if efficiency.low > 1 else "within noise of 100 %"
            notes_here.append(
                "efficiency above 100 % after re-measuring: not a finding"
                if flag == "superlinear"
                else "efficiency above 100 % but within the noise of 100 %"
            )
        foreign = [r.foreign for r in found if not math.isnan(r.foreign)]
        rows.append(
            row(
                key,
                "ok",
                "; ".join(notes_here),
                samples_per_s=throughput.value,
                samples_per_s_low=throughput.low,
                samples_per_s_high=throughput.high,
                step_time_p50_ms=statistics.median(r.step.value for r in found) * 1e3,
                step_time_p90_ms=statistics.median(r.p90_s for r in found) * 1e3,
                speedup=speedup.value,
                speedup_low=speedup.low,
                speedup_high=speedup.high,
                efficiency=efficiency.value,
                efficiency_low=efficiency.low,
                efficiency_high=efficiency.high,
                compute_ms=compute.value,
                compute_ms_low=compute.low,
                compute_ms_high=compute.high,
                comm_ms=comm.value,
                comm_ms_low=comm.low,
                comm_ms_high=comm.high,
                memory_mib=max(r.memory_mib for r in found),
                memory_kind="cuda_peak_allocated" if cuda else "cpu_rss",
                steps=found[-1].steps,
                repeats=len({r.round for r in found}),
                oversubscribed=key in oversubscribed,
                flag=flag,
                foreign_cpu_pct=100 * max(foreign) if foreign else math.nan,
            )
        )
    return BenchResult(
        rows=tuple(rows),
        repeats=repeats,
        threads_per_rank=threads,
        cores=cores,
        gpus=gpus,
        device=device,
        noise_floor=floor,
        load_before=meter.before,
        load_during=meter.during,
        load_worst=meter.worst,
        notes=tuple(notes),
    )


def _stats(
    key: _Key, found: list[_Run], aa: dict[tuple[int, int], list[float]], floor: float
) -> dict[str, Interval]:
    """Intervals of one configuration's repetitions; speedups against the same round's baseline."""
    _, n, b = key
    baseline = {r: statistics.fmean(v) for (batch, r), v in aa.items() if batch == b}
    ratios = [run.samples_per_s / baseline[run.round] for run in found if run.round in baseline]
    speedup = ratio_spread(ratios, floor=floor)
    return {
        "throughput": spread([r.samples_per_s for r in found], floor=floor),
        "speedup": speedup,
        "efficiency": speedup.scaled(1 / n),
        "compute": spread([r.compute.value * 1e3 for r in found if r.compute is not None], floor=floor),
        "comm": spread([r.comm.value * 1e3 for r in found if r.comm is not None], floor=floor),
    }

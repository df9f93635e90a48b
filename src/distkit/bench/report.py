"""What a benchmark leaves behind: a CSV, PNG plots and a recommendation that says how sure it is.

The recommendation follows :func:`distkit.bench.stats.decide` over the configurations it may
draw from (measured, not oversubscribed, not implausible) and states its confidence: ``high``
(the winner's interval clears every other's on a quiet machine), ``none`` (no significant
difference at this noise) or ``low`` (other processes loaded the machine). Every other sentence
follows from numbers shown beside it. Plots live in :mod:`distkit.bench._plots` (matplotlib,
imported only when plotting).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distkit._utils.fs import atomic_open
from distkit.bench import _load as _load_module
from distkit.bench._plots import plot_profiles, plot_rows
from distkit.bench._prediction import _ACCUMULATE, ScalingProfile, _pays
from distkit.bench.runner import BenchResult, BenchRow
from distkit.bench.stats import Interval, Option, decide

__all__ = [
    "MAX_LOAD",
    "candidates",
    "plot_profiles",
    "plot_rows",
    "recommend",
    "recommend_profiles",
    "trust",
    "write_csv",
]

#: Share of the machine's CPUs other processes may use before a recommendation is withheld: at
#: 10 % a 2-core machine already lends a fifth of a core to someone else.
MAX_LOAD = _load_module.MAX_LOAD
# Efficiency from which scaling counts as near-linear.
_GOOD = 0.8
# Cheapest first among configurations with as many processes or devices.
_STRATEGY_COST = {"single": 0, "ddp": 1, "dp": 2}


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path, columns: Sequence[str]) -> Path:
    """Write ``rows`` (dictionaries) to ``path`` atomically, with ``columns`` as the header.

    Example:
        >>> write_csv([{"a": 1.5}], "/tmp/distkit-doc.csv", ["a"]).name  # doctest: +SKIP
        'distkit-doc.csv'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    for item in rows:
        writer.writerow({k: _cell(v) for k, v in item.items()})
    with atomic_open(path, mode=0o644) as handle:
        handle.write(text.getvalue().encode())
    return path


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _rate_range(i: Interval) -> str:
    return f"{_rate(i.value)} [{_rate(i.low)}-{_rate(i.high)}]"


def _x_range(i: Interval) -> str:
    return f"{i.value:.2f}x [{i.low:.2f}-{i.high:.2f}]"


def _pct_range(i: Interval) -> str:
    return f"{i.value:.0%} [{i.low:.0%}-{i.high:.0%}]"


def _ms_range(i: Interval) -> str:
    return f"{i.value:.2f} ms [{i.low:.2f}-{i.high:.2f}]"


def _gain(row: BenchRow) -> str:
    if row.strategy == "single" or math.isnan(row.speedup):
        return ""
    if row.flag:
        # Above 100 % is never a finding: within the noise it reads as 100 %.
        efficiency = f"about 100 % efficiency (measured {row.efficiency:.0%}, within the noise)"
    else:
        efficiency = f"{_pct_range(row.efficiency_interval)} efficiency"
    return f", {_x_range(row.speedup_interval)} one process, {efficiency}"


def candidates(result: BenchResult) -> list[BenchRow]:
    """The rows a recommendation may draw from: measured, not oversubscribed, not implausible.

    Example:
        >>> [r.label for r in candidates(result)]  # doctest: +SKIP
        ['single (one process) at batch 64', 'ddp on 2 processes at batch 64']
    """
    return [
        r
        for r in result.rows
        if r.status == "ok"
        and not r.oversubscribed
        and r.flag != "superlinear"
        and not math.isnan(r.samples_per_s)
    ]


def _devices(row: BenchRow) -> int:
    return 1 if row.strategy == "single" else row.world_size


def trust(result: BenchResult, *, max_load: float = MAX_LOAD) -> str:
    """The line each plot of ``result`` carries: the confidence its report can have, and why.

    Example:
        >>> trust(result)  # doctest: +SKIP
        'confidence: measured on an idle machine (other processes used 2% of its CPUs)'
    """
    return _load_module.trust_line(_load(result), max_load)


def _load(result: BenchResult) -> float:
    values = [v for v in (result.load_before, result.load_during) if not math.isnan(v)]
    return max(values) if values else math.nan


def _decision_lines(result: BenchResult, max_load: float) -> list[str]:
    eligible = candidates(result)
    if not eligible:
        return [
            "No recommendation (confidence: none): every measured configuration oversubscribes this "
            "machine or was implausible, so none can be compared fairly."
        ]
    by_label = {r.label: r for r in eligible}
    decision = decide(
        [Option(r.label, r.throughput, (_devices(r), _STRATEGY_COST[r.strategy])) for r in eligible]
    )
    fastest = by_label[decision.fastest.label]
    noise = f"±{decision.noise:.0%}" if not math.isnan(decision.noise) else "unknown noise"
    load = _load(result)
    tied = [by_label[o.label] for o in decision.tied]
    cheapest = by_label[decision.cheapest.label]
    if decision.significant and decision.runner_up is not None:
        runner = by_label[decision.runner_up.label]
        margin = fastest.samples_per_s / runner.samples_per_s - 1
        finding = (
            f"{fastest.label}: {_rate_range(fastest.throughput)} samples/s{_gain(fastest)}. It beats the "
            f"runner-up, {runner.label} ({_rate_range(runner.throughput)}), by {margin:.0%}, beyond the "
            f"noise ({noise})."
        )
    elif decision.significant:
        finding = (
            f"{fastest.label}, the only configuration it may draw from: "
            f"{_rate_range(fastest.throughput)} samples/s."
        )
    else:
        names = "; ".join(f"{r.label} ({_rate_range(r.throughput)})" for r in tied[:4])
        more = f"; and {len(tied) - 4} more" if len(tied) > 4 else ""
        finding = (
            f"no significant difference at this noise ({noise}) between {names}{more}. The cheapest of "
            f"them: {cheapest.label}."
        )
    if not math.isnan(load) and load > max_load:
        return [
            f"No recommendation (confidence: low): other processes used {load:.0%} of this machine's CPUs "
            f"(more than {max_load:.0%}), so these numbers measure their load as much as the model. Run "
            f"again on an idle machine.",
            f"On this loaded machine: {finding[0].lower()}{finding[1:]}"
            if not decision.significant
            else f"On this loaded machine the fastest was {finding}",
        ]
    if not decision.significant:
        return [f"No recommendation (confidence: none): {finding}"]
    lines = [f"Recommendation (confidence: high): {finding}"]
    if fastest.world_size > 1 and not _pays(fastest.speedup_high, fastest.world_size):
        per = (fastest.speedup - 1) / (fastest.world_size - 1)
        alone = max((r for r in eligible if _devices(r) == 1), key=lambda r: r.samples_per_s, default=None)
        alternative = (
            f"; if processes cost, {alone.label} gives {alone.samples_per_s / fastest.samples_per_s:.0%} of "
            f"its throughput with one"
            if alone is not None
            else ""
        )
        lines.append(
            f"It pays poorly: each added process brings only {per:.2f} of one process's speed{alternative}."
        )
    return lines


def _scaling_lines(result: BenchResult) -> list[str]:
    lines = []
    ok = [r for r in result.rows if r.status == "ok" and r.strategy != "single" and not math.isnan(r.speedup)]
    singles = {r.batch_size: r for r in result.rows if r.strategy == "single" and r.status == "ok"}
    for strategy in ("ddp", "dp"):
        fair = [r for r in ok if r.strategy == strategy and r.world_size > 1 and not r.oversubscribed]
        if not fair:
            continue
        top = max(r.world_size for r in fair)
        at_top = sorted((r for r in fair if r.world_size == top), key=lambda r: r.batch_size)
        unit = "GPUs" if strategy == "dp" else "processes"
        effs = ", ".join(
            f"{_x_range(r.speedup_interval)} ({_pct_range(r.efficiency_interval)}) at batch {r.batch_size}"
            for r in at_top
        )
        if all(r.efficiency_low >= _GOOD for r in at_top):
            verdict = "scales well"
        elif all(r.speedup_high < 1 for r in at_top):
            verdict = "is slower than one process at every batch size"
        elif any(_pays(r.speedup_low, r.world_size) for r in at_top):
            verdict = "pays at some batch sizes"
        elif all(not _pays(r.speedup_high, r.world_size) for r in at_top):
            verdict = "pays poorly: each added process brings less than half of its speed"
        else:
            verdict = "cannot be judged at this noise"
        lines.append(f"{strategy} on {top} {unit}: {verdict}; {effs}.")
        split = [r for r in at_top if not math.isnan(r.comm_ms) and not math.isnan(r.compute_ms)]
        if split:
            parts = "; ".join(
                f"batch {r.batch_size}: compute {_ms_range(r.compute)}, communication {_ms_range(r.comm)}, "
                f"their sum {r.compute_ms + r.comm_ms:.2f} ms against a measured step of "
                f"{r.step_time_p50_ms:.2f} ms"
                for r in split
            )
            lines.append(f"Per step and process ({strategy} on {top}): {parts}.")
            heavy = [r for r in split if r.comm.clears(r.compute)]
            light = [r for r in split if r.compute.clears(r.comm)]
            if heavy:
                lines.append(
                    "Communication outweighs compute at batch "
                    + ", ".join(str(r.batch_size) for r in heavy)
                    + " (beyond the noise): a second process waits more for the all-reduce than it computes."
                )
            if light and not heavy:
                lines.append("Compute outweighs communication at every batch size shown.")
        if len(at_top) > 1:
            small, large = at_top[0], at_top[-1]
            if large.efficiency_interval.clears(small.efficiency_interval):
                lines.append(
                    f"Larger batches per process scale better: {large.efficiency:.0%} at batch "
                    f"{large.batch_size} against {small.efficiency:.0%} at batch {small.batch_size}, beyond "
                    f"the noise (the all-reduce per step stays the same while compute grows). To scale "
                    f"better, raise the batch per process."
                )
            elif small.efficiency_interval.clears(large.efficiency_interval):
                lines.append(
                    f"Larger batches per process scale worse here: {large.efficiency:.0%} at batch "
                    f"{large.batch_size} against {small.efficiency:.0%} at batch {small.batch_size}: raising "
                    f"the batch would not help scaling."
                )
        poor = [r for r in split if r.efficiency < _GOOD and r.batch_size in singles]
        if poor:
            r = max(poor, key=lambda r: r.batch_size)
            alone_ms = singles[r.batch_size].step_time_p50_ms
            k = _ACCUMULATE
            speedup = r.world_size * k * alone_ms / (k * r.compute_ms + r.comm_ms)
            lines.append(
                f"Accumulating {k} batches per all-reduce with DDP's no_sync() would take one all-reduce per "
                f"{k} steps: from the compute and communication above, about {speedup:.2f}x "
                f"({speedup / r.world_size:.0%}) at batch {r.batch_size} on {r.world_size} {unit}."
            )
    return lines


def _method_lines(result: BenchResult) -> list[str]:
    lines = []
    floor = (
        "unknown (no baseline measured twice)"
        if math.isnan(result.noise_floor)
        else f"{result.noise_floor:.1%}"
    )
    lines.append(
        f"How sure: {result.repeats} interleaved repetitions per configuration; intervals are their range, "
        f"widened to the noise floor. Noise floor (A/A test): the one-process baseline, measured at the "
        f"start and at the end of every round, differed by up to {floor}."
    )
    if result.device == "cpu":
        lines.append(
            f"Fair comparison: every process ran {result.threads_per_rank} torch thread(s), the one-process "
            f"baseline too, on {result.cores} usable core(s); speedup and efficiency count what each added "
            f"process brings, and a configuration whose processes x threads exceed the cores is "
            f"oversubscribed."
        )
    else:
        lines.append(
            f"Fair comparison: every process ran {result.threads_per_rank} torch thread(s), on "
            f"{result.gpus} visible GPU(s); more ranks than GPUs is oversubscribed."
        )
    over: dict[str, str] = {}
    for r in result.rows:
        if r.oversubscribed:
            unit = "GPUs" if r.strategy == "dp" else "processes"
            name = f"{r.strategy} on {r.world_size} {unit}" if r.strategy != "single" else "single"
            over.setdefault(name, r.note.split("; ")[0].removeprefix("oversubscribed: "))
    if over:
        listed = ", ".join(f"{name} ({why})" for name, why in over.items())
        lines.append(f"Oversubscribed, so never recommended: {listed}.")
    if math.isnan(result.load_during):
        lines.append("Machine load from other processes: not measured (it needs Linux's /proc).")
    else:
        worst = "" if math.isnan(result.load_worst) else f" (at most {result.load_worst:.0%} during one run)"
        lines.append(
            f"Machine load from other processes: {result.load_before:.0%} of the CPUs in the second before "
            f"the run, {result.load_during:.0%} during it{worst}."
        )
    lines.extend(result.notes)
    for r in result.rows:
        if r.flag == "superlinear":
            lines.append(
                f"{r.label}: efficiency {r.efficiency:.0%} even after re-measuring; a fixed batch per "
                f"process cannot exceed 100 %, so this is a disturbed measurement, not a finding, and it is "
                f"left out."
            )
        if r.status == "skipped" and not r.oversubscribed:
            lines.append(f"{r.strategy}: skipped, {r.note}.")
    if result.device == "cpu":
        lines.append(
            "Measured with CPU processes over gloo; on GPUs compute is faster and NCCL overlaps "
            "communication, so run distkit bench there too."
        )
    return lines


def recommend(result: BenchResult, *, max_load: float = MAX_LOAD) -> str:
    """A plain-language reading of a benchmark: what to run, how sure, and why.

    The first line is the decision: ``Recommendation (confidence: high): ...`` only when the
    fastest eligible configuration's interval clears every other's and other processes used at
    most ``max_load`` of the CPUs; otherwise ``No recommendation (confidence: none)`` with "no
    significant difference at this noise (±x %)" and the cheapest of the tied configurations, or
    ``(confidence: low)`` on a loaded machine. Then what the numbers show per strategy, the
    compute/communication split, and how it was measured (noise floor, threads, oversubscription,
    load, notes).

    Args:
        result: What :func:`distkit.bench.runner.run_benchmark` returned.
        max_load: Foreign CPU share above which no recommendation is made.

    Returns:
        The text of ``recommendation.txt``.

    Example:
        >>> print(recommend(result).splitlines()[0])  # doctest: +SKIP
        Recommendation (confidence: high): single (one process) at batch 256: ...
    """
    if not any(r.status == "ok" for r in result.rows):
        lines = ["Nothing was measured: every configuration was skipped."]
    else:
        lines = _decision_lines(result, max_load)
        lines.extend(_scaling_lines(result))
    lines.extend(_method_lines(result))
    # Skipped configurations repeat per world size and batch size; keep the first line of each.
    return "\n".join(dict.fromkeys(lines))


def recommend_profiles(profiles: Sequence[ScalingProfile]) -> str:
    """The advisor's verdict for several batch sizes: each profile's, then what the batch changes.

    "Raise the batch per rank" appears only when the largest batch's predicted efficiency
    interval clears the smallest's at the largest predicted world size.

    Example:
        >>> print(recommend_profiles(profiles))  # doctest: +SKIP
    """
    parts = [p.recommendation() for p in profiles]
    ranked = sorted((p for p in profiles if p.batch_size), key=lambda p: p.batch_size or 0)
    if len(ranked) > 1 and ranked[0].predictions:
        small, large = ranked[0], ranked[-1]
        n = max(p.world_size for p in small.predictions)
        a, b = small.predict(n), large.predict(n)
        a_int = Interval(a.efficiency, a.efficiency_low, a.efficiency_high)
        b_int = Interval(b.efficiency, b.efficiency_low, b.efficiency_high)
        if b_int.clears(a_int):
            parts.append(
                f"A larger batch per rank is predicted to scale better: {b.efficiency:.0%} on {n} ranks "
                f"at batch {large.batch_size} against {a.efficiency:.0%} at batch {small.batch_size} "
                f"(compute grows with the batch, communication does not). Raise the batch per rank if "
                f"training allows it."
            )
        elif a_int.clears(b_int):
            parts.append(
                f"A larger batch per rank is predicted to scale worse here: {b.efficiency:.0%} on {n} "
                f"ranks at batch {large.batch_size} against {a.efficiency:.0%} at batch {small.batch_size}."
            )
        else:
            parts.append(
                f"On {n} ranks the predicted efficiency does not differ beyond the spread between batch "
                f"{small.batch_size} and batch {large.batch_size}: the batch size is not the lever here."
            )
    return "\n\n".join(parts)

"""The scaling advisor's prediction against a measured 2-process DDP run, on this machine.

Run by hand (not in CI):  .venv/bin/python benchmarks/bench_scaling_advisor.py [--rounds 1]
                          [--cases tiny:32 transformer:8] [--plot docs/img/advisor_vs_measured.png]

For each workload, every round runs both sides one after the other, alternating which goes first:
``profile_scaling`` (compute timed in 2 spawned gloo ranks, alone and in lockstep, with DDP's
gradient communication) predicts the speedup of 2 DDP ranks over one process; ``run_benchmark``
measures it (3 interleaved repetitions, the baseline measured twice per round). Both train with the
workload's own optimizer (SGD, AdamW for the transformer) and every process uses 1 torch thread:
2 ranks on 2 cores. Prints the medians over rounds with the intervals of the last round, the
errors of the predicted speedup (the check: exit status 1 if any exceeds --tolerance, 15 % by
default, the target of issue 13) and of the predicted step time.

On a machine shared with other jobs the timings follow their load, so each case (one workload,
both sides) is repeated until no other process used more than ``--max-foreign`` of the CPUs while it
ran: the CPU time of the whole machine (/proc/stat, Linux) minus that of this process and its
children (getrusage). Before each try it waits for the CPUs to be 90 % idle. The foreign share of
each accepted case is printed; a case still disturbed after ``--tries`` keeps its least disturbed
try, is listed, and the verdict is NO VERDICT (exit status 2).
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from distkit.bench import profile_scaling
from distkit.bench.runner import run_benchmark
from distkit.bench.workloads import load_workload

# (preset, batch per rank): compute/communication ratios from below 1 to above 10, and a small
# transformer text classifier like seed 004's (most of its gradient is the token embedding's).
CASES = (
    ("tiny", 32),
    ("small", 64),
    ("small", 256),
    ("medium", 64),
    ("medium", 256),
    ("conv", 32),
    ("transformer", 8),
    ("transformer", 32),
)
THREADS = 1
T = TypeVar("T")
# Each measured part runs at least this long on both sides (see run_benchmark's min_time_s).
MIN_TIME_S = 1.0


def _busy_jiffies() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _own_cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the ranks, once waited for
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _wait_idle(threshold: float = 0.9, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy0, total0 = _busy_jiffies()
        time.sleep(2.0)
        busy1, total1 = _busy_jiffies()
        if 1 - (busy1 - busy0) / max(1, total1 - total0) >= threshold:
            return


def _undisturbed(run: Callable[[], T], max_foreign: float, tries: int) -> tuple[T, float]:
    """Run ``run`` until other processes used at most ``max_foreign`` of the CPUs meanwhile.

    After ``tries`` disturbed attempts, the least disturbed one is returned (the caller marks it).
    """
    tick = os.sysconf("SC_CLK_TCK")
    cpus = os.cpu_count() or 1
    best: tuple[T, float] | None = None
    for _ in range(tries):
        _wait_idle()
        busy0, _ = _busy_jiffies()
        own0, wall0 = _own_cpu_s(), time.monotonic()
        result = run()
        busy1, _ = _busy_jiffies()
        own1, wall1 = _own_cpu_s(), time.monotonic()
        foreign = max(0.0, (busy1 - busy0) / tick - (own1 - own0)) / ((wall1 - wall0) * cpus)
        if best is None or foreign < best[1]:
            best = (result, foreign)
        if foreign <= max_foreign:
            return result, foreign
        print(f"  disturbed: other processes used {foreign:.0%} of the CPUs; again", file=sys.stderr)
    assert best is not None  # tries >= 1
    print(f"  no undisturbed measurement in {tries} tries; keeping the least disturbed", file=sys.stderr)
    return best


def _case(name: str, batches: list[int], order: tuple[str, str], steps: int) -> dict[int, dict[str, float]]:
    """Both sides for one workload, in the given order: per batch size, predicted and measured."""
    found: dict[int, dict[str, float]] = {b: {} for b in batches}
    for side in order:
        if side == "predict":
            for b in batches:
                found[b].update(_predict(name, b, steps))
        else:
            for b, values in _measure(name, batches, steps).items():
                found[b].update(values)
    return found


def _predict(name: str, batch_size: int, steps: int) -> dict[str, float]:
    workload = load_workload(name)
    model = copy.deepcopy(workload.model)
    profile = profile_scaling(
        model,
        workload.make_batch(batch_size),
        world_sizes=(2,),
        compute_loss=workload.compute_loss,
        optimizer=workload.optimizer(model),
        steps=steps,
        warmup_steps=5,
        min_time_s=MIN_TIME_S,
        comm_world_size=2,
        num_threads=THREADS,
    )
    prediction = profile.predict(2)
    return {
        "compute": profile.compute_s,
        "rank_compute": profile.rank_compute_s,
        "comm": profile.comm.step_s,
        "pred_step": prediction.step_s,
        "pred_speedup": prediction.speedup,
        "pred_low": prediction.speedup_low,
        "pred_high": prediction.speedup_high,
    }


def _measure(name: str, batch_sizes: list[int], steps: int) -> dict[int, dict[str, float]]:
    result = run_benchmark(
        name,
        strategies=("single", "ddp"),
        world_sizes=(2,),
        batch_sizes=batch_sizes,
        steps=steps,
        warmup_steps=5,
        min_time_s=MIN_TIME_S,
        repeats=3,
        threads_per_rank=THREADS,
    )
    return {
        r.batch_size: {
            "step": r.step_time_p50_ms / 1e3,
            "speedup": r.speedup,
            "meas_low": r.speedup_low,
            "meas_high": r.speedup_high,
            "meas_compute": r.compute_ms / 1e3,
            "meas_comm": r.comm_ms / 1e3,
        }
        for r in result.rows
        if r.strategy == "ddp"
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds, alternating which side goes first (medians are reported); each takes about 6 "
        "minutes on 2 idle cores (default: 1)",
    )
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run")
    parser.add_argument(
        "--tolerance", type=float, default=0.15, help="largest acceptable relative error of the speedup"
    )
    parser.add_argument(
        "--cases", nargs="+", default=None, help="preset:batch cases to run (default: all of CASES)"
    )
    parser.add_argument("--plot", default=None, help="write a predicted-vs-measured PNG here")
    parser.add_argument(
        "--max-foreign", type=float, default=0.1, help="CPU share other processes may use during a case"
    )
    parser.add_argument("--tries", type=int, default=8, help="attempts per case before giving up")
    args = parser.parse_args()

    cases = CASES
    if args.cases:
        cases = tuple((name, int(batch)) for name, _, batch in (c.partition(":") for c in args.cases))
    torch.set_num_threads(THREADS)
    models = sorted({name for name, _ in cases}, key=[c[0] for c in cases].index)
    samples: dict[tuple[str, int], dict[str, list[float]]] = {case: {} for case in cases}
    started = time.perf_counter()
    for round_index in range(args.rounds):
        for name in models:
            batches = [b for n, b in cases if n == name]
            # Alternate which side goes first, so slow drifts in machine load hit both alike.
            order = ("predict", "measure") if round_index % 2 == 0 else ("measure", "predict")
            found, foreign = _undisturbed(
                functools.partial(_case, name, batches, order, args.steps), args.max_foreign, args.tries
            )
            for b, values in found.items():
                for key, value in values.items():
                    samples[(name, b)].setdefault(key, []).append(value)
                samples[(name, b)].setdefault("foreign", []).append(foreign)
            print(
                f"round {round_index + 1}, {name}: other processes used {foreign:.0%} of the CPUs",
                file=sys.stderr,
            )
        print(
            f"round {round_index + 1}/{args.rounds} done ({time.perf_counter() - started:.0f} s)",
            file=sys.stderr,
        )

    print(
        f"profile_scaling vs measured DDP, 2 gloo processes x {THREADS} thread, "
        f"medians of {args.rounds} rounds; [low-high]: intervals of the last round"
    )
    header = (
        f"{'model':>11} {'batch':>5} {'alone ms':>8} {'rank ms':>8} {'comm ms':>8} {'ratio':>6} "
        f"{'pred step':>9} {'meas step':>9} {'error':>6} {'pred x [interval]':>18} "
        f"{'meas x [interval]':>18} {'error':>6}"
    )
    print(header)
    worst = 0.0
    table = []
    for case in cases:
        values = samples[case]
        m = {key: statistics.median(v) for key, v in values.items()}
        last = {key: v[-1] for key, v in values.items()}
        step_error = m["pred_step"] / m["step"] - 1
        speedup_error = m["pred_speedup"] / m["speedup"] - 1
        worst = max(worst, abs(speedup_error))
        table.append((case, m, last))
        pred = f"{m['pred_speedup']:.2f} [{last['pred_low']:.2f}-{last['pred_high']:.2f}]"
        meas = f"{m['speedup']:.2f} [{last['meas_low']:.2f}-{last['meas_high']:.2f}]"
        print(
            f"{case[0]:>11} {case[1]:>5} {m['compute'] * 1e3:>8.2f} {m['rank_compute'] * 1e3:>8.2f} "
            f"{m['comm'] * 1e3:>8.2f} {m['rank_compute'] / m['comm']:>6.2f} {m['pred_step'] * 1e3:>9.2f} "
            f"{m['step'] * 1e3:>9.2f} {step_error:>+6.0%} {pred:>18} {meas:>18} {speedup_error:>+6.0%}"
        )
    disturbed = [case for case in cases if max(samples[case]["foreign"]) > args.max_foreign]
    verdict = "PASS" if worst <= args.tolerance else "FAIL"
    if disturbed:
        verdict = "NO VERDICT"
        listed = ", ".join(f"{name} {b}" for name, b in disturbed)
        print(f"disturbed by other processes (more than {args.max_foreign:.0%} of the CPUs): {listed}")
    print(f"largest speedup error {worst:.0%} (tolerance {args.tolerance:.0%}): {verdict}")
    print("compute and communication, advisor (profile_scaling) vs bench (its ddp x2 rows), ms per step:")
    for case, m, _ in table:
        print(
            f"  {case[0]:>11} {case[1]:>5}: compute {m['rank_compute'] * 1e3:.2f} vs "
            f"{m['meas_compute'] * 1e3:.2f}, communication {m['comm'] * 1e3:.2f} vs "
            f"{m['meas_comm'] * 1e3:.2f}"
        )
    if args.plot:
        _plot(table, args.plot, args.tolerance)
        print(f"wrote {args.plot}")
    return {"PASS": 0, "FAIL": 1}.get(verdict, 2)


def _plot(
    table: list[tuple[tuple[str, int], dict[str, float], dict[str, float]]], path: str, tolerance: float
) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    figure = Figure(figsize=(10.4, 4.4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    steps_ax, speed_ax = figure.subplots(1, 2, width_ratios=(1, 1.5))
    measured = [m["step"] * 1e3 for _, m, _ in table]
    predicted = [m["pred_step"] * 1e3 for _, m, _ in table]
    low, high = min(measured + predicted) * 0.7, max(measured + predicted) * 1.4
    line = [low, high]
    steps_ax.plot(line, line, "k--", linewidth=1, label="prediction = measurement")
    steps_ax.fill_between(line, [v * (1 - tolerance) for v in line], [v * (1 + tolerance) for v in line],
                          color="grey", alpha=0.2, label=f"within {tolerance:.0%}")  # fmt: skip
    for ((name, b), _, _), x, y in zip(table, measured, predicted, strict=True):
        steps_ax.plot([x], [y], "o", label=f"{name}, batch {b}")
    steps_ax.set(xscale="log", yscale="log", xlim=line, ylim=line, xlabel="measured DDP step (ms)",
                 ylabel="predicted step (ms)", title="Step time of 2 DDP ranks")  # fmt: skip
    ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500) if low <= t <= high]
    for axis in (steps_ax.xaxis, steps_ax.yaxis):
        axis.set_major_locator(FixedLocator(ticks))
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    steps_ax.legend(fontsize="x-small")

    labels = [f"{name}\nbatch {b}" for (name, b), _, _ in table]
    x = list(range(len(table)))

    def bars(offset: float, key: str, lo: str, hi: str, label: str) -> None:
        values = [m[key] for _, m, _ in table]
        yerr = [
            [max(0.0, v - last[lo]) for v, (_, _, last) in zip(values, table, strict=True)],
            [max(0.0, last[hi] - v) for v, (_, _, last) in zip(values, table, strict=True)],
        ]
        speed_ax.bar([i + offset for i in x], values, width=0.4, yerr=yerr, capsize=3, label=label)

    bars(-0.2, "pred_speedup", "pred_low", "pred_high", "predicted")
    bars(0.2, "speedup", "meas_low", "meas_high", "measured")
    speed_ax.axhline(2, color="k", linestyle="--", linewidth=1, label="ideal")
    speed_ax.axhline(1, color="grey", linestyle=":", linewidth=1)
    speed_ax.set_xticks(x, labels, fontsize="x-small")
    speed_ax.set(ylabel="speedup over 1 process", title="Speedup of 2 DDP ranks (error bars: intervals)")
    speed_ax.legend(fontsize="small")
    figure.suptitle("profile_scaling vs measured DDP: gloo, 2 CPU processes x 1 thread", fontsize="medium")
    figure.savefig(path)


if __name__ == "__main__":
    sys.exit(main())

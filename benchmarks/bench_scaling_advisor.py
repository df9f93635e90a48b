"""The scaling advisor's prediction against a measured 2-process DDP run, on this machine.

Run by hand (not in CI):  .venv/bin/python benchmarks/bench_scaling_advisor.py [--rounds 3]
                          [--plot docs/img/advisor_vs_measured.png]

For each workload, every round runs both sides one after the other, alternating which goes first:
``profile_scaling`` (compute timed here alone, and in lockstep in 2 spawned gloo ranks with DDP's
gradient communication) predicts the step time of 2 DDP ranks; ``run_benchmark`` measures one
process and 2 DDP processes. Every process, including this one while it times compute, uses 1
torch thread: 2 ranks on 2 cores. Prints the medians over rounds and the errors of the predicted
step time (the check: exit status 1 if any exceeds --tolerance) and of the predicted speedup, which
also depends on the one-process baseline timed in another process.

On a machine shared with other jobs the timings follow their load, so each case (one workload,
both sides) is repeated until no other process used more than ``--max-foreign`` of the CPUs while it
ran: the CPU time of the whole machine (/proc/stat, Linux) minus that of this process and its
children (getrusage). Before each try it waits for the CPUs to be 90 % idle. The foreign share of
each accepted case is printed.
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

# (preset, batch per rank): compute/communication ratios from below 1 to above 10.
CASES = (("tiny", 32), ("small", 64), ("small", 256), ("medium", 64), ("medium", 256), ("conv", 32))
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
    """Run ``run`` until other processes used at most ``max_foreign`` of the CPUs meanwhile."""
    tick = os.sysconf("SC_CLK_TCK")
    cpus = os.cpu_count() or 1
    foreign = 1.0
    for _ in range(tries):
        _wait_idle()
        busy0, _ = _busy_jiffies()
        own0, wall0 = _own_cpu_s(), time.monotonic()
        result = run()
        busy1, _ = _busy_jiffies()
        own1, wall1 = _own_cpu_s(), time.monotonic()
        foreign = max(0.0, (busy1 - busy0) / tick - (own1 - own0)) / ((wall1 - wall0) * cpus)
        if foreign <= max_foreign:
            return result, foreign
        print(f"  disturbed: other processes used {foreign:.0%} of the CPUs; again", file=sys.stderr)
    raise SystemExit(f"no undisturbed measurement in {tries} tries (last: {foreign:.0%} foreign)")


def _case(name: str, batches: list[int], order: tuple[str, str], steps: int) -> dict[int, dict[str, float]]:
    """Both sides for one workload, in the given order: per batch size, predicted and measured."""
    found: dict[int, dict[str, float]] = {b: {} for b in batches}
    for side in order:
        if side == "predict":
            for b in batches:
                compute, rank_compute, comm, step, speedup = _predict(name, b, steps)
                found[b].update(
                    compute=compute,
                    rank_compute=rank_compute,
                    comm=comm,
                    pred_step=step,
                    pred_speedup=speedup,
                )
        else:
            for b, (step, speedup) in _measure(name, batches, steps).items():
                found[b].update(step=step, speedup=speedup)
    return found


def _predict(name: str, batch_size: int, steps: int) -> tuple[float, float, float, float, float]:
    workload = load_workload(name)
    model = copy.deepcopy(workload.model)
    profile = profile_scaling(
        model,
        workload.make_batch(batch_size),
        world_sizes=(2,),
        compute_loss=workload.compute_loss,
        optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
        steps=steps,
        warmup_steps=5,
        min_time_s=MIN_TIME_S,
        comm_world_size=2,
        num_threads=THREADS,
    )
    prediction = profile.predict(2)
    return (
        profile.compute_s,
        profile.rank_compute_s,
        profile.comm.step_s,
        prediction.step_s,
        prediction.speedup,
    )


def _measure(name: str, batch_sizes: list[int], steps: int) -> dict[int, tuple[float, float]]:
    rows = run_benchmark(
        name,
        strategies=("single", "ddp"),
        world_sizes=(2,),
        batch_sizes=batch_sizes,
        steps=steps,
        warmup_steps=5,
        min_time_s=MIN_TIME_S,
        threads_per_rank=THREADS,
    )
    return {r.batch_size: (r.step_time_p50_ms / 1e3, r.speedup) for r in rows if r.strategy == "ddp"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run")
    parser.add_argument("--tolerance", type=float, default=0.25, help="largest acceptable relative error")
    parser.add_argument("--plot", default=None, help="write a predicted-vs-measured PNG here")
    parser.add_argument(
        "--max-foreign", type=float, default=0.1, help="CPU share other processes may use during a case"
    )
    parser.add_argument("--tries", type=int, default=8, help="attempts per case before giving up")
    args = parser.parse_args()

    torch.set_num_threads(THREADS)
    models = sorted({name for name, _ in CASES}, key=[c[0] for c in CASES].index)
    samples: dict[tuple[str, int], dict[str, list[float]]] = {case: {} for case in CASES}
    started = time.perf_counter()
    for round_index in range(args.rounds):
        for name in models:
            batches = [b for n, b in CASES if n == name]
            # Alternate which side goes first, so slow drifts in machine load hit both alike.
            order = ("predict", "measure") if round_index % 2 == 0 else ("measure", "predict")
            found, foreign = _undisturbed(
                functools.partial(_case, name, batches, order, args.steps), args.max_foreign, args.tries
            )
            for b, values in found.items():
                for key, value in values.items():
                    samples[(name, b)].setdefault(key, []).append(value)
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
        f"medians of {args.rounds} rounds"
    )
    header = (
        f"{'model':>7} {'batch':>5} {'alone ms':>8} {'rank ms':>8} {'comm ms':>8} {'ratio':>6} "
        f"{'pred step':>9} {'meas step':>9} {'error':>6} {'pred x':>6} {'meas x':>6} {'error':>6}"
    )
    print(header)
    worst = 0.0
    table = []
    for case in CASES:
        m = {key: statistics.median(values) for key, values in samples[case].items()}
        step_error = m["pred_step"] / m["step"] - 1
        speedup_error = m["pred_speedup"] / m["speedup"] - 1
        worst = max(worst, abs(step_error))
        table.append((case, m))
        print(
            f"{case[0]:>7} {case[1]:>5} {m['compute'] * 1e3:>8.2f} {m['rank_compute'] * 1e3:>8.2f} "
            f"{m['comm'] * 1e3:>8.2f} {m['rank_compute'] / m['comm']:>6.2f} {m['pred_step'] * 1e3:>9.2f} "
            f"{m['step'] * 1e3:>9.2f} {step_error:>+6.0%} {m['pred_speedup']:>6.2f} {m['speedup']:>6.2f} "
            f"{speedup_error:>+6.0%}"
        )
    verdict = "PASS" if worst <= args.tolerance else "FAIL"
    print(f"largest step-time error {worst:.0%} (tolerance {args.tolerance:.0%}): {verdict}")
    if args.plot:
        _plot(table, args.plot, args.tolerance)
        print(f"wrote {args.plot}")
    return 0 if verdict == "PASS" else 1


def _plot(table: list[tuple[tuple[str, int], dict[str, float]]], path: str, tolerance: float) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    figure = Figure(figsize=(9.6, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    steps_ax, speed_ax = figure.subplots(1, 2, width_ratios=(1, 1.4))
    measured = [m["step"] * 1e3 for _, m in table]
    predicted = [m["pred_step"] * 1e3 for _, m in table]
    low, high = min(measured + predicted) * 0.7, max(measured + predicted) * 1.4
    line = [low, high]
    steps_ax.plot(line, line, "k--", linewidth=1, label="prediction = measurement")
    steps_ax.fill_between(line, [v * (1 - tolerance) for v in line], [v * (1 + tolerance) for v in line],
                          color="grey", alpha=0.2, label=f"within {tolerance:.0%}")  # fmt: skip
    for ((name, b), _), x, y in zip(table, measured, predicted, strict=True):
        steps_ax.plot([x], [y], "o", label=f"{name}, batch {b}")
    steps_ax.set(xscale="log", yscale="log", xlim=line, ylim=line, xlabel="measured DDP step (ms)",
                 ylabel="predicted step (ms)", title="Step time of 2 DDP ranks")  # fmt: skip
    ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500) if low <= t <= high]
    for axis in (steps_ax.xaxis, steps_ax.yaxis):
        axis.set_major_locator(FixedLocator(ticks))
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    steps_ax.legend(fontsize="x-small")

    labels = [f"{name}\nbatch {b}" for (name, b), _ in table]
    x = list(range(len(table)))
    speed_ax.bar([i - 0.2 for i in x], [m["pred_speedup"] for _, m in table], width=0.4, label="predicted")
    speed_ax.bar([i + 0.2 for i in x], [m["speedup"] for _, m in table], width=0.4, label="measured")
    speed_ax.axhline(2, color="k", linestyle="--", linewidth=1, label="ideal")
    speed_ax.axhline(1, color="grey", linestyle=":", linewidth=1)
    speed_ax.set_xticks(x, labels, fontsize="small")
    speed_ax.set(ylabel="speedup over 1 process", title="Speedup of 2 DDP ranks")
    speed_ax.legend(fontsize="small")
    figure.suptitle("profile_scaling vs measured DDP: gloo, 2 CPU processes x 1 thread", fontsize="medium")
    figure.savefig(path)


if __name__ == "__main__":
    sys.exit(main())

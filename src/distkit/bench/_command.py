"""``distkit bench`` and ``distkit bench --profile``: run, print, and write the files.

The parser lives in :mod:`distkit.cli` (it must not import torch, so that ``--help`` is fast);
this module runs the command once the arguments are known. Progress goes to stderr: a tqdm bar
in a terminal, one plain line per finished run elsewhere (a pipe, a log file, ``CI=true``), so
logs never fill with progress frames.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from distkit.bench import _load, report, runner
from distkit.bench.profile import CommOption, CommProfile, ScalingPrediction, ScalingProfile, profile_scaling
from distkit.bench.workloads import load_workload
from distkit.errors import DistkitError

# Values of CI that mean "running in CI" (GitHub Actions, GitLab, Travis and others set CI=true).
_CI_TRUE = {"1", "true", "yes", "on"}


def progress_mode(
    no_progress: bool, stream: TextIO | None = None, environ: Mapping[str, str] | None = None
) -> str:
    """``"none"`` (--no-progress), ``"bar"`` (a terminal, not CI, tqdm installed) or ``"lines"``."""
    if no_progress:
        return "none"
    stream = sys.stderr if stream is None else stream
    environ = os.environ if environ is None else environ
    if environ.get("CI", "").strip().lower() in _CI_TRUE:
        return "lines"
    isatty = getattr(stream, "isatty", None)
    if not (callable(isatty) and isatty()):
        return "lines"
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return "lines"
    return "bar"


class Progress:
    """Progress on stderr: a tqdm bar, one line per finished run, or nothing."""

    def __init__(self, mode: str, desc: str) -> None:
        self.mode = mode
        self.bar: Any = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=0, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True)

    def __call__(self, done: int, total: int, text: str) -> None:
        if self.bar is not None:
            if self.bar.total != total:
                self.bar.total = total
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(done - self.bar.n)
        elif self.mode == "lines":
            print(f"[{done}/{total}] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def default_world_sizes() -> list[int]:
    """1, 2, 4, ... up to the visible GPUs, or up to the usable cores (at most 4) on CPU."""
    limit = torch.cuda.device_count() if torch.cuda.is_available() else min(_load.usable_cores(), 4)
    sizes = [1]
    while sizes[-1] * 2 <= limit:
        sizes.append(sizes[-1] * 2)
    return sizes


def _json_ready(value: Any) -> Any:
    # JSON has no NaN: a value that was not measured is null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


def _plots_or_reason(plot: Callable[[], list[Path]]) -> tuple[list[Path], str | None]:
    try:
        return plot(), None
    except ImportError as err:
        return [], str(err)


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 0) -> None:
    """Right-aligned columns, except the last ``left`` ones (free text)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    split = len(headers) - left

    def line(cells: Sequence[str]) -> str:
        right = [c.rjust(w) for c, w in zip(cells[:split], widths[:split], strict=True)]
        return "  ".join(right + list(cells[split:])).rstrip()

    print(line(headers))
    for row in rows:
        print(line(row))


def _num(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def _interval(value: float, low: float, high: float, fmt: Callable[[float], str]) -> str:
    if math.isnan(value):
        return "-"
    if math.isnan(low) or math.isnan(high) or low == high == value:
        return fmt(value)
    return f"{fmt(value)} [{fmt(low)}-{fmt(high)}]"


def _prediction_cell(pred: ScalingPrediction) -> str:
    speedup = _interval(pred.speedup, pred.speedup_low, pred.speedup_high, lambda v: f"{v:.2f}")
    return f"{speedup} ({pred.efficiency:.0%})"


def _finish(
    args: argparse.Namespace,
    out: Path,
    csv_path: Path,
    plots: list[Path],
    plot_problem: str | None,
    advice: str,
    payload: dict[str, Any],
    print_table: Callable[[], None],
) -> int:
    advice_path = out / "recommendation.txt"
    advice_path.write_text(advice + "\n")
    if args.json:
        files = {"csv": str(csv_path), "plots": [str(p) for p in plots], "recommendation": str(advice_path)}
        payload = {**payload, "recommendation": advice, "files": files}
        if plot_problem:
            payload["plot_error"] = plot_problem
        print(json.dumps(_json_ready(payload), indent=2))
        return 0
    print_table()
    print()
    print(advice)
    print()
    print("wrote " + ", ".join(str(p) for p in [csv_path, advice_path, *plots]))
    if plot_problem:
        print(f"no plots: {plot_problem}", file=sys.stderr)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """``distkit bench`` without ``--profile``."""
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file at --out, a read-only place: name the option, not just the errno
        what = "is a file" if out.is_file() else f"cannot be made ({err.strerror})"
        raise DistkitError(f"--out {args.out} {what}: pass a directory, new or existing.") from err
    world_sizes = args.world_sizes or default_world_sizes()
    if args.profile:
        return run_profile(args, out)
    flag = getattr(args, "world_sizes_flag", None)
    if flag in ("--gpus", "--devices") and not torch.cuda.is_available():
        print(
            f"note: no CUDA GPU is visible, so {flag} counts CPU processes (ddp over gloo).", file=sys.stderr
        )
    if "single" not in args.strategies:
        print(
            "note: added the single baseline (one process): speedup and efficiency are measured against it.",
            file=sys.stderr,
        )
    progress = Progress(progress_mode(args.no_progress), "distkit bench")
    try:
        result = runner.run_benchmark(
            args.model,
            strategies=args.strategies,
            world_sizes=world_sizes,
            batch_sizes=args.batch_sizes,
            steps=args.steps,
            warmup_steps=args.warmup_steps,
            min_time_s=args.min_time_s,
            repeats=args.repeats,
            threads_per_rank=args.threads_per_rank,
            timeout_s=args.timeout_s,
            on_progress=progress,
        )
    finally:
        progress.close()
    rows = list(result.rows)
    csv_path = report.write_csv([r.as_dict() for r in rows], out / "results.csv", runner.BenchRow.columns())
    plots, plot_problem = _plots_or_reason(lambda: report.plot_rows(rows, out, trust=report.trust(result)))
    advice = report.recommend(result)

    def table() -> None:
        first = rows[0]
        print(
            f"distkit bench: {first.model} ({first.params:,} params) on {result.device}, "
            f"{result.threads_per_rank} torch thread(s) per process, {result.cores} usable core(s), "
            f"{result.repeats} interleaved repetitions; [low-high] is the range of the repetitions."
        )
        measured = [r for r in rows if r.status == "ok"]
        if measured:
            _print_table(
                [
                    "strategy",
                    "n",
                    "batch",
                    "samples/s",
                    "speedup",
                    "efficiency",
                    "compute ms",
                    "comm ms",
                    "memory MiB",
                    "note",
                ],
                [
                    [
                        r.strategy,
                        str(r.world_size),
                        str(r.batch_size),
                        _interval(
                            r.samples_per_s, r.samples_per_s_low, r.samples_per_s_high, lambda v: f"{v:,.0f}"
                        ),
                        _interval(r.speedup, r.speedup_low, r.speedup_high, lambda v: f"{v:.2f}"),
                        _interval(r.efficiency, r.efficiency_low, r.efficiency_high, lambda v: f"{v:.0%}"),
                        _num(r.compute_ms, 2),
                        _num(r.comm_ms, 2),
                        _num(r.memory_mib, 0),
                        r.note,
                    ]
                    for r in measured
                ],
                left=1,
            )
        skipped: dict[tuple[str, str], int] = {}
        for r in rows:
            if r.status == "skipped":
                skipped[(r.strategy, r.note)] = skipped.get((r.strategy, r.note), 0) + 1
        for (strategy, note), count in skipped.items():
            print(f"skipped: {strategy} ({count} configuration{'s' if count != 1 else ''}): {note}")

    return _finish(args, out, csv_path, plots, plot_problem, advice, result.as_dict(), table)


def run_profile(args: argparse.Namespace, out: Path) -> int:
    """``distkit bench --profile``: the advisor for each batch size."""
    workload = load_workload(args.model)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    threads = args.threads_per_rank or (1 if cuda else runner.default_threads_per_rank(args.comm_world_size))
    predict = sorted(set(args.predict))
    progress = Progress(progress_mode(args.no_progress), "distkit bench --profile")
    profiles: list[ScalingProfile] = []
    comm: CommProfile | None = None
    comm_options: tuple[CommOption, ...] = ()
    try:
        for index, batch_size in enumerate(args.batch_sizes, 1):
            model = copy.deepcopy(workload.model).to(device)
            profile = profile_scaling(
                model,
                workload.make_batch(batch_size),
                world_sizes=predict,
                compute_loss=workload.compute_loss,
                optimizer=workload.optimizer(model),
                steps=args.steps,
                warmup_steps=args.warmup_steps,
                min_time_s=args.min_time_s,
                comm_world_size=args.comm_world_size,
                num_threads=threads,
                bandwidth_gbps=args.bandwidth_gbps,
                latency_us=args.latency_us,
                comm=comm,
                comm_options=comm_options,
                options=not args.no_prescription,
                timeout_s=args.timeout_s,
            )
            if cuda:
                # Communication does not depend on the batch size: measure it once. CPU ranks are
                # spawned for every batch size, as they also time the compute they share the cores for.
                comm, comm_options = profile.comm, profile.comm_options
            profiles.append(profile)
            progress(index, len(args.batch_sizes), f"batch {batch_size}: ratio {profile.ratio:.1f}")
    finally:
        progress.close()

    records = [
        {
            "model": args.model,
            "params": p.num_parameters,
            "batch_size": p.batch_size,
            "world_size": pred.world_size,
            "compute_ms": p.compute_s * 1e3,
            "compute_ms_low": p.compute_low * 1e3,
            "compute_ms_high": p.compute_high * 1e3,
            "rank_compute_ms": p.rank_compute_s * 1e3,
            "rank_compute_ms_low": p.rank_compute_low * 1e3,
            "rank_compute_ms_high": p.rank_compute_high * 1e3,
            "comm_ms_measured": p.comm.step_s * 1e3,
            "comm_ms_low": p.comm.step_low * 1e3,
            "comm_ms_high": p.comm.step_high * 1e3,
            "comm_world_size": p.comm.world_size,
            "backend": p.comm.backend,
            "ratio": p.ratio,
            "predicted_step_ms": pred.step_s * 1e3,
            "predicted_comm_ms": pred.comm_s * 1e3,
            "predicted_speedup": pred.speedup,
            "predicted_speedup_low": pred.speedup_low,
            "predicted_speedup_high": pred.speedup_high,
            "predicted_efficiency": pred.efficiency,
            "predicted_samples_per_s": pred.samples_per_s,
            "overlap": p.overlap,
            "threads_per_rank": p.num_threads,
        }
        for p in profiles
        for pred in p.predictions
    ]
    csv_path = report.write_csv(records, out / "profile.csv", list(records[0]))
    title = f"Predicted speedup: {args.model} ({profiles[0].num_parameters:,} params)"
    plots, plot_problem = _plots_or_reason(
        lambda: [report.plot_profiles(profiles, out / "predicted_scaling.png", title=title)]
    )
    advice = report.recommend_profiles(profiles)

    def table() -> None:
        print(
            f"distkit bench --profile: {args.model} ({profiles[0].num_parameters:,} params), "
            f"{threads} torch thread(s) per process; [low-high] is the range over the measurement's blocks."
        )
        _print_table(
            [
                "batch",
                "alone ms",
                "per rank ms",
                f"comm ms @{profiles[0].comm.world_size}",
                "ratio",
                *(f"x{n} speedup" for n in predict if n > 1),  # x1 is 1.00 by definition
            ],
            [
                [
                    str(p.batch_size),
                    _interval(
                        p.compute_s * 1e3, p.compute_low * 1e3, p.compute_high * 1e3, lambda v: f"{v:.2f}"
                    ),
                    _interval(
                        p.rank_compute_s * 1e3,
                        p.rank_compute_low * 1e3,
                        p.rank_compute_high * 1e3,
                        lambda v: f"{v:.2f}",
                    ),
                    _interval(
                        p.comm.step_s * 1e3,
                        p.comm.step_low * 1e3,
                        p.comm.step_high * 1e3,
                        lambda v: f"{v:.2f}",
                    ),
                    _num(p.ratio, 2),
                    *(_prediction_cell(pred) for pred in p.predictions if pred.world_size > 1),
                ]
                for p in profiles
            ],
        )

    payload = {"profiles": [p.as_dict() for p in profiles]}
    return _finish(args, out, csv_path, plots, plot_problem, advice, payload, table)

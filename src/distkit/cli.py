"""The ``distkit`` command: ``distkit env`` checks the configuration, ``distkit bench`` measures scaling.

``distkit env [--json]`` reports versions, GPUs, the launcher detected, what :func:`distkit.init`
would pick and the relevant environment variables, with the problems it sees; it exits with 1
when one of them would make ``init()`` fail. ``distkit bench`` runs a model over strategies,
process counts and batch sizes and writes a CSV, PNG plots and a recommendation;
``distkit bench --profile`` runs the scaling advisor instead (:func:`distkit.profile_scaling`).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["collect_env", "main"]

# The variables distkit and torch read to place a process in a job, plus the knobs that change how
# collectives behave. Prefixed families are listed only when set.
_ENV_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "TORCH_DISTRIBUTED_DEBUG",
    "OMP_NUM_THREADS",
)
_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "TORCHELASTIC_", "OMPI_COMM_WORLD_")
_ENV_EXTRA = (
    "TORCH_CPP_LOG_LEVEL",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
)


def _version_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, tuple):
        return ".".join(str(part) for part in value)
    if isinstance(value, int) and value >= 10000:  # NCCL encodes 2.21.5 as 22105
        major, rest = divmod(value, 10000)
        return f"{major}.{rest // 100}.{rest % 100}"
    return str(value)


def _nccl_version() -> str | None:
    import torch

    try:
        return _version_text(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError, TypeError):
        return None  # a build without NCCL (CPU-only torch)


def _environment() -> dict[str, str | None]:
    chosen = {name: os.environ.get(name) for name in _ENV_VARS}
    for name, value in sorted(os.environ.items()):
        if name.startswith(_ENV_PREFIXES) or name in _ENV_EXTRA:
            chosen[name] = value
    return chosen


def collect_env() -> dict[str, Any]:
    """The configuration check behind ``distkit env``, as a JSON-ready dictionary.

    Local: no communication, no process group created, no GPU memory allocated.

    Returns:
        Keys ``distkit``, ``python``, ``platform``, ``torch``, ``cuda``, ``cudnn``, ``nccl``,
        ``backends``, ``cuda_available``, ``cuda_device_count``, ``gpus``, ``nvml``, ``cpu_count``,
        ``torch_threads``, ``launcher``, ``init_would_pick``, ``environment`` and ``problems`` (a
        list of ``{"level": "error" | "warning", "message": ...}``).

    Example:
        >>> from distkit.cli import collect_env
        >>> collect_env()["launcher"]["name"]
        'none'
    """
    import torch
    import torch.distributed as dist

    import distkit
    from distkit import monitor, runtime
    from distkit.errors import DistkitError

    problems: list[dict[str, str]] = []
    cuda_available = torch.cuda.is_available()
    gpus, driver, nvml_reason = monitor._gpu_inventory()
    report: dict[str, Any] = {
        "distkit": distkit.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": _version_text(torch.backends.cudnn.version()) if cuda_available else None,
        "nccl": _nccl_version(),
        "backends": {name: dist.is_backend_available(name) for name in ("gloo", "nccl", "mpi")},
        "cuda_available": cuda_available,
        "cuda_device_count": torch.cuda.device_count() if cuda_available else 0,
        "gpus": gpus,
        "nvml": {"available": nvml_reason is None, "driver": driver, "reason": nvml_reason},
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }

    env = None
    try:
        env = runtime.get_env()
    except ValueError as err:
        report["launcher"] = {"name": None, "error": str(err)}
        problems.append({"level": "error", "message": f"launcher variables: {err}"})
    if env is not None:
        report["launcher"] = {
            "name": env.launcher,
            "rank": env.rank,
            "world_size": env.world_size,
            "local_rank": env.local_rank,
            "local_world_size": env.local_world_size,
            "node_rank": env.node_rank,
            "master_addr": env.master_addr,
            "master_port": env.master_port,
        }
        try:
            device = runtime.get_device()
            backend = runtime._resolve_backend(None, device) if env.is_distributed else None
            report["init_would_pick"] = {"backend": backend, "device": str(device)}
        except DistkitError as err:
            report["init_would_pick"] = {"backend": None, "device": None, "error": str(err)}
            problems.append({"level": "error", "message": str(err)})
    else:
        report["init_would_pick"] = {
            "backend": None,
            "device": None,
            "error": "the launcher variables are invalid",
        }
    report["environment"] = environ = _environment()

    def warn(message: str) -> None:
        problems.append({"level": "warning", "message": message})

    if cuda_available and nvml_reason is not None:
        warn(f"CUDA works but NVML does not ({nvml_reason}); GPUMonitor will record nothing.")
    if not cuda_available and gpus:
        build = " (a CPU-only build)" if torch.version.cuda is None else ""
        warn(
            f"{len(gpus)} NVIDIA GPU(s) are present but torch {torch.__version__} cannot use CUDA{build}; "
            f"install a CUDA build of torch."
        )
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if torch.version.cuda is not None and not cuda_available and visible is not None:
        warn(f"CUDA_VISIBLE_DEVICES={visible!r} leaves torch no usable GPU.")
    if (
        env is not None
        and env.local_world_size > 1
        and not cuda_available
        and not environ.get("OMP_NUM_THREADS")
    ):
        warn(
            f"{env.local_world_size} processes share this node's {os.cpu_count()} cores and OMP_NUM_THREADS "
            f"is unset, so each may start a thread per core; set OMP_NUM_THREADS to cores / processes "
            f"(torchrun sets 1)."
        )
    if (environ.get("TORCH_DISTRIBUTED_DEBUG") or "").upper() == "DETAIL":
        warn(
            "TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective and slows training; "
            "unset it for speed runs."
        )
    for name in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"):
        if environ.get(name) == "1":
            warn(f"{name}=1 turns off a fast NCCL transport; all-reduces will be slower.")
    report["problems"] = problems
    return report


def _print_env(report: dict[str, Any]) -> None:
    def line(key: str, value: str) -> None:
        print(f"  {key:<14}{value}".rstrip())

    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    print(f"distkit {report['distkit']} configuration check")
    line("python", f"{report['python']} ({report['platform']})")
    line(
        "torch",
        f"{report['torch']} (CUDA {report['cuda'] or 'none'}, cuDNN {report['cudnn'] or 'none'}, "
        f"NCCL {report['nccl'] or 'none'})",
    )
    line("backends", ", ".join(f"{name} {yes(ok)}" for name, ok in report["backends"].items()))
    nvml = report["nvml"]
    if report["gpus"]:
        line("GPUs", f"{len(report['gpus'])} visible (driver {nvml['driver']})")
        for gpu in report["gpus"]:
            line("", f"{gpu['device']}: {gpu['name']}, {gpu['memory_total_mib']:.0f} MiB, {gpu['uuid']}")
    else:
        detail = nvml["reason"] or "NVML lists no GPU visible to this process"
        line("GPUs", f"none visible; torch sees {report['cuda_device_count']} ({detail})")
    line("CPU", f"{report['cpu_count']} cores, torch uses {report['torch_threads']} threads")
    launcher = report["launcher"]
    if launcher.get("error"):
        line("launcher", f"invalid: {launcher['error']}")
    else:
        where = (
            f"rank {launcher['rank']} of {launcher['world_size']} (local {launcher['local_rank']} of "
            f"{launcher['local_world_size']}, node {launcher['node_rank']})"
        )
        if launcher["master_addr"]:
            where += f", master {launcher['master_addr']}:{launcher['master_port']}"
        line("launcher", f"{launcher['name']}: {where}")
    pick = report["init_would_pick"]
    if pick.get("error"):
        line("init() picks", f"nothing: {pick['error']}")
    elif pick["backend"] is None:
        line("init() picks", f"no process group (a world of one), device {pick['device']}")
    else:
        line("init() picks", f"backend {pick['backend']}, device {pick['device']}")
    set_vars = {k: v for k, v in report["environment"].items() if v is not None}
    if set_vars:
        line("environment", "")
        for name, value in set_vars.items():
            line("", f"{name}={value}")
    else:
        line("environment", "none of the distributed variables is set")
    print("problems:" if report["problems"] else "problems: none")
    for problem in report["problems"]:
        print(f"  {problem['level']}: {problem['message']}")


def _cmd_env(args: argparse.Namespace) -> int:
    report = collect_env()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_env(report)
    return 1 if any(p["level"] == "error" for p in report["problems"]) else 0


class _Progress:
    """A tqdm bar on stderr, or one line per step when tqdm is not installed."""

    def __init__(self, total: int, *, enabled: bool, desc: str) -> None:
        self.total = total
        self.done = 0
        self.enabled = enabled
        self.bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def step(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _default_world_sizes() -> list[int]:
    import torch

    limit = torch.cuda.device_count() if torch.cuda.is_available() else min(os.cpu_count() or 1, 4)
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


def _print_advice(advice: str, written: list[Path], plot_problem: str | None) -> None:
    print()
    print(advice)
    print()
    print("wrote " + ", ".join(str(p) for p in written))
    if plot_problem:
        print(f"no plots: {plot_problem}", file=sys.stderr)


def _write_advice(
    args: argparse.Namespace,
    out: Path,
    csv_path: Path,
    plots: list[Path],
    plot_problem: str | None,
    advice: str,
    **results: list[dict[str, Any]],
) -> Path | None:
    """Write recommendation.txt and return its path; with --json print everything and return None."""
    advice_path = out / "recommendation.txt"
    advice_path.write_text(advice + "\n")
    if not args.json:
        return advice_path
    files = {"csv": str(csv_path), "plots": [str(p) for p in plots], "recommendation": str(advice_path)}
    payload: dict[str, Any] = {**results, "recommendation": advice, "files": files}
    if plot_problem:
        payload["plot_error"] = plot_problem
    print(json.dumps(_json_ready(payload), indent=2))
    return None


def _plots_or_reason(plot: Callable[[], list[Path]]) -> tuple[list[Path], str | None]:
    try:
        return plot(), None
    except ImportError as err:
        return [], str(err)


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def _num(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def _cmd_bench(args: argparse.Namespace) -> int:
    from distkit.bench import report, runner

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world_sizes = args.world_sizes or _default_world_sizes()
    if args.profile:
        return _cmd_profile(args, out)
    total = sum(
        len(args.batch_sizes) * (1 if s == "single" else len(world_sizes)) for s in set(args.strategies)
    )
    progress = _Progress(total, enabled=not args.no_progress, desc="distkit bench")

    def on_progress(item: Any) -> None:
        if isinstance(item, runner.BenchRow):
            progress.step(f"{item.strategy} x{item.world_size} batch {item.batch_size}: skipped")
        else:
            strategy, n, b = item
            progress.step(f"{strategy} x{n} batch {b}")

    try:
        rows = runner.run_benchmark(
            args.model,
            strategies=args.strategies,
            world_sizes=world_sizes,
            batch_sizes=args.batch_sizes,
            steps=args.steps,
            warmup_steps=args.warmup_steps,
            min_time_s=args.min_time_s,
            threads_per_rank=args.threads_per_rank,
            timeout_s=args.timeout_s,
            on_progress=on_progress,
        )
    finally:
        progress.close()
    csv_path = report.write_csv([r.as_dict() for r in rows], out / "results.csv", runner.BenchRow.columns())
    plots, plot_problem = _plots_or_reason(lambda: report.plot_rows(rows, out))
    advice = report.recommend(rows)
    advice_path = _write_advice(
        args, out, csv_path, plots, plot_problem, advice, rows=[r.as_dict() for r in rows]
    )
    if advice_path is None:
        return 0
    _print_table(
        ["strategy", "n", "batch", "samples/s", "p50 ms", "speedup", "efficiency", "memory MiB", "status"],
        [
            [
                r.strategy,
                str(r.world_size),
                str(r.batch_size),
                _num(r.samples_per_s, 0),
                _num(r.step_time_p50_ms, 2),
                _num(r.speedup, 2),
                "-" if math.isnan(r.efficiency) else f"{r.efficiency:.0%}",
                _num(r.memory_mib, 0),
                r.status if r.status == "ok" else f"skipped: {r.note}",
            ]
            for r in rows
        ],
    )
    _print_advice(advice, [csv_path, advice_path, *plots], plot_problem)
    return 0


def _cmd_profile(args: argparse.Namespace, out: Path) -> int:
    import torch

    from distkit.bench import profile_scaling, report, runner
    from distkit.bench.workloads import load_workload

    workload = load_workload(args.model)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    threads = args.threads_per_rank or (1 if cuda else runner.default_threads_per_rank(args.comm_world_size))
    predict = sorted(set(args.predict))
    progress = _Progress(len(args.batch_sizes), enabled=not args.no_progress, desc="distkit bench --profile")
    profiles = []
    comm = None
    try:
        for batch_size in args.batch_sizes:
            model = copy.deepcopy(workload.model).to(device)
            profile = profile_scaling(
                model,
                workload.make_batch(batch_size),
                world_sizes=predict,
                compute_loss=workload.compute_loss,
                optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                steps=args.steps,
                warmup_steps=args.warmup_steps,
                min_time_s=args.min_time_s,
                comm_world_size=args.comm_world_size,
                num_threads=threads,
                bandwidth_gbps=args.bandwidth_gbps,
                latency_us=args.latency_us,
                comm=comm,
                timeout_s=args.timeout_s,
            )
            if cuda:
                # Communication does not depend on the batch size: measure it once. CPU ranks are
                # spawned for every batch size, as they also time the compute they share the cores for.
                comm = profile.comm
            profiles.append(profile)
            progress.step(f"batch {batch_size}: ratio {profile.ratio:.1f}")
    finally:
        progress.close()

    columns = [
        "model",
        "params",
        "batch_size",
        "world_size",
        "compute_ms",
        "rank_compute_ms",
        "comm_ms_measured",
        "comm_world_size",
        "backend",
        "ratio",
        "predicted_step_ms",
        "predicted_comm_ms",
        "predicted_speedup",
        "predicted_efficiency",
        "predicted_samples_per_s",
        "overlap",
        "threads_per_rank",
    ]
    records = [
        {
            "model": args.model,
            "params": p.num_parameters,
            "batch_size": p.batch_size,
            "world_size": pred.world_size,
            "compute_ms": p.compute_s * 1e3,
            "rank_compute_ms": p.rank_compute_s * 1e3,
            "comm_ms_measured": p.comm.step_s * 1e3,
            "comm_world_size": p.comm.world_size,
            "backend": p.comm.backend,
            "ratio": p.ratio,
            "predicted_step_ms": pred.step_s * 1e3,
            "predicted_comm_ms": pred.comm_s * 1e3,
            "predicted_speedup": pred.speedup,
            "predicted_efficiency": pred.efficiency,
            "predicted_samples_per_s": pred.samples_per_s,
            "overlap": p.overlap,
            "threads_per_rank": p.num_threads,
        }
        for p in profiles
        for pred in p.predictions
    ]
    csv_path = report.write_csv(records, out / "profile.csv", columns)
    title = f"Predicted speedup: {args.model} ({profiles[0].num_parameters:,} params)"
    plots, plot_problem = _plots_or_reason(
        lambda: [report.plot_profiles(profiles, out / "predicted_scaling.png", title=title)]
    )
    advice = "\n\n".join(p.recommendation() for p in profiles)
    advice_path = _write_advice(
        args, out, csv_path, plots, plot_problem, advice, profiles=[p.as_dict() for p in profiles]
    )
    if advice_path is None:
        return 0
    _print_table(
        [
            "batch",
            "alone ms",
            "per rank ms",
            f"comm ms @{profiles[0].comm.world_size}",
            "ratio",
            *(f"x{n} speedup" for n in predict),
        ],
        [
            [
                str(p.batch_size),
                _num(p.compute_s * 1e3, 2),
                _num(p.rank_compute_s * 1e3, 2),
                _num(p.comm.step_s * 1e3, 2),
                _num(p.ratio, 2),
                *(f"{pred.speedup:.2f} ({pred.efficiency:.0%})" for pred in p.predictions),
            ]
            for p in profiles
        ],
    )
    _print_advice(advice, [csv_path, advice_path, *plots], plot_problem)
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    from distkit.bench import runner
    from distkit.bench.workloads import PRESETS

    parser = argparse.ArgumentParser(
        prog="distkit", description="distkit: distributed PyTorch, checked and measured."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{env,bench}")

    env = commands.add_parser(
        "env", help="check the configuration: versions, GPUs, launcher, backend, variables"
    )
    env.add_argument("--json", action="store_true", help="print one JSON object for machines")
    env.set_defaults(func=_cmd_env)

    bench = commands.add_parser(
        "bench",
        help="measure throughput and scaling of a model; --profile predicts it instead",
        description="Run a model over strategies, process/device counts and batch sizes; write results.csv, "
        "throughput.png, scaling_efficiency.png, memory.png and recommendation.txt. With --profile, measure "
        "compute and gradient communication once and predict the speedup for --predict rank counts.",
    )
    bench.add_argument(
        "--model",
        default="tiny",
        help=f"a preset ({', '.join(PRESETS)}) or module:factory returning a "
        f"distkit.bench.workloads.Workload or (model, make_batch[, compute_loss]) (default: tiny)",
    )
    bench.add_argument(
        "--strategies",
        nargs="+",
        choices=runner.STRATEGIES,
        default=list(runner.STRATEGIES),
        help="strategies to run (default: all; dp is skipped without CUDA)",
    )
    bench.add_argument(
        "--world-sizes",
        nargs="+",
        type=_positive_int,
        default=None,
        help="process counts (ddp) or device counts (dp) (default: 1, 2, 4... up to the GPUs, or "
        "up to 4 CPU cores)",
    )
    bench.add_argument(
        "--batch-sizes",
        nargs="+",
        type=_positive_int,
        default=[32, 128],
        help="samples per process (per device for dp) per step (default: 32 128)",
    )
    bench.add_argument("--steps", type=_positive_int, default=20, help="measured steps per run (default: 20)")
    bench.add_argument("--warmup-steps", type=int, default=5, help="unmeasured steps first (default: 5)")
    bench.add_argument(
        "--min-time-s",
        type=float,
        default=1.0,
        help="measure each run for at least this long, adding steps for fast models "
        "(default: 1; 0: exactly --steps)",
    )
    bench.add_argument(
        "--threads-per-rank",
        type=_positive_int,
        default=None,
        help="torch threads per process (default on CPU: cores / largest process count)",
    )
    bench.add_argument("--out", default="distkit-bench", help="output directory (default: ./distkit-bench)")
    bench.add_argument("--timeout-s", type=float, default=600.0, help="deadline per group of processes")
    bench.add_argument("--json", action="store_true", help="print the results as one JSON object")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    advisor = bench.add_argument_group("scaling advisor (--profile)")
    advisor.add_argument(
        "--profile",
        action="store_true",
        help="measure compute and communication and predict speedups, instead of measuring runs",
    )
    advisor.add_argument(
        "--predict",
        nargs="+",
        type=_positive_int,
        default=[1, 2, 4, 8],
        help="rank counts to predict (default: 1 2 4 8)",
    )
    advisor.add_argument(
        "--comm-world-size",
        type=_positive_int,
        default=2,
        help="local processes to measure the all-reduce with (default: 2)",
    )
    advisor.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=None,
        help="predict from this link bandwidth (Gbit/s) instead of measuring the all-reduce",
    )
    advisor.add_argument(
        "--latency-us", type=float, default=10.0, help="per-hop latency for --bandwidth-gbps (default: 10)"
    )
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``distkit`` command and return its exit status.

    Local: no communication (``bench`` starts its own processes).

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        0 on success; 1 when ``env`` found an error or ``bench`` failed; 2 on a usage error.

    Example:
        >>> from distkit.cli import main
        >>> main(["env", "--json"])  # doctest: +SKIP
        0
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench" and args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.command == "bench" and not args.min_time_s >= 0:
        parser.error(f"--min-time-s must be >= 0, got {args.min_time_s}")
    from distkit.errors import DistkitError

    try:
        return int(args.func(args))
    except (DistkitError, ValueError, ImportError, OSError) as err:
        print(f"distkit {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

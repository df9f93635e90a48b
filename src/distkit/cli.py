"""The ``distkit`` command: ``distkit env`` checks the configuration, ``distkit bench`` measures scaling,
``distkit checkpoint`` lists, inspects, consolidates and imports checkpoints.

``distkit env [--json]`` reports versions, GPUs, the launcher detected, what :func:`distkit.init`
would pick and the relevant environment variables, with the problems it sees; it exits with 1
when one of them would make ``init()`` fail. ``distkit bench`` runs a model over strategies,
process counts and batch sizes, in interleaved repetitions, and writes a CSV, PNG plots and a
recommendation that states how sure it is; ``distkit bench --profile`` runs the scaling advisor
instead (:func:`distkit.profile_scaling`). The parser imports no torch, so ``distkit --help`` and
``distkit --version`` answer at once; the bench command itself lives in
:mod:`distkit.bench._command`, the checkpoint command in :mod:`distkit.checkpoint._command`.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import platform
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

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

    from distkit import monitor, runtime
    from distkit._version import __version__
    from distkit.errors import DistkitError

    problems: list[dict[str, str]] = []
    cuda_available = torch.cuda.is_available()
    gpus, driver, nvml_reason = monitor._gpu_inventory()
    report: dict[str, Any] = {
        "distkit": __version__,
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
    threads = environ.get("OMP_NUM_THREADS")
    if threads and not (threads.strip().isdigit() and int(threads) > 0):
        # The OpenMP runtime ignores it (with a line of its own) and starts a thread per core.
        warn(
            f"OMP_NUM_THREADS={threads!r} is not a positive integer, so it is ignored and each process "
            f"may start a thread per core; set it to a number such as cores / processes."
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


def _cmd_bench(args: argparse.Namespace) -> int:
    from distkit.bench import _command

    return _command.run_bench(args)


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    from distkit.checkpoint import _command

    return _command.run_checkpoint_command(args)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


class _Counts(argparse.Action):
    """Store the counts and which spelling was used (``--gpus`` on a CPU machine gets a note)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.world_sizes_flag = option_string


class _Parser(argparse.ArgumentParser):
    """argparse's parser, naming the closest choice to a misspelt subcommand or choice (Python
    3.11's argparse lists the choices only: ``distkit chekpoint``)."""

    def error(self, message: str) -> NoReturn:
        found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if found:
            choices = re.findall(r"'([^']*)'", found.group(2))
            # Two at most: a slip can be as near to two choices ('dpp': 'dp' and 'ddp').
            close = difflib.get_close_matches(found.group(1), choices, n=2, cutoff=0.6)
            if close:
                message += f"; did you mean {' or '.join(map(repr, close))}?"
        super().error(message)


def _parser() -> argparse.ArgumentParser:
    # Nothing here may import torch: `distkit --help` and `distkit --version` must answer at once.
    from distkit._version import __version__
    from distkit.bench._names import PRESET_NAMES, STRATEGIES

    parser = _Parser(prog="distkit", description="distkit: distributed PyTorch, checked and measured.")
    parser.add_argument("--version", action="version", version=f"distkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{env,bench,checkpoint}")

    env = commands.add_parser(
        "env", help="check the configuration: versions, GPUs, launcher, backend, variables"
    )
    env.add_argument("--json", action="store_true", help="print one JSON object for machines")
    env.set_defaults(func=_cmd_env, command_parser=env)

    bench = commands.add_parser(
        "bench",
        help="measure throughput and scaling of a model; --profile predicts it instead",
        description="Run a model over strategies, process/device counts and batch sizes, each configuration "
        "in interleaved repetitions; write results.csv (with intervals), throughput.png, "
        "scaling_efficiency.png, memory.png and recommendation.txt (with its confidence, the noise floor and "
        "the machine's load). With --profile, measure compute and gradient communication once and predict "
        "the speedup for --predict rank counts.",
    )
    bench.add_argument(
        "--model",
        default="tiny",
        help=f"a preset ({', '.join(PRESET_NAMES)}) or module:factory returning a "
        f"distkit.bench.workloads.Workload or (model, make_batch[, compute_loss]) (default: tiny)",
    )
    bench.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES,
        default=list(STRATEGIES),
        help="strategies to run (default: all; dp is skipped without CUDA; single, the baseline of "
        "every speedup, is added when missing)",
    )
    bench.add_argument(
        "--world-sizes",
        "--gpus",
        "--devices",
        dest="world_sizes",
        nargs="+",
        type=_positive_int,
        default=None,
        action=_Counts,
        help="process counts (ddp) or device counts (dp); --gpus and --devices are the same option "
        "(default: 1, 2, 4... up to the GPUs, or up to 4 usable CPU cores)",
    )
    bench.add_argument(
        "--batch-sizes",
        nargs="+",
        type=_positive_int,
        default=[32, 128],
        help="samples per process (per device for dp) per step (default: 32 128)",
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved repetitions of every configuration, at least 3 (default: 3; --profile "
        "alternates its parts in blocks instead)",
    )
    bench.add_argument("--steps", type=_positive_int, default=20, help="measured steps per run (default: 20)")
    bench.add_argument("--warmup-steps", type=int, default=5, help="unmeasured steps first (default: 5)")
    bench.add_argument(
        "--min-time-s",
        type=float,
        default=1.0,
        help="measure each part of a run for at least this long, adding steps for fast models "
        "(default: 1; 0: exactly --steps)",
    )
    bench.add_argument(
        "--threads-per-rank",
        type=_positive_int,
        default=None,
        help="torch threads per process, the same in every configuration (default on CPU: usable cores / "
        "largest process count)",
    )
    bench.add_argument("--out", default="distkit-bench", help="output directory (default: ./distkit-bench)")
    bench.add_argument(
        "--timeout-s", type=float, default=600.0, help="deadline for starting a group and for each run"
    )
    bench.add_argument("--json", action="store_true", help="print the results as one JSON object")
    bench.add_argument(
        "--no-progress",
        action="store_true",
        help="nothing on stderr while it runs (by default: a bar in a terminal, one line per finished run "
        "in a pipe or with CI=true)",
    )
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
    advisor.add_argument(
        "--no-prescription",
        action="store_true",
        help="measure no DDP option and no doubled batch, and prescribe nothing (faster; each option "
        "holds a stand-in of the model's size on each rank)",
    )
    bench.set_defaults(func=_cmd_bench, command_parser=bench)

    checkpoint = commands.add_parser(
        "checkpoint",
        help="list, inspect, consolidate or import checkpoints",
        description="List the step checkpoints of a CheckpointManager directory, inspect one checkpoint's "
        "manifest, consolidate a sharded checkpoint into one full state.pt for inference, or import a "
        "Lightning or Accelerate checkpoint.",
    )
    actions = checkpoint.add_subparsers(
        dest="action", required=True, metavar="{list,inspect,consolidate,import}"
    )
    listing = actions.add_parser("list", help="the step checkpoints of a directory and their state")
    listing.add_argument("directory", help="a CheckpointManager directory (local path or fsspec URL)")
    inspect = actions.add_parser("inspect", help="one checkpoint's manifest: step, format, entries, files")
    inspect.add_argument("path", help="a checkpoint directory (local path or fsspec URL)")
    for sub in (listing, inspect):
        sub.add_argument(
            "--verify", action="store_true", help="also check every file's CRC32 (reads them all)"
        )
        sub.add_argument("--json", action="store_true", help="print JSON for machines")
    consolidate = actions.add_parser(
        "consolidate",
        help="write a (sharded) checkpoint as one full checkpoint",
        description="Verify SRC and write it to DST as one full checkpoint, whatever world size saved it: "
        "DST/state.pt loads with torch.load(path, weights_only=True), without distkit.",
    )
    consolidate.add_argument("src", help="the checkpoint to read (sharded or full)")
    consolidate.add_argument("dst", help="the full checkpoint directory to write")
    importing = actions.add_parser(
        "import",
        help="convert a Lightning .ckpt or an Accelerate save_state directory into a distkit checkpoint",
        description="Read SRC (a Lightning .ckpt file or an Accelerate save_state directory) with "
        "torch.load(weights_only=True) and write its model and optimizer state to DST as a committed "
        "distkit checkpoint, which Trainer(resume=DST) and distkit.load_checkpoint read; print what was "
        "carried over and what was not. A torch.distributed.checkpoint directory (torchtitan) needs no "
        "import: distkit loads it as it is.",
    )
    importing.add_argument("src", help="a Lightning .ckpt file or an Accelerate save_state directory")
    importing.add_argument("dst", help="the distkit checkpoint directory to write (new or empty)")
    importing.add_argument(
        "--strip-prefix",
        default=None,
        metavar="PREFIX",
        help="strip PREFIX from the model's keys, leaving out the keys without it; '' keeps every key "
        "(default: Lightning's prefix common to every key, the LightningModule's attribute such as "
        "'model.', is stripped; Accelerate's keys are kept)",
    )
    importing.add_argument(
        "--step", type=int, default=None, help="the step to record (default: the one found, if any)"
    )
    checkpoint.set_defaults(func=_cmd_checkpoint)
    for sub in (listing, inspect, consolidate, importing):
        sub.set_defaults(command_parser=sub)
    return parser


def _refuse_unknown(parser: argparse.ArgumentParser, extra: list[str]) -> NoReturn:
    """A flag the (sub)command does not take, told by that command (its usage, not distkit's) with
    the closest of its own flags."""
    flags = [option for action in parser._actions for option in action.option_strings]
    unknown = next((arg.split("=", 1)[0] for arg in extra if arg.startswith("-")), None)
    close = difflib.get_close_matches(unknown, flags, n=1) if unknown else []
    hint = f"; did you mean {close[0]}?" if close else ""
    parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``distkit`` command and return its exit status.

    Local: no communication (``bench`` starts its own processes).

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        0 on success; 1 when ``env`` found an error, ``bench`` failed, or ``checkpoint`` found the
        checkpoint missing, corrupt, not consolidable or not importable; 2 on a usage error.

    Example:
        >>> from distkit.cli import main
        >>> main(["env", "--json"])  # doctest: +SKIP
        0
    """
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    command = getattr(args, "command_parser", parser)
    if extra:
        _refuse_unknown(command, extra)
    if args.command == "bench" and args.warmup_steps < 0:
        command.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.command == "bench" and not args.min_time_s >= 0:
        command.error(f"--min-time-s must be >= 0, got {args.min_time_s}")
    if args.command == "bench" and not args.timeout_s > 0:
        command.error(f"--timeout-s must be > 0 (seconds), got {args.timeout_s:g}")
    if args.command == "bench" and args.repeats < 3:
        command.error(
            f"--repeats must be >= 3 (an interval needs at least 3 repetitions), got {args.repeats}"
        )
    from distkit.errors import DistkitError

    try:
        return int(args.func(args))
    # A bad --model raises AttributeError or TypeError with a message written for the user.
    except (DistkitError, ValueError, ImportError, OSError, AttributeError, TypeError) as err:
        print(f"distkit {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

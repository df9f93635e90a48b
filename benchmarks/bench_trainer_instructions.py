"""The Trainer's own work per step, counted: CPU instructions of the training thread under
valgrind's callgrind, the Trainer with every default on against the hand-written loop.

Run by hand (not in CI; needs valgrind):  .venv/bin/python benchmarks/bench_trainer_instructions.py
[--setups ddp single fsdp] [--each] [--repeat N] (about 5 minutes on the 2-core machine for ddp and
single, 5 more for fsdp; 4 times as long with --each; N times as long with --repeat N).

Why. Timing 2 % on 2 ranks that share 2 cores is hopeless (bench_trainer_guard.py's A/A spreads
reach several percent), but the instructions a thread executes barely depend on the other rank's
timing: three idle runs gave the DDP ratio as 1.0297, 1.0291 and 1.0243. Run it idle all the same:
work done by the clock (the progress line, the checkpoint's time check) comes more often per step
under valgrind, and a short run beside two busy processes was 1.4 % off. They are not time: cache
misses and branch mispredictions are not counted, so a ratio here is a floor for the time ratio,
not the time ratio itself. What the count shows is every Python call, attribute lookup and
tensor made per step that the hand loop does not make, to about half a percent: the same code
counted twice can differ by 10 to 25 K instructions a step, so a change smaller than that needs
--repeat, which prints each loop's range and the hand loop's A/A.

How. Each loop runs twice in fresh processes, once for ``--short`` steps and once for ``--long``
steps (after the same 20 warm-up steps, in the same process); rank 0 runs under ``valgrind
--tool=callgrind --separate-threads=yes`` and its main thread's count is read. The difference of the
two runs divided by the difference of the steps is the loop's cost per step: set-up, warm-up, the
end of fit and the process's exit cancel. Logging steps (every 50, each with its all-reduces, the
CSV row and the progress line) fall inside the difference, so they count at their share. The other
threads (gloo's, OpenBLAS's) are left out: they spin and wait for the other rank, and their counts
vary from run to run.

The workloads are bench_trainer_guard.py's tiny MLP (batch 32): DDP on 2 gloo ranks against seed
002's DDP loop, one process against the same loop without DDP, and (``--setups fsdp``, not run by
default) FSDP2 on 2 gloo ranks against the same loop over the model with ``fully_shard`` on each
Linear and then on the root, as ``FSDPStrategy(unit_classes=nn.Linear)`` shards it (a fresh model
each run, as FSDP shards in place). The guard's FSDP line uses the medium MLP, whose step callgrind
takes over ten seconds to run: the tiny one shows the same extra work of the Trainer against a much
smaller step. Its counts vary more from run to run than DDP's (FSDP2's hooks make many Python objects
a step, so a full garbage collection falls at a different step in each run): use ``--repeat 3``.
The Trainer has its real defaults (CSV logger, ModelCheckpoint, progress lines, hang doctor,
straggler timing), with the hang doctor's timeout set long (callgrind slows rank 0 about fifty-fold,
which the adaptive timeout would otherwise take for a hang).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP = 20
_MIN_STEPS = 500  # the least difference of steps between the two runs (see main)
_DEADLINE_S = 1800  # for each process of a run; a run takes about two minutes here
SETUPS = {
    "ddp": "DDP, 2 gloo ranks, tiny MLP",
    "single": "one process, tiny MLP",
    "fsdp": "FSDP2, 2 gloo ranks, tiny MLP (each Linear a unit)",
}
DEFAULT_SETUPS = ["ddp", "single"]
# Short names of bench_trainer_defaults.VARIANTS (the Trainer with its defaults switched on).
VARIANT_KEYS = {
    "all": "Trainer, defaults (all on)",
    "bare": "Trainer, every default off",
    "logger": "+ CSV logger",
    "checkpoint": "+ ModelCheckpoint",
    "progress": "+ progress lines",
    "doctor": "+ hang doctor",
    "straggler": "+ straggler timing",
}


def _worker(setup: str, loop: str, steps: int, rank: int, port: int, ready: str) -> None:
    """One process of one run: warm-up steps, then ``steps`` steps of ``loop``. Rank 0 creates
    ``ready`` once imported, just before it starts the store that rank 1 connects to."""
    import torch

    sys.path.insert(0, str(HERE))
    from bench_trainer import MODELS, _loader, _seeded
    from bench_trainer_defaults import VARIANTS, _fsdp_model, _hand_block, _trainer_block

    torch.set_num_threads(1)
    strategy = setup
    import distkit

    if setup != "single":
        if rank == 0:
            Path(ready).touch()
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        distkit.init(backend="gloo", hang_timeout_s=3600.0)
    factory, features, batch_size, _ = next(iter(MODELS.values()))
    model = _seeded(factory)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as root:
        for n in (WARMUP, steps):
            # After the warm-up, every object made so far (torch's modules, the first Trainer's)
            # leaves the collector's view: a full collection falling in one run and not the other
            # would otherwise cost millions of instructions at random. Collections still run as often.
            gc.freeze()
            loader = _loader(features, batch_size, n, rank)
            if setup == "single":  # the first n batches of the whole dataset, as the guard's
                loader = torch.utils.data.DataLoader(
                    loader.dataset, batch_size=batch_size, sampler=list(range(batch_size * n))
                )
            if setup == "fsdp":  # FSDP shards a model in place: a fresh one each run
                model = _fsdp_model(factory) if loop == "hand" else _seeded(factory)
                optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            if loop == "hand":
                _hand_block(model, optimizer, loader, strategy)
            else:
                _trainer_block(model, optimizer, loader, VARIANTS[VARIANT_KEYS[loop]], strategy, root)
    if setup != "single":
        distkit.barrier()
        distkit.shutdown()


def _run_rank1(
    name: str, rank0: subprocess.Popen[bytes], command: list[str], env: dict[str, str], ready: Path, log: Path
) -> None:
    """Run rank 1 at full speed beside rank 0 (slowed about fifty-fold under valgrind): started once
    rank 0 has imported torch and is about to open the store, and stopped as soon as either fails."""
    deadline = time.monotonic() + _DEADLINE_S
    while not ready.exists():
        if rank0.poll() is not None:
            raise SystemExit(f"{name}: rank 0 failed to start under valgrind:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: rank 0 did not start within {_DEADLINE_S} s")
        time.sleep(0.5)
    rank1 = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    try:
        # Either rank's failure ends the run: a dead rank 0 must not leave rank 1 waiting in a
        # collective until its timeout.
        while rank1.poll() is None and rank0.poll() in (None, 0):
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: rank 1 did not finish within {_DEADLINE_S} s")
            time.sleep(0.5)
        # Rank 0 first: when it dies, rank 1 fails too, and the cause is rank 0's.
        if rank0.poll() not in (None, 0):
            tail = log.read_text()[-3000:]
            raise SystemExit(f"{name}: rank 0 failed under valgrind (exit {rank0.returncode}):\n{tail}")
        if rank1.returncode != 0:
            raise SystemExit(f"{name}: rank 1 failed (exit {rank1.returncode}); its error is printed above")
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait()


def _count(setup: str, loop: str, steps: int, out: Path, repeat: int = 0) -> int:
    """Instructions of rank 0's main thread over a whole run of ``steps`` steps (``repeat``: which
    repetition, for the files' names)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    prefix = out / f"{setup}.{loop}.{steps}.{repeat}"
    ready = Path(f"{prefix}.ready")
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", setup, loop, str(steps)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    valgrind = [
        "valgrind",
        "--tool=callgrind",
        "--separate-threads=yes",
        f"--callgrind-out-file={prefix}.%p",
    ]
    log = Path(f"{prefix}.log")
    with log.open("w") as stderr:
        command = [*valgrind, *me, "0", str(port), str(ready)]
        rank0 = subprocess.Popen(command, env=env, stdout=stderr, stderr=stderr)
    try:
        if setup != "single":
            _run_rank1(prefix.name, rank0, [*me, "1", str(port), str(ready)], env, ready, log)
        if rank0.wait(timeout=_DEADLINE_S) != 0:
            raise SystemExit(
                f"{prefix.name} failed under valgrind (exit {rank0.returncode}):\n{log.read_text()[-3000:]}"
            )
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{prefix.name}: rank 0 did not finish within {_DEADLINE_S} s") from None
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait()
    # --separate-threads: one file per thread, ``<prefix>.<pid>-<thread>``; thread 01 is the main one.
    files = sorted(out.glob(f"{prefix.name}.*-01"))
    if len(files) != 1:
        raise SystemExit(f"expected one main-thread profile for {prefix.name}, found {files}")
    match = re.search(r"^(?:summary|totals): (\d+)", files[0].read_text(errors="replace"), re.MULTILINE)
    if match is None:
        raise SystemExit(f"no instruction total in {files[0]}")
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--setups",
        nargs="+",
        choices=list(SETUPS),
        default=DEFAULT_SETUPS,
        help=f"which workloads (default: {' '.join(DEFAULT_SETUPS)})",
    )
    parser.add_argument("--short", type=int, default=100, help="steps of the short run (default 100)")
    parser.add_argument("--long", type=int, default=700, help="steps of the long run (default 700)")
    parser.add_argument(
        "--each",
        action="store_true",
        help="also the Trainer with every default off and with each default alone (4 times longer)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="count every loop this many times and print the median and range (default 1); from 2 on "
        "the hand loop's second count against its first is printed as the A/A",
    )
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        setup, loop, steps, rank, port, ready = args.worker
        _worker(setup, loop, int(steps), int(rank), int(port), ready)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_trainer_instructions.py needs valgrind (apt-get install valgrind).")
    if not 0 < args.short < args.long:
        parser.error(f"need 0 < --short < --long, got {args.short} and {args.long}")
    if args.long - args.short < _MIN_STEPS:
        # One-off work (the first progress line, a logging step or not) then outweighs the steps:
        # 10 and 30 steps gave the DDP Trainer 1.109, where 100 and 700 give 1.029 run after run.
        parser.error(
            f"--long - --short must be at least {_MIN_STEPS} steps for a per-step count to mean "
            f"anything, got {args.long - args.short}"
        )
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    print(
        f"Instructions per step of rank 0's training thread (callgrind; runs of {args.long} and "
        f"{args.short} steps, their difference / {args.long - args.short}"
        + (f"; median [range] of {args.repeat} counts)" if args.repeat > 1 else ")")
    )
    loops = ["hand", *(VARIANT_KEYS if args.each else ["all"])]
    reps = range(args.repeat)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for setup in args.setups:
            print(f"{SETUPS[setup]}:")
            # Two runs at a time (rank 0 under valgrind is the one busy process of each); the
            # repetitions interleaved, so that a slow spell of the machine falls on every loop.
            runs = [(loop, steps, rep) for rep in reps for loop in loops for steps in (args.short, args.long)]
            with ThreadPoolExecutor(max_workers=2) as pool:
                futures = {run: pool.submit(_count, setup, run[0], run[1], out, run[2]) for run in runs}
                counts = {run: future.result() for run, future in futures.items()}
            per_step = {
                loop: [
                    (counts[loop, args.long, rep] - counts[loop, args.short, rep]) / (args.long - args.short)
                    for rep in reps
                ]
                for loop in loops
            }
            hand = statistics.median(per_step["hand"])
            for loop in loops:
                name = "hand-written loop" if loop == "hand" else VARIANT_KEYS[loop]
                counted = per_step[loop]
                # Each repetition's ratio against the hand loop of the same repetition.
                ratios = [c / h for c, h in zip(counted, per_step["hand"], strict=True)]
                line = (
                    f"  {name:28s} {statistics.median(counted) / 1e3:8.1f} K a step   ratio to hand "
                    f"{statistics.median(ratios):.4f}   ({(statistics.median(counted) - hand) / 1e3:+.1f} K)"
                )
                if args.repeat > 1:
                    line += f"   range {min(counted) / 1e3:.1f}-{max(counted) / 1e3:.1f} K"
                    if loop != "hand":
                        line += f", ratio {min(ratios):.4f}-{max(ratios):.4f}"
                print(line, flush=True)
            if args.repeat > 1:
                first, second = per_step["hand"][:2]
                print(f"  {'A/A (hand, 2nd count / 1st)':28s} {second / first:.4f}", flush=True)


if __name__ == "__main__":
    main()

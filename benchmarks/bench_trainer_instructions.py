"""The Trainer's own work per step, counted exactly: CPU instructions of the training thread under
valgrind's callgrind, the Trainer with every default on against the hand-written loop.

Run by hand (not in CI; needs valgrind):  .venv/bin/python benchmarks/bench_trainer_instructions.py
[--setups ddp single] [--each] (about 5 minutes on the 2-core machine; 20 with --each).

Why. Timing 2 % on 2 ranks that share 2 cores is hopeless (bench_trainer_guard.py's A/A spreads
reach several percent), but the instructions a thread executes barely depend on the other rank's
timing: two idle runs agree to 0.1 %. Run it idle all the same: work done by the clock (the progress
line, the checkpoint's time check) comes more often per step under valgrind, and a short run beside
two busy processes was 1.4 % off. They are not time: cache misses and branch mispredictions are not
counted, so a ratio here is a floor for the time ratio, not the time ratio itself. What the count
shows exactly is every Python call, attribute lookup and tensor made per step that the hand loop
does not make.

How. Each loop runs twice in fresh processes, once for ``--short`` steps and once for ``--long``
steps (after the same 20 warm-up steps, in the same process); rank 0 runs under ``valgrind
--tool=callgrind --separate-threads=yes`` and its main thread's count is read. The difference of the
two runs divided by the difference of the steps is the loop's cost per step: set-up, warm-up, the
end of fit and the process's exit cancel. Logging steps (every 50, each with its all-reduces, the
CSV row and the progress line) fall inside the difference, so they count at their share. The other
threads (gloo's, OpenBLAS's) are left out: they spin and wait for the other rank, and their counts
vary from run to run.

The workloads are bench_trainer_guard.py's tiny MLP (batch 32): DDP on 2 gloo ranks against seed
002's DDP loop, and one process against the same loop without DDP. The Trainer has its real
defaults (CSV logger, ModelCheckpoint, progress lines, hang doctor, straggler timing), with the hang
doctor's timeout set long (callgrind slows rank 0 about fifty-fold, which the adaptive timeout would
otherwise take for a hang).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP = 20
SETUPS = {"ddp": "DDP, 2 gloo ranks, tiny MLP", "single": "one process, tiny MLP"}
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
    from bench_trainer_defaults import VARIANTS, _hand_block, _trainer_block

    torch.set_num_threads(1)
    strategy = "ddp" if setup == "ddp" else "single"
    import distkit

    if rank == 0:
        Path(ready).touch()
    if setup == "ddp":
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
            if loop == "hand":
                _hand_block(model, optimizer, loader, strategy)
            else:
                _trainer_block(model, optimizer, loader, VARIANTS[VARIANT_KEYS[loop]], strategy, root)
    if setup == "ddp":
        distkit.barrier()
        distkit.shutdown()


def _count(setup: str, loop: str, steps: int, out: Path) -> int:
    """Instructions of rank 0's main thread over a whole run of ``steps`` steps."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    prefix = out / f"{setup}.{loop}.{steps}"
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
    if setup == "ddp":
        # Rank 1 runs at full speed and waits for rank 0: started once rank 0, slowed about
        # fifty-fold, has imported torch and is about to open the store.
        deadline = time.monotonic() + 600
        while not ready.exists() and rank0.poll() is None:
            if time.monotonic() > deadline:
                rank0.kill()
                raise SystemExit(f"rank 0 of {setup}/{loop}/{steps} did not start within 600 s")
            time.sleep(0.5)
        if not ready.exists():
            raise SystemExit(f"rank 0 of {setup}/{loop}/{steps} failed to start:\n{log.read_text()[-3000:]}")
        try:
            rank1 = subprocess.run(
                [*me, "1", str(port), str(ready)], env=env, stdout=subprocess.DEVNULL, timeout=1800
            )
        except subprocess.TimeoutExpired:
            rank0.kill()
            raise SystemExit(f"rank 1 of {setup}/{loop}/{steps} did not finish within 1800 s") from None
        if rank1.returncode != 0:
            rank0.kill()
            raise SystemExit(f"rank 1 of {setup}/{loop}/{steps} failed (exit {rank1.returncode})")
    if rank0.wait(timeout=1800) != 0:
        raise SystemExit(f"{setup}/{loop}/{steps} failed under valgrind:\n{log.read_text()[-3000:]}")
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
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--short", type=int, default=100, help="steps of the short run (default 100)")
    parser.add_argument("--long", type=int, default=700, help="steps of the long run (default 700)")
    parser.add_argument(
        "--each",
        action="store_true",
        help="also the Trainer with every default off and with each default alone (4 times longer)",
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
    print(
        f"Instructions per step of rank 0's training thread (callgrind; runs of {args.long} and "
        f"{args.short} steps, their difference / {args.long - args.short})"
    )
    loops = ["hand", *(VARIANT_KEYS if args.each else ["all"])]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for setup in args.setups:
            print(f"{SETUPS[setup]}:")
            # Two runs at a time (rank 0 under valgrind is the one busy process of each).
            runs = [(loop, steps) for loop in loops for steps in (args.short, args.long)]
            with ThreadPoolExecutor(max_workers=2) as pool:
                counted = pool.map(_count, [setup] * len(runs), *zip(*runs, strict=True), [out] * len(runs))
                counts = dict(zip(runs, counted, strict=True))
            per_step = {
                loop: (counts[loop, args.long] - counts[loop, args.short]) / (args.long - args.short)
                for loop in loops
            }
            hand = per_step["hand"]
            for loop in loops:
                name = "hand-written loop" if loop == "hand" else VARIANT_KEYS[loop]
                print(
                    f"  {name:28s} {per_step[loop] / 1e3:8.1f} K a step   ratio to hand "
                    f"{per_step[loop] / hand:.4f}   ({(per_step[loop] - hand) / 1e3:+.1f} K)",
                    flush=True,
                )


if __name__ == "__main__":
    main()

"""What each of the Trainer's defaults costs per step: the Trainer with every default off, with each
switched on alone, and with all of them (its real defaults), against a hand-written loop measured
in the same blocks, with an A/A pair of the hand loop as the noise floor.

Run by hand (not in CI):  .venv/bin/python benchmarks/bench_trainer_defaults.py [--blocks 10]
[--setups ddp single fsdp], or the same options after ``benchmarks/bench_trainer.py --breakdown``.
benchmarks/bench_trainer_guard.py runs the same measurement for the Trainer with all its defaults
alone and checks the ratios against the budgets of issue 29.

Workloads: benchmarks/bench_trainer.py's tiny MLP (overhead-bound) and medium MLP (compute-bound),
each on 2 gloo ranks (DDP; the hand loop is seed 002's DDP loop) and in one process (the hand loop
without DDP; the Trainer with strategy="single"); and the medium MLP under FSDP2 on 2 gloo ranks:
the hand loop calls ``fully_shard`` on each Linear and then on the root (not resharded after
forward), as ``FSDPStrategy(unit_classes=nn.Linear)`` shards it in the Trainer, and both build a
fresh model and optimizer every block (``fully_shard`` changes the model in place). The defaults,
each switched on alone over a Trainer that has them all off:

- ``logger=True``: the CSV logger (one reduction of the loss every ``log_every_n_steps``);
- ``enable_checkpointing=True``: a ModelCheckpoint, whose per-step cost is the time-based check
  (one all-reduce of a flag at logging steps; its epoch-end save is outside the timed steps);
- ``enable_progress_bar=None``: the progress display (plain ProgressLog lines here: stderr is no
  terminal);
- ``hang_timeout_s="auto"``: the hang doctor's watchdog (several processes only);
- ``straggler_margin=0.2``: the per-phase step timing and the straggler check at logging steps.

Every variant runs in the same processes, block by block, in an order that rotates every block;
a block times each loop's steps after its first three. A variant's ratio is the median over
blocks of (its block median / the hand loop's block median in the same block), with the quartiles
of those ratios beside it; "hand (A/A)" is the hand loop again, so its spread is what no ratio can
be told from.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_trainer import MODELS, _loader, _per_step, _seeded

# Every default off; each variant switches some on.
BARE: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "hang_timeout_s": None,
    "straggler_margin": None,
}
DEFAULTS: dict[str, Any] = {
    "logger": True,
    "enable_checkpointing": True,
    "enable_progress_bar": None,
    "hang_timeout_s": "auto",
    "straggler_margin": 0.2,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "Trainer, every default off": {},
    "+ CSV logger": {"logger": True},
    "+ ModelCheckpoint": {"enable_checkpointing": True},
    "+ progress lines": {"enable_progress_bar": None},
    "+ hang doctor": {"hang_timeout_s": "auto"},
    "+ straggler timing": {"straggler_margin": 0.2},
    "Trainer, defaults (all on)": DEFAULTS,
}
LOOPS = ("hand", "hand (A/A)", *VARIANTS)


def _fsdp_model(factory: Any) -> nn.Module:
    """A fresh seeded model, each Linear a sharding unit and then the root, as
    ``FSDPStrategy(unit_classes=nn.Linear)`` shards it (distkit.sharding.shard_model)."""
    from torch.distributed.fsdp import fully_shard

    model = _seeded(factory)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            fully_shard(module)
    # The root is gathered first in backward: not resharded after forward (shard_model's choice).
    fully_shard(model, reshard_after_forward=False)
    return model


@contextlib.contextmanager
def _stamped(optimizer: torch.optim.Optimizer) -> Iterator[list[tuple[float, float, float]]]:
    """(wall clock, process CPU, thread CPU) right after each ``optimizer.step()``, by a wrapper on
    the instance: the same call in the hand loop and in the Trainer. A callback would cost the
    Trainer alone a call a step, and the detach of the loss it is handed, which the Trainer's
    defaults do not make (the guard stamped so until 2026-11-27)."""
    stamps: list[tuple[float, float, float]] = []
    previous = optimizer.__dict__.get("step")
    step = optimizer.step

    def stamped(*args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        stamps.append((time.perf_counter(), time.process_time(), time.thread_time()))
        return result

    optimizer.step = stamped  # type: ignore[method-assign]
    try:
        yield stamps
    finally:
        if previous is None:
            del optimizer.step
        else:
            optimizer.step = previous  # type: ignore[method-assign]


def _hand_block(module: nn.Module, optimizer: torch.optim.Optimizer, loader: Any, strategy: str) -> list[Any]:
    model = DDP(module) if strategy == "ddp" else module
    criterion = nn.CrossEntropyLoss()
    with _stamped(optimizer) as stamps:
        for data, target in loader:
            optimizer.zero_grad()
            loss = criterion(model(data), target)
            loss.backward()
            optimizer.step()
            loss.item()
    return _per_step(stamps)


def _trainer_block(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Any,
    options: dict[str, Any],
    strategy: str,
    root: str,
) -> list[Any]:
    from distkit.trainer import FSDPStrategy, Trainer

    settings = {**BARE, **options}
    trainer = Trainer(
        strategy=FSDPStrategy(unit_classes=nn.Linear) if strategy == "fsdp" else strategy,
        max_steps=len(loader),
        batch_size=loader.batch_size,
        default_root_dir=tempfile.mkdtemp(dir=root),  # a new run each block (checkpoints, logs)
        **settings,
    )
    with (
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
        _stamped(optimizer) as stamps,
    ):
        trainer.fit(model, loader, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())
    return _per_step(stamps)


# What one spawned world measures: strategy ("ddp", "single" or "fsdp"), model names (MODELS),
# loops (LOOPS), timed blocks, and steps per block (None: the model's own in MODELS).
Job = tuple[str, tuple[str, ...], tuple[str, ...], int, int | None]


def _measure(job: Job, rank: int) -> dict[str, dict[str, list[list[Any]]]]:
    import distkit

    strategy, names, loops, blocks, steps_per_block = job
    several = strategy != "single"
    results: dict[str, dict[str, list[list[Any]]]] = {}
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            factory, features, batch_size, steps = MODELS[name]
            steps = steps_per_block or steps
            loader = _loader(features, batch_size, steps, rank)
            if not several:  # one process: the whole dataset's first `steps` batches, no sampler
                loader = torch.utils.data.DataLoader(
                    loader.dataset, batch_size=batch_size, sampler=list(range(batch_size * (steps + 2)))
                )
            # FSDP shards a model in place: every block starts from a fresh one (made in the block).
            models = {way: _seeded(factory) for way in loops} if strategy != "fsdp" else {}
            optimizers = {way: torch.optim.Adam(models[way].parameters(), lr=1e-3) for way in models}
            times: dict[str, list[list[Any]]] = {way: [] for way in loops}
            for block in range(blocks + 1):
                shift = block % len(loops)
                for way in loops[shift:] + loops[:shift]:
                    if several:
                        distkit.barrier()
                    if strategy == "fsdp":
                        model = _fsdp_model(factory) if way.startswith("hand") else _seeded(factory)
                        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
                    else:
                        model, optimizer = models[way], optimizers[way]
                    if way.startswith("hand"):
                        per_step = _hand_block(model, optimizer, loader, strategy)
                    else:
                        per_step = _trainer_block(model, optimizer, loader, VARIANTS[way], strategy, root)
                    if block:  # block 0 warms every loop up
                        times[way].append(per_step)
            results[name] = times
    return results


def _worker(rank: int, world_size: int, port: int, jobs: list[Job], queue: Any) -> None:
    torch.set_num_threads(1)  # as torchrun would: one thread per process
    if world_size > 1:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        import distkit

        distkit.init(backend="gloo")
    results = [_measure(job, rank) for job in jobs]
    if rank == 0:
        queue.put(results)
    if world_size > 1:
        import distkit

        distkit.barrier()
        distkit.shutdown()


def run_jobs(world_size: int, jobs: list[Job]) -> list[dict[str, dict[str, list[list[Any]]]]]:
    """Run ``jobs`` one after the other in ``world_size`` spawned processes; rank 0's block times,
    one ``{model: {loop: [block's per-step (wall, CPU) times]}}`` per job."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, jobs, queue)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: list[dict[str, dict[str, list[list[Any]]]]] = queue.get(timeout=3600)
    for proc in procs:
        proc.join(timeout=60)
    return results


def ratios(hand: list[list[Any]], ours: list[list[Any]], clock: int) -> list[float]:
    """Per block: the median step time of ``ours`` / the hand loop's in the same block (clock 0:
    wall, 1: CPU time of the process, 2: CPU time of the training thread alone)."""

    def median(block: list[Any]) -> float:
        return statistics.median(step[clock] for step in block)

    return [median(o) / median(h) for h, o in zip(hand, ours, strict=True)]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Lower quartile, median and upper quartile of ``values``."""
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return q1, statistics.median(values), q3


def _shown(values: list[float]) -> str:
    q1, mid, q3 = quartiles(values)
    return f"{mid:.3f} [{q1:.3f}, {q3:.3f}]"


# What --setups names: the processes, and where the medium model alone is measured (FSDP).
SETUPS = {
    "ddp": (2, "2 gloo ranks (DDP)", tuple(MODELS)),
    "single": (1, "one process (single)", tuple(MODELS)),
    "fsdp": (2, "2 gloo ranks (FSDP2, each Linear a unit)", (list(MODELS)[1],)),
}


def main(argv: list[str] | None = None) -> None:
    """Measure and print the table; ``argv``: the options (default: the command line's), also
    given by ``bench_trainer.py --breakdown``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10, help="timed blocks per loop, model and setup")
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    args = parser.parse_args(argv)
    print(
        f"per-step time / the hand loop's in the same block: median [quartiles] over {args.blocks} "
        f"blocks; wall clock, then CPU time of the process (rank 0)"
    )
    for setup in args.setups:
        world_size, where, names = SETUPS[setup]
        start = time.monotonic()
        (results,) = run_jobs(world_size, [(setup, names, LOOPS, args.blocks, None)])
        print(f"\n{where} ({time.monotonic() - start:.0f} s)")
        print(
            f"  {'loop':28s} "
            + " ".join(f"{name.split(' (')[0] + ' wall':>28s} {'CPU':>22s}" for name in results)
        )
        for way in LOOPS[1:]:
            cells = []
            for times in results.values():
                cells.append(f"{_shown(ratios(times['hand'], times[way], 0)):>28s}")
                cells.append(f"{_shown(ratios(times['hand'], times[way], 1)):>22s}")
            print(f"  {way:28s} " + " ".join(cells))


if __name__ == "__main__":
    main()

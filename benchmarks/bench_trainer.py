"""Per-step time of distkit.Trainer against the hand-written DDP loop of seed 002, gloo, 2 CPU ranks.

Run by hand (not in CI):  .venv/bin/python benchmarks/bench_trainer.py [--blocks 80]

With ``--breakdown [--blocks 10] [--setups ddp single fsdp]`` it prints instead what each of the
Trainer's defaults costs a step (each switched on alone, then all of them, against the hand loop and
an A/A pair of it; DDP on 2 ranks and one process, tiny and medium models, and FSDP): the
measurement of benchmarks/bench_trainer_defaults.py, which takes those options.

Two models: a tiny MLP (32->64->10, batch 32: overhead-bound, about 2 ms a step here) and a
1.6 M-parameter MLP (256->1024->1024->256->10, batch 128: compute-bound). Three loops run in the
same two processes with the same model size and optimizer (Adam): the hand-written loop and the
Trainer on the same DataLoader (DistributedSampler), which isolates what the Trainer adds to a step,
and the Trainer given the TensorDataset itself, which it loads with distributed_dataloader (what
`fit(model, dataset)` costs, the loader included). They run block by block, reversing the order
every block, so drifts in machine speed hit all alike. A block times the
steps after its first three (set-up: DDP rebuilds its buckets after its first backward). Each block
wraps the model in a new DDP, in the Trainer's fit and in the hand-written loop alike. The
hand-written step is seed 002's: zero_grad, forward, loss, backward, step, loss.item(). The Trainer
runs with its defaults (CSV logging every 50 steps, so one all-reduce per 50 steps) except
checkpointing and the progress bar.

Two clocks per step: wall time, and the CPU time of the rank's process (its own work, gloo's threads
included, not the time it waits for the other rank or for a core). Each block gives one median per
clock; the headline overhead is the median over blocks of the ratio Trainer / hand-written of the
two loops' block medians in the same block. A burst of load from other processes on a shared
machine then spoils the blocks it lands in, not the result. Pooled medians and lower quartiles over
every timed step are printed too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import socket
import tempfile
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# Steps at the start of every block that are not timed (see _per_step).
_SKIP = 3

# name: (model factory, input features, batch size per rank, timed steps per block)
MODELS: dict[str, tuple[Callable[[], nn.Module], int, int, int]] = {
    "tiny MLP (2.7 K params, batch 32)": (
        lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)),
        32,
        32,
        150,
    ),
    "medium MLP (1.6 M params, batch 128)": (
        lambda: nn.Sequential(
            nn.Linear(256, 1024),
            nn.ReLU(),
            nn.Linear(1024, 1024),
            nn.ReLU(),
            nn.Linear(1024, 256),
            nn.ReLU(),
            nn.Linear(256, 10),
        ),
        256,
        128,
        25,
    ),
}


def _loader(features: int, batch_size: int, steps: int, rank: int) -> DataLoader:  # type: ignore[type-arg]
    # Enough samples for every block to stay inside one epoch (no epoch-end work is timed).
    n = 2 * batch_size * (steps + 2)
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(n, features, generator=generator), torch.randint(0, 10, (n,)))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def _handwritten_block(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,  # type: ignore[type-arg]
) -> list[float]:
    # A new DDP per block, as Trainer.fit makes one per call: both pay DDP's set-up alike.
    model = DDP(module)
    criterion = nn.CrossEntropyLoss()
    stamps = []
    for data, target in loader:
        optimizer.zero_grad()
        loss = criterion(model(data), target)
        loss.backward()
        optimizer.step()
        loss.item()
        stamps.append((time.perf_counter(), time.process_time()))
    return _per_step(stamps)


def _per_step(stamps: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
    # Steady state only: the first steps carry set-up (iterator start, and DDP rebuilding its
    # buckets in the order gradients arrived, which it does once after its first backward).
    # Each stamp holds one reading per clock; a step's entry, each clock's difference.
    steady = stamps[_SKIP:]
    return [tuple(y - x for x, y in zip(a, b, strict=True)) for a, b in itertools.pairwise(steady)]


def _trainer_block(
    model: nn.Module, optimizer: torch.optim.Optimizer, data: object, steps: int, batch_size: int, root: str
) -> list[tuple[float, float]]:
    from distkit.trainer import Callback, Trainer

    class Stamps(Callback):
        def __init__(self) -> None:
            self.stamps: list[tuple[float, float]] = []

        def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
            self.stamps.append((time.perf_counter(), time.process_time()))

    stamps = Stamps()
    trainer = Trainer(
        strategy="ddp",
        max_steps=steps,
        batch_size=batch_size,
        default_root_dir=root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[stamps],
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the start-up report, once per block
        trainer.fit(model, data, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())
    return _per_step(stamps.stamps)


# The hand-written loop; the Trainer on the same DataLoader (what the Trainer adds to a step); the
# Trainer given the dataset, which it loads with distributed_dataloader (what a user of fit(model,
# dataset) gets, the loader's own cost included).
LOOPS = ("hand-written", "Trainer", "Trainer on the dataset")


def _seeded(factory: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return factory()


def _worker(rank: int, port: int, blocks: int, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as torchrun would: 2 ranks on 2 cores
    import distkit

    distkit.init(backend="gloo")
    # model -> loop -> one list of (wall, cpu) step times per block
    results: dict[str, dict[str, list[list[tuple[float, float]]]]] = {}
    with tempfile.TemporaryDirectory() as root:
        for name, (factory, features, batch_size, steps) in MODELS.items():
            loader = _loader(features, batch_size, steps, rank)
            models = {way: _seeded(factory) for way in LOOPS}
            optimizers = {way: torch.optim.Adam(models[way].parameters(), lr=1e-3) for way in LOOPS}
            times: dict[str, list[list[tuple[float, float]]]] = {way: [] for way in LOOPS}
            for block in range(blocks + 1):
                order = list(LOOPS) if block % 2 == 0 else list(reversed(LOOPS))
                for way in order:
                    distkit.barrier()
                    model, optimizer = models[way], optimizers[way]
                    if way == "hand-written":
                        per_step = _handwritten_block(model, optimizer, loader)
                    else:
                        data = loader if way == "Trainer" else loader.dataset
                        per_step = _trainer_block(model, optimizer, data, len(loader), batch_size, root)
                    if block:  # block 0 warms both up (imports, allocator, first DDP buckets)
                        times[way].append(per_step)
            results[name] = times
    if rank == 0:
        queue.put(results)
    distkit.barrier()
    distkit.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="timed blocks per loop and model (default 40; 10 with --breakdown)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="print instead what each default costs (the measurement of bench_trainer_defaults.py)",
    )
    parser.add_argument(
        "--setups",
        nargs="+",
        metavar="SETUP",
        help="with --breakdown: ddp, single, fsdp (default: all three)",
    )
    args = parser.parse_args()
    if args.breakdown:
        from bench_trainer_defaults import main as breakdown

        blocks = [] if args.blocks is None else ["--blocks", str(args.blocks)]
        breakdown(blocks + (["--setups", *args.setups] if args.setups else []))
        return
    if args.setups:
        parser.error("--setups goes with --breakdown")
    blocks = 40 if args.blocks is None else args.blocks
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(rank, port, blocks, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = queue.get(timeout=1800)
    for proc in procs:
        proc.join(timeout=60)
    print(
        f"per-step time of rank 0, {blocks} interleaved blocks per loop (gloo, 2 CPU ranks, "
        f"1 thread each); overhead = Trainer / hand-written - 1"
    )
    for name, times in results.items():
        hand_blocks = times["hand-written"]
        print(f"{name}: {sum(len(block) for block in hand_blocks)} timed steps per loop")
        for way in LOOPS[1:]:
            print(f"  {way}:")
            _print_overhead(hand_blocks, times[way])


def _print_overhead(
    hand_blocks: list[list[tuple[float, float]]], our_blocks: list[list[tuple[float, float]]]
) -> None:
    for clock, label in ((0, "wall"), (1, "CPU")):
        ratios = [
            _median_of(ours, clock) / _median_of(hand, clock)
            for hand, ours in zip(hand_blocks, our_blocks, strict=True)
        ]
        hand_all = [step[clock] for block in hand_blocks for step in block]
        our_all = [step[clock] for block in our_blocks for step in block]
        pooled = [
            f"{q_name} {_quantile(hand_all, q) * 1e3:.3f} / {_quantile(our_all, q) * 1e3:.3f} ms "
            f"({100 * (_quantile(our_all, q) / _quantile(hand_all, q) - 1):+.1f} %)"
            for q_name, q in (("median", 0.5), ("lower quartile", 0.25))
        ]
        low, mid, high = (100 * (_quantile(ratios, q) - 1) for q in (0.25, 0.5, 0.75))
        print(
            f"    {label:4s} overhead {mid:+5.1f} % (median of block ratios; quartiles {low:+.1f} to "
            f"{high:+.1f} %)   pooled hand-written / this: {'; '.join(pooled)}"
        )


def _median_of(block: list[tuple[float, float]], clock: int) -> float:
    return _quantile([step[clock] for step in block], 0.5)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


if __name__ == "__main__":
    main()

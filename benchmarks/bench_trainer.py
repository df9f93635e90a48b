"""Per-step time of distkit.Trainer against the hand-written DDP loop of seed 002, gloo, 2 CPU ranks.

Run by hand (not in CI):  .venv/bin/python benchmarks/bench_trainer.py [--blocks 10]

Two models: a tiny MLP (32->64->10, batch 32: overhead-bound, about 2 ms a step here) and a
1.6 M-parameter MLP (256->1024->1024->256->10, batch 128: compute-bound). Both loops run in the same
two processes on the same DataLoader (DistributedSampler), model size and optimizer (Adam), block by
block, alternating which goes first, so drifts in machine speed hit both alike. A block times the
steps after its first three (set-up: DDP rebuilds its buckets after its first backward). Each block
wraps the model in a new DDP, in the Trainer's fit and in the hand-written loop alike. The
hand-written step is seed 002's: zero_grad, forward, loss, backward, step, loss.item(). The Trainer
runs with its defaults (CSV logging every 50 steps) except checkpointing and the progress bar.
Prints each loop's median and lower-quartile step time over every timed step (bursts of load
from other processes on a shared machine move these less than a mean; the lower quartile least)
and the Trainer's overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import io
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
        stamps.append(time.perf_counter())
    return _per_step(stamps)


def _per_step(stamps: list[float]) -> list[float]:
    # Steady state only: the first steps carry set-up (iterator start, and DDP rebuilding its
    # buckets in the order gradients arrived, which it does once after its first backward).
    return [b - a for a, b in zip(stamps[_SKIP:], stamps[_SKIP + 1 :], strict=False)]


def _trainer_block(
    model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, root: str
) -> float:  # type: ignore[type-arg]
    from distkit.trainer import Callback, Trainer

    class Stamps(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
            self.stamps.append(time.perf_counter())

    stamps = Stamps()
    trainer = Trainer(
        strategy="ddp",
        max_steps=len(loader),
        default_root_dir=root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[stamps],
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the start-up report, once per block
        trainer.fit(model, loader, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())
    return _per_step(stamps.stamps)


def _worker(rank: int, port: int, blocks: int, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as torchrun would: 2 ranks on 2 cores
    import distkit

    distkit.init(backend="gloo")
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as root:
        for name, (factory, features, batch_size, steps) in MODELS.items():
            torch.manual_seed(0)
            own_model = factory()
            torch.manual_seed(0)
            hand_model = factory()
            loader = _loader(features, batch_size, steps, rank)
            hand_optimizer = torch.optim.Adam(hand_model.parameters(), lr=1e-3)
            trainer_optimizer = torch.optim.Adam(own_model.parameters(), lr=1e-3)
            times: dict[str, list[float]] = {"hand-written": [], "Trainer": []}
            for block in range(blocks + 1):
                order = list(times) if block % 2 == 0 else list(reversed(times))
                for way in order:
                    distkit.barrier()
                    if way == "Trainer":
                        per_step = _trainer_block(own_model, trainer_optimizer, loader, root)
                    else:
                        per_step = _handwritten_block(hand_model, hand_optimizer, loader)
                    if block:  # block 0 warms both up (imports, allocator, first DDP buckets)
                        times[way].extend(per_step)
            results[name] = times
    if rank == 0:
        queue.put(results)
    distkit.barrier()
    distkit.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20, help="timed blocks per loop and model")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(rank, port, args.blocks, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = queue.get(timeout=1800)
    for proc in procs:
        proc.join(timeout=60)
    print(
        f"per-step time, median over the steps of {args.blocks} interleaved blocks per loop "
        f"(gloo, 2 CPU ranks, 1 thread each)"
    )
    for name, times in results.items():
        hand, ours = sorted(times["hand-written"]), sorted(times["Trainer"])
        print(f"{name}: {len(hand)} + {len(ours)} timed steps")
        for label, q in (("median", 0.5), ("lower quartile", 0.25)):
            h, o = hand[int(q * len(hand))], ours[int(q * len(ours))]
            print(
                f"  {label:15s} hand-written {h * 1e3:8.3f} ms   Trainer {o * 1e3:8.3f} ms   "
                f"ratio {o / h:5.3f}   overhead {100 * (o / h - 1):+5.1f} %"
            )


if __name__ == "__main__":
    main()

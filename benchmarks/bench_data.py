"""distkit.distributed_dataloader against hand-written DataLoader code: map-style data and streams.

Run by hand:  .venv/bin/python benchmarks/bench_data.py [--section map|stream] [--repeats 7] [--rounds 5]

Map-style (``--section map``): distkit's loader against a DataLoader + DistributedSampler. Both
loaders are timed in one process (a world of one: the split is the same code on any world size),
pass by pass in turn, so drifts in machine speed hit both alike. Prints the median time per batch
and the ratio distkit / torch.

Streams (``--section stream``): a StreamLoader over ``ShardFiles`` (local text shards, written once
to a temporary directory) against what users write today: an ``IterableDataset`` that reads the
same shards and keeps every ``(world_size * num_workers)``-th line from its own offset, in a plain
DataLoader. Both read the whole stream in every rank and worker; both collate alike (a line parsed
to a small tensor, then ``default_collate``). Every configuration runs in newly started gloo ranks
(1 or 2), which run the loaders at the same time (a barrier before each pass). A round times one
full epoch of each variant, in an order rotated every round, after one untimed warm-up pass each;
the StreamLoader shuffled (buffer 1000) is its own variant, and the hand-written loader runs twice
(an A/A pair: the noise floor). Prints rank 0's median samples/s per variant, and the throughput
ratios against the hand-written loader of the same round: the median over rounds with the lowest
and highest (below 1: slower). The StreamLoader drops the last incomplete global step, the
hand-written loader keeps every worker's last short batch: samples/s counts what each delivered.
Neither keeps its workers between passes (a StreamLoader cannot: each pass starts them at the
stream's position); in the ranks they start by forkserver. 2 ranks x 2 workers oversubscribe a
2-core machine: there the absolute rates measure the machine, the ratios are what carries over.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Iterator

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    TensorDataset,
    default_collate,
    get_worker_info,
)

import distkit
from distkit.testing import run_ranks

BATCH = 32


class InMemory(Dataset):
    """Tensors already in memory: the loader's own overhead dominates."""

    def __init__(self, n: int = 8192) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 32, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def tensors() -> TensorDataset:
    """The same tensors as a TensorDataset: provably draws nothing, so distkit skips the per-batch
    random streams."""
    data = InMemory()
    return TensorDataset(data.x, data.y)


class Augmented(InMemory):
    """A random augmentation per sample, as image pipelines have."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.01 * torch.randn(32), self.y[i]


def per_batch_ms(loader: object) -> float:
    start = time.perf_counter()
    n = sum(1 for _ in loader)  # type: ignore[attr-defined]
    return (time.perf_counter() - start) / n * 1e3


def torch_loader(dataset: Dataset, workers: int) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, seed=0)
    return DataLoader(
        dataset,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context="fork" if workers else None,
    )


def map_section(repeats: int) -> None:
    print(f"{'dataset':13} {'workers':>7} {'torch ms':>9} {'distkit ms':>11} {'distkit/torch':>14}")
    for name, make in (("TensorDataset", tensors), ("InMemory", InMemory), ("Augmented", Augmented)):
        for workers in (0, 2):
            dataset = make()
            ours = distkit.distributed_dataloader(
                dataset, BATCH, num_workers=workers, multiprocessing_context="fork" if workers else None
            )
            theirs = torch_loader(dataset, workers)
            per_batch_ms(theirs), per_batch_ms(ours)  # warm-up: workers start
            t_torch, t_ours = [], []
            for _ in range(repeats):
                t_torch.append(per_batch_ms(theirs))
                t_ours.append(per_batch_ms(ours))
            a, b = statistics.median(t_torch), statistics.median(t_ours)
            print(f"{name:13} {workers:>7} {a:>9.3f} {b:>11.3f} {b / a:>13.2f}x")


# --- Streams ---------------------------------------------------------------------------------------

# The variants of the stream section, in the order of the first round. "again" is the A/A pair.
STREAM, SHUFFLED, HAND, AGAIN = "stream", "stream shuffled", "hand-written", "hand-written again"


def write_shards(directory: str, shards: int, lines: int) -> list[str]:
    """``shards`` text files of ``lines`` short lines each: a running number and some text."""
    paths = []
    for shard in range(shards):
        path = os.path.join(directory, f"shard-{shard:03d}.txt")
        with open(path, "w", encoding="utf-8") as file:
            file.writelines(f"{shard * lines + i} the quick brown fox\n" for i in range(lines))
        paths.append(path)
    return paths


def collate_lines(lines: list[str]) -> torch.Tensor:
    """The per-sample work of both loaders: parse the number, make a small tensor; then collate."""
    samples = []
    for line in lines:
        number = int(line.split(" ", 1)[0])
        samples.append(torch.tensor([number, number % 10]))
    return default_collate(samples)


class StridedShards(IterableDataset[str]):
    """The hand-written split: every rank and worker reads all the shards and keeps every
    ``(world_size * num_workers)``-th line, from line ``rank * num_workers + worker_id`` on."""

    def __init__(self, paths: list[str], rank: int, world_size: int) -> None:
        self.shards = distkit.ShardFiles(paths)
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[str]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        readers = self.world_size * workers
        return itertools.islice(iter(self.shards), self.rank * workers + worker, None, readers)


def samples_per_s(loader: object) -> float:
    distkit.barrier()  # the ranks read at the same time, as in training
    start = time.perf_counter()
    n = sum(len(batch) for batch in loader)  # type: ignore[attr-defined]
    return n / (time.perf_counter() - start)


def stream_rounds(paths: list[str], batch: int, workers: int, rounds: int) -> dict[str, list[float]]:
    """On every rank: each variant's samples/s per round, this rank's."""
    rank, world_size = distkit.get_rank(), distkit.get_world_size()
    shards = distkit.ShardFiles(paths)
    options = {"num_workers": workers, "collate_fn": collate_lines, "pin_memory": False}
    loaders = {
        STREAM: distkit.distributed_dataloader(shards, batch, shuffle=False, **options),
        SHUFFLED: distkit.distributed_dataloader(shards, batch, shuffle=True, buffer_size=1000, **options),
        HAND: DataLoader(StridedShards(paths, rank, world_size), batch_size=batch, **options),
        AGAIN: DataLoader(StridedShards(paths, rank, world_size), batch_size=batch, **options),
    }
    names = list(loaders)
    for name in names:
        samples_per_s(loaders[name])  # warm-up: files in the page cache, code paths taken once
    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        # Each variant takes each place in the order in turn, so drifts hit all alike.
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            rates[name].append(samples_per_s(loaders[name]))
    return rates


def ratio_text(ours: list[float], theirs: list[float]) -> str:
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def stream_section(shards: int, lines: int, batch: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-data-") as directory:
        paths = write_shards(directory, shards, lines)
        print(
            f"streams: {shards} local text shards x {lines} lines, batch {batch} per rank, "
            f"{rounds} rounds of one epoch each; rank 0's samples/s; ratios vs hand-written per round: "
            f"median (lowest-highest), below 1 is slower"
        )
        print(
            f"{'ranks':>5} {'workers':>7} {'hand-written':>12} {'StreamLoader':>12} {'Stream/hand':>17} "
            f"{'shuffled':>9} {'shuffled/hand':>17} {'A/A':>17}"
        )
        for world_size in (1, 2):
            for workers in (0, 2):
                rates = run_ranks(
                    stream_rounds,
                    paths,
                    batch,
                    workers,
                    rounds,
                    world_size=world_size,
                    fresh=True,
                    timeout_s=600,
                )[0]
                hand = rates[HAND]
                print(
                    f"{world_size:>5} {workers:>7} {statistics.median(hand):>12,.0f} "
                    f"{statistics.median(rates[STREAM]):>12,.0f} {ratio_text(rates[STREAM], hand):>17} "
                    f"{statistics.median(rates[SHUFFLED]):>9,.0f} {ratio_text(rates[SHUFFLED], hand):>17} "
                    f"{ratio_text(rates[AGAIN], hand):>17}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=("all", "map", "stream"), default="all", help="what to run")
    parser.add_argument("--repeats", type=int, default=7, help="map-style: timed passes per loader")
    parser.add_argument("--rounds", type=int, default=5, help="streams: timed epochs per variant")
    parser.add_argument("--shards", type=int, default=8, help="streams: shard files")
    parser.add_argument("--lines", type=int, default=20_000, help="streams: lines per shard")
    parser.add_argument("--batch", type=int, default=64, help="streams: batch size per rank")
    args = parser.parse_args()
    if args.section in ("all", "map"):
        map_section(args.repeats)
    if args.section == "all":
        print()
    if args.section in ("all", "stream"):
        stream_section(args.shards, args.lines, args.batch, args.rounds)


if __name__ == "__main__":
    main()

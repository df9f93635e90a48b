"""Per-batch cost of distkit.distributed_dataloader against a hand-written DataLoader + DistributedSampler.

Run by hand:  .venv/bin/python benchmarks/bench_data.py [--repeats 7]

Both loaders are timed in one process (a world of one: the split is the same code on any world
size), pass by pass in turn, so drifts in machine speed hit both alike. Prints the median time per
batch and the ratio distkit / torch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import distkit

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per loader")
    args = parser.parse_args()
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
            for _ in range(args.repeats):
                t_torch.append(per_batch_ms(theirs))
                t_ours.append(per_batch_ms(ours))
            a, b = statistics.median(t_torch), statistics.median(t_ours)
            print(f"{name:13} {workers:>7} {a:>9.3f} {b:>11.3f} {b / a:>13.2f}x")


if __name__ == "__main__":
    main()

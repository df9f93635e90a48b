"""A short DDP run on synthetic data that uses distkit's foundation helpers.

Run:  torchrun --standalone --nproc_per_node=2 examples/quickstart.py
      python examples/quickstart.py            (a world of one: the same code, no launcher)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import distkit


def main() -> None:
    env = distkit.init()
    log = distkit.get_logger("quickstart", main_process_only=True)
    distkit.rank_zero_print(
        f"launcher={env.launcher} world_size={env.world_size} device={distkit.get_device()}"
    )

    # Same data on every rank (seeded), split by the sampler.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(2048, 1, generator=g)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, seed=0)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler)

    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    if distkit.is_distributed():
        model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    for epoch in range(5):
        sampler.set_epoch(epoch)
        loss_sum, seen = 0.0, 0
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(xb)
            seen += len(xb)
        # Exact mean over every sample of every rank, in one collective.
        metrics = distkit.reduce_metrics({"train_loss": (loss_sum, seen), "steps": float(len(loader))})
        distkit.rank_zero_print(f"epoch {epoch}: train_loss={metrics['train_loss']:.4f}")

    # Every rank scores its own share; ranks may hold different numbers of rows.
    own = torch.arange(env.rank, len(dataset), env.world_size)
    with torch.no_grad():
        errors = (model(x[own]) - y[own]).abs().squeeze(1)
    all_errors = torch.cat(distkit.all_gather(errors))
    distkit.barrier(timeout_s=60)
    log.info("scored %d samples", all_errors.numel())
    distkit.rank_zero_print(f"mean absolute error over {all_errors.numel()} samples: {all_errors.mean():.4f}")
    if all_errors.numel() != len(dataset):
        raise SystemExit("gathered the wrong number of samples")
    distkit.shutdown()


if __name__ == "__main__":
    main()

"""A short Trainer run for the progress tests, whose stderr the test points at a file or a terminal.

Usage: python progress_job.py ROOT STRATEGY DEVICES [--every N]

Trains a small model for 3 epochs of 5 optimizer steps (320 samples, batch 32 per rank on 2 ranks;
10 steps per epoch in one process), validating each epoch and logging every 4 steps to
ROOT/metrics.csv. Without --every the Trainer picks its progress display itself (a tqdm bar in a
terminal, a ProgressLog in a file); with it, a ProgressLog(every_n_steps=N, interval_s=None) is
given among the callbacks.
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch import nn
from torch.utils.data import TensorDataset

from distkit.trainer import Callback, Trainer
from distkit.trainer.progress import ProgressLog


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("strategy")
    parser.add_argument("devices", type=int)
    parser.add_argument("--every", type=int)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(1234)
    train = TensorDataset(
        torch.randn(320, 20, generator=generator), torch.randint(0, 10, (320,), generator=generator)
    )
    val = TensorDataset(
        torch.randn(64, 20, generator=generator), torch.randint(0, 10, (64,), generator=generator)
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10))
    callbacks: list[Callback] = []
    if args.every is not None:
        callbacks.append(ProgressLog(every_n_steps=args.every, interval_s=None))
    trainer = Trainer(
        strategy=args.strategy,
        devices=args.devices,
        max_epochs=3,
        batch_size=32,
        log_every_n_steps=4,
        seed=0,
        default_root_dir=args.root,
        enable_checkpointing=False,
        callbacks=callbacks,
    )
    trainer.fit(
        model,
        train,
        val,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=nn.functional.cross_entropy,
    )


if __name__ == "__main__":
    main()

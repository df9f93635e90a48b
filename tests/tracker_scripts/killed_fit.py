"""A one-process Trainer fit logging to metrics.csv, MLflow (file store) and wandb (offline) at every
step, that SIGKILLs itself after a given step: the tests of "every step once in each tracker across
kills" (tests/test_tracker_kills.py).

Usage: python killed_fit.py ROOT [--kill-step S]

13 steps per epoch, 25 in all, a checkpoint every 5 steps, resume="auto": run it again on the same
ROOT to resume from the last checkpoint before the kill. The SIGKILL comes from a callback after
step S's logging and checkpoint, so the process dies with nothing flushed or closed.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from torch import nn
from torch.utils.data import TensorDataset

from distkit.trainer import Callback, CSVLogger, ModelCheckpoint, Trainer
from distkit.trainer.tracking import MLflowLogger, WandbLogger

EXPERIMENT = "tracker-kills"
PROJECT = "tracker-kills"
MAX_STEPS = 25
CHECKPOINT_EVERY = 5
# Quiet and quick: no console capture, no system metrics.
WANDB_SETTINGS = {"settings": {"silent": True, "console": "off", "x_disable_stats": True}}


class KillAt(Callback):
    """SIGKILL this process after optimizer step ``step`` (its logging and checkpoint done)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        if trainer.global_step == self.step:
            print(f"killing myself after step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--kill-step", type=int, default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(104, 4, generator=generator), torch.arange(104) % 2)  # 13 batches
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    callbacks: list[Callback] = [ModelCheckpoint(every_n_steps=CHECKPOINT_EVERY, keep_last=10)]
    if args.kill_step is not None:
        callbacks.append(KillAt(args.kill_step))  # after the checkpoint callback: its save is done
    trainer = Trainer(
        default_root_dir=args.root,
        max_steps=MAX_STEPS,
        batch_size=8,
        log_every_n_steps=1,
        seed=0,
        resume="auto",
        enable_progress_bar=False,
        callbacks=callbacks,
        logger=[
            CSVLogger(),
            MLflowLogger(EXPERIMENT),
            WandbLogger(PROJECT, init_kwargs=WANDB_SETTINGS),
        ],
    )
    trainer.fit(
        model, data, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.functional.cross_entropy
    )


if __name__ == "__main__":
    main()

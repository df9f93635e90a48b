"""One script, launched as `python launch_parity.py OUT` (fit starts 2 processes itself) or as
`torchrun --standalone --nproc_per_node=2 launch_parity.py OUT` (fit joins the job): the two must
train the same job, bitwise, and leave the same state behind.

The script seeds with distkit.seed_everything() and no Trainer seed, then draws from every global
generator before fit (model init, torch, python `random`, numpy), and the model draws from all of
them in its forward pass (dropout, noise, a random scale): a worker that does not start from this
process's generators and default loader seed trains another job.

With `factories` as second argument, fit gets an optimizer and a scheduler factory instead of the
objects (the same job).

Usage: python launch_parity.py OUT [factories]

Writes, from the main process after fit (the launching process under python, rank 0 under torchrun):
OUT/after_fit.pt, what the launching code sees: weights, optimizer and scheduler state, the
callbacks' state (EarlyStopping's, and the best checkpoint ModelCheckpoint's manager finds), the
Trainer's counters and metrics, and whether trainer.optimizer is the object passed. Rank 0 of the
training job also writes OUT/rank0.pt at the end of fit (the same record, taken inside the training
process), so that the launching process can be compared with it.
"""

from __future__ import annotations

import functools
import os
import random
import sys
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

import distkit
from distkit.trainer import Callback, EarlyStopping, ModelCheckpoint, Trainer


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Draws from torch's, python's and numpy's global generators on every forward pass.
        scale = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        return self.net(x * scale + 0.01 * torch.randn_like(x))


class Points(Dataset):  # type: ignore[type-arg]
    def __init__(self, length: int) -> None:
        generator = torch.Generator().manual_seed(99)
        self.x = torch.randn(length, 12, generator=generator)
        self.y = torch.randint(0, 4, (length,), generator=generator)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        # An augmentation: draws from the loader's per-batch stream (derived from the loader seed).
        return self.x[index] + 0.05 * torch.randn(12), self.y[index]

    def __len__(self) -> int:
        return len(self.x)


def record(trainer: Trainer, model: nn.Module) -> dict[str, Any]:
    stopper = next(cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping))
    checkpoint = next(cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint))
    return {
        "best_checkpoint": os.path.basename(checkpoint.manager.best()),
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": trainer.optimizer.state_dict(),
        "lr_scheduler": trainer.lr_scheduler.state_dict(),
        "early_stopping": stopper.state_dict(),
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "skipped_steps": trainer.skipped_steps,
        "callback_metrics": dict(trainer.callback_metrics),
    }


class Rank0Record(Callback):
    """Rank 0's own record at the end of fit, written by the training process itself."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer: Trainer) -> None:
        if trainer.is_main_process:
            torch.save(record(trainer, trainer.model), f"{self.out}/rank0.pt")


def main() -> None:
    out = sys.argv[1]
    factories = sys.argv[2:] == ["factories"]
    distkit.seed_everything(7)
    model = Noisy()
    # The script draws from every generator before fit, as real scripts do (splits, inits, ...).
    torch.rand(5)
    random.random()
    np.random.rand(3)
    if factories:
        optimizer: Any = functools.partial(torch.optim.AdamW, lr=0.02)
        scheduler: Any = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    stopper = EarlyStopping("val_loss", patience=5)
    trainer = Trainer(
        strategy="ddp",
        devices=2,
        max_epochs=3,
        batch_size=8,
        log_every_n_steps=2,
        default_root_dir=out,
        enable_progress_bar=False,
        callbacks=[stopper, Rank0Record(out), ModelCheckpoint(monitor="val_loss", keep_best=1)],
    )
    trainer.fit(
        model,
        Points(96),
        Points(24),
        optimizer=optimizer,
        lr_scheduler=scheduler,
        loss_fn=nn.functional.cross_entropy,
    )
    if distkit.is_main_process():
        result = record(trainer, model)
        # The objects passed to fit (None: factories were passed).
        result["passed_objects"] = (
            None if factories else (trainer.optimizer is optimizer and trainer.lr_scheduler is scheduler)
        )
        torch.save(result, f"{out}/after_fit.pt")


if __name__ == "__main__":
    main()

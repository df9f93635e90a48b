"""A small Trainer job for the tests that need real processes: `python` (fit starts its own
processes) or `torchrun` (fit joins the job), optionally killing or signalling one rank mid-run.

Usage: python train_job.py ROOT MAX_STEPS [--kill-rank R --kill-step S] [--term-rank R --term-step S]

ROOT gets the checkpoints (every 2 steps, resume="auto") and, from the main process, the final
weights in ROOT/weights.pt (also after a preemption, which then re-raises its SystemExit(0)). With
--kill-*, rank R SIGKILLs itself after step S in the first attempt of a torchrun job
(TORCHELASTIC_RESTART_COUNT=0) only; with --term-*, rank R sends itself SIGTERM after step S, as a
scheduler preempting the job would.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.trainer import Callback, ModelCheckpoint, Trainer


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 10))


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    return TensorDataset(
        torch.randn(320, 20, generator=generator), torch.randint(0, 10, (320,), generator=generator)
    )


def make_trainer(root: str, max_steps: int, callbacks: list[Callback]) -> Trainer:
    return Trainer(
        strategy="ddp",
        devices=2,
        max_steps=max_steps,
        seed=3,
        resume="auto",
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        callbacks=[*callbacks, ModelCheckpoint(every_n_steps=2, every_n_epochs=0, keep_last=10)],
    )


def fit(trainer: Trainer, model: nn.Module) -> None:
    trainer.fit(
        model,
        make_data(),
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
        loss_fn=nn.CrossEntropyLoss(),
    )


class SignalSelf(Callback):
    """Rank `rank` sends itself `signum` after optimizer step `step`."""

    def __init__(self, rank: int, step: int, signum: int, first_attempt_only: bool) -> None:
        self.rank, self.step, self.signum = rank, step, signum
        self.first_attempt_only = first_attempt_only

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        if distkit.get_rank() != self.rank or trainer.global_step != self.step:
            return
        if self.first_attempt_only and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        print(f"rank {self.rank} sends itself signal {self.signum} after step {self.step}", flush=True)
        os.kill(os.getpid(), self.signum)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--kill-rank", type=int)
    parser.add_argument("--kill-step", type=int)
    parser.add_argument("--term-rank", type=int)
    parser.add_argument("--term-step", type=int)
    args = parser.parse_args()
    callbacks: list[Callback] = []
    if args.kill_rank is not None:
        callbacks.append(SignalSelf(args.kill_rank, args.kill_step, signal.SIGKILL, first_attempt_only=True))
    if args.term_rank is not None:
        callbacks.append(SignalSelf(args.term_rank, args.term_step, signal.SIGTERM, first_attempt_only=False))
    model = make_model()
    trainer = make_trainer(args.root, args.max_steps, callbacks)
    try:
        fit(trainer, model)
    finally:
        # Under torchrun the main process writes; under python, this (the launching) process holds
        # rank 0's final weights once fit() returns or exits after a preemption.
        if distkit.is_main_process():
            result = {
                "weights": model.state_dict(),
                "world_size": trainer.world_size,
                "step": trainer.global_step,
            }
            torch.save(result, f"{args.root}/weights.pt")
            print(f"stopped at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()

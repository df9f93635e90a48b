"""A callback of the user's can do what the built-ins do, through ``TrainerView`` alone.

Two user-written copies, each handed a view of the Trainer that refuses every name outside the
protocol: ``ModelCheckpoint``'s best-k selection (saving with a ``CheckpointManager`` of its own)
keeps the same checkpoints, with the same weights, as ``ModelCheckpoint`` in the same run on 2 DDP
ranks; ``ProgressLog``'s step line (position and loss) is the same line.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.checkpoint import CheckpointManager
from distkit.trainer import Callback, ModelCheckpoint, ProgressLog, Trainer, TrainerView

# Every name TrainerView lists: its properties and methods, and its one settable attribute.
PROTOCOL = {name for name in vars(TrainerView) if not name.startswith("_")} | set(TrainerView.__annotations__)


class OnlyTheProtocol:
    """The Trainer as a callback written against TrainerView sees it: any other name raises."""

    def __init__(self, trainer: Trainer) -> None:
        object.__setattr__(self, "_trainer", trainer)

    def __getattr__(self, name: str) -> Any:
        if name not in PROTOCOL:
            raise AttributeError(f"{name!r} is not part of TrainerView")
        return getattr(object.__getattribute__(self, "_trainer"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "should_stop":
            raise AttributeError(f"TrainerView lets a callback set should_stop only, not {name!r}")
        setattr(object.__getattribute__(self, "_trainer"), name, value)


class UsersBestK(Callback):
    """A copy of ModelCheckpoint's best-k logic: every N steps, ranked when validated at that step."""

    def __init__(self, directory: str, every_n_steps: int, keep_best: int) -> None:
        self.directory, self.every_n_steps, self.keep_best = directory, every_n_steps, keep_best
        self.manager: CheckpointManager | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        self.manager = CheckpointManager(
            self.directory, keep_last=1, keep_best=self.keep_best, monitor="val_loss", mode="min"
        )

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        view: Any = OnlyTheProtocol(trainer)
        step = view.global_step
        if step % self.every_n_steps:
            return
        metrics = view.last_validation_metrics if view.last_validation_step == step else None
        assert self.manager is not None
        self.manager.save(step, view.checkpoint_state(), metrics=metrics or None)

    def on_fit_end(self, trainer: Trainer) -> None:
        assert self.manager is not None
        self.manager.close()


def blobs(n: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(n, 8, generator=generator)
    return TensorDataset(x, (x[:, 0] > 0).long())


def best_k_side_by_side(tmp: str) -> tuple[list[str], list[str], list[bool]]:
    torch.manual_seed(0)
    ours = os.path.join(tmp, "ours")
    users = os.path.join(tmp, "users")
    trainer = Trainer(
        strategy="ddp",
        max_steps=12,
        batch_size=8,
        val_check_interval=2,  # validation at every even step: some saves are ranked, some not
        log_every_n_steps=3,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=tmp,
        seed=0,
        callbacks=[
            UsersBestK(users, every_n_steps=2, keep_best=2),
            ModelCheckpoint(
                ours,
                monitor="val_loss",
                keep_best=2,
                keep_last=1,
                every_n_steps=2,
                every_n_epochs=0,
                every_n_minutes=None,
            ),
        ],
    )
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    trainer.fit(
        model,
        blobs(512),
        blobs(64),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
        loss_fn=nn.functional.cross_entropy,
    )
    kept = sorted(os.listdir(ours))
    same_weights = [
        torch.equal(
            torch.load(os.path.join(ours, name, "state.pt"), weights_only=False)["model"]["0.weight"],
            torch.load(os.path.join(users, name, "state.pt"), weights_only=False)["model"]["0.weight"],
        )
        for name in kept
        if name.startswith("step_")
    ]
    return kept, sorted(os.listdir(users)), same_weights


def test_a_users_best_k_through_trainerview_keeps_what_modelcheckpoint_keeps(ranks, tmp_path) -> None:
    for ours, users, same_weights in ranks.run(best_k_side_by_side, str(tmp_path)):
        assert [name for name in ours if name.startswith("step_")] == [
            name for name in users if name.startswith("step_")
        ]
        # keep_best=2 plus the latest: a selection by the metric, not just the last saves.
        assert 2 <= len(same_weights) <= 3 and all(same_weights)


class UsersProgressLine(Callback):
    """A copy of ProgressLog's step line (position and loss) through TrainerView alone."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.waiting = -1
        self.logged: tuple[int, float] = (-1, math.nan)

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        view: Any = OnlyTheProtocol(trainer)
        if view.log_pending:  # the logged loss comes with on_log, after the step-end callbacks
            self.waiting = view.global_step
            return
        self.write(view)

    def on_log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        view: Any = OnlyTheProtocol(trainer)
        self.logged = (view.global_step, metrics.get("train_loss", math.nan))
        if self.waiting == view.global_step:
            self.write(view)

    def write(self, view: Any) -> None:
        step, self.waiting = view.global_step, -1
        if self.logged[0] == step:
            loss = f"loss {self.logged[1]:.4f}"
        elif view.running_loss is not None:
            loss = f"loss {view.running_loss:.4f}"
        else:
            loss = "loss n/a"
        self.lines.append(f"step {step}/{view.total_steps} | epoch {view.current_epoch} | {loss}")


def test_a_users_progress_line_through_trainerview_is_progresslogs_line(tmp_path) -> None:
    stream = io.StringIO()
    users = UsersProgressLine()
    torch.manual_seed(0)
    trainer = Trainer(
        max_steps=9,
        batch_size=16,
        log_every_n_steps=4,  # lines at logging steps (the logged loss) and between them (running)
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
        seed=0,
        callbacks=[users, ProgressLog(every_n_steps=1, interval_s=None, stream=stream)],
    )
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    trainer.fit(
        model, blobs(256), optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss_fn=nn.functional.cross_entropy
    )
    ours = [
        " | ".join(line.split(" | ")[:3])
        for line in stream.getvalue().splitlines()
        if line.startswith("step ")
    ]
    assert len(ours) == 9
    assert users.lines == ours


def test_the_view_refuses_what_trainerview_does_not_list(tmp_path) -> None:
    # The copies above would fail on a private read: the view is a real fence, not a pass-through.
    view: Any = OnlyTheProtocol(Trainer(max_steps=1, logger=False, default_root_dir=str(tmp_path)))
    assert view.global_step == 0 and view.last_validation_step is None and view.running_loss is None
    for private in ("_last_validation", "_window_sum", "_batches_done", "_log_pending", "fit"):
        try:
            getattr(view, private)
        except AttributeError:
            continue
        raise AssertionError(f"the view let {private} through")
    view.should_stop = True
    try:
        view.global_step = 3
    except AttributeError:
        return
    raise AssertionError("the view let global_step be set")


def test_trainerview_is_public_and_lists_the_callback_reads() -> None:
    assert distkit.TrainerView is TrainerView
    for name in (
        "last_validation_metrics",
        "last_validation_step",
        "running_loss",
        "batches_in_epoch",
        "log_pending",
        "checkpoint_state",
        "global_step",
        "should_stop",
    ):
        assert name in PROTOCOL, name

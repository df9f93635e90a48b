"""The classic distributed deadlocks, each in a hand-written DDP loop and in the Trainer.

Used by tests/test_hang.py (on ``distkit.testing`` ranks) and runnable as a script, one process per
rank, to see the hang doctor's report as a user would (docs/debugging.md pastes these):

    DISTKIT_HANG_TIMEOUT_S=5 torchrun --nproc_per_node=2 tests/hang_scenarios.py save_on_rank_0 loop

Each line where a rank goes the other way carries a ``# <- case`` marker; :func:`line_of` finds it,
so that the tests can check that the report names that line.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distkit
from distkit.checkpoint import CheckpointManager, ResumeState

CASES = (
    "barrier_on_rank_0",
    "save_on_rank_0",
    "extra_batch",
    "different_order",
    "stuck_in_user_code",
    "dead_rank",
)
# The step at which the scenarios go wrong: after DDP has rebuilt its buckets (step 1).
BAD_STEP = 2


def line_of(marker: str) -> int:
    """The line of this file that ends with ``# <- marker``."""
    for number, text in enumerate(Path(__file__).read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# <- {marker}"):
            return number
    raise LookupError(marker)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _last_rank() -> int:
    return distkit.get_world_size() - 1


def _mark(run_dir: str) -> None:
    """Note when this rank reached the step where things go wrong (the tests time the report)."""
    Path(run_dir, f"bad-step-{distkit.get_rank()}.txt").write_text(repr(time.time()))


def _die() -> None:
    if distkit.get_world_size() == 2:
        os._exit(3)
    os.kill(os.getpid(), 9)  # SIGKILL


# -- a hand-written loop --------------------------------------------------------------------------


def hand_loop(case: str, run_dir: str, hang_timeout_s: float | None = None) -> str:
    """Train a few DDP steps; at ``BAD_STEP`` one rank goes the other way as ``case`` says."""
    distkit.init("gloo", hang_timeout_s=hang_timeout_s)
    rank, world_size = distkit.get_rank(), distkit.get_world_size()
    model = nn.parallel.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(os.path.join(run_dir, "checkpoints"), overwrite=True)
    progress = ResumeState()
    steps = BAD_STEP + 2 + (1 if case == "extra_batch" and rank == 0 else 0)
    generator = torch.Generator().manual_seed(rank)
    for step in range(steps):
        inputs = torch.randn(4, 8, generator=generator)
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()  # <- extra_batch
        optimizer.step()
        progress.global_step = step + 1
        if step != BAD_STEP:
            continue
        _mark(run_dir)
        if case == "barrier_on_rank_0":
            if distkit.is_main_process():
                distkit.barrier()  # <- barrier_on_rank_0
        elif case == "save_on_rank_0":
            if distkit.is_main_process():
                manager.save(step, {"model": model, "progress": progress})  # <- save_on_rank_0
        elif case == "different_order":
            first, second = torch.ones(3), torch.ones(5)
            if rank == 0:
                dist.all_reduce(first)  # <- different_order
                dist.broadcast(second, src=0)
            else:
                dist.broadcast(second, src=0)  # <- different_order_other
                dist.all_reduce(first)
        elif case == "stuck_in_user_code" and rank == _last_rank():
            while True:
                time.sleep(0.01)  # <- stuck_in_user_code
        elif case == "dead_rank" and rank == _last_rank():
            _die()  # <- dead_rank
    # The end of training: every rank reports its last loss.
    metrics = distkit.reduce_metrics({"loss": loss.item()})  # <- extra_batch_other
    distkit.shutdown()
    return f"rank {rank}/{world_size} finished: {metrics}"


# -- the Trainer ----------------------------------------------------------------------------------


class _Deadlock(distkit.Callback):
    """The hand-written loop's deadlocks, from a callback of the Trainer."""

    def __init__(self, case: str, run_dir: str) -> None:
        self.case = case
        self.run_dir = run_dir
        self.manager = CheckpointManager(os.path.join(run_dir, "own-checkpoints"), overwrite=True)

    def on_train_step_end(self, trainer: distkit.Trainer, loss: torch.Tensor) -> None:
        if trainer.global_step != BAD_STEP + 1:
            return
        _mark(self.run_dir)
        rank = distkit.get_rank()
        if self.case == "barrier_on_rank_0":
            if trainer.is_main_process:
                distkit.barrier()  # <- trainer_barrier_on_rank_0
        elif self.case == "save_on_rank_0":
            if trainer.is_main_process:
                state = {"model": trainer.model, "progress": ResumeState(global_step=trainer.global_step)}
                self.manager.save(trainer.global_step, state)  # <- trainer_save_on_rank_0
        elif self.case == "different_order":
            if rank == 0:
                distkit.all_gather_object(rank)  # <- trainer_different_order
                distkit.broadcast_object("x")
            else:
                distkit.broadcast_object("x")  # <- trainer_different_order_other
                distkit.all_gather_object(rank)


class _StepModel(nn.Module):
    """A model whose training_step goes wrong on the last rank at BAD_STEP (stuck, or dead)."""

    def __init__(self, case: str, run_dir: str) -> None:
        super().__init__()
        self.net = _model()
        self.case = case
        self.run_dir = run_dir
        self.steps = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.steps += 1
        if self.steps == BAD_STEP + 1 and distkit.get_rank() == _last_rank():
            _mark(self.run_dir)
            if self.case == "stuck_in_user_code":
                while True:
                    time.sleep(0.01)  # <- trainer_stuck_in_user_code
            if self.case == "dead_rank":
                _die()  # <- trainer_dead_rank
        inputs, target = batch
        return nn.functional.cross_entropy(self(inputs), target)


def _uneven_loader(extra_on_rank_0: bool) -> DataLoader:  # type: ignore[type-arg]
    rank = distkit.get_rank()
    batches = BAD_STEP + 2 + (1 if extra_on_rank_0 and rank == 0 else 0)
    generator = torch.Generator().manual_seed(rank)
    data = TensorDataset(
        torch.randn(4 * batches, 8, generator=generator), torch.randint(0, 2, (4 * batches,))
    )
    return DataLoader(data, batch_size=4)


def trainer_loop(case: str, run_dir: str, hang_timeout_s: float | str | None = "auto") -> str:
    """The same deadlocks under ``Trainer.fit`` (DDP, one epoch)."""
    model = _StepModel(case, run_dir)
    trainer = distkit.Trainer(
        strategy="ddp",
        max_epochs=1,
        callbacks=[_Deadlock(case, run_dir)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=run_dir,
        hang_timeout_s=hang_timeout_s,
    )
    # A DataLoader used as given, without a DistributedSampler: with "extra_batch" rank 0 gets one
    # batch more than the others (its epoch has one more step), the classic uneven-shards bug.
    trainer.fit(model, _uneven_loader(case == "extra_batch"), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    return f"rank {distkit.get_rank()} finished at step {trainer.global_step}"


def run_as_a_script(fn: object, *args: object) -> object:
    """Call ``fn`` as a script's top level would: an uncaught exception goes to ``sys.excepthook``
    and the process exits with code 1 (``distkit.testing`` ranks report it to the parent instead)."""
    try:
        return fn(*args)  # type: ignore[operator]
    except BaseException:
        sys.excepthook(*sys.exc_info())
        raise


if __name__ == "__main__":
    # python tests/hang_scenarios.py CASE loop|trainer [RUN_DIR], one process per rank (torchrun).
    which, kind = sys.argv[1], sys.argv[2]
    directory = sys.argv[3] if len(sys.argv) > 3 else os.environ.get("DISTKIT_RUN_DIR", ".")
    os.environ["DISTKIT_RUN_DIR"] = directory  # where a hand-written loop's report goes
    if kind == "loop":
        print(hand_loop(which, directory))
    else:
        print(trainer_loop(which, directory))

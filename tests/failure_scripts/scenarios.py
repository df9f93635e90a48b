"""Jobs that fail, to check that every process ends within seconds and names the real cause.

Used by tests/test_failure_exit.py; runnable by hand, one process per rank:

    torchrun --nproc_per_node=2 tests/failure_scripts/scenarios.py rank0_only reduce_metrics
    torchrun --nproc_per_node=2 tests/failure_scripts/scenarios.py raise_in_step trainer
    python tests/failure_scripts/scenarios.py raise_in_step self_launch     # the Trainer starts 2
    python tests/failure_scripts/scenarios.py rank0_only barrier spawn      # mp.spawn, 2 processes

``rank0_only OP``: a DDP loop in which rank 0 alone calls distkit's ``OP`` at step 2 (nanoGPT's
``if master_process: save``); the other ranks go on to the next step's gradient all-reduce.
``raise_in_step``: the last rank raises ``ValueError`` in ``training_step`` at step 2 (Trainer).
Options (environment): ``FAILURE_FINALLY_SHUTDOWN=1`` wraps the job in ``try/finally:
distkit.shutdown()``; ``FAILURE_HANG_TIMEOUT_S`` sets ``hang_timeout_s`` (default: off).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import distkit
from distkit import coordination
from distkit.checkpoint import CheckpointManager, ResumeState

OPS = (
    "barrier",
    "reduce_metrics",
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast_object",
    "scatter_object",
    "any_rank",
    "all_ranks",
    "save",
)
BAD_STEP = 2


def _hang_timeout() -> float | None:
    value = os.environ.get("FAILURE_HANG_TIMEOUT_S")
    return float(value) if value else 0.0


def _mark(run_dir: str, what: str) -> None:
    """When this rank reached the failure (the tests time the exits from it)."""
    Path(run_dir, f"{what}-{distkit.get_rank()}.txt").write_text(repr(time.time()))


def _call(op: str, manager: CheckpointManager, model: nn.Module, step: int) -> None:
    rank = distkit.get_rank()
    if op == "barrier":
        distkit.barrier()
    elif op == "reduce_metrics":
        distkit.reduce_metrics({"loss": 1.0})
    elif op == "all_reduce":
        distkit.all_reduce(torch.ones(3))
    elif op == "all_gather":
        distkit.all_gather(torch.ones(2))
    elif op == "all_gather_object":
        distkit.all_gather_object(rank)
    elif op == "broadcast_object":
        distkit.broadcast_object("x")
    elif op == "scatter_object":
        distkit.scatter_object(list(range(distkit.get_world_size())))
    elif op == "any_rank":
        distkit.any_rank(True)
    elif op == "all_ranks":
        distkit.all_ranks(True)
    elif op == "save":
        manager.save(step, {"model": model, "progress": ResumeState(global_step=step)})
    elif op == "torch_all_reduce":  # not distkit's: meets DDP's bucket all-reduce of another size
        torch.distributed.all_reduce(torch.ones(4))  # <- torch_all_reduce
    else:
        raise ValueError(f"unknown op {op!r}; one of {OPS}")


def rank0_only(op: str, run_dir: str) -> None:
    distkit.init("gloo", hang_timeout_s=_hang_timeout())
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(os.path.join(run_dir, "checkpoints"), overwrite=True)
    for step in range(BAD_STEP + 3):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == BAD_STEP and distkit.is_main_process():
            _mark(run_dir, "bad-step")
            _call(op, manager, model, step)


class _Failing(nn.Module):
    def __init__(self, run_dir: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.run_dir = run_dir
        self.steps = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.steps += 1
        if self.steps == BAD_STEP + 1 and distkit.get_rank() == distkit.get_world_size() - 1:
            _mark(self.run_dir, "bad-step")
            raise ValueError(f"bad batch {batch_idx} on the last rank")  # <- raise_in_step
        inputs, target = batch
        return nn.functional.cross_entropy(self(inputs), target)


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # type: ignore[arg-type]


def raise_in_step(run_dir: str, devices: int | None = None) -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    trainer = distkit.Trainer(
        strategy="ddp",
        devices=devices if devices is not None else "auto",
        max_epochs=1,
        batch_size=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=run_dir,
        hang_timeout_s=_hang_timeout() if os.environ.get("FAILURE_HANG_TIMEOUT_S") else "auto",
    )
    trainer.fit(_Failing(run_dir), data, optimizer=_sgd)


def raise_in_section(run_dir: str) -> None:
    """Rank 0 raises inside main_process_first: rank 1 gets MainProcessError, a consequence."""
    distkit.init()
    with distkit.main_process_first(timeout_s=60):
        if distkit.is_main_process():
            _mark(run_dir, "section")
            raise FileNotFoundError("data/raw.csv")  # <- raise_in_section


def first_dies_in_section(run_dir: str) -> None:
    """Rank 1 goes first in main_process_first(rank=1) and is killed inside it: rank 0 gets the
    heartbeat's verdict (a DistkitError), a consequence. The heartbeat is made fast here."""
    coordination._HEARTBEAT_INTERVAL_S = 0.2
    coordination._HEARTBEAT_STALE_S = 2.0
    distkit.init()
    with distkit.main_process_first(rank=1, timeout_s=60):
        if distkit.get_rank() == 1:
            time.sleep(0.5)  # a few heartbeats first, as in a real job
            _mark(run_dir, "section")
            os.kill(os.getpid(), signal.SIGKILL)


def _job(case: str, what: str, run_dir: str) -> None:
    try:
        if case == "rank0_only":
            rank0_only(what, run_dir)
        elif case == "raise_in_section":
            raise_in_section(run_dir)
        elif case == "first_dies_in_section":
            first_dies_in_section(run_dir)
        elif what == "self_launch":
            raise_in_step(run_dir, devices=2)
        else:
            raise_in_step(run_dir)
    finally:
        if os.environ.get("FAILURE_FINALLY_SHUTDOWN") == "1":
            distkit.shutdown()


def _spawned(local_rank: int, case: str, what: str, run_dir: str, port: str) -> None:
    os.environ.update(RANK=str(local_rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE="2")
    _job(case, what, run_dir)


if __name__ == "__main__":
    case, what = sys.argv[1], sys.argv[2]
    launcher = sys.argv[3] if len(sys.argv) > 3 else ""
    directory = os.environ.get("DISTKIT_RUN_DIR", ".")
    if launcher == "spawn":
        import torch.multiprocessing as mp

        mp.spawn(_spawned, args=(case, what, directory, os.environ["MASTER_PORT"]), nprocs=2)
    elif what == "self_launch":
        # The elastic agent that fit() starts here takes over these signals; fit() puts them back.
        before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            _job(case, what, directory)
        finally:
            after = {signum: signal.getsignal(signum) for signum in before}
            print(f"signal handlers restored: {after == before}", flush=True)
    else:
        _job(case, what, directory)
    del dist

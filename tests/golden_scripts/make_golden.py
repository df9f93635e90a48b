"""Regenerate the golden checkpoints in ``tests/golden`` and what loading and resuming them must give.

    python tests/golden_scripts/make_golden.py

When to run it: **only when the checkpoint format changes on purpose** (a new manifest field or
``format_version``, another layout of ``state.pt`` or of the Trainer's entries). The files it writes
are the proof, checked by ``tests/test_golden_checkpoints.py``, that checkpoints written by the
distkit of that day still load and resume bitwise; a refactor that moves modules must pass that
test *without* running this script. If checkpoints written before an intended format change must
still load, keep the old golden files (and their test) beside new ones instead of replacing them.

What it writes, each case in its own directory beside an ``expected.json``:

``plain/``     ``distkit.save_checkpoint`` of a model, its AdamW, a ``ResumeState`` and plain data
               (one process), and the losses of the hand-written loop's next steps.
``managed/``   a ``CheckpointManager`` directory with steps 1 and 2 (one process).
``sharded/``   ``distkit.save_checkpoint`` of an FSDP2 model (``distkit.shard_model``) and its AdamW
               on 2 gloo ranks: DCP's ``.metadata`` and one ``.distcp`` per rank beside ``state.pt``.
``midepoch/``  a 2-rank DDP ``Trainer`` run checkpointed at step 3 of a 6-step epoch
               (``ModelCheckpoint(every_n_steps=3)``), and the losses and weights of steps 4..8 of the
               same run left uninterrupted.

Everything is seeded; models are a few hundred parameters and data is made here, so the whole
directory is about 220 kB and the script takes about 15 s on 2 cores. The 2-rank cases run on
``distkit.testing.run_ranks`` (local gloo processes on 127.0.0.1). Before anything in
``tests/golden`` is replaced, each resumable case is resumed from a copy of its new checkpoint and
must reproduce its uninterrupted run bitwise; otherwise the script stops and writes nothing.

Regenerating gives the same tensors, losses and ``expected.json``, but not the same bytes in every
file: each ``manifest.json`` records its creation time, and DCP's ``.metadata`` records the
directory it was written into and a random save id.

This module is also what the test imports: the models, data and loops below are the ones the
golden files were made with (module level, because the ranks import them by name). It has no side
effects at import.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

import distkit

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CASES = ("plain", "managed", "sharded", "midepoch")

# --------------------------------------------------------------------------------------------------
# Describing what was saved or loaded: exact, readable, and independent of the machine


def digest(tensor: torch.Tensor) -> str:
    """``"float32[12, 8] sha256:<16 hex digits>"`` of a tensor's bytes: equal only if bitwise equal."""
    value = tensor.detach().cpu().contiguous()
    data = value.reshape(-1).view(torch.uint8).numpy().tobytes()
    dtype = str(value.dtype).removeprefix("torch.")
    return f"{dtype}{list(value.shape)} sha256:{hashlib.sha256(data).hexdigest()[:16]}"


def describe(value: Any) -> Any:
    """``value`` as JSON: tensors by :func:`digest`, floats as ``float.hex`` (exact), the rest as is."""
    if isinstance(value, torch.Tensor):
        return digest(value)
    if isinstance(value, Mapping):
        return {str(key): describe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(item) for item in value]
    if isinstance(value, float):
        return value.hex()
    return value


def hexes(values: Any) -> list[str]:
    """Every number of a tensor (flattened) or of a list of floats, as ``float.hex``."""
    if isinstance(values, torch.Tensor):
        values = values.detach().reshape(-1).tolist()
    return [float(v).hex() for v in values]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)  # a DTensor gathers its shards (collective)
    return (full() if full is not None else tensor).detach().clone()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """Every parameter and its AdamW state, whole, by parameter name, described. Collective under FSDP."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    out = {}
    for name, param in inner.named_parameters():
        out[name] = digest(whole(param))
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            out[f"{name}.{key}"] = digest(whole(value))
    return out


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([whole(p).reshape(-1) for p in model.parameters()])


def optimizer_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    # The hyperparameters a checkpoint restores; the rest of a group (foreach, fused, ...) is what
    # this torch version adds by default, not what the checkpoint holds.
    keys = ("lr", "betas", "eps", "weight_decay")
    return [describe({key: group[key] for key in keys}) for group in optimizer.param_groups]


def environment() -> dict[str, str]:
    """What decides the bits of a CPU training step besides the inputs: torch and its CPU kernels."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


@contextmanager
def kept_rng() -> Iterator[None]:
    """Put this process's RNG streams back afterwards (loading a ResumeState replaces them)."""
    saved = distkit.capture_rng_state()
    try:
        yield
    finally:
        distkit.restore_rng_state(saved)


# --------------------------------------------------------------------------------------------------
# The model and the hand-written loop of the plain and managed cases (one process)


class TinyMLP(nn.Module):
    """``inputs -> hidden -> classes`` with dropout, so a resume is exact only if the RNG is restored."""

    def __init__(self, inputs: int = 8, hidden: int = 12, classes: int = 4, dropout: float = 0.25) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(inputs, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)


def loop_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """One step on a batch drawn from the global torch RNG (which a ResumeState restores)."""
    inputs, target = torch.randn(8, 8), torch.randint(0, 4, (8,))
    loss = nn.functional.cross_entropy(model(inputs), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


NOTE = {"name": "golden", "lr": 0.01, "tags": ["a", "b"]}
PLAIN_STEPS = 3  # steps before the checkpoint
PLAIN_STEPS_AFTER = 3  # steps of the resumed loop whose losses are recorded


def loop_state(model: nn.Module, optimizer: torch.optim.Optimizer, progress: Any) -> dict[str, Any]:
    return {"model": model, "optimizer": optimizer, "progress": progress, "note": dict(NOTE)}


def describe_loop_state(model: nn.Module, optimizer: torch.optim.Optimizer, progress: Any) -> dict[str, Any]:
    """What a load must put back: every tensor by digest, the hyperparameters, the loop position."""
    return {
        "model": describe(model.state_dict()),
        "optimizer_state": describe(optimizer.state_dict()["state"]),
        "optimizer_groups": optimizer_groups(optimizer),
        "progress": [progress.epoch, progress.global_step, progress.batches_in_epoch],
    }


def next_draws() -> dict[str, Any]:
    """This process's next draws from torch's, python's and numpy's global generators."""
    return {
        "torch": hexes(torch.rand(4)),
        "python": random.random().hex(),
        "numpy": float(np.random.random()).hex(),
    }


def continue_loop(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The loop's next steps after the checkpoint, and the next draws of every generator."""
    losses = [loop_step(model, optimizer) for _ in range(PLAIN_STEPS_AFTER)]
    return {"losses": hexes(losses), "weights": hexes(flat_weights(model)), "draws": next_draws()}


def fresh_loop_state() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """A model of other weights and an optimizer without state: a load must replace everything."""
    torch.manual_seed(12345)
    model = TinyMLP()
    return model, make_optimizer(model), distkit.ResumeState()


def plain_run() -> tuple[nn.Module, torch.optim.Optimizer, list[float], Any]:
    """The plain case's loop up to its checkpoint: model, optimizer, losses and position."""
    distkit.seed_everything(0, workers=False)
    model = TinyMLP()
    optimizer = make_optimizer(model)
    losses = [loop_step(model, optimizer) for _ in range(PLAIN_STEPS)]
    progress = distkit.ResumeState(epoch=0, global_step=PLAIN_STEPS, batches_in_epoch=PLAIN_STEPS)
    return model, optimizer, losses, progress


def make_plain(out: Path) -> dict[str, Any]:
    model, optimizer, losses, progress = plain_run()
    distkit.save_checkpoint(
        out / "checkpoint",
        loop_state(model, optimizer, progress),
        step=PLAIN_STEPS,
        metrics={"loss": losses[-1]},
    )
    return {
        "step": PLAIN_STEPS,
        "metrics": {"loss": losses[-1].hex()},
        "note": NOTE,
        "loaded": describe_loop_state(model, optimizer, progress),
        "after_resume": continue_loop(model, optimizer),
        "environment": environment(),
    }


def make_managed(out: Path) -> dict[str, Any]:
    distkit.seed_everything(1, workers=False)
    model = TinyMLP()
    optimizer = make_optimizer(model)
    progress = distkit.ResumeState()
    steps = {}
    with distkit.CheckpointManager(out / "checkpoints", keep_last=3) as manager:
        for step in (1, 2):
            loss = loop_step(model, optimizer)
            progress.global_step = progress.batches_in_epoch = step
            manager.save(step, loop_state(model, optimizer, progress), metrics={"loss": loss})
            steps[str(step)] = describe_loop_state(model, optimizer, progress)
    return {"latest": "step_000000002", "steps": steps}


# --------------------------------------------------------------------------------------------------
# The sharded case: FSDP2 on 2 ranks


SHARDED_STEP = 2


def sharded_model() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank before sharding
    return TinyMLP(dropout=0.0)


def shard(model: nn.Module) -> nn.Module:
    # 50: each Linear (108 and 52 parameters) is a unit of its own, the root holds nothing more.
    return distkit.shard_model(model, min_unit_params=50)


def train_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed * 100 + distkit.get_rank())  # each rank its own data
    for _ in range(steps):
        inputs = torch.randn(8, 8, generator=generator)
        target = torch.randint(0, 4, (8,), generator=generator)
        loss = nn.functional.cross_entropy(model(inputs), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def make_sharded_on_rank(path: str) -> dict[str, Any]:
    """Train an FSDP2 model on this rank, save it sharded; its snapshot and this rank's next draws."""
    model = shard(sharded_model())
    optimizer = make_optimizer(model)
    train_sharded(model, optimizer, SHARDED_STEP, seed=1)
    # Each rank's own streams (python, numpy, torch), which the ResumeState records.
    distkit.seed_everything(100 + distkit.get_rank(), workers=False)
    progress = distkit.ResumeState(epoch=1, global_step=SHARDED_STEP, batches_in_epoch=1)
    distkit.save_checkpoint(
        path,
        {"model": model, "optimizer": optimizer, "progress": progress, "note": dict(NOTE)},
        step=SHARDED_STEP,
    )
    return {"snapshot": snapshot(model, optimizer), "draws": next_draws()}


def load_sharded_into_fsdp(path: str) -> dict[str, Any]:
    """Load the golden sharded checkpoint into an FSDP2 model of other weights (and a stepped
    optimizer) on this rank; what it then holds, and this rank's next draws."""
    model = shard(sharded_model())
    optimizer = make_optimizer(model)
    train_sharded(model, optimizer, 1, seed=9)
    progress = distkit.ResumeState()
    state = {"model": model, "optimizer": optimizer, "progress": progress, "note": {}}
    distkit.load_checkpoint(path, state)
    return {
        "snapshot": snapshot(model, optimizer),
        "draws": next_draws(),
        "progress": [progress.epoch, progress.global_step, progress.batches_in_epoch],
        "note": state["note"],
    }


# --------------------------------------------------------------------------------------------------
# The mid-epoch case: a Trainer on 2 DDP ranks


MIDEPOCH_STEP = 3  # the checkpoint's step; an epoch is 6 steps (96 samples, 8 per rank and step)
MIDEPOCH_MAX_STEPS = 8  # the resumed run goes on into the second epoch (a new shuffle) at step 7


class Samples(Dataset):  # type: ignore[type-arg]
    """96 samples of 6 features in 3 classes, made from a fixed seed."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(7)
        self.data = torch.randn(96, 6, generator=generator)
        self.targets = torch.randint(0, 3, (96,), generator=generator)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index], self.targets[index]

    def __len__(self) -> int:
        return len(self.targets)


class RecordLosses(distkit.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_step_end(self, trainer: Any, loss: torch.Tensor) -> None:
        self.losses.append(loss.item())


def midepoch_run(root: str, max_steps: int, resume: str | None) -> dict[str, Any]:
    """Train on this rank of 2 (DDP) with checkpoints every 3 steps in ``root/checkpoints``; this
    rank's losses of the steps it took, the full weights afterwards, and the step it ended at."""
    torch.manual_seed(0)
    model = TinyMLP(inputs=6, hidden=16, classes=3, dropout=0.2)
    record = RecordLosses()
    # every_n_minutes=None: no save by wall-clock time, which would make the saved steps vary.
    checkpoint = distkit.ModelCheckpoint(every_n_steps=3, every_n_epochs=0, every_n_minutes=None, keep_last=5)
    trainer = distkit.Trainer(
        strategy="ddp",
        max_steps=max_steps,
        batch_size=8,
        seed=3,
        resume=resume,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        callbacks=[record, checkpoint],
    )
    trainer.fit(
        model,
        Samples(),
        optimizer=functools.partial(torch.optim.AdamW, lr=0.01),
        loss_fn=nn.functional.cross_entropy,
        lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5),
    )
    return {
        "losses": hexes(record.losses),
        "weights": hexes(flat_weights(model)),
        "step": trainer.global_step,
    }


def describe_trainer_checkpoint(path: str | Path) -> dict[str, Any]:
    """The entries of a Trainer checkpoint read whole, with the parts that say where the run was."""
    state = distkit.load_checkpoint(path)
    progress = state["progress"]
    return {
        "keys": sorted(state),
        "model": describe(state["model"]),
        "optimizer_state": describe(state["optimizer"]["state"]),
        "progress": [progress["epoch"], progress["global_step"], progress["batches_in_epoch"]],
        "progress_world_size": progress["world_size"],
        "lr_scheduler_last_epoch": state["lr_scheduler"]["last_epoch"],
        "train_loader": describe(state["train_loader"]),
    }


# --------------------------------------------------------------------------------------------------
# Generation


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _generate(work: Path) -> dict[str, dict[str, Any]]:
    """Write every case into ``work/<case>`` and return the expected results; resume each resumable
    case from a copy first and stop if it does not reproduce its uninterrupted run bitwise."""
    from distkit.testing import run_ranks

    expected: dict[str, dict[str, Any]] = {}

    expected["plain"] = make_plain(work / "plain")
    with kept_rng():
        model, optimizer, progress = fresh_loop_state()
        distkit.load_checkpoint(work / "plain" / "checkpoint", loop_state(model, optimizer, progress))
        resumed = continue_loop(model, optimizer)
    if resumed != expected["plain"]["after_resume"]:
        raise SystemExit("plain: the loop resumed from the new checkpoint differs from the uninterrupted one")

    expected["managed"] = make_managed(work / "managed")

    ranks = run_ranks(make_sharded_on_rank, str(work / "sharded" / "checkpoint"), world_size=2)
    if ranks[0]["snapshot"] != ranks[1]["snapshot"]:
        raise SystemExit("sharded: the ranks' snapshots of the same FSDP model differ")
    expected["sharded"] = {
        "step": SHARDED_STEP,
        "world_size": 2,
        "note": NOTE,
        "progress": [1, SHARDED_STEP, 1],
        "snapshot": ranks[0]["snapshot"],
        "draws": {str(rank): result["draws"] for rank, result in enumerate(ranks)},
    }

    uninterrupted = run_ranks(
        midepoch_run, str(work / "uninterrupted"), MIDEPOCH_MAX_STEPS, None, world_size=2
    )
    # "Killed" after step 4: the last checkpoint is step 3, in the middle of the first epoch.
    run_ranks(midepoch_run, str(work / "interrupted"), MIDEPOCH_STEP + 1, None, world_size=2)
    checkpoints = _copy(work / "interrupted" / "checkpoints", work / "midepoch" / "checkpoints")
    if sorted(p.name for p in checkpoints.iterdir()) != [f"step_{MIDEPOCH_STEP:09d}"]:
        raise SystemExit(f"midepoch: the interrupted run left {sorted(os.listdir(checkpoints))}")
    _copy(checkpoints, work / "resumed" / "checkpoints")
    resumed_ranks = run_ranks(midepoch_run, str(work / "resumed"), MIDEPOCH_MAX_STEPS, "auto", world_size=2)
    if uninterrupted[0]["weights"] != uninterrupted[1]["weights"]:
        raise SystemExit("midepoch: the DDP ranks' weights differ after the uninterrupted run")
    for rank, (full, resumed_run) in enumerate(zip(uninterrupted, resumed_ranks, strict=True)):
        if (
            resumed_run["losses"] != full["losses"][MIDEPOCH_STEP:]
            or resumed_run["weights"] != full["weights"]
        ):
            raise SystemExit(
                f"midepoch: rank {rank} resumed from step {MIDEPOCH_STEP} differs from the uninterrupted run"
            )
    expected["midepoch"] = {
        "checkpoint_step": MIDEPOCH_STEP,
        "max_steps": MIDEPOCH_MAX_STEPS,
        "checkpoint": describe_trainer_checkpoint(checkpoints / f"step_{MIDEPOCH_STEP:09d}"),
        "losses_after_resume": {
            str(rank): result["losses"][MIDEPOCH_STEP:] for rank, result in enumerate(uninterrupted)
        },
        "final_weights": uninterrupted[0]["weights"],
        "environment": environment(),
    }
    return expected


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="distkit-golden-") as tmp:
        work = Path(tmp)
        expected = _generate(work)
        GOLDEN.mkdir(exist_ok=True)
        for case in CASES:
            target = GOLDEN / case
            if target.exists():
                shutil.rmtree(target)
            target.mkdir()
            for entry in ("checkpoint", "checkpoints"):
                if (work / case / entry).exists():
                    _copy(work / case / entry, target / entry)
            text = json.dumps(expected[case], indent=1, sort_keys=True) + "\n"
            (target / "expected.json").write_text(text)
            # The modes a git checkout gives (distkit writes 0o600 and 0o700), so that the test here
            # reads the files as it will in a fresh clone.
            for path in [target, *target.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
    total = sum(p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file())
    print(f"wrote {', '.join(CASES)} to {GOLDEN} ({total / 1024:.0f} KiB of files)")
    return 0


if __name__ == "__main__":
    # The ranks import the functions they run by module name, which __main__ is not in their
    # processes: run from this file imported as golden_scripts.make_golden (tests/ on sys.path).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from golden_scripts import make_golden

    sys.exit(make_golden.main())

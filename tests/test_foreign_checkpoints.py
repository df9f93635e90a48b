"""Checkpoints of other tools (issue 28, point 1): a torch.distributed.checkpoint directory as
torchtitan writes it loads as it is, on any world size, into plain and FSDP2 modules and through
``Trainer(resume=...)``; an Accelerate ``save_state`` directory and a Lightning ``.ckpt`` are
converted by ``distkit checkpoint import`` into checkpoints the Trainer resumes from with the same
weights; and every other path says what it is and the command that loads it, never "a save that did
not finish" unless it is one.

The foreign checkpoints are written with plain torch code in the layouts of those tools, with their
file names and keys (torchtitan's components/checkpoint.py and optimizer.py, Accelerate's
checkpointing.py and utils/constants.py, Lightning's checkpoint_connector.py dump_checkpoint), so
none of them needs to be installed. Sharded writes and FSDP loads run on real gloo ranks.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import distkit
from _launch import launcher_free_env
from distkit import Callback, CheckpointCorruptError, ForeignCheckpointError, ResumeState, Trainer
from distkit.cli import main
from test_sharded_checkpoint import assert_same, optimizer_for, snapshot

# --------------------------------------------------------------------------------------------------
# Models, training and snapshots (module level: the ranks import them by name)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed * 1000 + distkit.get_rank())
    for _ in range(steps):
        loss = model(torch.randn(8, 8, generator=generator)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A plain model and its AdamW after two steps: what the other tools saved."""
    model = make_model()
    optimizer = optimizer_for(model)
    train(model, optimizer, 2, seed=1)
    return model, optimizer


# --------------------------------------------------------------------------------------------------
# torchtitan's layout, written by two FSDP2 ranks


def write_dcp(directory: str, layout: str) -> dict[str, torch.Tensor]:
    """Train an FSDP2 model (distkit.shard_model) on this rank, save it with dcp.save as torchtitan
    does, and return its snapshot.

    ``"nested"``: ``dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})``.
    ``"torchtitan"``: what torchtitan's CheckpointManager saves: the model's keys at the top level
    (``_flattened_model_states_sd``), the optimizer flattened by parameter name (OptimizersContainer:
    ``flatten_optimizer_state_dict=True``), an LR scheduler's state and ``train_state.step``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = distkit.shard_model(make_model())
    optimizer = optimizer_for(model)
    train(model, optimizer, 2, seed=1)
    if layout == "nested":
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        state = {
            **get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=flat),
            "lr_scheduler": scheduler.state_dict(),
            "train_state": {"step": torch.tensor(2, dtype=torch.int32)},
        }
    dcp.save(state, checkpoint_id=directory)
    return snapshot(model, optimizer)


def load_into_fsdp(path: str) -> dict[str, torch.Tensor]:
    model = distkit.shard_model(make_model())
    optimizer = optimizer_for(model)
    train(model, optimizer, 1, seed=9)  # other values everywhere, and optimizer state to replace
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the entries this state lacks: checked in the one-rank load
        distkit.load_checkpoint(path, {"model": model, "optimizer": optimizer})
    return snapshot(model, optimizer)


@pytest.mark.parametrize("layout", ["nested", "torchtitan"])
def test_a_dcp_checkpoint_of_two_fsdp_ranks_loads_whole_on_one_rank_and_resharded_on_two(
    tmp_path: Path, ranks, layout: str
) -> None:
    directory = str(tmp_path / "step-2")
    saved = ranks.run(write_dcp, directory, layout, world_size=2, timeout_s=90)[0]
    assert "manifest.json" not in os.listdir(directory) and ".metadata" in os.listdir(directory)
    model = make_model()
    optimizer = optimizer_for(model)
    train(model, optimizer, 1, seed=9)
    progress = ResumeState()
    with pytest.warns(UserWarning) as caught:
        loaded = distkit.load_checkpoint(
            directory, {"model": model, "optimizer": optimizer, "progress": progress}
        )
    assert sorted(loaded) == ["model", "optimizer"]
    assert_same(snapshot(model, optimizer), saved)  # 2 -> 1, no process group, a plain module
    (warning,) = [str(w.message) for w in caught]
    assert "torch.distributed.checkpoint directory without a distkit manifest" in warning
    assert (
        "loaded ['model', 'optimizer']" in warning and "it has no ['progress'], which start fresh" in warning
    )
    if layout == "torchtitan":
        assert "it also holds ['lr_scheduler', 'train_state'], which distkit does not load" in warning
    assert progress.global_step == 0
    for resharded in ranks.run(load_into_fsdp, directory, world_size=2, timeout_s=90):  # 2 -> 2, FSDP
        assert_same(resharded, saved)


# --------------------------------------------------------------------------------------------------
# Training continues through Trainer(resume=...)


class StartState(Callback):
    """The weights and optimizer state (whole) and the step the fit starts from."""

    def on_fit_start(self, trainer) -> None:  # type: ignore[no-untyped-def]
        self.step = trainer.global_step
        self.weights = snapshot(trainer.model, trainer.optimizer)


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_step_end(self, trainer, loss: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        self.losses.append(float(loss))


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    return torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator)
    )


def resume_fit(
    root: str, resume: str, strategy: str
) -> tuple[int, dict[str, torch.Tensor], list[float], int]:
    """Fit 3 steps from ``resume`` (``strategy``: "single", or "fsdp" with two units); the step and
    state it started from, its losses, its last step."""
    start, losses = StartState(), Losses()
    trainer = Trainer(
        default_root_dir=root,
        strategy=distkit.FSDPStrategy(min_unit_params=100) if strategy == "fsdp" else strategy,
        max_steps=3,
        batch_size=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        resume=resume,
        callbacks=[start, losses],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(
            make_model(),
            dataset(),
            optimizer=lambda params: torch.optim.AdamW(params, lr=0.01),
            loss_fn=nn.functional.cross_entropy,
        )
    fresh = [str(w.message) for w in caught if "start fresh" in str(w.message)]
    assert len(fresh) == 1 and "'progress'" in fresh[0] and "'counters'" in fresh[0], fresh
    return start.step, start.weights, losses.losses, trainer.global_step


def test_the_trainer_resumes_from_a_torchtitan_checkpoint_on_one_rank_and_on_two_fsdp_ranks(
    tmp_path: Path, ranks
) -> None:
    directory = str(tmp_path / "checkpoint" / "step-2")
    saved = ranks.run(write_dcp, directory, "torchtitan", world_size=2, timeout_s=90)[0]
    step, weights, losses, last = resume_fit(str(tmp_path / "one"), directory, "single")
    assert step == 0 and last == 3 and len(losses) == 3
    assert_same(weights, saved)  # it starts from the loaded weights and Adam moments
    two = ranks.run(resume_fit, str(tmp_path / "two"), directory, "fsdp", timeout_s=90)
    for step, weights, losses, last in two:
        assert step == 0 and last == 3 and len(losses) == 3 and all(np.isfinite(losses))
        assert_same(weights, saved)


# --------------------------------------------------------------------------------------------------
# distkit checkpoint import: Accelerate and Lightning


def distkit_command(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m distkit.cli`` of the distkit these tests import, in a world of one."""
    src = str(Path(distkit.__file__).resolve().parent.parent)
    env = launcher_free_env()
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "distkit.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors format (an 8-byte header length, a JSON header, the raw bytes), written by
    hand: the package need not be installed to make one."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, tensor in tensors.items():
        data = tensor.detach().contiguous().numpy().tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def write_accelerate(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, safe: bool
) -> None:
    """What ``Accelerator.save_state(directory)`` writes for a DDP model (``get_state_dict(model,
    unwrap=False)``: keys under ``module.``), an optimizer, a scheduler and process 0's RNG states."""
    directory.mkdir(parents=True)
    weights = {f"module.{name}": value for name, value in model.state_dict().items()}
    if safe:
        write_safetensors(directory / "model.safetensors", weights)
    else:
        torch.save(weights, directory / "pytorch_model.bin")
    torch.save(optimizer.state_dict(), directory / "optimizer.bin")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    torch.save(scheduler.state_dict(), directory / "scheduler.bin")
    torch.save(
        {
            "step": 0,  # Accelerator.step: the gradient-accumulation counter, not a training step
            "random_state": random.getstate(),
            "numpy_random_seed": np.random.get_state(),
            "torch_manual_seed": torch.get_rng_state(),
        },
        directory / "random_states_0.pkl",
    )


def write_lightning(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, **extra: object) -> None:
    """What Lightning's ``dump_checkpoint`` writes for a LightningModule holding the model as
    ``self.model``: its ``state_dict`` keys start with ``model.``."""
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    checkpoint = {
        "epoch": 1,
        "global_step": 12,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": {f"model.{name}": value for name, value in model.state_dict().items()},
        "loops": {"fit_loop": {"state_dict": {}, "epoch_loop.state_dict": {"_batches_that_stepped": 12}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 0, 'every_n_epochs': 1, "
            "'train_time_interval': None}": {
                "best_model_score": None,
                "best_model_path": "",
                "kth_value": torch.tensor(float("inf")),
                "dirpath": "lightning_logs/version_0/checkpoints",
            }
        },
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [scheduler.state_dict()],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 0.01, "hidden": 16},
        **extra,
    }
    torch.save(checkpoint, path)


@pytest.mark.parametrize("safe", [False, True], ids=["pytorch_model.bin", "model.safetensors"])
def test_an_accelerate_save_state_imported_by_the_command_resumes_in_the_trainer_with_its_weights(
    tmp_path: Path, safe: bool
) -> None:
    model, optimizer = trained()
    source = tmp_path / "project" / "checkpoints" / "step_40"
    write_accelerate(source, model, optimizer, safe=safe)
    dest = tmp_path / "imported"
    done = distkit_command("checkpoint", "import", str(source), str(dest))
    if safe and not _has_safetensors():
        assert done.returncode == 1, done.stdout + done.stderr
        assert "needs the safetensors package: pip install safetensors" in done.stderr, done.stderr
        assert not dest.exists()
        return
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert f"imported Accelerate save_state directory {source} into {dest} (step 40)" in out, out
    assert "pytorch_model.bin" in out or "model.safetensors" in out
    assert "optimizer.bin: 4 parameter(s) in 1 group(s)" in out
    for left in ("scheduler.bin", "random_states_0.pkl"):
        assert left in out.split("not carried over:")[1], out
    assert "removed DDP's 'module.'" in out
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["step"] == 40 and manifest["source"] == {"tool": "accelerate", "version": ""}
    step, weights, losses, last = resume_fit(str(tmp_path / "run"), str(dest), "single")
    assert step == 0 and last == 3 and len(losses) == 3
    assert_same(weights, snapshot(model, optimizer))


def _has_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return False
    return True


def test_a_lightning_ckpt_imported_by_the_command_resumes_in_the_trainer_with_its_weights(
    tmp_path: Path,
) -> None:
    model, optimizer = trained()
    source = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=1-step=12.ckpt"
    source.parent.mkdir(parents=True)
    write_lightning(source, model, optimizer)
    dest = tmp_path / "imported"
    done = distkit_command("checkpoint", "import", str(source), str(dest))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert f"imported Lightning checkpoint {source} into {dest} (step 12)" in out, out
    assert "state_dict: 4 tensor(s)" in out and "optimizer_states[0]: 4 parameter(s)" in out
    left = out.split("not carried over:")[1]
    for key in ("loops", "callbacks", "lr_schedulers", "hyper_parameters"):
        assert f"  {key} " in left, out
    assert "stripped the prefix 'model.'" in out and "--strip-prefix ''" in out
    assert "step 12 is Lightning's global_step" in out
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["step"] == 12 and manifest["source"] == {"tool": "lightning", "version": "2.4.0"}
    assert main(["checkpoint", "inspect", str(dest), "--verify"]) == 0  # a normal, verified checkpoint
    step, weights, losses, last = resume_fit(str(tmp_path / "run"), str(dest), "single")
    assert step == 0 and last == 3 and len(losses) == 3
    assert_same(weights, snapshot(model, optimizer))


def test_import_keeps_the_prefix_when_asked_and_refuses_a_prefix_no_key_has(tmp_path: Path) -> None:
    model, optimizer = trained()
    write_lightning(tmp_path / "last.ckpt", model, optimizer)
    report = distkit.import_checkpoint(tmp_path / "last.ckpt", tmp_path / "kept", strip_prefix="")
    assert report.step == 12 and sorted(report.carried) == ["model", "optimizer"]
    state = torch.load(tmp_path / "kept" / "state.pt", weights_only=True)
    assert sorted(state["model"]) == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight"]
    with pytest.raises(
        ValueError, match=r"no key of the model's state dict starts with 'net\.'.*\['model\.'\]"
    ):
        distkit.import_checkpoint(tmp_path / "last.ckpt", tmp_path / "other", strip_prefix="net")
    assert not (tmp_path / "other").exists()
    with pytest.raises(
        FileExistsError, match=r"already holds a checkpoint \(step 12\); import never replaces"
    ):
        distkit.import_checkpoint(tmp_path / "last.ckpt", tmp_path / "kept")


def test_a_lightning_ckpt_with_objects_weights_only_refuses_names_them_and_the_way_out(
    tmp_path: Path,
) -> None:
    import argparse

    model, optimizer = trained()
    write_lightning(
        tmp_path / "last.ckpt", model, optimizer, hyper_parameters={"args": argparse.Namespace(lr=1)}
    )
    with pytest.raises(distkit.DistkitError) as caught:
        distkit.import_checkpoint(tmp_path / "last.ckpt", tmp_path / "out")
    message = str(caught.value)
    assert "argparse.Namespace" in message and "never unpickles arbitrary objects" in message
    assert "torch.serialization.safe_globals" in message and "hyper_parameters" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["truncated", "random bytes", "text"])
def test_a_damaged_or_foreign_file_to_import_is_named_as_such_not_as_unsafe(
    tmp_path: Path, damage: str
) -> None:
    """Was: a truncated .ckpt gave miniz's RuntimeError and a text file `KeyError: 101`, each as a
    traceback from torch; random bytes were called "objects that weights_only does not allow",
    with advice to load the file with weights_only=False."""
    model, optimizer = trained()
    whole = tmp_path / "whole.ckpt"
    write_lightning(whole, model, optimizer)
    source = tmp_path / "last.ckpt"
    if damage == "truncated":
        source.write_bytes(whole.read_bytes()[:3000])  # a copy that did not finish
    elif damage == "random bytes":
        source.write_bytes(random.Random(0).randbytes(4096))
    else:
        source.write_text("hello\n")
    with pytest.raises(distkit.DistkitError) as caught:
        distkit.import_checkpoint(source, tmp_path / "out")
    message = str(caught.value)
    assert message.startswith(
        f"cannot read {source} (read as a Lightning checkpoint): it is not a complete file written by "
        f"torch.save (truncated, damaged, or another kind of file; torch.load says "
    ), message
    assert "Copy it again from where it was saved" in message, message
    assert "weights_only=False" not in message and "does not allow" not in message, message
    assert not (tmp_path / "out").exists()
    done = distkit_command("checkpoint", "import", str(source), str(tmp_path / "out"))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "it is not a complete file written by torch.save" in done.stderr, done.stderr


# --------------------------------------------------------------------------------------------------
# What a path that is not a distkit checkpoint is said to be


def write_plain_dcp(directory: Path) -> None:
    """A DCP checkpoint of one process (torchtitan's layout, a model and its optimizer)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model, optimizer = trained()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {
        **get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=flat),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group says it assumes one process
        dcp.save(state, checkpoint_id=str(directory))


def test_each_foreign_layout_is_named_with_the_command_that_loads_or_converts_it(tmp_path: Path) -> None:
    model, optimizer = trained()
    accelerate = tmp_path / "checkpoint_3"
    write_accelerate(accelerate, model, optimizer, safe=False)
    lightning = tmp_path / "last.ckpt"
    write_lightning(lightning, model, optimizer)
    state = {"model": make_model()}
    for path, kind, says in (
        (accelerate, "accelerate", "an Accelerate save_state directory (optimizer.bin, pytorch_model.bin"),
        (lightning, "lightning", "a Lightning checkpoint"),
    ):
        with pytest.raises(ForeignCheckpointError) as caught:
            distkit.load_checkpoint(path, state)
        assert caught.value.kind == kind
        message = str(caught.value)
        assert message.startswith(f"{path} is not a distkit checkpoint: it looks like {says}"), message
        assert f"`distkit checkpoint import {path} DEST`" in message and "did not finish" not in message
        with pytest.raises(ForeignCheckpointError, match="distkit checkpoint import"):  # and the Trainer
            resume_fit(str(tmp_path / "run"), str(path), "single")
    dcp_dir = tmp_path / "step-100"
    write_plain_dcp(dcp_dir)
    with pytest.raises(ForeignCheckpointError) as caught:
        distkit.consolidate_checkpoint(dcp_dir, tmp_path / "full")  # needs a distkit checkpoint
    assert caught.value.kind == "dcp"
    assert f"distkit loads it as it is: distkit.load_checkpoint('{dcp_dir}'" in str(caught.value)
    assert f"Trainer(resume='{dcp_dir}')" in str(caught.value)
    sharded = tmp_path / "epoch=0-step=5.ckpt"  # Lightning's FSDP sharded checkpoint: DCP plus meta.pt
    write_plain_dcp(sharded)
    torch.save({"global_step": 5}, sharded / "meta.pt")
    with pytest.raises(ForeignCheckpointError, match=r"Lightning FSDP checkpoint .*consolidate_checkpoint"):
        distkit.load_checkpoint(sharded, state)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "readme.txt").write_text("not a checkpoint")
    with pytest.raises(ForeignCheckpointError, match=r"a directory of other files \(readme\.txt\)") as caught:
        distkit.load_checkpoint(other, state)
    assert caught.value.kind == "unknown" and "did not finish" not in str(caught.value)


def test_only_a_distkit_save_that_did_not_finish_is_called_one(tmp_path: Path) -> None:
    distkit.save_checkpoint(tmp_path / "done", {"w": torch.ones(2)})
    unfinished = tmp_path / "unfinished"  # an object store's put of state.pt before its manifest's
    unfinished.mkdir()
    (unfinished / "state.pt").write_bytes((tmp_path / "done" / "state.pt").read_bytes())
    with pytest.raises(CheckpointCorruptError, match=r"no manifest\.json \(a save that did not finish"):
        distkit.load_checkpoint(unfinished)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointCorruptError, match=r"an empty directory, with no manifest\.json"):
        distkit.load_checkpoint(tmp_path / "empty")


def test_a_checkpoint_manager_directory_given_as_one_checkpoint_is_named_with_its_highest_complete_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A natural slip: the directory of the run's checkpoints instead of one of them.
    directory = tmp_path / "checkpoints"
    manager = distkit.CheckpointManager(directory)
    for step in (9, 10):
        manager.save(step, {"w": torch.full((2,), float(step))})
    newest = f"{directory}/step_000000010"
    state = {"w": torch.zeros(2)}
    with pytest.raises(ForeignCheckpointError) as caught:
        distkit.load_checkpoint(directory, state)
    message = str(caught.value)
    assert caught.value.kind == "manager" and caught.value.suggested == newest, message
    again = pickle.loads(pickle.dumps(caught.value))  # as it crosses to the other ranks
    assert (str(again), again.suggested, again.kind) == (message, newest, "manager")
    assert message.startswith(
        f"{directory} is not one checkpoint: it is a CheckpointManager directory holding 2 step "
        f"checkpoint(s) (step_000000009, step_000000010)"
    ), message
    assert f"distkit.load_checkpoint('{newest}', state)" in message
    assert f"`distkit checkpoint list {directory}`" in message
    assert "no checkpoint distkit knows" not in message
    assert torch.equal(state["w"], torch.zeros(2))  # nothing was loaded
    distkit.load_checkpoint(newest, state)  # what the message says works
    assert torch.equal(state["w"], torch.full((2,), 10.0))
    assert main(["checkpoint", "inspect", str(directory)]) == 1
    assert f"`distkit checkpoint inspect {newest}`" in capsys.readouterr().err
    with pytest.raises(ForeignCheckpointError, match=re.escape(f"Trainer(resume='{newest}')")):
        resume_fit(str(tmp_path / "run"), str(directory), "single")
    # A save killed before its manifest: a higher step that must not be the one recommended.
    (directory / "step_000000011").mkdir()
    (directory / "step_000000011" / "state.pt").write_bytes(b"half")
    with pytest.raises(ForeignCheckpointError) as caught:
        distkit.load_checkpoint(directory, state)
    message = str(caught.value)
    assert (
        "3 step checkpoint(s) (step_000000009, step_000000010, step_000000011); step_000000011 did not "
        "finish (no manifest.json)"
    ) in message, message
    assert f"distkit.load_checkpoint('{newest}', state)" in message, message
    assert main(["checkpoint", "inspect", str(directory)]) == 1
    assert f"`distkit checkpoint inspect {newest}`" in capsys.readouterr().err
    (directory / "step_000000011" / "state.pt").unlink()
    (directory / "step_000000011").rmdir()
    # The run's directory (the Trainer's default_root_dir) instead of its checkpoints sub-directory.
    (tmp_path / "metrics.csv").write_text("step\n")
    with pytest.raises(ForeignCheckpointError) as caught:
        distkit.load_checkpoint(tmp_path, state)
    message = str(caught.value)
    assert caught.value.kind == "manager" and caught.value.path == str(tmp_path), message
    assert caught.value.suggested == newest, message
    assert message.startswith(
        f"{tmp_path} is not one checkpoint: it looks like a Trainer run directory (checkpoints, "
        f"checkpoints.distkit-lock, metrics.csv) whose checkpoints are in {directory}, 2 step checkpoint(s)"
    ), message
    assert f"distkit.load_checkpoint('{newest}', state)" in message
    assert f"Trainer(default_root_dir='{tmp_path}', resume='auto') continues that run" in message
    notes = tmp_path / "notes"  # a file named checkpoints is no run's checkpoint directory
    notes.mkdir()
    (notes / "checkpoints").write_text("not a directory")
    with pytest.raises(ForeignCheckpointError, match=r"a directory of other files \(checkpoints\)") as caught:
        distkit.load_checkpoint(notes, state)
    assert caught.value.kind == "unknown"


def test_a_dcp_checkpoint_of_another_model_is_refused_before_loading_and_strict_false_loads_what_fits(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "step-7"
    write_plain_dcp(directory)
    wider = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    before = [p.detach().clone() for p in wider.parameters()]
    with pytest.raises(
        distkit.DistkitError, match=r"size mismatch for 0\.weight: copying a param with shape"
    ):
        distkit.load_checkpoint(directory, {"model": wider})
    assert all(torch.equal(a, b) for a, b in zip(before, wider.parameters(), strict=True))
    longer = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Linear(4, 4))
    with pytest.raises(distkit.DistkitError, match=r'Missing key\(s\) in state_dict: "3\.weight", "3\.bias"'):
        distkit.load_checkpoint(directory, {"model": longer})
    with pytest.warns(UserWarning, match="torch.distributed.checkpoint directory"):
        distkit.load_checkpoint(directory, {"model": longer}, strict=False)
    assert torch.equal(longer[0].weight, trained()[0][0].weight)
    with pytest.raises(distkit.DistkitError, match=r"holds no weights of state\['net'\]"):
        distkit.load_checkpoint(directory, {"net": nn.Linear(3, 3)})
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=1, logger=False, enable_progress_bar=False, resume=str(directory)
    )
    with pytest.raises(
        distkit.DistkitError, match=r"the model changed since that checkpoint was saved"
    ) as caught:
        trainer.fit(
            wider,
            dataset(),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            loss_fn=nn.functional.cross_entropy,
        )
    assert "0.weight: (16, 8) in the checkpoint, (32, 8) in this model" in str(caught.value)


# --------------------------------------------------------------------------------------------------
# A directory of torchtitan's step-N checkpoints: latest(), restore(), resume="auto", list


def test_latest_and_resume_auto_in_a_directory_of_torchtitan_step_dirs_name_them_and_the_way_to_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "root" / "checkpoints"
    for step in (100, 200):
        write_plain_dcp(directory / f"step-{step}")
    newest = directory / "step-200"
    manager = distkit.CheckpointManager(directory)
    with pytest.raises(ForeignCheckpointError) as caught:
        manager.latest()
    message = str(caught.value)
    assert caught.value.kind == "dcp" and caught.value.path == str(newest)
    assert "holds no distkit checkpoint" in message and "2 of another tool: step-200, step-100" in message
    assert "torch.distributed.checkpoint directory" in message and f"Trainer(resume='{newest}')" in message
    with pytest.raises(ForeignCheckpointError, match="step-200"):
        manager.restore({"model": make_model()})
    manager.close()
    trainer = Trainer(
        default_root_dir=tmp_path / "root",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        resume="auto",
    )
    with pytest.raises(ForeignCheckpointError, match=r"Trainer\(resume='auto'\)\) resumes only from its own"):
        trainer.fit(
            make_model(),
            dataset(),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            loss_fn=nn.functional.cross_entropy,
        )
    assert main(["checkpoint", "list", str(directory)]) == 0
    assert "holds no distkit checkpoint (step_<N> directories" in capsys.readouterr().out


def test_resume_auto_in_an_empty_directory_still_starts_fresh_in_silence(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    assert distkit.CheckpointManager(tmp_path / "checkpoints").latest() is None
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=1, logger=False, enable_progress_bar=False, resume="auto"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(
            make_model(),
            dataset(),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            loss_fn=nn.functional.cross_entropy,
        )
    assert trainer.global_step == 1

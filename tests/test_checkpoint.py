"""Checkpoints on real files, fsspec's memory filesystem and 2-rank gloo groups: atomic commits,
safe loads, retention, async saves, exact resume, writers killed mid-save, malformed manifests,
FIFOs and symlinks, real write errors (a full tmpfs, a file-size limit), and one run and one
writer per directory (a kernel lock, a killed holder, an object-store lease)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pathlib
import random
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import traceback
import uuid
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import ClassVar

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from torch import nn

import distkit
from _launch import launcher_free_env
from distkit.checkpoint import CheckpointCorruptError, ResumeState

WRITER = pathlib.Path(__file__).parent / "checkpoint_scripts" / "killed_writer.py"
FAILING_WRITE = pathlib.Path(__file__).parent / "checkpoint_scripts" / "failing_write.py"
LOCK_HOLDER = pathlib.Path(__file__).parent / "checkpoint_scripts" / "lock_holder.py"


@pytest.fixture
def memory_root() -> Iterator[str]:
    # fsspec's memory filesystem is one store per process: give each test its own root.
    root = f"memory://ckpt-{uuid.uuid4().hex[:12]}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


class RecordingMemoryFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem under its own protocol, noting for each checkpoint that starts to
    be deleted which checkpoints were committed (held a manifest) at that moment."""

    protocol = ("recordmem",)
    store: ClassVar[dict[str, object]] = {}  # its own store, apart from memory://
    pseudo_dirs: ClassVar[list[str]] = [""]
    # (step directory, the committed step directories at its first deletion), in order.
    deletions: ClassVar[list[tuple[str, list[str]]]] = []

    @classmethod
    def _strip_protocol(cls, path):  # type: ignore[no-untyped-def]
        return super()._strip_protocol(path.removeprefix("recordmem://") if isinstance(path, str) else path)

    def _rm(self, path):  # type: ignore[no-untyped-def]
        parts = self._strip_protocol(path).split("/")
        step = next((part for part in parts if re.fullmatch(r"step_\d{9}", part)), None)
        if step is not None and step not in [deleted for deleted, _ in self.deletions]:
            committed = sorted(key.split("/")[-2] for key in self.store if key.endswith("/manifest.json"))
            self.deletions.append((step, committed))
        super()._rm(path)


fsspec.register_implementation("recordmem", RecordingMemoryFileSystem, clobber=True)


@pytest.fixture
def recording_root() -> Iterator[str]:
    RecordingMemoryFileSystem.store.clear()
    RecordingMemoryFileSystem.deletions.clear()
    yield f"recordmem://ckpt-{uuid.uuid4().hex[:12]}"
    RecordingMemoryFileSystem.store.clear()
    RecordingMemoryFileSystem.deletions.clear()


def read_bytes(path: str) -> bytes:
    with fsspec.open(path, "rb") as f:
        return f.read()


def committed_steps(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.glob("step_*") if (p / "manifest.json").exists())


def damage_one_byte(file: pathlib.Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


# --------------------------------------------------------------------------------------------------
# Exact round trip and resume


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_training() -> dict[str, object]:
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
        "scaler": torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1),
        "progress": ResumeState(),
    }


def train_steps(parts: dict[str, object], steps: int) -> list[float]:
    # Every source of randomness a loop uses: torch (data, dropout), python and numpy (augmentation).
    model, optimizer = parts["model"], parts["optimizer"]
    scheduler, scaler, progress = parts["scheduler"], parts["scaler"], parts["progress"]
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8) * (1 + random.random()) + float(np.random.rand())
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        progress.global_step += 1
        progress.batches_in_epoch += 1
        losses.append(loss.item())
    return losses


def test_round_trip_of_model_optimizer_scheduler_scaler_rng_and_position_is_exact(tmp_path) -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    original = make_training()
    train_steps(original, 3)
    original["progress"].epoch = 1
    distkit.save_checkpoint(tmp_path / "ckpt", original, step=3)
    expected = train_steps(original, 4)

    resumed = make_training()  # fresh objects, different initial weights
    torch.manual_seed(123)  # and different RNG streams until the load
    random.seed(123)
    np.random.seed(123)
    distkit.load_checkpoint(tmp_path / "ckpt", resumed)
    assert (resumed["progress"].epoch, resumed["progress"].global_step) == (1, 3)
    assert resumed["progress"].batches_in_epoch == 3
    assert resumed["scheduler"].last_epoch == 3 and resumed["scaler"].get_scale() > 0
    assert train_steps(resumed, 4) == expected
    for name in ("model", "optimizer", "scheduler", "scaler"):
        torch.testing.assert_close(resumed[name].state_dict(), original[name].state_dict(), rtol=0, atol=0)


def test_manifest_records_step_world_size_versions_metrics_and_checksum(tmp_path) -> None:
    path = distkit.save_checkpoint(tmp_path / "c", {"w": torch.ones(3)}, step=7, metrics={"loss": 0.5})
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    data = (tmp_path / "c" / "state.pt").read_bytes()
    assert path == str(tmp_path / "c")
    assert manifest["step"] == 7 and manifest["world_size"] == 1
    assert manifest["torch_version"] == torch.__version__
    assert manifest["distkit_version"] == distkit.__version__
    assert manifest["metrics"] == {"loss": 0.5} and manifest["keys"] == ["w"]
    assert manifest["files"] == {"state.pt": {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}}


def test_files_are_readable_by_the_owner_only_unless_file_mode_says_otherwise(tmp_path) -> None:
    distkit.save_checkpoint(tmp_path / "private", {"w": torch.ones(1)})
    distkit.save_checkpoint(tmp_path / "shared", {"w": torch.ones(1)}, file_mode=0o640)
    for name, file_mode, dir_mode in (("private", 0o600, 0o700), ("shared", 0o640, 0o750)):
        assert (tmp_path / name).stat().st_mode & 0o777 == dir_mode
        for file in ("state.pt", "manifest.json"):
            assert (tmp_path / name / file).stat().st_mode & 0o777 == file_mode
    with pytest.raises(ValueError, match="file_mode"):
        distkit.save_checkpoint(tmp_path / "x", {"w": torch.ones(1)}, file_mode=0o444)


def test_saving_again_replaces_the_checkpoint_and_leaves_no_temporary_files(tmp_path) -> None:
    distkit.save_checkpoint(tmp_path / "c", {"w": torch.zeros(2)})
    distkit.save_checkpoint(tmp_path / "c", {"w": torch.ones(2)})
    assert torch.equal(distkit.load_checkpoint(tmp_path / "c")["w"], torch.ones(2))
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_saving_over_a_directory_of_other_files_is_refused(tmp_path) -> None:
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        distkit.save_checkpoint(tmp_path / "precious", {"w": torch.ones(1)})
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"


def test_plain_values_and_tensors_are_restored_into_the_given_mapping(tmp_path) -> None:
    buffer = torch.zeros(3)
    distkit.save_checkpoint(tmp_path / "c", {"buffer": torch.arange(3.0), "epoch": 4, "names": ["a"]})
    state = {"buffer": buffer, "epoch": 0, "names": []}
    loaded = distkit.load_checkpoint(tmp_path / "c", state)
    assert state["buffer"] is buffer and torch.equal(buffer, torch.arange(3.0))
    assert state["epoch"] == 4 and state["names"] == ["a"] and loaded["epoch"] == 4


def test_a_module_given_as_the_state_is_refused_naming_the_mapping_to_pass(tmp_path) -> None:
    # save_checkpoint(path, model) and load_checkpoint(path, model): the slip of leaving out {"model": ...}.
    model = nn.Linear(2, 2)
    expected = r"state must be a mapping of names to objects, e\.g\. \{'model': model\}, got Linear"
    with pytest.raises(TypeError, match=expected):
        distkit.save_checkpoint(tmp_path / "a", model)
    distkit.save_checkpoint(tmp_path / "b", {"model": model})
    with pytest.raises(TypeError, match=expected):  # was "'Linear' object is not iterable"
        distkit.load_checkpoint(tmp_path / "b", model)
    with pytest.raises(TypeError, match=expected):  # before looking for the path
        distkit.load_checkpoint(tmp_path / "nowhere", model)


@pytest.mark.parametrize("step", ["3", -1, 1.0, True, torch.tensor(3)])
def test_a_step_a_load_would_refuse_is_refused_before_anything_is_written(tmp_path, step) -> None:
    # Was: saved and committed, then refused by every load as "not usable" (its manifest's step).
    with pytest.raises(ValueError, match=r"step must be an integer >= 0 or None, got "):
        distkit.save_checkpoint(tmp_path / "c", {"model": nn.Linear(2, 2)}, step=step)
    assert not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match=r"step must be an integer >= 0"):
        distkit.CheckpointManager(tmp_path / "m").save(step, {"model": nn.Linear(2, 2)})


def test_a_numpy_step_is_recorded_as_an_int_and_metrics_must_be_a_mapping(tmp_path) -> None:
    distkit.save_checkpoint(tmp_path / "c", {"model": nn.Linear(2, 2)}, step=np.int64(4))
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["step"] == 4
    distkit.load_checkpoint(tmp_path / "c", {"model": nn.Linear(2, 2)})
    # Was: AttributeError: 'list' object has no attribute 'items'.
    with pytest.raises(TypeError, match=r"metrics must map names to numbers .* got list"):
        distkit.save_checkpoint(tmp_path / "d", {"model": nn.Linear(2, 2)}, metrics=[("loss", 1.0)])


def test_a_home_path_a_bytes_path_and_a_protocol_typo(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    # Was: a directory named "~" in the working directory (and `rm -rf ~` to clean it up).
    saved = distkit.save_checkpoint("~/ckpt", {"model": nn.Linear(2, 2)})
    assert saved == str(tmp_path / "home" / "ckpt") and not (tmp_path / "~").exists()
    assert distkit.CheckpointManager("~/runs").path_for(3).startswith(str(tmp_path / "home" / "runs"))
    distkit.load_checkpoint(os.fsencode(saved), {"model": nn.Linear(2, 2)})  # was a TypeError
    # Was fsspec's "Protocol not known: s4".
    with pytest.raises(ValueError, match=r"fsspec knows no protocol 's4'\. Did you mean s3://\?"):
        distkit.save_checkpoint("s4://bucket/ckpt", {"model": nn.Linear(2, 2)})


def test_names_of_state_swapped_are_named_not_a_bare_keyerror(tmp_path) -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    distkit.save_checkpoint(tmp_path / "c", {"model": model, "optimizer": optimizer})
    # Was: KeyError: 'param_groups', from torch's Optimizer.load_state_dict.
    with pytest.raises(distkit.DistkitError, match=r"state\['model'\] is a SGD, but .* Are the names"):
        distkit.load_checkpoint(tmp_path / "c", {"model": optimizer, "optimizer": model})
    with pytest.raises(distkit.DistkitError, match=r"state\['optimizer'\] is a Linear, but .* an optim"):
        distkit.load_checkpoint(tmp_path / "c", {"optimizer": model})
    # Was: torch's "don't know how to restore data location of torch.storage.UntypedStorage".
    with pytest.raises(ValueError, match=r"map_location='gpu' is no device torch knows; did you mean 'cuda'"):
        distkit.load_checkpoint(tmp_path / "c", {"model": model}, map_location="gpu")


def test_an_optimizer_state_of_another_kind_is_refused_at_load_not_at_the_first_step(tmp_path) -> None:
    model = nn.Linear(2, 2)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 2)).sum().backward()
    adamw.step()
    distkit.save_checkpoint(tmp_path / "c", {"model": model, "optimizer": adamw})
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # Was: loaded in silence, then KeyError: 'momentum' at sgd.step().
    expected = r"is a SGD, but the checkpoint's optimizer lacks its settings \['dampening', 'momentum'\]"
    with pytest.raises(distkit.DistkitError, match=expected):
        distkit.load_checkpoint(tmp_path / "c", {"optimizer": sgd})
    adam = torch.optim.Adam(model.parameters())  # the same settings: taken
    distkit.load_checkpoint(tmp_path / "c", {"optimizer": adam})
    assert adam.state_dict()["state"][0]["exp_avg"].equal(adamw.state_dict()["state"][0]["exp_avg"])


def test_a_restore_warning_points_at_the_callers_line(tmp_path) -> None:
    manager = distkit.CheckpointManager(tmp_path / "runs")
    manager.save(1, {"model": nn.Linear(2, 2)})
    with pytest.warns(UserWarning, match=r"has no entries \['extra'\]") as caught:
        manager.restore({"model": nn.Linear(2, 2), "extra": torch.zeros(1)}, strict=False)
    assert [w.filename for w in caught] == [__file__]  # was distkit/checkpoint/_manager.py


def test_a_manager_refuses_a_file_or_one_checkpoint_as_its_directory(tmp_path) -> None:
    (tmp_path / "plain.pt").write_text("weights")
    # Was: NotADirectoryError at the first save (and a plain.pt.distkit-lock beside it).
    with pytest.raises(ValueError, match=r"needs a directory .* but .*plain\.pt is a file"):
        distkit.CheckpointManager(tmp_path / "plain.pt")
    distkit.save_checkpoint(tmp_path / "one", {"model": nn.Linear(2, 2)})
    # Was: its steps written inside that checkpoint, in silence.
    with pytest.raises(ValueError, match=r"one is one checkpoint \(it holds manifest\.json\), not a"):
        distkit.CheckpointManager(tmp_path / "one")
    assert sorted(os.listdir(tmp_path / "one")) == ["manifest.json", "state.pt"]
    # Was: "'Linear' object is not iterable".
    with pytest.raises(TypeError, match=r"state must be a mapping of names to objects"):
        distkit.CheckpointManager(tmp_path / "runs").restore(nn.Linear(2, 2))


def test_strict_that_is_not_a_bool_is_refused_not_taken_as_true(tmp_path) -> None:
    distkit.save_checkpoint(tmp_path / "c", {"model": nn.Linear(2, 2)})
    with pytest.raises(TypeError, match=r"strict must be True or False, got str 'no' \(a non-empty string"):
        distkit.load_checkpoint(tmp_path / "c", {"model": nn.Linear(2, 2)}, strict="no")


def test_missing_entries_raise_when_strict_and_are_skipped_with_a_warning_otherwise(tmp_path) -> None:
    distkit.save_checkpoint(tmp_path / "c", {"model": nn.Linear(2, 2)})
    with pytest.raises(distkit.DistkitError, match=r"no entries \['optimizer'\].*holds \['model'\]"):
        distkit.load_checkpoint(tmp_path / "c", {"model": nn.Linear(2, 2), "optimizer": torch.zeros(1)})
    target = torch.zeros(1)
    with pytest.warns(UserWarning, match=r"no entries \['optimizer'\]"):
        distkit.load_checkpoint(tmp_path / "c", {"optimizer": target}, strict=False)
    assert torch.equal(target, torch.zeros(1))


# --------------------------------------------------------------------------------------------------
# Wrappers: DDP / DataParallel / torch.compile prefixes


def test_dataparallel_and_compiled_modules_are_saved_without_wrapper_prefixes(tmp_path) -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    inner[0] = torch.compile(inner[0], backend="eager")  # a compiled submodule: "0._orig_mod.weight"
    wrapped = nn.DataParallel(torch.compile(inner, backend="eager"))
    distkit.save_checkpoint(tmp_path / "c", {"model": wrapped})
    saved = torch.load(tmp_path / "c" / "state.pt", weights_only=True)["model"]
    assert list(saved) == ["0.weight", "0.bias", "1.weight", "1.bias"]

    plain = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    distkit.load_checkpoint(tmp_path / "c", {"model": plain})
    compiled_again = torch.compile(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)), backend="eager")
    distkit.load_checkpoint(tmp_path / "c", {"model": compiled_again})
    for target in (plain, compiled_again._orig_mod):
        assert torch.equal(target[0].weight, inner[0]._orig_mod.weight)
        assert torch.equal(target[1].bias, inner[1].bias)


def test_state_dicts_saved_with_a_module_prefix_load_into_a_plain_module(tmp_path) -> None:
    source = nn.Linear(2, 2)
    legacy = OrderedDict((f"module.{k}", v) for k, v in source.state_dict().items())
    distkit.save_checkpoint(tmp_path / "c", {"model": legacy})
    target = nn.Linear(2, 2)
    distkit.load_checkpoint(tmp_path / "c", {"model": target})
    assert torch.equal(target.weight, source.weight)


# --------------------------------------------------------------------------------------------------
# Safety and integrity


class Payload:
    """Runs code when unpickled: what a malicious checkpoint carries."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (pathlib.Path.touch, (self.marker,))


def test_checkpoint_with_malicious_reduce_payload_is_refused_and_the_payload_never_runs(tmp_path) -> None:
    marker = tmp_path / "payload_ran"
    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    # What an attacker ships: a valid manifest (checksums prove integrity, not trust) and a pickle.
    torch.save({"model": Payload(marker)}, ckpt / "state.pt")
    data = (ckpt / "state.pt").read_bytes()
    manifest = {"format": "distkit-checkpoint", "format_version": 1, "step": 1, "files": {}}
    manifest["files"]["state.pt"] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))

    with pytest.raises(distkit.DistkitError, match=r"refused to load .*state\.pt.*weights_only"):
        distkit.load_checkpoint(ckpt, {"model": nn.Linear(1, 1)})
    shutil.copytree(ckpt, tmp_path / "run" / "step_000000001")
    with pytest.raises(distkit.DistkitError, match="refused to load"):
        distkit.CheckpointManager(tmp_path / "run").restore({"model": nn.Linear(1, 1)})
    assert not marker.exists()
    # The payload is live: an unsafe load runs it. Without this the test above could not fail.
    torch.load(ckpt / "state.pt", weights_only=False)
    assert marker.exists()


def test_values_that_a_safe_load_would_refuse_are_rejected_at_save_naming_the_key(tmp_path) -> None:
    with pytest.raises(TypeError, match=r"state\['extra'\]\['arrays'\]\[0\] is a numpy\.ndarray"):
        distkit.save_checkpoint(tmp_path / "c", {"extra": {"arrays": [np.zeros(2)]}})
    assert not (tmp_path / "c").exists()


def test_a_damaged_byte_is_detected_before_unpickling_and_the_file_is_named(tmp_path) -> None:
    distkit.save_checkpoint(tmp_path / "c", {"w": torch.randn(1000)})
    damage_one_byte(tmp_path / "c" / "state.pt")
    with pytest.raises(CheckpointCorruptError, match=r"c/state\.pt has CRC32 [0-9a-f]{8}, the manifest says"):
        distkit.load_checkpoint(tmp_path / "c")


def test_truncated_state_is_reported_with_both_sizes(memory_root) -> None:
    distkit.save_checkpoint(f"{memory_root}/c", {"w": torch.randn(1000)})
    fs = fsspec.filesystem("memory")
    data = fs.cat_file(f"{memory_root}/c/state.pt")
    fs.pipe_file(f"{memory_root}/c/state.pt", data[:100])
    with pytest.raises(
        CheckpointCorruptError, match=rf"state\.pt is 100 bytes, the manifest says {len(data)}"
    ):
        distkit.load_checkpoint(f"{memory_root}/c")


# --------------------------------------------------------------------------------------------------
# CheckpointManager: latest, best, retention, fallbacks


@pytest.mark.parametrize("where", ["local", "memory"])
def test_truncated_newest_checkpoint_makes_latest_fall_back_with_a_warning_naming_it(
    where, tmp_path, memory_root
) -> None:
    directory = str(tmp_path) if where == "local" else memory_root
    manager = distkit.CheckpointManager(directory, keep_last=3)
    for step in (1, 2):
        manager.save(step, {"w": torch.full((100,), float(step))})
    newest = f"{directory}/step_000000002/state.pt"
    with fsspec.open(newest, "rb") as f:
        data = f.read()
    with fsspec.open(newest, "wb") as f:
        f.write(data[: len(data) // 2])

    with pytest.warns(UserWarning, match=r"skipping corrupt checkpoint .*step_000000002.*truncated"):
        assert manager.latest() == f"{directory}/step_000000001"
    state = {"w": torch.zeros(100)}
    with pytest.warns(UserWarning, match="step_000000002"):
        assert manager.restore(state) == 1
    assert torch.equal(state["w"], torch.ones(100))


def test_partial_object_store_checkpoint_without_manifest_is_skipped_with_a_warning(memory_root) -> None:
    manager = distkit.CheckpointManager(memory_root)
    manager.save(5, {"w": torch.ones(2)})
    # What a writer killed between its two puts leaves on an object store: state.pt, no manifest.
    fsspec.filesystem("memory").pipe_file(f"{memory_root}/step_000000009/state.pt", b"partial")
    with pytest.warns(UserWarning, match=r"partial checkpoint .*step_000000009.*no manifest\.json"):
        assert manager.latest() == f"{memory_root}/step_000000005"


def test_restore_falls_back_past_a_damaged_checkpoint_and_returns_none_when_nothing_is_left(tmp_path) -> None:
    manager = distkit.CheckpointManager(tmp_path, keep_last=None)
    assert manager.restore({"w": torch.zeros(1)}) is None
    assert manager.latest() is None
    for step in (10, 20):
        manager.save(step, {"w": torch.full((50,), float(step))})
    damage_one_byte(tmp_path / "step_000000020" / "state.pt")
    state = {"w": torch.zeros(50)}
    with pytest.warns(UserWarning, match=r"step_000000020.*CRC32"):
        assert manager.restore(state) == 10
    assert torch.equal(state["w"], torch.full((50,), 10.0))


def test_retention_never_counts_a_checkpoint_that_failed_its_checksums_among_the_newest(tmp_path) -> None:
    """Was: a resume skipped the newest (a bit flip), and the next save's keep_last=2 then deleted
    the step it had restored and kept the damaged one: one usable checkpoint left, not two."""
    with distkit.CheckpointManager(tmp_path, keep_last=2) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"w": torch.full((50,), float(step))})
    damage_one_byte(tmp_path / "step_000000003" / "state.pt")  # same size: retention checks sizes only
    state = {"w": torch.zeros(50)}
    with distkit.CheckpointManager(tmp_path, keep_last=2) as manager:
        with pytest.warns(UserWarning, match=r"skipping corrupt checkpoint .*step_000000003"):
            assert manager.restore(state) == 2
        kept = r"retention keeps .*step_000000003: it cannot be read \(.*CRC32"
        with pytest.warns(UserWarning, match=kept):
            manager.save(4, state)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_000000002",  # two usable: the one restored and the new one
        "step_000000003",  # kept (never deleted), but not counted
        "step_000000004",
    ]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_retention_keeps_the_newest_and_the_best_and_deletes_only_after_the_commit(
    recording_root, async_save
) -> None:
    manager = distkit.CheckpointManager(
        recording_root, keep_last=2, keep_best=1, monitor="loss", mode="min", async_save=async_save
    )
    losses = {1: 0.9, 2: 0.2, 3: 0.5, 4: 0.7, 5: 0.6}
    for step, loss in losses.items():
        manager.save(step, {"w": torch.ones(1)}, metrics={"loss": loss})
    manager.wait()
    fs = fsspec.filesystem("recordmem")
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(recording_root, detail=False))
    # .distkit-writer.json: the writer lease of this (still open) manager.
    assert names == [".distkit-writer.json", "step_000000002", "step_000000004", "step_000000005"]
    assert manager.best() == f"{recording_root}/step_000000002"
    assert manager.latest() == f"{recording_root}/step_000000005"
    # The order: each deletion began only once the step whose save made it surplus was committed
    # (step 1 after step 3's commit, step 3 after step 5's), never to make room for a save in flight.
    assert RecordingMemoryFileSystem.deletions == [
        ("step_000000001", ["step_000000001", "step_000000002", "step_000000003"]),
        ("step_000000003", ["step_000000002", "step_000000003", "step_000000004", "step_000000005"]),
    ]


def test_best_follows_mode_and_ignores_steps_saved_without_the_metric(tmp_path) -> None:
    manager = distkit.CheckpointManager(tmp_path, keep_last=None, monitor="acc", mode="max")
    assert manager.best() is None
    manager.save(1, {"w": torch.ones(1)}, metrics={"acc": 0.5})
    manager.save(2, {"w": torch.ones(1)}, metrics={"acc": 0.8})
    manager.save(3, {"w": torch.ones(1)})
    assert manager.best() == str(tmp_path / "step_000000002")
    with pytest.raises(ValueError, match=r"metrics has no 'acc'.*\['loss'\]"):
        manager.save(4, {"w": torch.ones(1)}, metrics={"loss": 1.0})
    with pytest.raises(ValueError, match="best\\(\\) needs a monitor"):
        distkit.CheckpointManager(tmp_path).best()


def test_retention_never_deletes_the_checkpoint_it_just_saved(tmp_path) -> None:
    manager = distkit.CheckpointManager(tmp_path, keep_last=1)
    manager.save(100, {"w": torch.ones(1)})
    manager.save(5, {"w": torch.zeros(1)})  # a restarted run in the same directory: ranked last by step
    assert committed_steps(tmp_path) == ["step_000000005", "step_000000100"]


# --------------------------------------------------------------------------------------------------
# Manifests that cannot be read: corrupt (never a raw KeyError), skipped by latest(), kept by retention

# Values of the wrong type (or range) for every field of a manifest, and for its shape as a whole.
_VALID_FILE = {"size": 10, "crc32": "0000000a"}
WRONG_FIELD_VALUES: dict[str, list[object]] = {
    "format": [None, 1, "other-format", []],
    "format_version": [None, "1", 1.0, True, 0, [1]],
    "step": ["3", 3.5, -1, True, [3], {}],
    "files": [
        None,
        [],
        "state.pt",
        {},
        {"state.pt": None},
        {"state.pt": 5},
        {"state.pt": {"size": "10", "crc32": "0000000a"}},
        {"state.pt": {"size": 10}},
        {"state.pt": {"size": 10, "crc32": 10}},
        {"state.pt": {"size": -1, "crc32": "0000000a"}},
        {"state.pt": {"size": 10, "crc32": "XYZ"}},
        {"state.pt": _VALID_FILE, "../../etc/passwd": _VALID_FILE},
        {"state.pt": _VALID_FILE, "/etc/passwd": _VALID_FILE},
        {"other.pt": _VALID_FILE},
    ],
    "metrics": [None, [], "x", {"loss": "0.5"}, {"loss": None}, {"loss": [1]}, {"loss": True}],
    "keys": [None, "w", [1], {}],
    "world_size": [None, "1", 0, 1.5, True],
    "torch_version": [None, 2, []],
    "distkit_version": [None, 2, []],
    "created_unix": [None, "now", [], True],
}
REQUIRED_FIELDS = ("format", "format_version", "step", "files")
NOT_A_MANIFEST = [b"", b"{", b"\xff\xfe\x00garbage", b"[" * 100_000, b"[]", b'"x"', b"1", b"null", b"true"]


def manifest_variants(good: dict[str, object]) -> Iterator[tuple[str, bytes, bool]]:
    """(what, manifest bytes, whether distkit must refuse it) for every malformation."""
    for raw in NOT_A_MANIFEST:
        yield f"document {raw[:10]!r}", raw, True
    for field in good:
        without = {k: v for k, v in good.items() if k != field}
        yield f"no {field}", json.dumps(without).encode(), field in REQUIRED_FIELDS
        for value in WRONG_FIELD_VALUES[field]:
            yield f"{field}={value!r}", json.dumps({**good, field: value}).encode(), True


def test_every_malformed_manifest_is_a_corrupt_checkpoint_never_a_raw_error(tmp_path) -> None:
    distkit.save_checkpoint(tmp_path / "good", {"w": torch.ones(2)}, step=2, metrics={"loss": 0.5})
    good = json.loads((tmp_path / "good" / "manifest.json").read_text())
    assert set(good) == set(WRONG_FIELD_VALUES)  # a new field must be fuzzed too
    checked = 0
    for what, raw, refused in manifest_variants(good):
        ckpt = tmp_path / f"case{checked}"
        shutil.copytree(tmp_path / "good", ckpt)
        (ckpt / "manifest.json").write_bytes(raw)
        try:
            distkit.load_checkpoint(ckpt)
        except CheckpointCorruptError as err:
            assert refused, f"{what}: refused although valid: {err}"
            assert "manifest.json" in err.reason, what
        except Exception as err:
            pytest.fail(f"{what}: {type(err).__name__} instead of CheckpointCorruptError: {err}")
        else:
            assert not refused, f"{what}: loaded although malformed"
        checked += 1
    assert checked > 70


def test_latest_best_and_retention_treat_every_malformed_manifest_as_unreadable(tmp_path) -> None:
    distkit.save_checkpoint(tmp_path / "template", {"w": torch.ones(2)}, step=1, metrics={"loss": 0.1})
    good = json.loads((tmp_path / "template" / "manifest.json").read_text())
    for number, (what, raw, refused) in enumerate(manifest_variants(good)):
        if not refused:
            continue
        directory = tmp_path / f"run{number}"
        shutil.copytree(tmp_path / "template", directory / "step_000000001")
        shutil.copytree(tmp_path / "template", directory / "step_000000002")
        (directory / "step_000000002" / "manifest.json").write_bytes(raw)
        manager = distkit.CheckpointManager(directory, keep_last=1, monitor="loss")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert manager.latest() == str(directory / "step_000000001"), what
            assert manager.best() == str(directory / "step_000000001"), what
            manager.save(3, {"w": torch.zeros(1)}, metrics={"loss": 0.2})  # must not raise
        assert (directory / "step_000000002" / "manifest.json").read_bytes() == raw, what
        manager.close()


def test_one_flipped_byte_in_the_newest_manifest_never_gets_its_checkpoint_deleted(tmp_path) -> None:
    manager = distkit.CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2):
        manager.save(step, {"w": torch.full((100,), float(step))})
    manifest = tmp_path / "step_000000002" / "manifest.json"
    data = bytearray(manifest.read_bytes())
    data[0] ^= 0xFF  # '{' no longer opens the JSON object
    manifest.write_bytes(bytes(data))

    with pytest.warns(UserWarning, match=r"skipping corrupt checkpoint .*step_000000002: its manifest\.json"):
        assert manager.latest() == str(tmp_path / "step_000000001")
    with pytest.warns(UserWarning, match=r"retention keeps .*step_000000002: it cannot be read") as seen:
        manager.save(3, {"w": torch.full((100,), 3.0)})
    assert sum("step_000000002" in str(w.message) for w in seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not at every save
        manager.save(4, {"w": torch.full((100,), 4.0)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000000002",
        "step_000000003",
        "step_000000004",
    ]
    saved = torch.load(tmp_path / "step_000000002" / "state.pt", weights_only=True)
    assert torch.equal(saved["w"], torch.full((100,), 2.0))  # the data the flipped byte did not touch


def test_a_newer_format_version_names_both_versions_and_upgrade_and_is_kept(tmp_path) -> None:
    manager = distkit.CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, {"w": torch.ones(1)})
    manager.save(2, {"w": torch.ones(1)})
    manifest = tmp_path / "step_000000002" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 2}))
    pattern = r"format_version 2 .*reads format_version 1 only.*Upgrade distkit"
    with pytest.raises(distkit.DistkitError, match=pattern):
        distkit.load_checkpoint(tmp_path / "step_000000002")
    # Not a fallback to the older step: resuming that would drop the newer run's progress.
    with pytest.raises(distkit.DistkitError, match=pattern):
        manager.latest()
    with pytest.raises(distkit.DistkitError, match=pattern):
        manager.restore({"w": torch.zeros(1)})
    with pytest.warns(UserWarning, match=r"retention keeps .*step_000000002: .*format_version 2"):
        manager.save(3, {"w": torch.ones(1)})
    assert json.loads(manifest.read_text())["format_version"] == 2


@pytest.mark.parametrize("async_save", [False, True])
def test_save_never_raises_once_committed_whatever_retention_finds(tmp_path, async_save) -> None:
    manager = distkit.CheckpointManager(tmp_path, keep_last=1, async_save=async_save)
    manager.save(1, {"w": torch.ones(1)})
    manager.wait()
    # What made retention raise a raw TypeError after the commit: a manifest with a wrong shape.
    garbage = tmp_path / "step_000000002"
    garbage.mkdir()
    (garbage / "state.pt").write_bytes(b"not a checkpoint")
    (garbage / "manifest.json").write_text(
        json.dumps({"format": "distkit-checkpoint", "files": {"state.pt": 5}})
    )
    with pytest.warns(UserWarning, match=r"retention keeps .*step_000000002"):
        manager.save(3, {"w": torch.full((1,), 3.0)})
        manager.wait()
    assert committed_steps(tmp_path) == ["step_000000002", "step_000000003"]
    assert distkit.load_checkpoint(tmp_path / "step_000000003")["w"].item() == 3.0


def test_retention_deletes_only_what_is_provably_its_own(tmp_path) -> None:
    manager = distkit.CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, {"w": torch.ones(1)})
    manager.save(2, {"w": torch.ones(1)})  # a committed surplus holding a file of the user:
    (tmp_path / "step_000000002" / "notes.txt").write_text("keep me")
    (tmp_path / "step_000000004").mkdir()  # no manifest and foreign files: not a killed save of ours
    (tmp_path / "step_000000004" / "eval.csv").write_text("keep me too")
    (tmp_path / "step_000000005").mkdir()  # no manifest, only our file name: a killed object-store save
    (tmp_path / "step_000000005" / "state.pt").write_bytes(b"partial")
    (tmp_path / ".step_000000006.distkit-tmp-abcd").mkdir()  # staging leftover of a killed save
    with pytest.warns(UserWarning, match="retention keeps"):
        manager.save(7, {"w": torch.ones(1)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000000002",
        "step_000000004",
        "step_000000007",
    ]
    assert (tmp_path / "step_000000002" / "notes.txt").read_text() == "keep me"


# --------------------------------------------------------------------------------------------------
# FIFOs, devices and symlinks inside a checkpoint are refused without being opened


def finishes_within(seconds: float, fn, *fifos: pathlib.Path):  # type: ignore[no-untyped-def]
    """``fn()``'s result, failing the test if it blocks longer than ``seconds``."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:  # a writer wakes the reader blocked in open(), so the thread ends
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"blocked for more than {seconds} s: it opened a FIFO")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def plant(ckpt: pathlib.Path, kind: str) -> tuple[str, pathlib.Path]:
    """Replace one file of the checkpoint ``ckpt`` with a special file; (what is expected, its path)."""
    if kind == "fifo-manifest":
        (ckpt / "manifest.json").unlink()
        os.mkfifo(ckpt / "manifest.json")
        return "a FIFO", ckpt / "manifest.json"
    state = ckpt / "state.pt"
    if kind == "symlink-state":
        real = ckpt.parent / f"{ckpt.name}-elsewhere.pt"
        state.rename(real)  # same bytes: size and checksum match the manifest
        state.symlink_to(real)
        return "a symbolic link", state
    # A special file at state.pt whose size (0) matches the manifest, so only opening it tells.
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["state.pt"] = {"size": 0, "crc32": f"{zlib.crc32(b''):08x}"}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    state.unlink()
    if kind == "fifo-state":
        os.mkfifo(state)
        return "a FIFO", state
    try:
        os.mknod(state, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # what /dev/null is
    except PermissionError:
        pytest.skip("creating a device file needs CAP_MKNOD (root)")
    return "a character device", state


@pytest.mark.parametrize("kind", ["fifo-manifest", "fifo-state", "symlink-state", "device-state"])
def test_a_fifo_device_or_symlink_in_a_checkpoint_is_refused_without_blocking(tmp_path, kind) -> None:
    with distkit.CheckpointManager(tmp_path, keep_last=None) as writer:
        writer.save(1, {"w": torch.ones(1)})
        writer.save(2, {"w": torch.ones(1)})
    described, special = plant(tmp_path / "step_000000002", kind)
    pattern = rf"{re.escape(str(special))} is {described}[^,]*, not a regular file"

    with pytest.raises(CheckpointCorruptError, match=pattern):
        finishes_within(20, lambda: distkit.load_checkpoint(tmp_path / "step_000000002"), special)
    manager = distkit.CheckpointManager(tmp_path, keep_last=1)
    with pytest.warns(UserWarning, match=pattern):
        assert finishes_within(20, manager.latest, special) == str(tmp_path / "step_000000001")
    with pytest.warns(UserWarning, match=pattern):
        assert finishes_within(20, lambda: manager.restore({"w": torch.zeros(1)}), special) == 1
    with pytest.warns(UserWarning, match=rf"retention keeps .*step_000000002: .*{described}"):
        finishes_within(20, lambda: manager.save(3, {"w": torch.ones(1)}), special)
    assert os.path.lexists(special)


# --------------------------------------------------------------------------------------------------
# Errors that name the real cause


def run_failing_write(command: list[str]) -> dict[str, object]:
    done = subprocess.run(command, capture_output=True, timeout=180, env=writer_env())
    output = done.stdout.decode()
    report = next(
        (line[len("REPORT ") :] for line in output.splitlines() if line.startswith("REPORT ")), None
    )
    assert done.returncode == 0 and report is not None, f"{output}\n{done.stderr.decode()}"
    return json.loads(report)


def test_a_full_disk_names_enospc_and_the_path_and_the_previous_checkpoint_stays_intact(tmp_path) -> None:
    # A real full filesystem: a 2 MiB tmpfs, mounted in a private mount namespace of the child.
    mount_point = tmp_path / "small_fs"
    mount_point.mkdir()
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs util-linux's unshare to mount a small tmpfs")
    probe = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "mount", "-t", "tmpfs", "tmpfs", str(mount_point)],
        capture_output=True,
        timeout=60,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.decode().strip()}")
    script = 'mount -t tmpfs -o size=2m tmpfs "$0" && exec "$1" "$2" "$0/ckpts" disk-full'
    command = [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", script, str(mount_point)]
    report = run_failing_write([*command, sys.executable, str(FAILING_WRITE)])
    sync, background = report["sync"], report["async"]
    assert sync["type"] == "OSError" and sync["errno"] == errno.ENOSPC
    assert "ENOSPC (No space left on device) while writing checkpoint " in sync["message"]
    assert f"{mount_point}/ckpts/.step_000000002.distkit-tmp-" in sync["message"]
    assert "nothing was committed" in sync["message"] and "free space" in sync["message"]
    assert background["type"] == "DistkitError" and "background save of step 3" in background["message"]
    assert "ENOSPC" in background["message"] and "ENOSPC" in background["cause"]
    assert report["listing"] == ["step_000000001"] and report["step1_intact"]


def test_any_write_error_names_its_errno_the_path_and_a_fix(tmp_path) -> None:
    # RLIMIT_FSIZE: a real EFBIG from write(2), on any POSIX machine without privileges.
    report = run_failing_write(
        [sys.executable, str(FAILING_WRITE), str(tmp_path / "ckpts"), "file-size-limit"]
    )
    sync = report["sync"]
    assert sync["type"] == "OSError" and sync["errno"] == errno.EFBIG
    assert "EFBIG (File too large) while writing checkpoint " in sync["message"]
    assert f"{tmp_path}/ckpts/.step_000000002.distkit-tmp-" in sync["message"]
    assert "ulimit -f" in sync["message"]
    assert report["listing"] == ["step_000000001"] and report["step1_intact"]


def test_a_file_that_vanished_while_written_names_a_second_writer() -> None:
    # Was "Fix: check the storage that holds it" when another process saved to the same path.
    from distkit.checkpoint._files import _write_error

    vanished = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "ck/.tmp/state.pt")
    error = _write_error(vanished, "ck", "ck/.tmp/state.pt", untouched="ck is untouched")
    assert error.errno == errno.ENOENT and isinstance(error, FileNotFoundError)
    assert "another process saves to the same path at the same time" in str(error)
    assert "use a CheckpointManager, whose lock refuses a second writer" in str(error)


def test_loading_a_path_that_does_not_exist_says_not_found(tmp_path, memory_root) -> None:
    for missing in (tmp_path / "nowhere", f"{memory_root}/nowhere"):
        with pytest.raises(
            FileNotFoundError, match=rf"checkpoint not found: {re.escape(str(missing))} does not"
        ):
            distkit.load_checkpoint(missing)
    (tmp_path / "model.pt").write_bytes(b"a file")
    with pytest.raises(NotADirectoryError, match=r"model\.pt is a file, not a checkpoint directory"):
        distkit.load_checkpoint(tmp_path / "model.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointCorruptError, match=r"no manifest\.json"):
        distkit.load_checkpoint(tmp_path / "empty")


def test_credentials_in_a_checkpoint_url_reach_no_error_warning_or_log_record(caplog) -> None:
    # fsspec's memory filesystem keeps the whole URL as its path, so the credentials go through every
    # call it gets and every debug line it logs, as they would through an object store's client.
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    root = f"memory://user:s3cr3tpass@{bucket}/run?sig=abcdef123"
    secrets = ("s3cr3tpass", "abcdef123")
    fs = fsspec.filesystem("memory")
    shown: list[str] = []  # everything the calls below showed: errors, warnings, log records
    fsspec_records = 0

    def outcome(call) -> BaseException | None:
        nonlocal fsspec_records
        caplog.clear()  # only what distkit's call logs, not this test's own use of fs
        error = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                call()
            except Exception as err:
                error = err
                shown.append("".join(traceback.format_exception(type(err), err, err.__traceback__)))
                shown.append(repr(vars(err)))
        shown.extend(str(warning.message) for warning in caught)
        shown.extend(f"{record.getMessage()} {record.exc_text or ''}" for record in caplog.records)
        fsspec_records += sum(record.name.startswith("fsspec") for record in caplog.records)
        return error

    caplog.set_level(logging.DEBUG)
    first = distkit.CheckpointManager(root)
    second = distkit.CheckpointManager(root)
    try:
        missing = outcome(lambda: distkit.load_checkpoint(f"{root}/nowhere"))
        assert isinstance(missing, FileNotFoundError)
        assert f"checkpoint not found: memory://***@{bucket}/run?sig=***" in str(missing)
        assert outcome(lambda: first.save(1, {"w": torch.ones(4)})) is None
        assert outcome(lambda: first.save(2, {"w": torch.ones(4)})) is None
        fs.pipe_file(f"{root}/step_000000002/state.pt", b"\0" * fs.size(f"{root}/step_000000002/state.pt"))
        assert outcome(first.latest) is None  # falls back to step 1, warning about step 2
        assert any("skipping corrupt checkpoint memory://***@" in text for text in shown)
        corrupt = outcome(lambda: distkit.load_checkpoint(f"{root}/step_000000002"))
        assert isinstance(corrupt, CheckpointCorruptError) and "CRC32" in str(corrupt)
        fresh = outcome(lambda: distkit.CheckpointManager(root).save(3, {"w": torch.ones(4)}))
        assert isinstance(fresh, distkit.CheckpointConflictError) and fresh.steps == [1, 2]
        assert outcome(lambda: second.claim(resuming=True)) is None  # takes the lease over, warning
        assert any("has a writer lease of" in text for text in shown)
        taken_over = outcome(lambda: first.save(3, {"w": torch.ones(4)}))
        assert isinstance(taken_over, distkit.CheckpointConflictError)
        assert "another writer took over" in str(taken_over)
        # A failure inside fsspec itself, whose message holds the path: state.pt is a directory there.
        fs.makedirs(f"{root}/blocked/state.pt")
        blocked = outcome(lambda: distkit.save_checkpoint(f"{root}/blocked", {"w": torch.ones(4)}))
        assert isinstance(blocked, OSError) and "state.pt" in str(blocked)
    finally:
        first.close()
        second.close()
        with contextlib.suppress(FileNotFoundError):
            fs.rm(f"/user:s3cr3tpass@{bucket}", recursive=True)
    assert fsspec_records > 0  # fsspec's own log lines were seen, and scrubbed
    leaks = [text for text in shown if any(secret in text for secret in secrets)]
    assert not leaks, "\n---\n".join(leaks)


# --------------------------------------------------------------------------------------------------
# Async saves


@pytest.mark.parametrize("where", ["local", "memory"])
def test_async_save_writes_the_same_bytes_as_a_sync_save_although_training_goes_on(
    where, tmp_path, memory_root
) -> None:
    torch.manual_seed(0)
    parts = make_training()
    train_steps(parts, 2)
    shared = torch.arange(10.0)
    state = {**parts, "views": [shared, shared[2:5]], "meta": {"lr": [0.1, 0.2]}}
    distkit.save_checkpoint(tmp_path / "sync", state, step=2)

    directory = str(tmp_path / "managed") if where == "local" else memory_root
    manager = distkit.CheckpointManager(directory, async_save=True)
    path = manager.save(2, state)
    train_steps(parts, 1)  # changes weights and optimizer state in place while the writer runs
    shared.add_(1)
    manager.wait()
    assert read_bytes(f"{path}/state.pt") == (tmp_path / "sync" / "state.pt").read_bytes()
    loaded = distkit.load_checkpoint(path)
    assert loaded["views"][1].untyped_storage().data_ptr() == loaded["views"][0].untyped_storage().data_ptr()


def test_background_failure_is_raised_at_the_next_wait_and_the_manager_recovers(tmp_path) -> None:
    directory = tmp_path / "ckpts"
    manager = distkit.CheckpointManager(directory, async_save=True)
    manager.save(1, {"w": torch.ones(1)})
    manager.wait()
    shutil.rmtree(directory)
    directory.write_text("a file where the directory was")
    manager.save(2, {"w": torch.ones(1)})
    with pytest.raises(
        distkit.DistkitError, match=r"background save of step 2 .* failed: NotADirectoryError"
    ):
        manager.wait()
    manager.wait()  # reported once
    directory.unlink()
    manager.save(3, {"w": torch.ones(1)})
    manager.save(4, {"w": torch.ones(1)})  # waits for step 3 first: one save in flight
    manager.wait()
    assert committed_steps(directory) == ["step_000000003", "step_000000004"]


def test_background_failure_is_raised_at_the_next_save(tmp_path) -> None:
    directory = tmp_path / "ckpts"
    manager = distkit.CheckpointManager(directory, async_save=True)
    directory.write_text("not a directory")  # after the manager checked it: the write fails
    manager.save(1, {"w": torch.ones(1)})
    with pytest.raises(distkit.DistkitError, match="background save of step 1"):
        manager.save(2, {"w": torch.ones(1)})


def test_interpreter_exit_waits_for_the_background_save(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, str(WRITER), str(tmp_path), "exit", "1", "1"],
        capture_output=True,
        timeout=120,
        env=writer_env(),
    )
    assert done.returncode == 0, done.stderr.decode()
    assert b"RETURNED" in done.stdout
    assert committed_steps(tmp_path) == ["step_000000001"]
    assert distkit.load_checkpoint(tmp_path / "step_000000001")["step"] == 1


# --------------------------------------------------------------------------------------------------
# Writers killed with SIGKILL


def writer_env() -> dict[str, str]:
    # The writer is a world of one whatever launched pytest.
    return launcher_free_env()


def run_until_paused(
    directory: pathlib.Path,
    point: str,
    first: int,
    last: int,
    mode: str = "sync",
    markers: tuple[bytes, ...] = (b"PAUSED",),
) -> None:
    """Start the writer (``mode``: ``sync``, ``async`` or ``async-sharded`` saves), wait until it has
    printed every one of ``markers`` (it pauses at ``point``), then SIGKILL it. An asynchronous writer
    that pauses on its training thread, inside ``save()``, fails the test at once."""
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(directory), point, str(first), str(last), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=writer_env(),
    )
    assert proc.stdout is not None
    output = b""
    # The child imports torch (seconds on a loaded machine) and saves a few MiB.
    deadline = time.monotonic() + 120
    try:
        while not all(marker in output for marker in markers):
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([proc.stdout], [], [], max(remaining, 0))
            if not ready:
                pytest.fail(f"writer did not pause within 120 s; output:\n{output.decode()}")
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                pytest.fail(f"writer exited with {proc.wait()} before pausing; output:\n{output.decode()}")
            output += chunk
            if mode != "sync" and b"PAUSED in MainThread" in output:
                pytest.fail(
                    f"the {mode} writer reached the {point!r} point on the training thread, inside "
                    f"save() (with asynchronous saves that work belongs to the writer thread, after "
                    f"the commit); output:\n{output.decode()}"
                )
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


# The async writers pause on a background thread; RETURNED shows the training thread's save()
# had already returned, so the kill hits a save that is in flight, not one made synchronously.
# async-sharded: the same with sharded checkpoints, whose shards DCP's async_save writes.
KILLED_WRITERS = {
    "sync": (b"PAUSED",),
    "async": (b"PAUSED", b"RETURNED"),
    "async-sharded": (b"PAUSED", b"RETURNED"),
}


@pytest.mark.parametrize("mode", sorted(KILLED_WRITERS))
def test_writer_killed_mid_save_or_mid_retention_never_loses_the_last_good_checkpoints(
    tmp_path, mode
) -> None:
    markers = KILLED_WRITERS[mode]

    def weights(loaded: dict[str, object]) -> object:
        return loaded["model"]["w"] if mode == "async-sharded" else loaded["w"]  # type: ignore[index]

    # Steps 1-3 committed (keep_last=2 leaves 2 and 3); killed while writing step 4's state.pt (a
    # sharded save: once its shard file is written).
    run_until_paused(tmp_path, "write", 1, 4, mode, markers)
    assert committed_steps(tmp_path) == ["step_000000002", "step_000000003"]
    assert any(p.name.startswith(".step_000000004.distkit-tmp-") for p in tmp_path.iterdir()), (
        "the writer should have died inside the save of step 4"
    )
    manager = distkit.CheckpointManager(tmp_path, keep_last=2)
    with pytest.warns(UserWarning, match=r"partial checkpoint .*step_000000004"):
        latest = manager.latest()
    assert latest == str(tmp_path / "step_000000003")
    loaded = distkit.load_checkpoint(latest)
    assert loaded["step"] == 3 and torch.equal(weights(loaded), torch.full((512, 512), 3.0))

    # Step 4 committed, then killed after retention un-committed step 2 but before deleting it.
    run_until_paused(tmp_path, "delete", 4, 4, mode, markers)
    assert committed_steps(tmp_path) == ["step_000000003", "step_000000004"], (
        f"killed inside the retention of step 4's save, the directory holds {committed_steps(tmp_path)}: "
        f"retention ran before step 4 was committed"
    )
    assert any(p.name.startswith(".step_000000002.distkit-tmp-del-") for p in tmp_path.iterdir())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # leftovers at or below the chosen step are not worth a warning
        latest = manager.latest()
        assert latest is not None and distkit.load_checkpoint(latest)["step"] == 4

    manager.save(5, {"w": torch.zeros(1), "step": 5})  # retention also clears the leftovers
    assert sorted(os.listdir(tmp_path)) == ["step_000000004", "step_000000005"]


# --------------------------------------------------------------------------------------------------
# One run, one writer per directory


def test_a_fresh_run_is_refused_where_another_run_committed_checkpoints_and_nothing_is_deleted(
    tmp_path,
) -> None:
    with distkit.CheckpointManager(tmp_path, keep_last=2) as old_run:
        for step in (100, 200):
            old_run.save(step, {"w": torch.full((1,), float(step))})
    new_run = distkit.CheckpointManager(tmp_path, keep_last=2)
    with pytest.raises(distkit.CheckpointConflictError) as refused:
        new_run.save(1, {"w": torch.zeros(1)})
    message = str(refused.value)
    assert message.startswith(f"[rank 0/1] the checkpoint directory {tmp_path} already holds committed")
    assert "steps [100, 200]" in message
    for way_out in ("restore(state)", "Trainer(resume='auto')", "another directory", "overwrite=True"):
        assert way_out in message
    assert refused.value.steps == [100, 200] and refused.value.directory == str(tmp_path)
    assert isinstance(refused.value, distkit.DistkitError)
    assert committed_steps(tmp_path) == ["step_000000100", "step_000000200"]
    assert not (tmp_path / "step_000000001").exists()
    with pytest.raises(distkit.CheckpointConflictError):
        new_run.claim()  # still refused: nothing changed
    new_run.close()


@pytest.mark.parametrize("how", ["restore", "claim_resuming", "latest_then_load"])
def test_only_a_run_that_resumes_from_the_directory_keeps_saving_there(tmp_path, how) -> None:
    with distkit.CheckpointManager(tmp_path, keep_last=2) as first:
        first.save(1, {"w": torch.ones(1)})
        first.save(2, {"w": torch.full((1,), 2.0)})
    with (
        distkit.CheckpointManager(tmp_path, keep_last=2) as fresh,
        pytest.raises(distkit.CheckpointConflictError),
    ):
        fresh.save(1, {"w": torch.zeros(1)})
    # The requeued job: a new manager, the same directory, and one of the three ways to resume.
    manager = distkit.CheckpointManager(tmp_path, keep_last=2)
    state = {"w": torch.zeros(1)}
    if how == "restore":
        assert manager.restore(state) == 2
    elif how == "claim_resuming":
        distkit.load_checkpoint(tmp_path / "step_000000002", state)
        manager.claim(resuming=True)
    else:
        distkit.load_checkpoint(manager.latest(), state)
    manager.save(3, state)
    assert committed_steps(tmp_path) == ["step_000000002", "step_000000003"]
    manager.close()


def test_latest_that_finds_nothing_does_not_count_as_resuming(tmp_path) -> None:
    with distkit.CheckpointManager(tmp_path) as first:
        first.save(5, {"w": torch.ones(1)})
    damage_one_byte(tmp_path / "step_000000005" / "state.pt")
    manager = distkit.CheckpointManager(tmp_path)
    with pytest.warns(UserWarning, match="skipping corrupt checkpoint"):
        assert manager.latest() is None
    with pytest.raises(distkit.CheckpointConflictError, match=r"steps \[5\]"):
        manager.save(1, {"w": torch.ones(1)})


def test_overwrite_deletes_the_old_runs_checkpoints_at_the_first_save(tmp_path) -> None:
    with distkit.CheckpointManager(tmp_path, keep_last=None) as old_run:
        for step in (10, 20, 30):
            old_run.save(step, {"w": torch.ones(1)})
    (tmp_path / ".step_000000040.distkit-tmp-abcd").mkdir()  # a killed save of the old run
    manager = distkit.CheckpointManager(tmp_path, keep_last=2, overwrite=True)
    with pytest.warns(UserWarning, match=r"overwrite=True: deleted the checkpoints of steps \[10, 20, 30\]"):
        manager.save(1, {"w": torch.zeros(1)})
    manager.save(2, {"w": torch.zeros(1)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000001", "step_000000002"]
    assert manager.latest() == str(tmp_path / "step_000000002")
    manager.close()
    # A manager that resumes deletes nothing, whatever overwrite says (a requeued job keeps its work).
    again = distkit.CheckpointManager(tmp_path, keep_last=2, overwrite=True)
    assert again.restore({"w": torch.zeros(1)}) == 2
    again.save(3, {"w": torch.zeros(1)})
    assert committed_steps(tmp_path) == ["step_000000002", "step_000000003"]
    again.close()
    with pytest.raises(TypeError, match="overwrite must be True or False"):
        distkit.CheckpointManager(tmp_path, overwrite="yes")  # type: ignore[arg-type]


def test_two_managers_in_one_process_conflict_until_the_first_lets_go(tmp_path) -> None:
    first = distkit.CheckpointManager(tmp_path)
    first.save(1, {"w": torch.ones(1)})
    second = distkit.CheckpointManager(tmp_path)
    host = socket.gethostname()
    with pytest.raises(distkit.CheckpointConflictError) as refused:
        second.claim(resuming=True)
    assert (
        f"another writer holds the checkpoint directory {tmp_path}: pid {os.getpid()} on host {host}"
        in str(refused.value)
    )
    assert "writing since 20" in str(refused.value) and f"{tmp_path}.distkit-lock" in str(refused.value)
    assert refused.value.holder is not None and refused.value.holder["pid"] == os.getpid()
    first.close()
    second.claim(resuming=True)  # released by close()
    second.save(2, {"w": torch.ones(1)})
    second.close()

    with distkit.CheckpointManager(tmp_path) as third:
        third.claim(resuming=True)
    fourth = distkit.CheckpointManager(tmp_path)  # released when the with block ended
    fourth.claim(resuming=True)
    del fourth  # garbage collected: released
    fifth = distkit.CheckpointManager(tmp_path)
    fifth.claim(resuming=True)
    fifth.cycle = fifth  # type: ignore[attr-defined]  # only the cycle collector can free it
    del fifth
    sixth = distkit.CheckpointManager(tmp_path)
    sixth.claim(resuming=True)  # an unreachable manager's lock does not count
    sixth.close()


def test_a_forked_child_dropping_its_copy_of_the_manager_leaves_the_parents_lock_held(tmp_path) -> None:
    manager = distkit.CheckpointManager(tmp_path)
    manager.claim()
    pid = os.fork()  # what a DataLoader worker is: a copy of the manager, sharing the lock's file
    if pid == 0:
        try:
            manager.close()  # also what garbage collection of the copy does
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    with pytest.raises(distkit.CheckpointConflictError, match=rf"pid {os.getpid()} "):
        distkit.CheckpointManager(tmp_path).claim()
    manager.close()


def test_a_second_job_is_refused_naming_the_first_and_a_killed_holders_lock_is_taken_over(tmp_path) -> None:
    directory = tmp_path / "ckpts"
    env = {**writer_env(), "SLURM_JOB_ID": "4242", "TORCHELASTIC_RUN_ID": "run-7"}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(LOCK_HOLDER),
            str(directory),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline().decode() if ready else ""
        assert line.startswith("HELD "), f"the holder did not claim within 120 s: {line!r}"
        manager = distkit.CheckpointManager(directory)
        with pytest.raises(distkit.CheckpointConflictError) as refused:
            manager.save(1, {"w": torch.ones(1)})
        message = str(refused.value)
        assert f"pid {proc.pid} on host {socket.gethostname()}, writing since " in message
        assert "(SLURM job 4242, torchelastic run run-7)" in message
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        manager.save(1, {"w": torch.ones(1)})  # the kernel released the dead holder's lock
        assert committed_steps(directory) == ["step_000000001"]
        manager.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_on_an_object_store_the_newest_writer_wins_and_the_other_stops_before_committing(memory_root) -> None:
    fs = fsspec.filesystem("memory")
    first = distkit.CheckpointManager(memory_root, keep_last=1)
    first.save(1, {"w": torch.ones(1)})
    lease = fs.cat_file(f"{memory_root}/.distkit-writer.json")
    with pytest.raises(distkit.CheckpointConflictError, match=r"already holds committed checkpoints"):
        distkit.CheckpointManager(memory_root).save(1, {"w": torch.zeros(1)})  # a fresh run: refused
    assert fs.cat_file(f"{memory_root}/.distkit-writer.json") == lease  # and it left the lease alone
    second = distkit.CheckpointManager(memory_root, keep_last=1)  # a requeued job: never refused
    with pytest.warns(UserWarning, match=rf"writer lease of pid {os.getpid()} .*taking it over"):
        assert second.restore({"w": torch.zeros(1)}) == 1
    second.save(2, {"w": torch.full((1,), 2.0)})
    with pytest.raises(
        distkit.CheckpointConflictError, match=rf"another writer took over .*pid {os.getpid()}"
    ):
        first.save(3, {"w": torch.full((1,), 3.0)})
    assert not fs.exists(f"{memory_root}/step_000000003")  # nothing committed by the old writer
    assert fs.exists(f"{memory_root}/step_000000002/manifest.json")  # nor deleted by its retention
    second.close()
    assert not fs.exists(f"{memory_root}/.distkit-writer.json")  # released


# --------------------------------------------------------------------------------------------------
# World size changes


def save_resume_state(directory: str) -> list[float]:
    torch.manual_seed(10 + distkit.get_rank())
    distkit.save_checkpoint(directory, {"progress": ResumeState(epoch=2, global_step=40, batches_in_epoch=5)})
    return torch.rand(2).tolist()


def test_resuming_on_a_different_world_size_reseeds_deterministically_with_a_warning(tmp_path, ranks) -> None:
    directory = str(tmp_path / "two_ranks")
    after_save = ranks.run(save_resume_state, directory, world_size=2)
    draws = []
    for _ in range(2):
        torch.manual_seed(999)
        progress = ResumeState()
        with pytest.warns(UserWarning, match=r"saved by 2 rank\(s\) and this job has 1.*reseeded"):
            distkit.load_checkpoint(directory, {"progress": progress})
        assert (progress.epoch, progress.global_step, progress.batches_in_epoch) == (2, 40, 5)
        draws.append(torch.rand(2).tolist())
    assert draws[0] == draws[1]  # deterministic
    assert draws[0] not in after_save  # neither rank's stream was silently reused


def reseeded_draws(directory: str) -> list[list[float]]:
    """This rank's first draws from torch, python and numpy after each of two resumes of
    ``directory`` on this world size (saved on another), from different RNG states before each."""
    draws = []
    for attempt in range(2):
        torch.manual_seed(500 + attempt)
        random.seed(500 + attempt)
        np.random.seed(500 + attempt)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*saved by \d+ rank\(s\) and this job has")
            distkit.load_checkpoint(directory, {"progress": ResumeState()})
        draws.append([*torch.rand(2).tolist(), random.random(), float(np.random.rand())])
    return draws


def test_ranks_resumed_on_more_ranks_draw_different_streams_that_every_resume_reproduces(
    tmp_path, ranks
) -> None:
    # 1 -> 2 (saved in this process, a world of one) and 2 -> 3: each rank is reseeded from the
    # saved states and its own rank, so the ranks draw differently (dropout masks, augmentations),
    # and the same checkpoint on the same world size gives every rank the same streams again.
    distkit.save_checkpoint(tmp_path / "one_rank", {"progress": ResumeState(global_step=7)})
    ranks.run(save_resume_state, str(tmp_path / "two_ranks"), world_size=2)
    for saved, world_size in (("one_rank", 1), ("two_ranks", 2)):
        per_rank = ranks.run(reseeded_draws, str(tmp_path / saved), world_size=world_size + 1)
        for rank, (first, second) in enumerate(per_rank):
            assert first == second, f"{saved} -> rank {rank}: two resumes drew {first} and {second}"
        firsts = [first for first, _ in per_rank]
        for generator, name in enumerate(["torch", "torch", "python", "numpy"]):
            drawn = [draws[generator] for draws in firsts]
            assert len(set(drawn)) == world_size + 1, (
                f"resumed {world_size} -> {world_size + 1}, the ranks' {name} generators drew {drawn}: "
                f"reseeding ignored the new rank"
            )


# --------------------------------------------------------------------------------------------------
# Two ranks on gloo


def resume_each_ranks_own_rng(directory: str) -> tuple[list[float], list[float], float, float]:
    rank = distkit.get_rank()
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    distkit.save_checkpoint(directory, {"progress": ResumeState(global_step=9)})
    expected = [*torch.rand(3).tolist(), random.random(), float(np.random.rand())]
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    progress = ResumeState()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same world size: no reseed warning
        distkit.load_checkpoint(directory, {"progress": progress})
    got = [*torch.rand(3).tolist(), random.random(), float(np.random.rand())]
    return expected, got, progress.global_step, rank


def test_each_rank_gets_back_its_own_rng_streams(tmp_path, ranks) -> None:
    results = ranks.run(resume_each_ranks_own_rng, str(tmp_path / "c"), world_size=2)
    for expected, got, global_step, _ in results:
        assert got == expected and global_step == 9
    assert results[0][0] != results[1][0]


def ddp_round_trips(directory: str) -> tuple[list[str], bool, bool]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    ddp = DDP(model)
    ddp(torch.randn(3, 4) + distkit.get_rank()).sum().backward()
    torch.optim.SGD(ddp.parameters(), lr=0.1).step()
    distkit.save_checkpoint(f"{directory}/from_ddp", {"model": ddp})
    # Collective: rank 1 returns only after the commit, so it can read the files at once.
    keys = list(torch.load(f"{directory}/from_ddp/state.pt", weights_only=True)["model"])
    plain = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    distkit.load_checkpoint(f"{directory}/from_ddp", {"model": plain})
    into_plain = all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters(), strict=True))

    torch.manual_seed(1)
    source = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    distkit.save_checkpoint(f"{directory}/plain", {"model": source})
    target = DDP(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    distkit.load_checkpoint(f"{directory}/plain", {"model": target})
    into_ddp = all(
        torch.equal(a, b) for a, b in zip(target.module.parameters(), source.parameters(), strict=True)
    )
    return keys, into_plain, into_ddp


def test_saved_under_ddp_loads_into_a_plain_module_and_the_reverse(tmp_path, ranks) -> None:
    for keys, into_plain, into_ddp in ranks.run(ddp_round_trips, str(tmp_path), world_size=2):
        assert keys == ["0.weight", "0.bias", "1.weight", "1.bias"]
        assert into_plain and into_ddp


def save_into_a_file(path: str) -> tuple[str, str]:
    try:
        distkit.save_checkpoint(path, {"w": torch.ones(1)}, timeout_s=60)
    except Exception as err:
        return type(err).__name__, str(err)
    return "no error", ""


def test_a_failure_on_rank_0_raises_on_every_rank_instead_of_hanging(tmp_path, ranks) -> None:
    (tmp_path / "blocker").write_text("a file, so no directory can be made under it")
    (kind0, _), (kind1, message1) = ranks.run(
        save_into_a_file, str(tmp_path / "blocker" / "ckpt"), world_size=2, timeout_s=60
    )
    assert kind0 in ("FileExistsError", "NotADirectoryError")
    assert kind1 == "MainProcessError"
    assert message1.startswith("[rank 1/2] saving checkpoint ") and kind0 in message1


def test_the_hang_doctor_counts_waiting_for_rank_0_to_commit_as_a_bounded_wait_not_a_hang() -> None:
    # That wait has its own deadline (timeout_s). The doctor knows it by the file and function name
    # of its frame, so moving the code must move that key too (it once went stale in a split).
    from distkit._doctor import where as _hang_where
    from distkit.checkpoint._commit import _Handshake

    assert _hang_where._decisive([(_Handshake.settle_other.__code__, 0, None)]) == (0, "exempt")


def async_saves_on_two_ranks(directory: str) -> tuple[list[str], int | None, float, tuple[str, str]]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    manager = distkit.CheckpointManager(directory, keep_last=2, async_save=True, timeout_s=60)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(float(step))
        manager.save(step, {"model": model, "progress": ResumeState(global_step=step)})
    manager.wait()
    committed = sorted(os.listdir(directory))
    target = nn.Linear(4, 4)
    restored = manager.restore({"model": target, "progress": ResumeState()})

    if distkit.get_rank() == 0:
        shutil.rmtree(directory)
        pathlib.Path(directory).write_text("a file where the directory was")
    distkit.barrier(timeout_s=60)
    manager.save(4, {"model": model})
    try:
        manager.wait()
        outcome = ("no error", "")
    except distkit.DistkitError as err:
        outcome = (type(err).__name__, str(err))
    return committed, restored, target.weight[0, 0].item(), outcome


def test_async_saves_commit_on_rank_0_and_a_background_failure_reaches_every_rank(tmp_path, ranks) -> None:
    results = ranks.run(async_saves_on_two_ranks, str(tmp_path / "ckpts"), world_size=2, timeout_s=90)
    for committed, restored, weight, _ in results:
        assert committed == ["step_000000002", "step_000000003"]
        assert restored == 3 and weight == 3.0
    (kind0, message0), (kind1, message1) = (r[3] for r in results)
    assert kind0 == "DistkitError" and "background save of step 4" in message0
    assert kind1 == "MainProcessError" and message1.startswith("[rank 1/2] saving checkpoint ")
    assert "NotADirectoryError" in message1


def restore_that_fails_on_rank_1(directory: str) -> str:
    manager = distkit.CheckpointManager(directory, timeout_s=60)
    manager.save(1, {"model": nn.Linear(2, 2)})
    target = nn.Linear(2, 2) if distkit.get_rank() == 0 else nn.Linear(3, 3)
    try:
        manager.restore({"model": target})
    except distkit.DistkitError as err:
        return str(err)
    return "no error"


def test_a_restore_failing_on_one_rank_raises_on_every_rank(tmp_path, ranks) -> None:
    message0, message1 = ranks.run(restore_that_fails_on_rank_1, str(tmp_path), world_size=2, timeout_s=60)
    assert message0.startswith("[rank 0/2] restoring from ") and "failed on rank(s) [1]" in message0
    assert message1.startswith("could not restore state['model'] into Linear: Error(s) in loading")


def restore_from_each_nodes_own_disk(root: str) -> str:
    # Two nodes, each with a local disk at the same path: only rank 0's holds the checkpoints.
    manager = distkit.CheckpointManager(f"{root}/node{distkit.get_rank()}", timeout_s=60)
    try:
        manager.restore({"model": nn.Linear(2, 2)})
    except distkit.DistkitError as err:
        return str(err)
    return "no error"


def test_ranks_that_find_no_checkpoint_where_rank_0_finds_one_are_told_the_directory_is_not_shared(
    tmp_path, ranks
) -> None:
    """Was: "The directory changed while they read it; make sure no other job writes to it", for
    nodes that each saw their own disk at the checkpoint path."""
    save = distkit.CheckpointManager(tmp_path / "node0")
    save.save(3, {"model": nn.Linear(2, 2)})
    save.close()
    for message in ranks.run(restore_from_each_nodes_own_disk, str(tmp_path), world_size=2, timeout_s=60):
        assert "ranks restored different checkpoints from " in message, message
        assert "{0: 3, 1: None} (rank: step). Rank(s) [1] found no checkpoint there at all" in message
        assert "a filesystem every node mounts" in message and "changed while" not in message, message


def late_rank_0_then_per_rank_saves(directory: str) -> tuple[str, int, str]:
    rank = distkit.get_rank()
    if rank == 0:
        time.sleep(3)  # reports long after rank 1's deadline
        distkit.save_checkpoint(f"{directory}/late", {"w": torch.ones(1)})
        outcome = "rank 0 saved late"
    else:
        try:
            distkit.save_checkpoint(f"{directory}/late", {"w": torch.ones(1)}, timeout_s=1)
            outcome = "no error"
        except distkit.CollectiveTimeoutError as err:
            outcome = f"{err.missing_ranks} {err}"
    distkit.barrier(timeout_s=60)
    own = distkit.save_checkpoint(f"{directory}/rank{rank}", {"rank": rank}, collective=False)
    try:
        distkit.save_checkpoint(f"{directory}/x", {"progress": ResumeState()}, collective=False)
        refused = "no error"
    except ValueError as err:
        refused = str(err)
    return outcome, distkit.load_checkpoint(own)["rank"], refused


def test_waiting_ranks_time_out_naming_rank_0_and_non_collective_saves_are_per_rank(tmp_path, ranks) -> None:
    (late0, own0, refused0), (late1, own1, _) = ranks.run(
        late_rank_0_then_per_rank_saves, str(tmp_path), world_size=2, timeout_s=60
    )
    assert late0 == "rank 0 saved late"
    assert late1.startswith("[0] [rank 1/2] waited 1 s for rank 0 to commit checkpoint ")
    assert (own0, own1) == (0, 1)
    assert "collective=True" in refused0


def two_runs_in_one_directory(directory: str) -> tuple[tuple[str, str, list[int]], int | None, list[str]]:
    with distkit.CheckpointManager(directory, timeout_s=60) as old_run:
        old_run.save(5, {"w": torch.ones(1)})
    fresh = distkit.CheckpointManager(directory, timeout_s=60)
    try:
        fresh.save(1, {"w": torch.zeros(1)})
        refusal = ("no error", "", [])
    except distkit.CheckpointConflictError as err:
        refusal = (type(err).__name__, str(err), err.steps)
    fresh.close()
    with distkit.CheckpointManager(directory, timeout_s=60) as requeued:
        step = requeued.restore({"w": torch.zeros(1)})
        requeued.save(6, {"w": torch.ones(1)})
    return refusal, step, sorted(os.listdir(directory))


def test_a_refused_claim_raises_the_same_error_on_every_rank(tmp_path, ranks) -> None:
    results = ranks.run(two_runs_in_one_directory, str(tmp_path / "ckpts"), world_size=2, timeout_s=90)
    for rank, ((kind, message, steps), step, listing) in enumerate(results):
        assert kind == "CheckpointConflictError" and steps == [5]
        assert message.startswith(f"[rank {rank}/2] the checkpoint directory ")
        assert step == 5 and listing == ["step_000000005", "step_000000006"]

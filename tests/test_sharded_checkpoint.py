"""Sharded checkpoints through torch's Distributed Checkpoint, with real FSDP2 models on gloo ranks:
exact round trips (sync and ``dcp.async_save``), resharding 2->1, 1->2 and 2->4 into FSDP, DDP and
plain modules, a full checkpoint into FSDP, consolidation, damaged shards, and a rank SIGKILLed in
the middle of a save."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import warnings

import pytest
import torch
from torch import nn

import distkit
from distkit.checkpoint import CheckpointManager, ResumeState
from distkit.testing import RankFailedError

# --------------------------------------------------------------------------------------------------
# Models, training and snapshots (module level: the ranks import them by name)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 4))


def shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed * 1000 + distkit.get_rank())
    for _ in range(steps):
        loss = model(torch.randn(8, 16, generator=generator)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def whole(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)  # a DTensor gathers its shards (collective)
    return (full() if full is not None else tensor).detach().clone()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and its Adam moments, whole, by name (collective for sharded models)."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    out = {}
    for name, param in inner.named_parameters():
        out[name] = whole(param)
        for moment in ("exp_avg", "exp_avg_sq"):
            if moment in optimizer.state.get(param, {}):
                out[f"{name}.{moment}"] = whole(optimizer.state[param][moment])
    return out


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def save_trained_fsdp(directory: str, steps: int = 2, *, async_save: bool = False) -> dict[str, torch.Tensor]:
    """Train an FSDP2 model, save it at ``steps`` with every kind of entry, return its snapshot."""
    model = shard(make_model())
    optimizer = optimizer_for(model)
    train(model, optimizer, steps, seed=1)
    progress = ResumeState(global_step=steps)
    with CheckpointManager(directory, async_save=async_save, overwrite=True) as manager:
        manager.save(
            steps,
            {"model": model, "optimizer": optimizer, "progress": progress, "note": {"lr": 0.01}},
            metrics={"loss": 0.5},
        )
        saved = snapshot(model, optimizer)
        train(model, optimizer, 1, seed=2)  # goes on while an async save is in flight
    return saved


# --------------------------------------------------------------------------------------------------
# Round trip on the same world size


def round_trip(directory: str, async_save: bool) -> tuple[int | None, bool, int, dict[str, object]]:
    saved = save_trained_fsdp(directory, async_save=async_save)
    model = shard(make_model())
    optimizer = optimizer_for(model)
    train(model, optimizer, 3, seed=7)  # different values everywhere, and optimizer state to replace
    progress = ResumeState()
    state = {"model": model, "optimizer": optimizer, "progress": progress, "note": {}}
    with CheckpointManager(directory) as manager:
        step = manager.restore(state)
    restored = snapshot(model, optimizer)
    same = sorted(restored) == sorted(saved) and all(torch.equal(restored[k], saved[k]) for k in saved)
    return step, same, progress.global_step, state["note"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_fsdp_state_round_trips_exactly_through_a_sharded_checkpoint(tmp_path, ranks, async_save) -> None:
    directory = tmp_path / "ckpts"
    results = ranks.run(round_trip, str(directory), async_save, world_size=2, timeout_s=90)
    assert results == [(2, True, 2, {"lr": 0.01})] * 2
    checkpoint = directory / "step_000000002"
    assert sorted(os.listdir(checkpoint)) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "state.pt",
    ]  # fmt: skip
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["format"] == "distkit-sharded-checkpoint" and manifest["world_size"] == 2
    assert manifest["sharded"] == {
        "engine": "torch.distributed.checkpoint",
        "keys": ["model", "optimizer"],
        "optimizers": {"optimizer": "model"},
    }
    assert manifest["keys"] == ["model", "optimizer", "progress", "note"]
    assert set(manifest["files"]) == set(os.listdir(checkpoint)) - {"manifest.json"}
    for name, info in manifest["files"].items():
        assert (checkpoint / name).stat().st_size == info["size"], name
        assert (checkpoint / name).stat().st_mode & 0o777 == 0o600, name
    # state.pt holds what is not sharded, readable without distkit.
    assert set(torch.load(checkpoint / "state.pt", weights_only=True)) == {"progress", "note"}
    assert not [p for p in directory.iterdir() if p.name.startswith(".step_")]  # no staging left


def refuse_a_full_checkpoint_of_fsdp(directory: str) -> str:
    model = shard(make_model())
    try:
        distkit.save_checkpoint(directory, {"model": model}, sharded=False)
    except ValueError as err:
        return str(err)
    return "saved"


def test_a_full_checkpoint_of_an_fsdp_model_is_refused_naming_the_entry_and_the_fix(tmp_path, ranks) -> None:
    messages = ranks.run(refuse_a_full_checkpoint_of_fsdp, str(tmp_path / "full"), world_size=2)
    for message in messages:
        assert message.startswith("state['model'] has sharded (DTensor) parameters")
        assert "sharded='auto'" in message and "consolidate_checkpoint" in message
    assert not (tmp_path / "full").exists()


# --------------------------------------------------------------------------------------------------
# Resharding: other world sizes, other wrappings


def load_into_fsdp(path: str) -> dict[str, torch.Tensor]:
    model = shard(make_model())
    optimizer = optimizer_for(model)
    train(model, optimizer, 1, seed=9)
    distkit.load_checkpoint(path, {"model": model, "optimizer": optimizer})
    return snapshot(model, optimizer)


def load_into_ddp(path: str) -> dict[str, torch.Tensor]:
    model = nn.parallel.DistributedDataParallel(make_model())
    optimizer = optimizer_for(model)
    train(model, optimizer, 1, seed=9)
    distkit.load_checkpoint(path, {"model": model, "optimizer": optimizer})
    return snapshot(model, optimizer)


def load_into_plain(path: str) -> dict[str, torch.Tensor]:
    model = make_model()
    optimizer = optimizer_for(model)
    distkit.load_checkpoint(path, {"model": model, "optimizer": optimizer})
    return snapshot(model, optimizer)


def test_a_sharded_checkpoint_of_two_ranks_loads_on_one_and_four_ranks_and_into_ddp(tmp_path, ranks) -> None:
    directory = str(tmp_path / "ckpts")
    saved = ranks.run(save_trained_fsdp, directory, world_size=2, timeout_s=90)[0]
    path = str(tmp_path / "ckpts" / "step_000000002")
    assert_same(load_into_plain(path), saved)  # 2 -> 1, no process group, a plain module
    for loaded in ranks.run(load_into_fsdp, path, world_size=1):  # 2 -> 1, FSDP
        assert_same(loaded, saved)
    for loaded in ranks.run(load_into_ddp, path, world_size=2):  # 2 -> 2, DDP
        assert_same(loaded, saved)
    for loaded in ranks.run(load_into_fsdp, path, world_size=4, timeout_s=120):  # 2 -> 4, FSDP
        assert_same(loaded, saved)


def test_a_sharded_checkpoint_of_one_rank_loads_on_two(tmp_path, ranks) -> None:
    directory = str(tmp_path / "ckpts")
    saved = ranks.run(save_trained_fsdp, directory, world_size=1)[0]
    for loaded in ranks.run(load_into_fsdp, str(tmp_path / "ckpts" / "step_000000002"), world_size=2):
        assert_same(loaded, saved)


def test_a_full_checkpoint_of_a_plain_model_loads_into_fsdp_on_two_ranks(tmp_path, ranks) -> None:
    model = make_model()
    optimizer = optimizer_for(model)
    train(model, optimizer, 2, seed=1)
    distkit.save_checkpoint(tmp_path / "full", {"model": model, "optimizer": optimizer})
    assert json.loads((tmp_path / "full" / "manifest.json").read_text())["format"] == "distkit-checkpoint"
    for loaded in ranks.run(load_into_fsdp, str(tmp_path / "full"), world_size=2):
        assert_same(loaded, snapshot(model, optimizer))


# --------------------------------------------------------------------------------------------------
# Consolidation, damage, and what is refused


def test_consolidate_writes_one_weights_only_state_that_loads_into_a_plain_model(tmp_path, ranks) -> None:
    saved = ranks.run(save_trained_fsdp, str(tmp_path / "ckpts"), world_size=2, timeout_s=90)[0]
    full = distkit.consolidate_checkpoint(tmp_path / "ckpts" / "step_000000002", tmp_path / "full")
    assert full == str(tmp_path / "full")
    manifest = json.loads((tmp_path / "full" / "manifest.json").read_text())
    assert manifest["format"] == "distkit-checkpoint" and manifest["step"] == 2
    assert manifest["metrics"] == {"loss": 0.5}
    state = torch.load(tmp_path / "full" / "state.pt", weights_only=True)
    assert sorted(state) == ["model", "note", "optimizer", "progress"]
    for name, tensor in state["model"].items():
        assert torch.equal(tensor, saved[name]), name
    assert state["optimizer"]["param_groups"][0]["params"][0] == "0.weight"  # by parameter name
    assert_same(load_into_plain(str(tmp_path / "full")), saved)


def test_a_damaged_shard_makes_latest_and_restore_fall_back_naming_the_file(tmp_path) -> None:
    model = make_model()
    manager = CheckpointManager(f"file://{tmp_path}", keep_last=3, sharded=True)  # file:// is local
    for step in (1, 2):
        with torch.no_grad():
            model[0].weight.fill_(step)
        manager.save(step, {"model": model})
    shard_file = tmp_path / "step_000000002" / "__0_0.distcp"
    data = bytearray(shard_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard_file.write_bytes(bytes(data))
    with pytest.warns(
        UserWarning, match=r"skipping corrupt checkpoint .*step_000000002: .*__0_0\.distcp has CRC32"
    ):
        assert manager.latest() == str(tmp_path / "step_000000001")
    with pytest.warns(UserWarning, match=r"__0_0\.distcp has CRC32"):
        assert manager.restore({"model": model}) == 1
    assert torch.equal(model[0].weight, torch.ones_like(model[0].weight))
    manager.close()


def test_sharded_checkpoints_on_an_object_store_are_refused_with_the_way_out() -> None:
    with pytest.raises(
        ValueError, match=r"sharded checkpoints are written to a local directory .*memory://x/c"
    ):
        distkit.save_checkpoint("memory://x/c", {"model": make_model()}, sharded=True)


def test_a_sharded_checkpoint_into_a_changed_model_names_every_change_before_reading(tmp_path) -> None:
    """Was: DCP's planner stopped at the first changed shape, so only 0.weight was named."""
    distkit.save_checkpoint(tmp_path / "c", {"model": make_model()}, sharded=True)
    wider = nn.Sequential(nn.Linear(16, 40), nn.ReLU(), nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 4))
    before = [p.detach().clone() for p in wider.parameters()]
    with pytest.raises(distkit.DistkitError) as caught:
        distkit.load_checkpoint(tmp_path / "c", {"model": wider})
    message = str(caught.value)
    for name in ("0.weight", "0.bias", "2.weight"):
        assert f"size mismatch for {name}: copying a param with shape" in message, message
    assert "size mismatch for 4.weight" not in message, message
    assert all(torch.equal(a, b) for a, b in zip(before, wider.parameters(), strict=True))  # nothing read


def test_loading_a_sharded_optimizer_without_its_module_names_what_to_pass(tmp_path) -> None:
    model = make_model()
    optimizer = optimizer_for(model)
    distkit.save_checkpoint(tmp_path / "c", {"model": model, "optimizer": optimizer}, sharded=True)
    with pytest.raises(distkit.DistkitError, match=r"needs the module it trains in the same state"):
        distkit.load_checkpoint(tmp_path / "c", {"optimizer": optimizer_for(make_model())}, strict=False)


# --------------------------------------------------------------------------------------------------
# Retention after an async sharded save: only once that save is committed


def test_async_sharded_retention_keeps_the_newest_and_the_best_and_deletes_only_after_the_commit(
    tmp_path, monkeypatch
) -> None:
    # What the directory held when each deletion began: which checkpoints were committed, and
    # whether a save was in flight (its staging directory in place). Recorded by wrapping distkit's
    # own deletion of a local checkpoint or leftover, which still deletes.
    from distkit.checkpoint._files import _LocalStorage

    deletions: list[tuple[str, list[str], list[str]]] = []
    remove = _LocalStorage.remove

    def recording_remove(self: _LocalStorage, path: str) -> None:
        staging = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".step_"))
        committed = sorted(p.name for p in tmp_path.glob("step_*") if (p / "manifest.json").exists())
        deletions.append((os.path.basename(path), committed, staging))
        remove(self, path)

    monkeypatch.setattr(_LocalStorage, "remove", recording_remove)
    model = make_model()
    manager = CheckpointManager(
        tmp_path, keep_last=2, keep_best=1, monitor="loss", mode="min", async_save=True, sharded=True
    )
    failure = None
    with warnings.catch_warnings():
        # DCP's async_save without a process group says it assumes one process: a world of one.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            for step, loss in {1: 0.9, 2: 0.2, 3: 0.5, 4: 0.7, 5: 0.6}.items():
                manager.save(step, {"model": model}, metrics={"loss": loss})
            manager.wait()
        except distkit.DistkitError as err:
            failure = err  # shown below, after what the deletions say about it
    names = sorted(p.name for p in tmp_path.iterdir())
    best = manager.best()
    manager.close()
    # Each deletion began only once the step whose save made it surplus was committed (step 1
    # after step 3's commit, step 3 after step 5's) with no save in flight, never to make room for
    # a save whose shards were not committed yet.
    assert deletions == [
        ("step_000000001", ["step_000000001", "step_000000002", "step_000000003"], []),
        ("step_000000003", ["step_000000002", "step_000000003", "step_000000004", "step_000000005"], []),
    ], (
        f"retention of an async sharded save ran before that save was committed; (deleted, committed, "
        f"in flight) at each deletion: {deletions}"
    )
    assert failure is None, failure
    assert names == ["step_000000002", "step_000000004", "step_000000005"], names
    assert best == str(tmp_path / "step_000000002")


# --------------------------------------------------------------------------------------------------
# A rank SIGKILLed in the middle of a sharded save


def killed_mid_save(directory: str) -> None:
    """Save steps 1 and 2, then SIGKILL rank 1 once its shard of step 3 is written, before the commit."""
    import torch.distributed.checkpoint as dcp

    import distkit.checkpoint._sharded as sharded

    model = shard(make_model())
    optimizer = optimizer_for(model)
    manager = CheckpointManager(directory, keep_last=2, overwrite=True)
    for step in (1, 2):
        train(model, optimizer, 1, seed=step)
        manager.save(step, {"model": model, "optimizer": optimizer})
    expected = snapshot(model, optimizer)
    if distkit.get_rank() == 0:
        torch.save(expected, os.path.join(directory, os.pardir, "expected.pt"))

    class KilledAfterWriting(dcp.FileSystemWriter):
        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            written = super().write_data(plan, planner)
            written.wait()
            os.kill(os.getpid(), signal.SIGKILL)

    if distkit.get_rank() == 1:
        sharded._writer = KilledAfterWriting  # this process only, which dies
    train(model, optimizer, 1, seed=3)
    manager.save(3, {"model": model, "optimizer": optimizer})


def test_a_rank_killed_mid_save_loses_nothing_committed_and_its_debris_is_cleared(tmp_path, ranks) -> None:
    directory = tmp_path / "ckpts"
    with pytest.raises(RankFailedError) as info:
        ranks.run(killed_mid_save, str(directory), world_size=2, fresh=True, timeout_s=120)
    assert any(f.rank == 1 and "SIGKILL" in f.summary for f in info.value.failures), info.value
    committed = sorted(p.name for p in directory.glob("step_*") if (p / "manifest.json").exists())
    assert committed == ["step_000000001", "step_000000002"]
    debris = [p for p in directory.iterdir() if p.name.startswith(".step_000000003.distkit-tmp-")]
    assert len(debris) == 1 and "__1_0.distcp" in os.listdir(debris[0])  # died after writing its shard

    manager = CheckpointManager(directory, keep_last=2)
    with pytest.warns(UserWarning, match=r"partial checkpoint .*step_000000003"):
        latest = manager.latest()
    assert latest == str(directory / "step_000000002")
    assert_same(load_into_plain(latest), torch.load(tmp_path / "expected.pt", weights_only=True))
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the partial checkpoint, warned about above
        assert manager.restore({"model": model}) == 2
    manager.save(3, {"model": model}, metrics=None)  # retention also clears the debris
    assert sorted(os.listdir(directory)) == ["step_000000002", "step_000000003"]
    manager.close()


def test_manifest_of_a_sharded_checkpoint_lists_every_dcp_file_as_its_own(tmp_path) -> None:
    # A directory holding DCP's files is replaced by a new save, not refused as someone else's.
    distkit.save_checkpoint(tmp_path / "c", {"model": make_model()}, sharded=True)
    distkit.save_checkpoint(tmp_path / "c", {"model": make_model()}, sharded=False)
    assert sorted(os.listdir(tmp_path / "c")) == ["manifest.json", "state.pt"]
    pathlib.Path(tmp_path / "c" / "__9_9.distcp.bak").write_bytes(b"x")
    with pytest.raises(FileExistsError, match=r"__9_9\.distcp\.bak"):
        distkit.save_checkpoint(tmp_path / "c", {"model": make_model()}, sharded=True)


class RunsCode:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch PWNED_BY_METADATA",))


def test_a_metadata_file_carrying_code_is_refused_and_never_runs_even_with_matching_checksums(
    tmp_path, monkeypatch
) -> None:
    import pickle
    import zlib

    monkeypatch.chdir(tmp_path)
    distkit.save_checkpoint(tmp_path / "c", {"model": make_model()}, sharded=True)
    payload = pickle.dumps(RunsCode())
    (tmp_path / "c" / ".metadata").write_bytes(payload)
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"size": len(payload), "crc32": f"{zlib.crc32(payload):08x}"}
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    for state in ({"model": make_model()}, None):  # into a module, and read whole
        with pytest.raises(distkit.DistkitError, match=r"refused to load .*\.metadata: global posix\.system"):
            distkit.load_checkpoint(tmp_path / "c", state)
    assert not (tmp_path / "PWNED_BY_METADATA").exists()


# --------------------------------------------------------------------------------------------------
# A rank whose shards cannot be written


def one_rank_cannot_write(directory: str) -> list[str]:
    """Save steps 1 (sync) and 2 (async) with rank 1's shard writes failing, then step 3 normally."""
    import torch.distributed.checkpoint as dcp

    import distkit.checkpoint._sharded as sharded

    class FullDisk(dcp.FileSystemWriter):
        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            raise OSError(28, "No space left on device (injected)")

    model = shard(make_model())
    optimizer = optimizer_for(model)
    outcomes = []
    writer = sharded._writer
    for async_save in (False, True):
        manager = CheckpointManager(directory, async_save=async_save, overwrite=True)
        if distkit.get_rank() == 1:
            sharded._writer = FullDisk
        try:
            manager.save(1, {"model": model, "optimizer": optimizer})
            manager.wait()
        except Exception as err:
            outcomes.append(f"{type(err).__name__}: {err}")
        finally:
            sharded._writer = writer  # a pool rank: the next test gets the real one
        manager.save(2, {"model": model, "optimizer": optimizer})  # the manager recovers
        manager.close()
    outcomes.append(",".join(sorted(os.listdir(directory))))
    return outcomes


def test_a_rank_that_cannot_write_its_shards_fails_the_save_on_every_rank_and_commits_nothing(
    tmp_path, ranks
) -> None:
    results = ranks.run(one_rank_cannot_write, str(tmp_path / "ckpts"), world_size=2, timeout_s=90)
    (sync0, async0, listing0), (sync1, async1, listing1) = results
    for message in (sync0, async0):
        assert "writing the shards of checkpoint" in message and "failed on rank(s) [1]" in message
        assert "No space left on device (injected)" in message and "Nothing was committed" in message
    assert sync1 == "OSError: [Errno 28] No space left on device (injected)"  # its own error, unwrapped
    assert async1.startswith("MainProcessError: [rank 1/2] saving checkpoint")
    assert "failed on rank(s) [1]" in async1
    assert listing0 == listing1 == "step_000000002"  # step 1 never committed, no staging left


def test_shards_written_where_rank_0_cannot_see_them_are_refused_before_the_commit(tmp_path) -> None:
    """Nodes that each see their own checkpoint directory (a node-local disk): before, rank 0
    committed a manifest listing rank 1's shard, which is on rank 1's disk only, so every later
    load skipped the checkpoint and resume="auto" started over. (Driven end to end with a second
    torchrun agent in its own mount namespace; here, rank 0's side of that save.)"""
    from distkit.checkpoint._sharded import _check_shards_here

    staging = tmp_path / ".step_000000010.distkit-tmp-x"
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"0" * 8)
    (staging / ".metadata").write_bytes(b"m")
    outcomes = [
        ({"__0_0.distcp": {"size": 8}, ".metadata": {"size": 1}}, None),
        ({"__1_0.distcp": {"size": 8}}, None),
    ]
    _check_shards_here(str(staging), str(tmp_path / "step_000000010"), outcomes[:1])  # all here
    with pytest.raises(distkit.DistkitError) as caught:
        _check_shards_here(str(staging), str(tmp_path / "step_000000010"), outcomes)
    message = str(caught.value)
    assert "the shard files of rank(s) [1] (__1_0.distcp) are not in rank 0's staging directory" in message
    assert "a filesystem every node mounts" in message and "Nothing was committed" in message, message
    assert not staging.exists()  # rank 0's part is cleared

"""Golden checkpoints: files written by an earlier distkit (``tests/golden``) still load bitwise and
resume bitwise, so that moving modules cannot change the checkpoint format unnoticed.

Four cases, each a directory of ``tests/golden`` beside its ``expected.json``: a plain
``save_checkpoint`` (model, AdamW, ResumeState, plain data), a ``CheckpointManager`` directory of
two steps, an FSDP2 sharded checkpoint of 2 ranks, and a 2-rank DDP Trainer run checkpointed
mid-epoch. The tests read copies in ``tmp_path`` (a checkout elsewhere, and nothing written into
``tests/golden``). Tensors are compared by SHA-256 of their bytes, floats by ``float.hex``.

A failure here after a refactor means checkpoints written before it no longer load as they did:
fix the code, do not regenerate. ``tests/golden_scripts/make_golden.py`` (which defines the models,
data and loops used below) is for intended format changes only; see its docstring.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import distkit
from golden_scripts import make_golden as golden

GOLDEN = golden.GOLDEN


def expected_of(case: str) -> dict[str, Any]:
    return json.loads((GOLDEN / case / "expected.json").read_text())


def copied(case: str, entry: str, tmp_path: Path) -> Path:
    """A copy of ``tests/golden/<case>/<entry>`` in ``tmp_path``: the files as another checkout has them."""
    return Path(shutil.copytree(GOLDEN / case / entry, tmp_path / case / entry))


@functools.cache
def kernels_as_recorded() -> bool:
    """Whether this machine's CPU kernels compute as the recording machine's did: the plain case's
    steps before its checkpoint, run here from the same seed, give the recorded state bitwise.

    torch's version and CPU capability (``golden.environment``) do not settle it: on an AVX512
    machine with more extensions (AMX, AVX512-FP16) the same three AdamW steps end in other last
    bits, and a resume from the recorded weights continues with other losses (2026-11-27).
    """
    with golden.kept_rng():
        model, optimizer, _, progress = golden.plain_run()
        return golden.describe_loop_state(model, optimizer, progress) == expected_of("plain")["loaded"]


def assert_same_numbers(got: list[str], want: list[str], what: str, recorded: dict[str, str]) -> None:
    """``got`` is ``want`` bitwise (both ``float.hex``) when torch and its CPU kernels are the ones
    that recorded ``want`` (:func:`kernels_as_recorded`); otherwise within 1e-5 relative, with a
    warning.

    Losses and weights after training steps depend on the kernels as well as on the checkpoint: a
    matrix product may round differently under another torch or CPU. A resume that restores the
    wrong RNG streams, batches or optimizer state moves them far more than rounding does, so the
    looser check still catches it there.
    """
    assert len(got) == len(want), f"{what}: {len(got)} values, {len(want)} recorded"
    now = golden.environment()
    if now == recorded and kernels_as_recorded():
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a == b, f"{what}[{index}] is {a}, the uninterrupted run gave {b} (bitwise, {now})"
        return
    why = "the plain case's first steps end in other bits here" if now == recorded else f"running under {now}"
    warnings.warn(
        f"{what}: compared within 1e-5, not bitwise: recorded under {recorded}, {why}",
        stacklevel=2,
    )
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        x, y = float.fromhex(a), float.fromhex(b)
        assert math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-7), f"{what}[{index}] is {x!r}, recorded {y!r}"


@pytest.fixture(scope="module", autouse=True)
def _golden_files_stay_untouched() -> Iterator[None]:
    """Fail the module if any test wrote into, added to or deleted from ``tests/golden``."""

    def fingerprint() -> dict[str, str]:
        return {
            str(path.relative_to(GOLDEN)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(GOLDEN.rglob("*"))
            if path.is_file()
        }

    before = fingerprint()
    yield
    assert fingerprint() == before, "a test changed tests/golden; tests must work on copies in tmp_path"


# --------------------------------------------------------------------------------------------------
# (a) plain: distkit.save_checkpoint of a model, its optimizer, a ResumeState and plain data


def test_plain_golden_checkpoint_loads_bitwise_the_tensors_position_and_data_it_was_saved_with(
    tmp_path, world_of_one
) -> None:
    expected = expected_of("plain")
    path = copied("plain", "checkpoint", tmp_path)
    with golden.kept_rng():
        model, optimizer, progress = golden.fresh_loop_state()
        state = {**golden.loop_state(model, optimizer, progress), "note": {}}
        returned = distkit.load_checkpoint(path, state)
        assert golden.describe_loop_state(model, optimizer, progress) == expected["loaded"]
    assert state["note"] == returned["note"] == expected["note"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == expected["step"]
    assert {name: value.hex() for name, value in manifest["metrics"].items()} == expected["metrics"]


def test_plain_golden_checkpoint_resumes_the_loop_with_the_recorded_losses_weights_and_rng_draws(
    tmp_path, world_of_one
) -> None:
    expected = expected_of("plain")
    with golden.kept_rng():
        model, optimizer, progress = golden.fresh_loop_state()
        distkit.load_checkpoint(
            copied("plain", "checkpoint", tmp_path), golden.loop_state(model, optimizer, progress)
        )
        # The loop draws its batches and dropout masks from the restored RNG.
        resumed = golden.continue_loop(model, optimizer)
    want = expected["after_resume"]
    # Draws from restored generators are exact on any machine.
    assert resumed["draws"] == want["draws"], "RNG streams not restored"
    environment = expected["environment"]
    assert_same_numbers(resumed["losses"], want["losses"], "losses after resuming", environment)
    assert_same_numbers(resumed["weights"], want["weights"], "weights after resuming", environment)


# --------------------------------------------------------------------------------------------------
# (b) managed: a CheckpointManager directory of steps 1 and 2


def test_managed_golden_directory_latest_and_restore_pick_step_2_and_every_step_loads_bitwise(
    tmp_path, world_of_one
) -> None:
    expected = expected_of("managed")
    directory = copied("managed", "checkpoints", tmp_path)
    manager = distkit.CheckpointManager(directory)
    try:
        assert manager.latest() == str(directory / expected["latest"])
        for step, want in expected["steps"].items():
            with golden.kept_rng():
                model, optimizer, progress = golden.fresh_loop_state()
                state = golden.loop_state(model, optimizer, progress)
                distkit.load_checkpoint(manager.path_for(int(step)), state)
                assert golden.describe_loop_state(model, optimizer, progress) == want, f"step {step}"
        with golden.kept_rng():
            model, optimizer, progress = golden.fresh_loop_state()
            assert manager.restore(golden.loop_state(model, optimizer, progress)) == 2
            assert golden.describe_loop_state(model, optimizer, progress) == expected["steps"]["2"]
    finally:
        manager.close()


# --------------------------------------------------------------------------------------------------
# (c) sharded: FSDP2 on 2 ranks, DCP files beside state.pt


def test_sharded_golden_checkpoint_loads_bitwise_into_fsdp_on_two_ranks_with_each_ranks_rng(
    tmp_path, ranks
) -> None:
    expected = expected_of("sharded")
    path = copied("sharded", "checkpoint", tmp_path)
    results = ranks.run(golden.load_sharded_into_fsdp, str(path), world_size=2, timeout_s=90)
    for rank, result in enumerate(results):
        assert result["snapshot"] == expected["snapshot"], f"rank {rank}"
        assert result["draws"] == expected["draws"][str(rank)], f"rank {rank}: RNG stream not restored"
        assert result["progress"] == expected["progress"] and result["note"] == expected["note"], (
            f"rank {rank}"
        )


def test_sharded_golden_checkpoint_reshards_into_a_plain_model_in_one_process_bitwise(
    tmp_path, world_of_one
) -> None:
    expected = expected_of("sharded")
    path = copied("sharded", "checkpoint", tmp_path)
    with golden.kept_rng():
        model, optimizer, _ = golden.fresh_loop_state()
        distkit.load_checkpoint(path, {"model": model, "optimizer": optimizer})
    assert golden.snapshot(model, optimizer) == expected["snapshot"]
    assert json.loads((path / "manifest.json").read_text())["world_size"] == expected["world_size"]


# --------------------------------------------------------------------------------------------------
# (d) mid-epoch: a 2-rank DDP Trainer run checkpointed at step 3 of a 6-step epoch


def test_midepoch_golden_checkpoint_holds_the_trainer_entries_recorded_at_generation(
    tmp_path, world_of_one
) -> None:
    expected = expected_of("midepoch")
    directory = copied("midepoch", "checkpoints", tmp_path)
    checkpoint = directory / f"step_{expected['checkpoint_step']:09d}"
    assert golden.describe_trainer_checkpoint(checkpoint) == expected["checkpoint"]


def assert_resumed_as_recorded(results: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    environment = expected["environment"]
    for rank, result in enumerate(results):
        assert result["step"] == expected["max_steps"], f"rank {rank}"
        want = expected["losses_after_resume"][str(rank)]
        assert_same_numbers(result["losses"], want, f"rank {rank}: losses of steps 4..8", environment)
        assert_same_numbers(
            result["weights"], expected["final_weights"], f"rank {rank}: final weights", environment
        )


def test_trainer_resume_auto_from_a_copy_of_the_midepoch_golden_run_continues_with_bitwise_its_losses(
    tmp_path, ranks
) -> None:
    expected = expected_of("midepoch")
    copied("midepoch", "checkpoints", tmp_path)  # tmp_path/midepoch/checkpoints: the run's directory
    root = str(tmp_path / "midepoch")
    results = ranks.run(golden.midepoch_run, root, expected["max_steps"], "auto", world_size=2, timeout_s=120)
    assert_resumed_as_recorded(results, expected)


def test_trainer_resume_from_the_midepoch_golden_checkpoint_path_continues_with_bitwise_its_losses(
    tmp_path, ranks
) -> None:
    expected = expected_of("midepoch")
    directory = copied("midepoch", "checkpoints", tmp_path)
    path = str(directory / f"step_{expected['checkpoint_step']:09d}")
    root = str(tmp_path / "midepoch")
    results = ranks.run(golden.midepoch_run, root, expected["max_steps"], path, world_size=2, timeout_s=120)
    assert_resumed_as_recorded(results, expected)


# --------------------------------------------------------------------------------------------------
# What the golden manifests record, and what loading must not hold against them


def test_golden_checkpoints_load_whatever_distkit_and_torch_versions_their_manifests_name(
    tmp_path, world_of_one
) -> None:
    manifests = sorted(GOLDEN.rglob("manifest.json"))
    assert len(manifests) == 5  # plain, managed x 2, sharded, midepoch
    for manifest_path in manifests:
        manifest = json.loads(manifest_path.read_text())
        assert manifest["format_version"] == 1, manifest_path
        assert isinstance(manifest["distkit_version"], str), manifest_path
    # An older distkit and torch named in the manifest: loading still gives the same state.
    path = copied("plain", "checkpoint", tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(distkit_version="0.0.1", torch_version="1.0.0")
    (path / "manifest.json").write_text(json.dumps(manifest))
    with golden.kept_rng():
        model, optimizer, progress = golden.fresh_loop_state()
        distkit.load_checkpoint(path, golden.loop_state(model, optimizer, progress))
        assert golden.describe_loop_state(model, optimizer, progress) == expected_of("plain")["loaded"]


def test_golden_directory_stays_under_one_mebibyte() -> None:
    total = sum(path.stat().st_size for path in GOLDEN.rglob("*") if path.is_file())
    assert total < 1 << 20, f"tests/golden holds {total} bytes; keep the golden models tiny"

"""`distkit checkpoint` never destroys a checkpoint (issue 23, point 4), and ``latest()`` never resumes
from a step directory that holds another step.

Every checkpoint here is real, made with the public API in a world of one (or, for an export of a
multi-rank run, on two gloo ranks); the command runs through ``distkit.cli.main`` in this process, or
as the real ``distkit`` executable where the exit status of the process itself is the point.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import fsspec
import pytest
import torch

import distkit
from _launch import launcher_free_env
from distkit.checkpoint import ResumeState
from distkit.cli import main


def distkit_command(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """The installed ``distkit`` executable (beside this interpreter), in a world of one."""
    executable = Path(sys.executable).parent / "distkit"
    env = launcher_free_env()
    return subprocess.run(
        [str(executable), *args], capture_output=True, text=True, timeout=180, env=env, **kwargs
    )


def make_run(directory: Path, steps: tuple[int, ...] = (38, 39, 40)) -> dict[int, str]:
    """A CheckpointManager directory whose step N holds ``w`` = N and ``loss`` = 100 - N."""
    with distkit.CheckpointManager(directory, keep_last=None) as manager:
        return {
            step: manager.save(
                step, {"w": torch.full((4,), float(step)), "step": step}, {"loss": 100.0 - step}
            )
            for step in steps
        }


def snapshot(path: str | Path) -> dict[str, bytes]:
    """Every file under ``path`` (relative name -> bytes): what 'untouched' compares."""
    root = Path(path)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def saved_step(path: str | Path) -> int:
    loaded = distkit.load_checkpoint(path)
    assert torch.equal(loaded["w"], torch.full((4,), float(loaded["step"])))
    return int(loaded["step"])


# --------------------------------------------------------------------------------------------------
# consolidate refuses every destination that would replace, nest or mislabel a checkpoint


def test_consolidate_onto_another_committed_step_is_refused_and_that_step_stays_intact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = make_run(tmp_path / "ck")
    before = snapshot(paths[39])
    assert main(["checkpoint", "consolidate", paths[40], paths[39]]) == 1
    err = capsys.readouterr().err
    assert (
        f"distkit checkpoint: error: the destination {paths[39]} already holds a checkpoint (step 39); "
        f"consolidate never replaces a checkpoint. Choose a new directory" in err
    ), err
    assert snapshot(paths[39]) == before and saved_step(paths[39]) == 39
    assert distkit.CheckpointManager(tmp_path / "ck").latest() == paths[40]


def test_consolidate_onto_an_existing_checkpoint_outside_any_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = make_run(tmp_path / "ck", steps=(40,))
    export = distkit.save_checkpoint(tmp_path / "export", {"w": torch.full((4,), 7.0), "step": 7}, step=7)
    before = snapshot(export)
    assert main(["checkpoint", "consolidate", paths[40], export]) == 1
    assert f"the destination {export} already holds a checkpoint (step 7)" in capsys.readouterr().err
    assert snapshot(export) == before


def test_consolidate_onto_its_own_source_is_refused_also_through_a_symlink(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = make_run(tmp_path / "ck", steps=(40,))
    before = snapshot(paths[40])
    assert main(["checkpoint", "consolidate", paths[40], paths[40]]) == 1
    err = capsys.readouterr().err
    assert (
        f"distkit checkpoint: error: the destination {paths[40]} is the source checkpoint {paths[40]}; "
        f"writing it would replace the checkpoint being read. Choose a new directory" in err
    ), err
    alias = tmp_path / "alias"
    alias.symlink_to(paths[40])
    assert main(["checkpoint", "consolidate", paths[40], str(alias)]) == 1
    assert f"the destination {alias} is the source checkpoint {paths[40]}" in capsys.readouterr().err
    assert snapshot(paths[40]) == before and saved_step(paths[40]) == 40


def test_consolidate_into_a_directory_inside_its_source_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = make_run(tmp_path / "ck", steps=(40,))
    before = snapshot(paths[40])
    inner = os.path.join(paths[40], "inner")
    assert main(["checkpoint", "consolidate", paths[40], inner]) == 1
    err = capsys.readouterr().err
    assert (
        f"distkit checkpoint: error: the destination {inner} is inside the source checkpoint {paths[40]}; "
        f"a checkpoint nested in another one is deleted with it. Choose a new directory outside "
        f"{paths[40]}." in err
    ), err
    assert not os.path.lexists(inner) and snapshot(paths[40]) == before


def test_consolidate_into_a_directory_inside_another_checkpoint_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = make_run(tmp_path / "ck", steps=(39, 40))
    before = snapshot(paths[39])
    nested = os.path.join(paths[39], "export", "full")
    assert main(["checkpoint", "consolidate", paths[40], nested]) == 1
    err = capsys.readouterr().err
    assert (
        f"the destination {nested} is inside the checkpoint {paths[39]}; a checkpoint nested in another "
        f"one is deleted with it. Choose a new directory outside {paths[39]}." in err
    ), err
    assert snapshot(paths[39]) == before


def test_consolidate_into_a_non_empty_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What a killed save leaves: distkit's own state.pt without a manifest. The old rule replaced it.
    paths = make_run(tmp_path / "ck", steps=(40,))
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"half a state")
    assert main(["checkpoint", "consolidate", paths[40], str(partial)]) == 1
    err = capsys.readouterr().err
    assert (
        f"the destination {partial} exists and is not empty (['state.pt']); consolidate writes only into "
        f"a new or empty directory. Choose a new directory" in err
    ), err
    assert (partial / "state.pt").read_bytes() == b"half a state"


def test_consolidate_into_a_step_directory_name_of_another_step_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A new step_000000041 beside the run's own checkpoints would resume as step 41 with step 40's state.
    paths = make_run(tmp_path / "ck", steps=(40,))
    mislabeled = str(tmp_path / "ck" / "step_000000041")
    assert main(["checkpoint", "consolidate", paths[40], mislabeled]) == 1
    err = capsys.readouterr().err
    assert (
        f"the destination {mislabeled} is named like the checkpoint of step 41 but the source holds step "
        f"40: a CheckpointManager of {tmp_path / 'ck'} would take it for step 41. Choose a directory "
        f"that is not named step_<N> (or name it step_000000040)." in err
    ), err
    assert not os.path.lexists(mislabeled)


def test_consolidate_on_an_object_store_refuses_its_source_a_nested_path_and_a_checkpoint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # fsspec's memory filesystem: one store per process, so the command runs in this process.
    root = f"memory://consolidate-{uuid.uuid4().hex[:12]}"
    try:
        src = distkit.save_checkpoint(f"{root}/step_000000005", {"w": torch.ones(2), "step": 5}, step=5)
        other = distkit.save_checkpoint(f"{root}/export", {"w": torch.zeros(2), "step": 1}, step=1)
        assert main(["checkpoint", "consolidate", src, f"{src}/"]) == 1
        assert f"the destination {src} is the source checkpoint {src}" in capsys.readouterr().err
        assert main(["checkpoint", "consolidate", src, f"{src}/inner"]) == 1
        assert f"the destination {src}/inner is inside the source checkpoint {src}" in capsys.readouterr().err
        assert main(["checkpoint", "consolidate", src, other]) == 1
        assert f"the destination {other} already holds a checkpoint (step 1)" in capsys.readouterr().err
        assert distkit.load_checkpoint(other)["step"] == 1 and distkit.load_checkpoint(src)["step"] == 5
        assert not fsspec.filesystem("memory").exists(f"{src}/inner")
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)


def test_consolidate_to_a_new_directory_writes_it_whole_or_not_at_all(tmp_path: Path) -> None:
    big = distkit.save_checkpoint(tmp_path / "big", {"w": torch.ones(2 << 20)}, step=3)  # 8 MiB

    def small_file_limit() -> None:  # a real EFBIG from write(2) past 1 MiB
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    export = tmp_path / "exports" / "full"
    done = distkit_command("checkpoint", "consolidate", big, str(export), preexec_fn=small_file_limit)
    assert done.returncode == 1, done.stderr
    assert "EFBIG (File too large) while writing checkpoint" in done.stderr, done.stderr
    assert not os.path.lexists(export) and os.listdir(tmp_path / "exports") == []  # no half, no debris

    done = distkit_command("checkpoint", "consolidate", big, str(export))
    assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path / "exports") == ["full"]
    assert torch.equal(distkit.load_checkpoint(export)["w"], torch.ones(2 << 20))


def test_consolidate_into_an_existing_empty_directory_still_works(tmp_path: Path) -> None:
    paths = make_run(tmp_path / "ck", steps=(40,))
    (tmp_path / "export").mkdir()
    assert main(["checkpoint", "consolidate", paths[40], str(tmp_path / "export")]) == 0
    assert saved_step(tmp_path / "export") == 40


def save_with_resume_state(directory: str) -> None:
    torch.manual_seed(100 + distkit.get_rank())  # each rank its own stream
    distkit.save_checkpoint(directory, {"w": torch.ones(2), "progress": ResumeState(global_step=7)}, step=7)


def resume_and_draw(path: str) -> tuple[float, list[str]]:
    """The first draw of torch's generator after resuming from ``path``, and the warnings the load gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distkit.load_checkpoint(path, {"w": torch.zeros(2), "progress": ResumeState()})
    return torch.rand(1).item(), [str(warning.message) for warning in caught]


def test_a_consolidated_export_names_the_world_size_that_saved_it_and_resumes_on_it_without_a_warning(
    tmp_path: Path, ranks, capsys: pytest.CaptureFixture[str]
) -> None:
    # The export's ResumeState holds both ranks' RNG streams: a manifest saying 1 rank (the process
    # that consolidated) contradicted the warning of a resume in one process ("saved by 2 rank(s)").
    source, export = str(tmp_path / "ck"), str(tmp_path / "export")
    ranks.run(save_with_resume_state, source, world_size=2)
    assert main(["checkpoint", "consolidate", source, export]) == 0
    assert json.loads((tmp_path / "export" / "manifest.json").read_text())["world_size"] == 2
    code, out, _ = run_main(capsys, "checkpoint", "inspect", export)
    assert code == 0 and "format       full (saved by 2 rank(s))" in out, out

    # On as many ranks as saved it, the streams come back exactly, as from the source, unwarned.
    resumed = ranks.run(resume_and_draw, export, world_size=2)
    assert resumed == ranks.run(resume_and_draw, source, world_size=2)
    assert [warned for _, warned in resumed] == [[], []]
    # In one process the mismatch is real and warned, with the number the manifest gives.
    _, warned = resume_and_draw(export)
    assert len(warned) == 1 and "RNG states were saved by 2 rank(s) and this job has 1" in warned[0]
    # Loading the weights alone (inference) restores no streams and warns about none.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distkit.load_checkpoint(export, {"w": torch.zeros(2)})


# --------------------------------------------------------------------------------------------------
# list and inspect of a missing path fail


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``distkit ARGS`` in this process (the executable itself costs an import of torch per call)."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_list_of_a_missing_directory_exits_1_and_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no" / "such" / "dir"
    expected = (
        f"distkit checkpoint: error: {missing} does not exist. Pass the directory of a "
        f"CheckpointManager (the one that holds its step_<N> directories)."
    )
    done = distkit_command("checkpoint", "list", str(missing))  # the real exit status, once
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == "" and expected in done.stderr, done.stderr
    code, out, err = run_main(capsys, "checkpoint", "list", str(missing), "--json")
    assert (code, out) == (1, "") and expected in err, err


def test_list_of_a_file_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("not a directory")
    code, _, err = run_main(capsys, "checkpoint", "list", str(tmp_path / "notes.txt"))
    assert code == 1
    assert f"{tmp_path / 'notes.txt'} is a file, not a directory of checkpoints" in err


def test_list_of_one_checkpoint_exits_1_and_names_inspect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    distkit.save_checkpoint(tmp_path / "one", {"w": torch.zeros(2)})
    code, out, err = run_main(capsys, "checkpoint", "list", str(tmp_path / "one"))
    # Was: "no checkpoints in ..." and exit status 0.
    assert (code, out) == (1, "")
    assert f"{tmp_path / 'one'} is one checkpoint, not a directory of them: `distkit checkpoint" in err


def test_list_of_a_trainer_run_directory_lists_its_checkpoints_subdirectory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    with distkit.CheckpointManager(run / "checkpoints") as manager:
        manager.save(7, {"w": torch.zeros(2)})
    (run / "metrics.csv").write_text("step\n")
    code, out, err = run_main(capsys, "checkpoint", "list", str(run))
    # Was: "no checkpoints in run" and exit status 0.
    assert code == 0, err
    assert f"{run} is a Trainer run directory; listing its checkpoints, in {run / 'checkpoints'}:" in err
    assert re.match(r"\s+7  committed  full", out), out


def test_a_memory_url_from_the_command_and_a_file_url_a_slash_short_are_explained(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_main(capsys, "checkpoint", "list", "memory://elsewhere/ckpts")
    assert code == 1 and "memory:// lives inside one process" in err, err
    # Was: "tmp/run does not exist", read as a path relative to the working directory.
    code, _, err = run_main(capsys, "checkpoint", "list", "file://tmp/run")
    assert code == 1, err
    assert "a file:// URL of an absolute path has three slashes (file:///tmp/run)" in err, err


def test_list_tells_a_save_that_did_not_finish_from_another_tools_step_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "step_000000006").mkdir()
    (tmp_path / "step_000000006" / "state.pt").write_bytes(b"half")
    (tmp_path / "step_000000005").mkdir()
    (tmp_path / "step_000000005" / "model.safetensors").write_bytes(b"x")
    code, out, err = run_main(capsys, "checkpoint", "list", str(tmp_path))
    assert code == 0, err
    # Was: both "partial (no manifest.json)"; inspect and latest() call the second not distkit's.
    assert out.splitlines() == [
        "         6  partial (no manifest.json)",
        "         5  not a distkit checkpoint: no manifest.json, and files distkit did not write "
        "(model.safetensors)",
    ]


def test_list_of_an_empty_directory_still_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "checkpoint", "list", str(tmp_path))
    assert code == 0, err
    assert out.strip() == f"no checkpoints in {tmp_path}"


def test_inspect_of_a_missing_path_exits_1_and_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "step_000000040"
    for extra in ((), ("--json",)):
        code, _, err = run_main(capsys, "checkpoint", "inspect", str(missing), *extra)
        assert code == 1, err
        assert f"checkpoint not found: {missing} does not exist" in err, err


# --------------------------------------------------------------------------------------------------
# latest() and restore() never resume from a step directory that holds another step


def mislabel(paths: dict[int, str], *, copy: int, onto: int) -> None:
    """Put step ``copy``'s checkpoint under step ``onto``'s name, as a hand-made `cp -r` would."""
    shutil.rmtree(paths[onto])
    shutil.copytree(paths[copy], paths[onto])


def test_latest_skips_a_step_directory_whose_manifest_names_another_step_with_a_warning(
    tmp_path: Path,
) -> None:
    paths = make_run(tmp_path / "ck")
    mislabel(paths, copy=40, onto=39)
    shutil.rmtree(paths[40])  # the newest is gone: latest() falls back past step 39's name
    manager = distkit.CheckpointManager(tmp_path / "ck")
    warning = (
        rf"skipping checkpoint {re.escape(paths[39])}: its directory is named for step 39 but its "
        rf"manifest says step 40 \(copied or renamed by hand\?\)\. Resuming from it would pair step 40's "
        rf"state with step 39's position, so an older checkpoint is used\. Delete it, or rename it to "
        rf"step_000000040 if that name is free\."
    )
    with pytest.warns(UserWarning, match=warning):
        assert manager.latest() == paths[38]
    with pytest.warns(UserWarning, match=warning):
        step = manager.restore(state := {"w": torch.zeros(4), "step": None})
    assert step == 38 and torch.equal(state["w"], torch.full((4,), 38.0))
    with pytest.warns(UserWarning, match=warning):
        assert distkit.CheckpointManager(tmp_path / "ck", monitor="loss").best() == paths[38]


def test_retention_keeps_a_mislabeled_step_directory_and_does_not_count_it(tmp_path: Path) -> None:
    paths = make_run(tmp_path / "ck")
    mislabel(paths, copy=40, onto=39)
    manager = distkit.CheckpointManager(tmp_path / "ck", keep_last=2)
    assert manager.restore({"w": torch.zeros(4), "step": None}) == 40  # the newest is sound
    with pytest.warns(
        UserWarning,
        match=rf"retention keeps {re.escape(paths[39])}: its directory is named for step 39 but its "
        rf"manifest says step 40",
    ):
        manager.save(41, {"w": torch.full((4,), 41.0), "step": 41})
    # Kept: 41 and 40 (the two newest that are what their names say) and the mislabeled 39.
    assert sorted(os.listdir(tmp_path / "ck")) == ["step_000000039", "step_000000040", "step_000000041"]


def test_list_shows_a_mislabeled_step_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = make_run(tmp_path / "ck")
    mislabel(paths, copy=40, onto=39)
    assert main(["checkpoint", "list", str(tmp_path / "ck")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split(None, 1) == [
        "39",
        "mislabeled: its manifest says step 40; latest() and restore() skip it",
    ], lines
    assert "committed" in lines[0] and "committed" in lines[2]

"""Every step once in each tracker across SIGKILLs: a real training process (one rank) logging to
metrics.csv, MLflow's file store and wandb offline at every step is SIGKILLed twice and resumed with
``resume="auto"``; MLflow is read back through its API, wandb through the attempts' own ``.wandb``
files (what ``wandb sync`` uploads, oldest first). A step counts as logged for a tracker only once the
tracker holds it durably: wandb's service buffers its file, so a killed attempt's file holds little
or nothing, and the resumed attempt logs those steps again from the logger's journal."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from test_loggers_tracking import WANDB_SETTINGS, csv_column, mlflow_history, wandb_attempts, wandb_steps

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None or importlib.util.find_spec("wandb") is None,
    reason="needs the mlflow and wandb extras: pip install 'distkit[mlflow,wandb]'",
)

SCRIPT = pathlib.Path(__file__).parent / "tracker_scripts" / "killed_fit.py"
ALL_STEPS = list(range(1, 26))  # killed_fit.py: 25 steps, each logged; 13 per epoch


def attempt(root: pathlib.Path, kill_step: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    command = [sys.executable, str(SCRIPT), str(root)]
    if kill_step is not None:
        command += ["--kill-step", str(kill_step)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    expected = -signal.SIGKILL if kill_step is not None else 0
    assert result.returncode == expected, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def mlflow_run_id(root: pathlib.Path) -> str:
    return str(json.loads((root / "mlflow_run.json").read_text())["run_id"])


def test_two_sigkills_then_resume_leave_every_step_once_in_mlflow_and_wandb(tmp_path) -> None:
    root = tmp_path / "run"
    # Attempt 1: checkpoints at 5 and 10, logs steps 1-13, killed after 13.
    attempt(root, kill_step=13)
    (killed,) = wandb_attempts(str(root))
    held_by_killed = [step for step, _ in killed["history"]]
    assert held_by_killed == ALL_STEPS[: len(held_by_killed)]  # a prefix, whatever wandb flushed
    # Attempt 2: resumes at 10, logs 11-19 (and again what attempt 1's file lacks), killed after 19.
    second = attempt(root, kill_step=19)
    assert "resumed at step 10" in second.stdout
    # Attempt 3: resumes at 15 and finishes.
    third = attempt(root)
    assert "resumed at step 15" in third.stdout

    expected = csv_column(str(root), "train_loss")  # metrics.csv: the resumed rows replace the killed
    assert sorted(expected) == ALL_STEPS

    run_id = mlflow_run_id(root)
    for key in ("train_loss", "epoch", "skipped_steps"):
        # One value per (metric, step): epoch is logged twice at step 13, the epoch's end.
        assert [step for step, _ in mlflow_history(str(root), run_id, key)] == ALL_STEPS, key
    assert dict(mlflow_history(str(root), run_id, "train_loss")) == pytest.approx(expected, rel=1e-12)
    assert [step for step, _ in mlflow_history(str(root), run_id, "train_loss_epoch")] == [13, 25]

    attempts = wandb_attempts(str(root))
    assert len(attempts) == 3
    assert {a["id"] for a in attempts if a["id"] is not None} == {
        json.loads((root / "wandb_run.json").read_text())["run_id"]
    }
    for key in ("train_loss", "epoch", "skipped_steps"):
        # The attempts' files in order, as `wandb sync` appends them: each step once, increasing.
        assert [step for step, _ in wandb_steps(attempts, key)] == ALL_STEPS, key
    assert dict(wandb_steps(attempts, "train_loss")) == pytest.approx(expected, rel=1e-12)
    assert [step for step, _ in wandb_steps(attempts, "train_loss_epoch")] == [13, 25]
    assert attempts[-1]["exit_code"] == 0
    # Finished: the last attempt's file holds every step, so the journal holds none.
    assert (root / "wandb_steps.jsonl").read_text() == ""


def test_wandb_file_reader_counts_only_whole_records_of_a_torn_file(tmp_path) -> None:
    from distkit.trainer.tracking import WandbLogger, _last_history_step

    logger = WandbLogger("tests", init_kwargs=WANDB_SETTINGS)
    logger.setup(tmp_path, None)
    for step in range(1, 301):
        logger.log_metrics({"loss": 1.0 / step, "epoch": 0.0}, step=step)
    logger.finalize()
    (whole,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert _last_history_step(whole) == 300
    data = whole.read_bytes()
    torn = tmp_path / "torn.wandb"
    previous = -1
    for cut in range(0, len(data) + 1, max(1, len(data) // 97)):
        torn.write_bytes(data[:cut])
        last = _last_history_step(torn)  # what a service killed after writing `cut` bytes left
        assert previous <= last <= 300
        previous = last
    assert previous >= 290  # the last cut is within a few records of the end
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0xFF  # a flipped bit: nothing after it counts
    torn.write_bytes(bytes(damaged))
    assert _last_history_step(torn) < 300

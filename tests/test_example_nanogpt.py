"""examples/nanogpt runs end to end under torchrun on 2 CPU processes: validation every N steps,
checkpoints every M steps, and a resumed run that carries on from the last step."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import distkit

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "nanogpt" / "train.py"

# A model small enough for tens of optimizer steps per second on a busy 2-core machine.
TINY = [
    "--batch-size=8",
    "--block-size=32",
    "--n-layer=2",
    "--n-head=2",
    "--n-embd=32",
    "--dropout=0.1",
    "--lr=1e-2",
    "--warmup-steps=5",
    "--eval-interval=10",
    "--checkpoint-interval=20",
    "--log-interval=5",
]


def _torchrun(out_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    # The test may itself run under a launcher: its variables would make torchrun's children join
    # the wrong job.
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port of its own: tests running side by side do not collide
        "--nproc_per_node=2",
        str(SCRIPT),
        f"--out-dir={out_dir}",
        *TINY,
        *extra,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _rows(out_dir: Path) -> list[dict[str, str]]:
    with open(out_dir / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def _series(rows: list[dict[str, str]], name: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[name])) for r in rows if r.get(name) not in (None, "")]


def test_nanogpt_example_validates_every_10_steps_checkpoints_every_20_and_resumes_at_the_last_step(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    first = _torchrun(out, "--max-steps=40")
    assert "step 40:" in first.stdout, first.stdout[-2000:]
    rows = _rows(out)
    val = _series(rows, "val_loss")
    train = _series(rows, "train_loss")
    assert [step for step, _ in val] == [10, 20, 30, 40], val
    assert [step for step, _ in train] == list(range(5, 41, 5)), train
    # It learns: below the loss of a uniform guess (ln of the vocabulary, ~4.6) and going down.
    vocab_size = len(json.loads((out / "meta.json").read_text())["vocab"])
    assert all(math.isfinite(loss) for _, loss in val + train)
    assert val[0][1] < math.log(vocab_size), val
    assert val[-1][1] < val[0][1], val
    assert train[-1][1] < train[0][1] - 0.5, train
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_000000020", "step_000000040"]

    second = _torchrun(out, "--max-steps=60", "--resume")
    assert "resumed at step 40" in second.stdout, second.stdout[-2000:]
    assert "step 60:" in second.stdout, second.stdout[-2000:]
    resumed = _rows(out)
    # The first run's rows are kept as they were, and the second run's steps follow them once each.
    assert [(r["step"], r["train_loss"], r["val_loss"]) for r in resumed[: len(rows)]] == [
        (r["step"], r["train_loss"], r["val_loss"]) for r in rows
    ]
    steps = [int(r["step"]) for r in resumed[len(rows) :] if r.get("train_loss")]
    assert steps == [45, 50, 55, 60], steps
    assert [step for step, _ in _series(resumed, "val_loss")] == [10, 20, 30, 40, 50, 60]
    assert distkit.CheckpointManager(checkpoints).latest().endswith("step_000000060")

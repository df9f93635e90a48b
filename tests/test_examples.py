"""The README's main job runs end to end: DDP on 2 CPU processes under torchrun, >= 95 % accuracy."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_main_job_trains_digits_to_95_percent_and_writes_checkpoints_log_and_plot(tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "examples" / "train_digits.py"),
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "validation accuracy" in done.stdout
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    accuracies = [float(r[k]) for r in rows for k in r if "acc" in k and r[k] not in ("", None)]
    assert accuracies and max(accuracies) >= 0.95, accuracies[-5:]
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any((tmp_path / "checkpoints").iterdir())

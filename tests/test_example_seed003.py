"""Seed 003's program as a bundled example (examples/seed003_main_multi_gpu.py): DDP on 2 CPU
processes under torchrun with the guide's flags, the learning rate scaled and warmed up in epochs,
and DP on a CPU machine refused with the Trainer's message rather than a traceback."""

from __future__ import annotations

import csv
import itertools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "seed003_main_multi_gpu.py"
# scikit-learn's digits: 1,797 samples, 360 of them (20 %, rounded up) held out for validation.
TRAIN_SAMPLES = 1797 - 360


def _env() -> dict[str, str]:
    # A test run inside another job's variables would join that job.
    return {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }


def test_seed003_example_trains_under_torchrun_with_scaled_lr_warmed_up_over_an_epoch(
    tmp_path: Path,
) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(EXAMPLE),
        "--multi-gpu",
        "ddp",
        "--epochs",
        "3",
        "--batch-size",
        "32",
        "--lr",
        "1e-3",
        "--warmup-epochs",
        "1",
        "--log-every-n-steps",
        "1",
        "--save-dir",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Every rank's share padded to 719 samples, batches of 32: 23 optimizer steps per epoch.
    per_epoch = math.ceil(math.ceil(TRAIN_SAMPLES / 2) / 32)
    final = re.search(r"seed003: val_acc (\d\.\d+) after 3 epoch\(s\), (\d+) steps", done.stdout)
    assert final is not None, done.stdout[-3000:]
    assert int(final.group(2)) == 3 * per_epoch
    assert float(final.group(1)) >= 0.75  # 10 classes: chance is 0.1; this run reaches about 0.84

    with open(tmp_path / "metrics.csv", newline="") as handle:
        lr = {int(row["step"]): float(row["lr"]) for row in csv.DictReader(handle) if row.get("lr")}
    assert sorted(lr) == list(range(1, 3 * per_epoch + 1))
    peak = 1e-3 * 2  # linear scaling: 2 ranks x 32 samples against the 32 that --lr was tuned for
    # Logged after `step` optimizer steps: the rate of step index `step`, (step + 1) / warm-up of
    # the peak during the first epoch, then cosine decay to 0 at the last step.
    for step in range(1, per_epoch):
        assert lr[step] == pytest.approx(peak * (step + 1) / per_epoch, rel=1e-9)
    assert max(lr.values()) == pytest.approx(peak, rel=1e-9)
    decay = [lr[step] for step in range(per_epoch, 3 * per_epoch + 1)]
    assert decay[0] == pytest.approx(peak, rel=1e-9)
    assert all(later < earlier for earlier, later in itertools.pairwise(decay))
    assert decay[-1] == pytest.approx(0.0, abs=1e-12)

    # The last two checkpoints kept (the best by val_acc is one of them in a run this short).
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved == [f"step_{2 * per_epoch:09d}", f"step_{3 * per_epoch:09d}"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="DP runs on a machine with CUDA")
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--multi-gpu", "dp"], r"error: strategy='dp' \(nn.DataParallel\) needs CUDA.*use strategy='ddp'"),
        (["--multi-gpu", "ddp", "--gpu-ids", "0,1"], r"error: --gpu-ids needs CUDA"),
    ],
    ids=["dp", "ddp-gpu-ids"],
)
def test_seed003_example_on_cpu_refuses_gpu_flags_with_a_message_not_a_traceback(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    cmd = [sys.executable, str(EXAMPLE), *flags, "--save-dir", str(tmp_path)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert re.search(message, done.stderr), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "checkpoints").exists()  # refused before anything ran

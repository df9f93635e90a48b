"""Seed 001's and seed 004's config-driven examples run under torchrun on 2 CPU processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def torchrun(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(EXAMPLES / script),
        *args,
    ]
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_seed001_config_file_with_overrides_trains_and_saves_the_resolved_config(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = torchrun(
        "seed001_config_run.py",
        "--config",
        str(EXAMPLES / "configs" / "seed001.yaml"),
        "--trainer.max_epochs",
        "2",
        "--model.latent_dim",
        "4",
        f"--trainer.default_root_dir={out}",
        cwd=tmp_path,
    )
    assert done.stdout.count("validation reconstruction MSE") == 1  # printed by rank 0 only
    assert "world size     2" in done.stdout
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["latent_dim"] == 4  # the override
    assert saved["model"]["hidden_dim"] == 32  # from the config file
    assert saved["optimizer"] == {
        "class_path": "torch.optim.Adam",
        "init_args": {**saved["optimizer"]["init_args"], "lr": 0.003},
    }
    assert saved["trainer"]["max_epochs"] == 2 and saved["trainer"]["strategy"] == "ddp"
    hparams = json.loads((out / "hparams.json").read_text())
    assert hparams["model"] == saved["model"] and hparams["run"]["world_size"] == 2
    assert any((out / "checkpoints").iterdir())

    # The example's --print_config (no launcher needed): the resolved YAML, nothing trained.
    printed = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "seed001_config_run.py"),
            "--config",
            str(out / "config.yaml"),
            "--model.dropout",
            "0.25",
            "--print_config",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert printed.returncode == 0, printed.stderr[-3000:]
    resolved = yaml.safe_load(printed.stdout)
    assert resolved["model"] == {**saved["model"], "dropout": 0.25}
    assert resolved["trainer"]["max_epochs"] == 2


def test_seed004_text_classifier_trains_with_ddp_and_reports_compute_versus_communication(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    done = torchrun(
        "seed004_text_classifier.py",
        "--config",
        str(EXAMPLES / "configs" / "seed004.yaml"),
        "--trainer.max_epochs",
        "1",
        "--data.num_samples",
        "256",
        "--data.num_val_samples",
        "64",
        "--model.d_model",
        "32",
        "--model.dim_feedforward",
        "64",
        "--analysis.steps",
        "2",
        "--analysis.min_time_s",
        "0",
        "--analysis.world_sizes",
        "[1, 2]",
        f"--trainer.default_root_dir={out}",
        cwd=tmp_path,
    )
    assert done.stdout.count("compute-versus-communication analysis") == 1
    assert "R = compute/comm" in done.stdout
    assert "2 rank(s): predicted speedup" in done.stdout
    assert "(gloo, 2 ranks)" in done.stdout  # measured on the job's own group
    assert "validation accuracy" in done.stdout
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["d_model"] == 32 and saved["analysis"]["world_sizes"] == [1, 2]

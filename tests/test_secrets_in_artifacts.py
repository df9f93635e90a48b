"""Credentials never reach an artefact of a run. A TrainerCLI run with every built-in logger (CSV,
TensorBoard, MLflow's file store, wandb offline) gets a key, a password and a token planted in a
checkpoint URL, a data URL and a credential-named option (from a config file and from the command
line), is resumed, and then every file of the run directory, every record of both trackers (read
through their own APIs and files) and everything printed or logged is searched for them. The resume
check still compares the configs (redacted on both sides), and the files distkit writes there are
the owner's only, as the checkpoints."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib
import stat
import sys
from typing import Any

import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import TensorDataset

from distkit.trainer.config_cli import TrainerCLI
from test_loggers_tracking import WANDB_SETTINGS, mlflow_runs, wandb_records

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mlflow", "wandb", "tensorboard")),
    reason="needs the mlflow, wandb and tensorboard extras",
)

KEY = "AKIAPLANTEDKEY0001"
PASSWORD = "plantedPassw0rd0002"
TOKEN = "plantedToken0003"
API_TOKEN = "plantedApiToken0004"
SECRETS = (KEY, PASSWORD, TOKEN, API_TOKEN)


class Net(nn.Module):
    """A small classifier.

    Args:
        hidden: Width of the hidden layer.
    """

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def blobs(source: str = "", api_token: str = "", samples: int = 64) -> TensorDataset:
    """Points in two classes, as if downloaded from ``source`` with ``api_token``.

    Args:
        source: Where the data would come from (a URL with credentials).
        api_token: A credential for it.
        samples: How many points.
    """
    assert api_token == API_TOKEN and PASSWORD in source  # the program itself gets the real values
    x = torch.randn(samples, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x[:, 0] > 0).long())


@pytest.fixture
def no_tracker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)


def config(root: pathlib.Path, bucket: str) -> dict[str, Any]:
    checkpoints = f"memory://{KEY}:{PASSWORD}@{bucket}/run?token={TOKEN}"
    return {
        "data": {"source": f"https://{KEY}:{PASSWORD}@data.example/digits.bin?token={TOKEN}"},
        "trainer": {
            "default_root_dir": str(root),
            "batch_size": 8,
            "log_every_n_steps": 2,
            "enable_progress_bar": False,
            "resume": "auto",
            "callbacks": [
                {
                    "class_path": "distkit.trainer.ModelCheckpoint",
                    "init_args": {"dirpath": checkpoints, "every_n_steps": 2},
                }
            ],
            "logger": [
                {"class_path": "distkit.trainer.CSVLogger"},
                {"class_path": "distkit.trainer.TensorBoardLogger"},
                {
                    "class_path": "distkit.trainer.tracking.MLflowLogger",
                    "init_args": {"experiment_name": "distkit-tests"},
                },
                {
                    "class_path": "distkit.trainer.tracking.WandbLogger",
                    "init_args": {"project": "tests", "init_kwargs": WANDB_SETTINGS},
                },
            ],
        },
    }


def run_script(monkeypatch: pytest.MonkeyPatch, config_path: pathlib.Path, *options: str) -> None:
    """As ``python train.py --config run.yaml --data.api_token TOKEN ...``: TrainerCLI reads
    ``sys.argv``, which wandb records too."""
    argv = ["train.py", "--config", str(config_path), "--data.api_token", API_TOKEN, *options]
    monkeypatch.setattr(sys, "argv", argv)
    TrainerCLI(Net, blobs, loss_fn=nn.functional.cross_entropy)


def found_in(data: bytes) -> list[str]:
    return [secret for secret in SECRETS if secret.encode() in data]


def test_no_planted_credential_reaches_a_file_a_tracker_record_or_the_output(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    no_tracker_env: None,
) -> None:
    root = tmp_path / "run"
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(config(root, f"bucket-{tmp_path.name}")))
    caplog.set_level(logging.INFO)

    run_script(monkeypatch, config_path, "--trainer.max_steps", "6")
    # Resumed from the checkpoint of step 6 with a longer schedule: the saved config.yaml holds the
    # redacted values, the new config the real ones, and only max_steps counts as a change.
    run_script(monkeypatch, config_path, "--trainer.max_steps", "8")
    output = capfd.readouterr()
    shown = output.out + output.err + caplog.text
    assert "resumed at step 6" in shown
    assert "trainer.max_steps: 6 -> 8" in shown
    # No spurious change: the resume warning lists max_steps only (wandb's own INFO logs, when the
    # session's logging lets them through, print the whole config and so name every key).
    changes = [
        record.getMessage() for record in caplog.records if "differs from the one" in record.getMessage()
    ]
    assert changes, shown
    assert all("data.source" not in text and "dirpath" not in text for text in changes), changes
    # A real change of a value holding a credential is still one, shown redacted.
    mirror = f"https://{KEY}:{PASSWORD}@mirror.example/digits.bin?token={TOKEN}"
    run_script(monkeypatch, config_path, "--trainer.max_steps", "10", "--data.source", mirror)
    output = capfd.readouterr()
    changed = output.out + output.err + caplog.text
    assert "resumed at step 8" in changed
    assert (
        "data.source: https://***@data.example/digits.bin?token=*** -> "
        "https://***@mirror.example/digits.bin?token=***" in changed
    ), changed
    shown += changed

    # Every file of the run directory, the trackers' own files included.
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    names = {str(p.relative_to(root)) for p in files}
    assert {"config.yaml", "hparams.json", "metrics.csv", "mlflow_run.json", "wandb_run.json"} <= names
    assert any(n.startswith("tensorboard/events.out.tfevents") for n in names)
    assert any(n.startswith("mlruns/") and "/params/" in n for n in names)
    assert len([n for n in names if n.startswith("wandb/offline-run-") and n.endswith(".wandb")]) == 3
    leaks = {str(p.relative_to(root)): found_in(p.read_bytes()) for p in files}
    assert {name: hits for name, hits in leaks.items() if hits} == {}
    assert found_in(shown.encode()) == []

    # The checkpoints (in memory://, the fsspec store of this process): no credential in any file.
    # (fsspec's memory store keeps the URL's user part in its paths; that is fsspec's naming.)
    import fsspec

    store = fsspec.filesystem("memory")
    checkpoint_files = [f for f in store.find("/") if f"bucket-{tmp_path.name}" in f]
    assert len(checkpoint_files) >= 2
    assert {
        f.rsplit("/", 1)[-1]: found_in(store.cat(f)) for f in checkpoint_files if found_in(store.cat(f))
    } == {}

    # The values are there, redacted (so the search above had something to find).
    saved = yaml.safe_load((root / "config.yaml").read_text())
    dirpath = saved["trainer"]["callbacks"][0]["init_args"]["dirpath"]
    assert dirpath == f"memory://***@bucket-{tmp_path.name}/run?token=***"
    assert saved["data"] == {
        "source": "https://***@mirror.example/digits.bin?token=***",
        "api_token": "***",
        "samples": 64,
    }
    assert json.loads((root / "hparams.json").read_text())["data"]["api_token"] == "***"

    # MLflow, through its API: params, tags, run name, metric names.
    (run,) = mlflow_runs(str(root))
    mlflow_text = json.dumps([run.data.params, run.data.tags, run.data.metrics, run.info.run_name])
    assert found_in(mlflow_text.encode()) == []
    assert run.data.params["data.api_token"] == "***"
    # MLflow's params keep their first values (the mirror came later).
    assert run.data.params["data.source"] == "https://***@data.example/digits.bin?token=***"

    # wandb, through its records: config, summary, history, the run and its environment (argv).
    records = [record for log in root.glob("wandb/offline-run-*/*.wandb") for record in wandb_records(log)]
    assert {r.WhichOneof("record_type") for r in records} >= {"config", "history", "run", "environment"}
    assert found_in("\n".join(str(record) for record in records).encode()) == []
    config_items = {
        item.key or ".".join(item.nested_key): json.loads(item.value_json)
        for record in records
        if record.WhichOneof("record_type") == "config"
        for item in record.config.update
    }
    assert config_items["data"]["api_token"] == "***"
    environment = [r.environment for r in records if r.WhichOneof("record_type") == "environment"]
    assert any("--data.api_token" in e.args and "***" in e.args for e in environment if e.args)

    # TensorBoard, through its event reader: the hparams text.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = [event.tensor_proto.string_val[0].decode() for event in events.Tensors("hparams/text_summary")]
    assert texts and all(found_in(text.encode()) == [] for text in texts)
    assert "memory://***@" in texts[-1]

    # One mode rule: the files distkit writes are the owner's only (the checkpoints' 0o600), the
    # folders it makes for the trackers' own files 0o700.
    for name in (
        "config.yaml",
        "hparams.json",
        "metrics.csv",
        "mlflow_run.json",
        "wandb_run.json",
        "wandb_steps.jsonl",
    ):
        assert stat.S_IMODE(os.stat(root / name).st_mode) == 0o600, name
    for name in ("tensorboard", "mlruns", "wandb"):
        assert stat.S_IMODE(os.stat(root / name).st_mode) == 0o700 & ~_umask(), name


def test_an_error_message_shows_no_planted_credential(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{KEY}:{PASSWORD}@bucket/data?token={TOKEN}"
    with pytest.raises(SystemExit) as exit_info:
        TrainerCLI(Net, blobs, args=["--data.sourse", url, "--data.api_token", API_TOKEN], run=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown key data.sourse" in err and "s3://***@bucket/data?token=***" in err, err
    assert found_in(err.encode()) == []


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def test_an_unreachable_tracking_server_is_named_without_its_uris_credentials(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: MLflow's "API request to http://user:password@...?token=... failed" reached the traceback,
    torchrun's error file and the hang report whole."""
    import socket
    import traceback

    import distkit
    from distkit.trainer import MLflowLogger

    with socket.socket() as probe:  # a port nothing listens on: the connection is refused at once
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", API_TOKEN)
    logger = MLflowLogger(tracking_uri=f"http://user:{PASSWORD}@127.0.0.1:{port}/?token={TOKEN}")
    trainer = distkit.Trainer(
        strategy="single",
        max_steps=1,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    data, model = blobs(f"https://x:{PASSWORD}@data.example", API_TOKEN), Net()
    with pytest.raises(Exception) as caught:
        trainer.fit(
            model,
            data,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=nn.functional.cross_entropy,
        )
    shown = "".join(traceback.format_exception(caught.value)) + caplog.text
    assert f"127.0.0.1:{port}" in shown and "http://***@" in shown, shown  # the server is still named
    assert found_in(shown.encode()) == [], shown


def test_a_hang_report_file_is_the_owners_only_and_redacted(tmp_path: pathlib.Path) -> None:
    from distkit._doctor import doctor, report

    note = doctor.exception_note(RuntimeError(f"API request to http://u:{PASSWORD}@h/?token={TOKEN} failed"))
    assert found_in(note.encode()) == [] and "http://***@h/?token=***" in note, note
    path, error = report.write(str(tmp_path), f"rank 0 raised {note}; seen at https://x:{PASSWORD}@h")
    assert error is None and path is not None
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # was 0644: stacks and errors are the run's
    assert found_in(pathlib.Path(path).read_bytes()) == []


def test_a_url_ending_a_clause_keeps_the_colon_after_it() -> None:
    from distkit._utils.secrets import Scrubber, redact_text

    url = "memory://alice:s3cretPW@bucket/run?token=T0KENVALUE"
    # Was: "...?token=*** nothing": the colon that ends the clause taken as part of the URL.
    assert redact_text(f"no checkpoint at {url}: nothing there") == (
        "no checkpoint at memory://***@bucket/run?token=***: nothing there"
    )
    assert Scrubber({"resume": url}).text(f"at {url}: x") == "at memory://***@bucket/run?token=***: x"

"""MLflowLogger and WandbLogger in real Trainer fits, with no network: MLflow's local file store and
wandb's offline mode, read back through the tools' own APIs (``mlflow.search_runs``,
``MlflowClient.get_metric_history``, and wandb's offline ``.wandb`` files parsed with wandb's own
protobuf records). A crashed fit resumed with ``resume="auto"`` continues the same run, each step
logged once; only the main process of a 2-rank DDP job logs; no wandb process outlives ``fit``."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import pathlib
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import torch
from torch import nn

from distkit.errors import DistkitError
from distkit.trainer import Callback, CSVLogger, ModelCheckpoint, Trainer
from distkit.trainer.tracking import MLflowLogger, WandbLogger

# Not importorskip: importing mlflow here, at collection, would decide its telemetry before the
# logger does (and it is slow); the extras are installed in the dev environment.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None or importlib.util.find_spec("wandb") is None,
    reason="needs the mlflow and wandb extras: pip install 'distkit[mlflow,wandb]'",
)

EXPERIMENT = "distkit-tests"
# 64 samples in batches of 8: 8 steps per epoch, 16 in 2 epochs; logged every 2 steps.
LOGGED_STEPS = list(range(2, 17, 2))
# Quiet and quick: no console capture (the ranks' stdout belongs to pytest), no system metrics.
WANDB_SETTINGS = {"settings": {"silent": True, "console": "off", "x_disable_stats": True}}


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever the machine's environment says, these tests use no server: mode="offline" and a
    # file store are what the loggers are given, and nothing may point them elsewhere.
    # MLFLOW_ALLOW_FILE_STORE too: the logger must opt in to the file store by itself.
    for name in (
        "WANDB_MODE",
        "WANDB_DIR",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
        "WANDB_API_KEY",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_ALLOW_FILE_STORE",
    ):
        monkeypatch.delenv(name, raising=False)


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


def fit(root: str, loggers: list[Any], *, crash_at: int | None = None, **options: Any) -> Trainer:
    """A tiny fit: checkpoints every 4 steps (and every epoch), logs every 2."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=generator), torch.arange(64) % 2)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    callbacks: list[Callback] = [ModelCheckpoint(every_n_steps=4)]
    if crash_at is not None:
        callbacks.append(CrashAt(crash_at))
    settings: dict[str, Any] = {
        "default_root_dir": root,
        "max_epochs": 2,
        "batch_size": 8,
        "log_every_n_steps": 2,
        "logger": loggers,
        "callbacks": callbacks,
        "enable_progress_bar": False,
        "resume": "auto",
    }
    settings.update(options)
    trainer = Trainer(**settings)
    trainer.fit(
        model, data, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.functional.cross_entropy
    )
    return trainer


def csv_column(root: str, name: str) -> dict[int, float]:
    with open(os.path.join(root, "metrics.csv"), newline="") as handle:
        return {int(row["step"]): float(row[name]) for row in csv.DictReader(handle) if row[name]}


def wandb_children() -> list[str]:
    return [p.name() for p in psutil.Process().children(recursive=True) if "wandb" in p.name()]


# --------------------------------------------------------------------------------------------------
# Reading back: MLflow through its API, wandb through its offline files


def mlflow_runs(root: str) -> list[Any]:
    import mlflow

    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri((pathlib.Path(root).resolve() / "mlruns").as_uri())
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # a reader outside the logger opts in too
    try:
        return list(mlflow.search_runs(experiment_names=[EXPERIMENT], output_format="list"))
    finally:
        del os.environ["MLFLOW_ALLOW_FILE_STORE"]
        mlflow.set_tracking_uri(previous)


def mlflow_history(root: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        client = MlflowClient(tracking_uri=(pathlib.Path(root).resolve() / "mlruns").as_uri())
        return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
    finally:
        del os.environ["MLFLOW_ALLOW_FILE_STORE"]


def wandb_records(path: pathlib.Path) -> Iterator[Any]:
    """The protobuf records of an offline ``.wandb`` file (LevelDB log format: 32 KiB blocks of
    chunks, each with a 7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb log"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # too little for a header: the block's trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:  # the torn tail of a killed attempt's file
            return
        pos += 7 + length
        if kind == 0:  # zero padding at the end of a block
            pos += left - 7 - length
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_attempts(root: str) -> list[dict[str, Any]]:
    """One entry per offline run directory, oldest first: id, config, history, summary, exit code
    (``id`` None for an attempt killed before wandb's service wrote its first record)."""
    attempts = []
    for directory in sorted((pathlib.Path(root) / "wandb").glob("offline-run-*")):
        (log,) = directory.glob("*.wandb")
        found: dict[str, Any] = {"id": None, "history": [], "config": {}, "summary": {}, "exit_code": None}
        for record in wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                found["id"] = record.run.run_id
            elif kind == "config":
                for item in record.config.update:
                    found["config"][item.key or ".".join(item.nested_key)] = json.loads(item.value_json)
            elif kind == "history":
                row = {
                    item.key or ".".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                found["history"].append((record.history.step.num, row))
            elif kind == "summary":
                for item in record.summary.update:
                    found["summary"][item.key or ".".join(item.nested_key)] = json.loads(item.value_json)
            elif kind == "exit":
                found["exit_code"] = record.exit.exit_code
        attempts.append(found)
    return attempts


def wandb_steps(attempts: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(step, row[key]) for attempt in attempts for step, row in attempt["history"] if key in row]


# --------------------------------------------------------------------------------------------------
# MLflow


def test_mlflow_resumed_fit_continues_the_run_and_logs_each_step_once(tmp_path) -> None:
    root = str(tmp_path)

    def loggers() -> list[Any]:
        return [CSVLogger(), MLflowLogger(EXPERIMENT, run_name="tiny")]

    with pytest.raises(RuntimeError, match="crash at step 7"):
        # Logged at 2, 4, 6; the checkpoint of step 4 is the last before the crash.
        fit(root, loggers(), crash_at=7)
    (crashed,) = mlflow_runs(root)
    assert crashed.info.status == "FAILED"
    assert [step for step, _ in mlflow_history(root, crashed.info.run_id, "train_loss")] == [2, 4, 6]

    fit(root, loggers())
    (run,) = mlflow_runs(root)  # the same run, continued
    assert run.info.run_id == crashed.info.run_id
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "tiny"
    # The Trainer's settings, as log_hyperparams received them.
    assert run.data.params["batch_size"] == "8"
    assert run.data.params["optimizer"] == "SGD"
    assert run.data.params["max_epochs"] == "2"
    assert json.loads(run.data.params["lr"]) == [0.1]
    # Step 6 was logged before the crash (after the checkpoint of step 4) and again by the resumed
    # fit: it is there once, with the resumed fit's value (exact resume: metrics.csv holds those).
    history = mlflow_history(root, run.info.run_id, "train_loss")
    assert [step for step, _ in history] == LOGGED_STEPS
    assert dict(history) == pytest.approx(csv_column(root, "train_loss"), rel=1e-12)
    assert [step for step, _ in mlflow_history(root, run.info.run_id, "train_loss_epoch")] == [8, 16]
    state = json.loads((tmp_path / "mlflow_run.json").read_text())
    assert state["run_id"] == run.info.run_id


def test_mlflow_fresh_fit_in_the_same_directory_starts_a_new_run(tmp_path) -> None:
    root = str(tmp_path)
    fit(root, [MLflowLogger(EXPERIMENT)], max_epochs=1)
    fit(
        root,
        [MLflowLogger(EXPERIMENT)],
        max_epochs=1,
        resume=None,
        callbacks=[ModelCheckpoint(overwrite=True)],
    )
    runs = mlflow_runs(root)
    assert len(runs) == 2 and runs[0].info.run_id != runs[1].info.run_id
    for run in runs:
        assert [step for step, _ in mlflow_history(root, run.info.run_id, "train_loss")] == [2, 4, 6, 8]


def test_mlflow_params_of_a_nested_config_are_dotted_and_keep_their_first_value(tmp_path, caplog) -> None:
    # What a TrainerCLI run gives log_hyperparams: its config, the Trainer's derived values under "run".
    config = {"model": {"hidden": 64, "act": "relu"}, "run": {"world_size": 2, "lr": [0.1]}}
    logger = MLflowLogger(EXPERIMENT)
    logger.setup(tmp_path, None)
    logger.log_hyperparams(config)
    logger.finalize()
    # Resumed with another model width: MLflow's parameters cannot change, so the first stays.
    resumed = MLflowLogger(EXPERIMENT)
    resumed.setup(tmp_path, 10)
    resumed.log_hyperparams({**config, "model": {"hidden": 128, "act": "relu"}, "data": {"path": "x"}})
    resumed.finalize()
    (run,) = mlflow_runs(str(tmp_path))
    assert run.info.run_id == logger.run_id == resumed.run_id
    assert run.data.params == {
        "model.hidden": "64",
        "model.act": "relu",
        "run.world_size": "2",
        "run.lr": "[0.1]",
        "data.path": "x",
    }
    assert "keeps its first values of: model.hidden: '64' -> '128'" in caplog.text


# --------------------------------------------------------------------------------------------------
# wandb (offline)


def test_wandb_offline_resumed_fit_continues_the_run_and_logs_each_step_once(tmp_path) -> None:
    root = str(tmp_path)

    def loggers() -> list[Any]:
        return [CSVLogger(), WandbLogger("tests", name="tiny", init_kwargs=WANDB_SETTINGS)]

    with pytest.raises(RuntimeError, match="crash at step 7"):
        fit(root, loggers(), crash_at=7)
    assert wandb_children() == []  # finalize stopped wandb-core, also after a failure
    fit(root, loggers())
    assert wandb_children() == []

    first, second = wandb_attempts(root)  # one offline directory per attempt, same run id
    assert first["id"] == second["id"] == json.loads((tmp_path / "wandb_run.json").read_text())["run_id"]
    assert (first["exit_code"], second["exit_code"]) == (1, 0)
    # Offline: the service the logger started sends no crash reports either.
    for directory in (tmp_path / "wandb").glob("offline-run-*"):
        assert '"disable-analytics":true' in (directory / "logs" / "debug-core.log").read_text()
    # The Trainer's settings, as log_hyperparams received them.
    assert second["config"]["batch_size"] == 8
    assert second["config"]["optimizer"] == "SGD"
    assert [step for step, _ in wandb_steps([first], "train_loss")] == [2, 4, 6]
    # Step 6 was logged before the crash and not again: `wandb sync` appends the second attempt
    # to the first, and the run has each step once, with the resumed fit's values (exact resume).
    history = wandb_steps([first, second], "train_loss")
    assert [step for step, _ in history] == LOGGED_STEPS
    assert min(step for step, _ in wandb_steps([second], "train_loss")) == 8
    assert dict(history) == pytest.approx(csv_column(root, "train_loss"), rel=1e-12)
    assert [step for step, _ in wandb_steps([first, second], "train_loss_epoch")] == [8, 16]


# --------------------------------------------------------------------------------------------------
# Both


def test_last_checkpoint_path_is_an_mlflow_tag_and_in_the_wandb_summary(tmp_path) -> None:
    root = str(tmp_path)
    fit(root, [MLflowLogger(EXPERIMENT), WandbLogger("tests", init_kwargs=WANDB_SETTINGS)], max_steps=6)
    last = str(tmp_path / "checkpoints" / "step_000000006")  # every 4 steps, and the end at 6
    assert os.path.isdir(last)
    (run,) = mlflow_runs(root)
    assert run.data.tags["distkit.checkpoint"] == last
    assert run.data.tags["distkit.checkpoint_step"] == "6"
    (attempt,) = wandb_attempts(root)
    assert (attempt["summary"]["checkpoint"], attempt["summary"]["checkpoint_step"]) == (last, 6)


@pytest.mark.parametrize("kind", ["mlflow", "wandb"])
def test_a_second_run_tracking_from_the_same_directory_at_once_is_refused(tmp_path, kind) -> None:
    def make() -> Any:
        return (
            MLflowLogger(EXPERIMENT) if kind == "mlflow" else WandbLogger("tests", init_kwargs=WANDB_SETTINGS)
        )

    running = make()
    running.setup(tmp_path, None)  # the run in progress: its logger set up, as fit sets it up
    state = tmp_path / running._STATE_FILE
    # Was: accepted; the second run took the first's place in mlflow_run.json / wandb_run.json (a
    # resume then continued the wrong run), and emptied the first's wandb journal.
    with pytest.raises(DistkitError, match=rf"another run writes {re.escape(str(state))}"):
        fit(str(tmp_path), [make()])
    running.finalize()
    assert fit(str(tmp_path), [make()]).global_step == 16


def ddp_fit_with_both_loggers(root: str) -> dict[str, Any]:
    mlflow_logger = MLflowLogger(EXPERIMENT)
    wandb_logger = WandbLogger("tests", init_kwargs=WANDB_SETTINGS)
    fit(root, [CSVLogger(), mlflow_logger, wandb_logger], strategy="ddp")
    return {
        "mlflow_run_id": mlflow_logger.run_id,
        "wandb_set_up": wandb_logger._state_path is not None,
        "wandb_children": wandb_children(),
    }


def test_only_the_main_process_logs_under_ddp(ranks, tmp_path) -> None:
    root = str(tmp_path)
    main, other = ranks.run(ddp_fit_with_both_loggers, root, world_size=2, timeout_s=240)
    assert main["mlflow_run_id"] is not None and main["wandb_set_up"]
    assert other["mlflow_run_id"] is None and not other["wandb_set_up"]
    assert main["wandb_children"] == other["wandb_children"] == []
    # 2 ranks of 32 samples: 4 steps per epoch, 8 in all; each step once, from the main process,
    # with the values reduced across ranks that metrics.csv holds.
    (run,) = mlflow_runs(root)
    assert run.info.run_id == main["mlflow_run_id"]
    assert run.data.params["world_size"] == "2"
    expected = csv_column(root, "train_loss")
    assert sorted(expected) == [2, 4, 6, 8]
    assert dict(mlflow_history(root, run.info.run_id, "train_loss")) == pytest.approx(expected, rel=1e-12)
    (attempt,) = wandb_attempts(root)
    assert dict(wandb_steps([attempt], "train_loss")) == pytest.approx(expected, rel=1e-12)
    assert attempt["config"]["world_size"] == 2


# --------------------------------------------------------------------------------------------------
# Light imports and clear errors


def test_loggers_import_their_tools_only_when_a_fit_starts_and_mlflow_without_telemetry(tmp_path) -> None:
    code = f"""
import pathlib, sys
import distkit.trainer
from distkit.trainer.tracking import MLflowLogger, WandbLogger, _mlflow_client
logger = MLflowLogger(); WandbLogger()
assert not {{'mlflow', 'wandb'}} & set(sys.modules), sorted({{'mlflow', 'wandb'}} & set(sys.modules))
_mlflow_client(pathlib.Path({str(tmp_path)!r}).joinpath('mlruns').as_uri())  # what setup() does first
from mlflow.telemetry import get_telemetry_client
assert get_telemetry_client() is None, 'MLflow telemetry is on'
logger.setup(pathlib.Path({str(tmp_path)!r}), None)
logger.log_metrics({{'loss': 1.0}}, step=1)
logger.finalize()
"""
    # Outside pytest and CI, where MLflow turns its telemetry on by default (PYTEST_CURRENT_TEST and
    # CI variables turn it off by themselves); a proxy that refuses keeps a failure here off the network.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PYTEST") and k not in ("CI", "GITHUB_ACTIONS")
    }
    for name in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "NO_PROXY", "no_proxy"):
        env.pop(name, None)
    env.update(HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)
    assert (tmp_path / "mlflow_run.json").exists()


@pytest.mark.parametrize(("module", "make"), [("mlflow", MLflowLogger), ("wandb", WandbLogger)])
def test_a_missing_package_names_the_extra_to_install(monkeypatch, module, make) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # Python's marker for a module that cannot import
    with pytest.raises(ImportError, match=rf"pip install 'distkit\[{module}\]'"):
        make()

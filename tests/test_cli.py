"""The `distkit` command: `env` and its checks, `bench` and `bench --profile` end to end."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distkit.bench.runner import BenchRow
from distkit.cli import collect_env, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    # Not inside the test session's own job: the command must see a plain environment.
    environ = {
        k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("TORCHELASTIC_")
    }
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "distkit.cli", *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=timeout,
    )


@pytest.fixture
def plain_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (*_LAUNCH_VARS, "TORCH_DISTRIBUTED_DEBUG", "OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_env_json_parses_and_reports_versions_launcher_and_choice() -> None:
    result = _run("env", "--json", env={"NCCL_DEBUG": "INFO"})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["torch"] == torch.__version__ and report["distkit"]
    assert report["backends"]["gloo"] is True
    assert report["launcher"]["name"] == "none" and report["launcher"]["world_size"] == 1
    assert report["init_would_pick"]["backend"] is None  # a world of one has no process group
    assert report["environment"]["NCCL_DEBUG"] == "INFO"
    assert "MASTER_ADDR" in report["environment"]  # listed even when unset
    assert report["nvml"]["available"] is (report["nvml"]["reason"] is None)
    if not torch.cuda.is_available():
        assert report["init_would_pick"]["device"] == "cpu" and report["nccl"] is None


def test_env_sees_a_torchrun_style_job_and_warns_about_its_settings(plain_env: pytest.MonkeyPatch) -> None:
    plain_env.setenv("RANK", "1")
    plain_env.setenv("WORLD_SIZE", "2")
    plain_env.setenv("MASTER_ADDR", "127.0.0.1")
    plain_env.setenv("MASTER_PORT", "29555")
    plain_env.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    report = collect_env()
    launcher = report["launcher"]
    assert (launcher["name"], launcher["rank"], launcher["world_size"]) == ("env", 1, 2)
    assert launcher["master_port"] == 29555
    if not torch.cuda.is_available():
        assert report["init_would_pick"] == {"backend": "gloo", "device": "cpu"}
        messages = " ".join(p["message"] for p in report["problems"])
        assert "OMP_NUM_THREADS is unset" in messages
    assert any("TORCH_DISTRIBUTED_DEBUG=DETAIL" in p["message"] for p in report["problems"])
    assert all(p["level"] == "warning" for p in report["problems"])


def test_env_exits_1_and_names_the_variable_when_the_launcher_variables_are_wrong(
    plain_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plain_env.setenv("RANK", "3")
    plain_env.setenv("WORLD_SIZE", "2")
    plain_env.setenv("MASTER_ADDR", "127.0.0.1")
    assert main(["env"]) == 1
    out = capsys.readouterr().out
    assert "launcher      invalid: RANK=3 is outside 0..1 (WORLD_SIZE=2)" in out
    assert "  error: launcher variables: RANK=3" in out
    assert main(["env", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["problems"][0]["level"] == "error" and "RANK=3" in report["problems"][0]["message"]


def test_env_text_output_has_every_section(
    plain_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for section in (
        "configuration check",
        "torch",
        "backends",
        "GPUs",
        "launcher",
        "init() picks",
        "problems",
    ):
        assert section in out, section


def test_bench_on_the_tiny_preset_writes_csv_plots_and_a_recommendation(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    result = _run(
        "bench", "--model", "tiny", "--strategies", "single", "dp", "ddp", "--world-sizes", "2",
        "--batch-sizes", "16", "--steps", "3", "--warmup-steps", "1", "--min-time-s", "0", "--out", str(out),
        "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert "distkit bench" in result.stderr  # the progress bar (or its lines) on stderr

    with open(out / "results.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == BenchRow.columns()
        rows = list(reader)
    assert [(r["strategy"], r["world_size"], r["status"]) for r in rows] == [
        ("single", "1", "ok"),
        ("dp", "2", "ok" if torch.cuda.device_count() >= 2 else "skipped"),
        ("ddp", "2", "ok"),
    ]
    ddp = rows[2]
    assert float(ddp["samples_per_s"]) > 0 and float(ddp["step_time_p50_ms"]) > 0
    assert float(ddp["efficiency"]) == pytest.approx(float(ddp["speedup"]) / 2, rel=1e-4)
    assert ddp["global_batch"] == "32" and float(ddp["memory_mib"]) > 0
    assert payload["rows"][0]["speedup"] == 1.0 and len(payload["rows"]) == 3

    for name in ("throughput.png", "scaling_efficiency.png", "memory.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name  # a drawn figure, not an empty canvas
    assert sorted(Path(p).name for p in payload["files"]["plots"]) == [
        "memory.png",
        "scaling_efficiency.png",
        "throughput.png",
    ]
    advice = (out / "recommendation.txt").read_text()
    assert advice.startswith("Fastest: ") and advice.strip() == payload["recommendation"]
    if not torch.cuda.is_available():
        assert "dp: skipped, DataParallel needs CUDA GPUs and none is visible." in advice


def test_bench_profile_json_reports_the_ratio_and_predictions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profile"
    status = main(
        [
            "bench", "--profile", "--model", "small", "--batch-sizes", "8", "64", "--predict", "1", "2", "4",
            "--steps", "2", "--warmup-steps", "1", "--min-time-s", "0", "--bandwidth-gbps", "10",
            "--out", str(out), "--json", "--no-progress",
        ]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert captured.err == ""  # --no-progress: nothing on stderr
    payload = json.loads(captured.out)
    small, large = payload["profiles"]
    assert (small["batch_size"], large["batch_size"]) == (8, 64)
    assert small["comm"] == large["comm"] and small["comm"]["source"] == "bandwidth model"
    assert [p["world_size"] for p in small["predictions"]] == [1, 2, 4]
    assert small["ratio"] == pytest.approx(small["rank_compute_s"] / small["comm"]["step_s"])
    assert "compute/communication ratio" in payload["recommendation"]
    with open(out / "profile.csv", newline="") as handle:
        records = list(csv.DictReader(handle))
    assert len(records) == 6 and {"ratio", "predicted_speedup", "predicted_efficiency"} <= set(records[0])
    assert (out / "predicted_scaling.png").read_bytes()[:8] == PNG_MAGIC


def test_bench_reports_a_bad_model_name_as_an_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--model", "enormous", "--no-progress", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("distkit bench: error: unknown model 'enormous': use a preset")


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--world-sizes", "0"])
    assert info.value.code == 2
    assert "expected an integer >= 1, got 0" in capsys.readouterr().err

"""The `distkit` command: `env` and its checks, `bench` and `bench --profile` end to end."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distkit
from _launch import launcher_free_env
from distkit import cli
from distkit.bench import _command, _load
from distkit.bench.runner import BenchRow
from distkit.cli import collect_env, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    # Not inside the test session's own job: the command must see a plain environment.
    environ = launcher_free_env(**(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "distkit.cli", *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=timeout,
    )


@pytest.fixture
def plain_env(world_of_one: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    # Besides the launcher's variables, the settings `distkit env` warns about.
    for name in ("TORCH_DISTRIBUTED_DEBUG", "OMP_NUM_THREADS"):
        world_of_one.delenv(name, raising=False)
    return world_of_one


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
    plain_env.setenv("OMP_NUM_THREADS", "abc")  # was: "problems: none"
    messages = [p["message"] for p in collect_env()["problems"]]
    assert any(
        m.startswith("OMP_NUM_THREADS='abc' is not a positive integer, so it is ignored") for m in messages
    )


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


SEED_000 = ("--strategies", "dp", "ddp", "--gpus", "1", "2", "4", "--batch-sizes", "64", "128", "256")


def test_seed_000s_command_in_a_pipe_logs_one_line_per_run_and_never_recommends_oversubscription(
    tmp_path: Path,
) -> None:
    out = tmp_path / "bench"
    fast = ("--steps", "3", "--warmup-steps", "1", "--min-time-s", "0")
    result = _run("bench", *SEED_000, *fast, "--out", str(out), env={"CI": ""})  # in a pipe, not CI
    assert result.returncode == 0, result.stderr

    # stderr: the notes, then exactly one plain line per finished run; no tqdm frames.
    assert "\r" not in result.stderr and "it/s" not in result.stderr and "run/s" not in result.stderr
    assert "note: added the single baseline (one process)" in result.stderr
    progress = [line for line in result.stderr.splitlines() if line.startswith("[")]
    counts = [re.match(r"\[(\d+)/(\d+)\] ", line) for line in progress]
    assert all(counts) and [int(m.group(1)) for m in counts if m] == list(range(1, len(progress) + 1))
    assert counts[-1] is not None and int(counts[-1].group(2)) == len(progress)
    if not torch.cuda.is_available():
        # 3 rounds of: 3 baselines twice (A/A) and 9 ddp configurations (dp is skipped without CUDA),
        # and as many more rounds for configurations re-measured for an efficiency above 100 %.
        assert len(progress) >= 3 * (2 * 3 + 9)
    assert re.match(r"\[\d+/\d+\] single x1 batch \d+, round \d+ \(A/A\): ", progress[-1])

    with open(out / "results.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == BenchRow.columns()
        rows = list(reader)
    assert {(r["strategy"], r["world_size"]) for r in rows} == {
        ("single", "1"),
        *((s, n) for s in ("dp", "ddp") for n in ("1", "2", "4")),
    }
    threads = int(rows[0]["threads_per_rank"])
    cores = _load.usable_cores()
    for row in rows:
        if row["strategy"] == "ddp" and not torch.cuda.is_available():
            assert row["oversubscribed"] == str(int(row["world_size"]) * threads > cores), row
            assert row["status"] == "ok" and float(row["samples_per_s_low"]) <= float(row["samples_per_s"])
            assert float(row["speedup_low"]) <= float(row["speedup"]) <= float(row["speedup_high"])
            assert float(row["comm_ms"]) >= 0 and float(row["compute_ms"]) > 0 and row["repeats"] == "3"

    stdout = result.stdout
    assert "interleaved repetitions" in stdout and "samples/s" in stdout
    advice = (out / "recommendation.txt").read_text()
    assert (len(progress) > 45) == ("Re-measured" in advice) or torch.cuda.is_available()
    decision = advice.splitlines()[0]
    assert decision.startswith(("Recommendation (confidence: high)", "No recommendation (confidence:"))
    assert decision in stdout
    assert "Noise floor (A/A test)" in advice and "Machine load from other processes" in advice
    assert "Added the single baseline" in advice and "the one-process baseline too" in advice
    if 4 * threads > cores and not torch.cuda.is_available():
        assert "Oversubscribed, so never recommended: ddp on 4 processes (4 processes x" in advice
        assert "on 4 processes" not in decision
        assert "oversubscribed: 4 processes x" in stdout
    if not torch.cuda.is_available():
        assert "skipped: dp (9 configurations): DataParallel needs CUDA GPUs and none is visible" in stdout
    for name in ("throughput.png", "scaling_efficiency.png", "memory.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name  # a drawn figure, not an empty canvas


def test_progress_is_a_bar_only_in_a_terminal_outside_ci() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert _command.progress_mode(False, Terminal(), {}) == "bar"
    assert _command.progress_mode(False, Terminal(), {"CI": "true"}) == "lines"
    assert _command.progress_mode(False, io.StringIO(), {}) == "lines"  # a pipe or a file
    assert _command.progress_mode(True, Terminal(), {}) == "none"


def test_help_and_version_answer_without_importing_torch() -> None:
    code = (
        "import contextlib, io, sys\n"
        "from distkit.cli import main\n"
        "for argv in (['--version'], ['--help'], ['bench', '--help']):\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as stop:\n"
        "            assert stop.code == 0, stop.code\n"
        "    print(out.getvalue())\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"distkit {distkit.__version__}\n")
    assert "--gpus" in result.stdout and "--devices" in result.stdout and "transformer" in result.stdout


def test_gpus_and_devices_are_the_world_sizes_option() -> None:
    parser = cli._parser()
    for flag in ("--gpus", "--devices", "--world-sizes"):
        args = parser.parse_args(["bench", flag, "1", "2", "4"])
        assert args.world_sizes == [1, 2, 4] and args.world_sizes_flag == flag


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
    assert small["compute_low"] <= small["compute_s"] <= small["compute_high"]
    assert [p["world_size"] for p in small["predictions"]] == [1, 2, 4]
    assert small["ratio"] == pytest.approx(small["rank_compute_s"] / small["comm"]["step_s"])
    assert "compute/communication ratio" in payload["recommendation"]
    with open(out / "profile.csv", newline="") as handle:
        records = list(csv.DictReader(handle))
    assert len(records) == 6
    assert {"ratio", "predicted_speedup", "predicted_speedup_low", "predicted_efficiency"} <= set(records[0])
    assert (out / "predicted_scaling.png").read_bytes()[:8] == PNG_MAGIC
    # The prescription's options: with a bandwidth model, compression halves the bytes.
    assert [o["name"] for o in small["comm_options"]] == ["fp16", "bf16"]
    assert {p["name"] for p in small["prescriptions"]} == {"fp16", "bf16", "accumulate", "batch"}
    assert "prescribed" in small
    status = main(
        [
            "bench", "--profile", "--model", "small", "--batch-sizes", "8", "--predict", "2",
            "--steps", "2", "--warmup-steps", "1", "--min-time-s", "0", "--bandwidth-gbps", "10",
            "--no-prescription", "--out", str(tmp_path / "bare"), "--json", "--no-progress",
        ]
    )  # fmt: skip
    (bare,) = json.loads(capsys.readouterr().out)["profiles"]
    assert status == 0 and bare["comm_options"] == [] and bare["double_batch_s"] is None


def test_bench_reports_a_bad_model_name_as_an_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--model", "enormous", "--no-progress", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("distkit bench: error: unknown model 'enormous': tried the presets (tiny, small")
    assert "and 'module:factory', which needs a ':'" in err
    assert main(["bench", "--model", "json:no_such_factory", "--no-progress", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "module 'json' (" in err and "has no attribute 'no_such_factory'" in err and "dumps" in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--world-sizes", "0"])
    assert info.value.code == 2
    assert "expected an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["bench", "--repeats", "2"])
    assert info.value.code == 2
    assert (
        "--repeats must be >= 3 (an interval needs at least 3 repetitions), got 2" in capsys.readouterr().err
    )
    for value in ("0", "-5"):  # was accepted, then every run "did not finish within -5 s"
        with pytest.raises(SystemExit) as info:
            main(["bench", "--timeout-s", value])
        assert info.value.code == 2
        assert f"--timeout-s must be > 0 (seconds), got {value}" in capsys.readouterr().err


def test_an_out_that_is_a_file_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "results"
    taken.write_text("")
    assert main(["bench", "--no-progress", "--out", str(taken)]) == 1
    # Was: "[Errno 17] File exists: '.../results'", naming no option.
    assert (
        capsys.readouterr().err
        == f"distkit bench: error: --out {taken} is a file: pass a directory, new or existing.\n"
    )


@pytest.mark.parametrize(
    ("argv", "usage", "hint"),
    [
        (["env", "--jsn"], "usage: distkit env ", "unrecognized arguments: --jsn; did you mean --json?"),
        (["bench", "--stesp", "5"], "usage: distkit bench ", "--stesp 5; did you mean --steps?"),
        (["checkpoint", "list", ".", "--verfy"], "usage: distkit checkpoint list ", "did you mean --verify?"),
        # A subcommand or a choice misspelt (was: the choices alone).
        (["chekpoint", "list", "."], "usage: distkit ", "invalid choice: 'chekpoint'"),
        (["chekpoint", "list", "."], "usage: distkit ", "; did you mean 'checkpoint'?"),
        (["checkpoint", "lsit", "."], "usage: distkit checkpoint ", "; did you mean 'list'?"),
        (["bench", "--strategies", "dpp"], "usage: distkit bench ", "; did you mean 'dp' or 'ddp'?"),
    ],
)
def test_a_flag_slip_is_told_by_its_subcommand_with_the_closest_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], usage: str, hint: str
) -> None:
    # Was: distkit's top-level usage and "unrecognized arguments" alone.
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and hint in err, err


# --------------------------------------------------------------------------------------------------
# distkit checkpoint


def test_checkpoint_command_lists_inspects_and_consolidates_a_sharded_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = torch.nn.Linear(4, 2)
    with distkit.CheckpointManager(tmp_path / "run", sharded=True) as manager:
        manager.save(5, {"model": model, "step": 5}, metrics={"loss": 0.25})
    (tmp_path / "run" / ".step_000000006.distkit-tmp-abcd").mkdir()  # debris of a killed save

    assert main(["checkpoint", "list", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["6", "leftover", "of", "a", "killed", "save", "or", "delete"]
    assert re.fullmatch(r"\s+5  committed  sharded 1 rank\(s\)\s+\d+\.\d KiB  loss=0\.25", lines[1]), lines[1]

    step_5 = str(tmp_path / "run" / "step_000000005")
    assert main(["checkpoint", "inspect", step_5, "--verify", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["format"], summary["step"], summary["sharded_keys"]) == ("sharded", 5, ["model"])
    assert set(summary["files"]) == {".metadata", "__0_0.distcp", "state.pt"}
    assert summary["verified"] == "sizes and checksums"

    assert main(["checkpoint", "consolidate", step_5, str(tmp_path / "full")]) == 0
    assert "one full state.pt" in capsys.readouterr().out
    state = torch.load(tmp_path / "full" / "state.pt", weights_only=True)
    assert torch.equal(state["model"]["weight"], model.weight) and state["step"] == 5

    shard = tmp_path / "run" / "step_000000005" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])  # truncated
    assert main(["checkpoint", "inspect", step_5]) == 1
    out = capsys.readouterr().out
    assert "__0_0.distcp is" in out and "the manifest says" in out
    assert main(["checkpoint", "consolidate", step_5, str(tmp_path / "again")]) == 1
    assert "distkit checkpoint: error: checkpoint" in capsys.readouterr().err

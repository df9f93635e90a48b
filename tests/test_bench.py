"""The scaling advisor, workloads, the benchmark runner's processes, and its report."""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit.bench import _load, _names, _spawn, _timing, profile_scaling, report
from distkit.bench.profile import (
    CommOption,
    CommProfile,
    ScalingProfile,
    _check_optimizer,
    _doubled,
    _pack_task,
    _unpack_task,
)
from distkit.bench.runner import BenchResult, BenchRow, is_oversubscribed, oversubscription, run_benchmark
from distkit.bench.stats import Interval, Option, decide, noise_floor, ratio_spread, spread
from distkit.bench.workloads import PRESETS, TextClassifier, Workload, default_loss, load_workload

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_profile_scaling_is_importable_from_distkit_and_distkit_bench() -> None:
    assert distkit.profile_scaling is profile_scaling


def test_profile_scaling_times_an_adamw_with_param_groups_in_spawned_ranks_without_touching_the_model(
    recwarn: pytest.WarningsRecorder,
) -> None:
    workload = load_workload("tiny")
    first, second = workload.model[0], workload.model[2]
    # AdamW's defaults hold "decoupled_weight_decay", which AdamW() refuses: rebuilding the optimizer
    # from type(optimizer)(params, **defaults) crashed here (issue 13).
    optimizer = torch.optim.AdamW(
        [{"params": first.parameters(), "lr": 1e-3}, {"params": second.parameters(), "weight_decay": 0.0}],
        lr=5e-4,
        foreach=False,
    )
    before = [p.detach().clone() for p in workload.model.parameters()]
    profile = profile_scaling(
        workload.model,
        workload.make_batch(16),
        optimizer=optimizer,
        world_sizes=(1, 2, 4),
        steps=3,
        warmup_steps=1,
        min_time_s=0,
        num_threads=1,
    )
    # The model travelled to the ranks (no "could not time the model" fallback warning).
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [
        str(w.message) for w in recwarn
    ]
    comm = profile.comm
    assert (comm.source, comm.backend, comm.world_size, comm.num_buckets) == ("measured", "gloo", 2, 1)
    assert comm.grad_bytes == 4 * workload.num_parameters
    assert comm.step_low <= comm.step_s <= comm.step_high
    assert profile.compute_low <= profile.compute_s <= profile.compute_high
    assert profile.rank_compute_low <= profile.rank_compute_s <= profile.rank_compute_high
    assert profile.batch_size == 16 and profile.num_threads == 1 and profile.overlap is False
    assert profile.ratio == pytest.approx(profile.rank_compute_s / comm.step_s)
    one, two, four = profile.predictions
    assert (one.world_size, one.step_s, one.speedup) == (1, profile.compute_s, 1.0)
    assert two.step_s == pytest.approx(profile.rank_compute_s + comm.step_s)
    assert four.step_s == pytest.approx(profile.rank_compute_s + comm.time_at(4))
    assert two.speedup == pytest.approx(2 * profile.compute_s / two.step_s)
    assert two.speedup_low <= two.speedup <= two.speedup_high
    assert four.samples_per_s == pytest.approx(4 * 16 / four.step_s)
    # The ranks trained copies: the caller's weights, gradients and optimizer state are untouched.
    assert all(torch.equal(a, b) for a, b in zip(before, workload.model.parameters(), strict=True))
    assert all(p.grad is None for p in workload.model.parameters())
    assert not optimizer.state
    # What the prescription weighs, measured in the same ranks: each compression through the
    # Trainer's own hooks (no bucket option: the model fits DDP's first bucket), and twice the batch.
    assert [o.name for o in profile.comm_options] == ["fp16", "bf16", "powersgd"]
    for option in profile.comm_options:
        assert option.comm.source == "measured" and option.comm.grad_bytes == comm.grad_bytes
        assert option.comm.step_low <= option.comm.step_s <= option.comm.step_high
        assert option.setting.startswith("DDPStrategy(comm_hook=") and not option.exact
    assert profile.double_batch_low <= profile.double_batch_s <= profile.double_batch_high
    assert profile.double_batch_s > 0
    assert 0 <= profile.rank_wait_s <= profile.rank_compute_s
    assert 0 < profile.optimizer_s < profile.compute_s  # AdamW's step, timed within the step alone
    names = {p.name for p in profile.prescriptions(2)}
    assert names == {"fp16", "bf16", "powersgd", "accumulate", "batch"}


def _adamw_with_groups(fused: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    groups = [
        {"params": model[0].parameters(), "lr": 1e-2, "weight_decay": 0.1},
        {"params": model[2].parameters(), "lr": 1e-3, "betas": (0.8, 0.9)},
    ]
    flags = {"fused": True} if fused else {"foreach": False}
    return model, torch.optim.AdamW(groups, lr=5e-4, amsgrad=True, **flags)


def _fused_adamw_works_on_cpu() -> bool:
    try:
        _adamw_with_groups(fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _fused_adamw_works_on_cpu(), reason="this torch build has no fused AdamW on CPU"))])  # fmt: skip
def test_the_ranks_copy_of_an_adamw_keeps_its_param_groups_flags_and_binds_the_copied_model(
    fused: bool,
) -> None:
    model, optimizer = _adamw_with_groups(fused)
    batch = (torch.randn(4, 8), torch.randint(2, (4,)))
    payload = _pack_task(model, batch, None, default_loss, optimizer)
    assert payload is not None
    unpacked = _unpack_task(payload)
    assert unpacked is not None
    copy_model, _, _, _, copy_opt = unpacked
    assert type(copy_opt) is torch.optim.AdamW
    assert len(copy_opt.param_groups) == 2
    for mine, theirs in zip(copy_opt.param_groups, optimizer.param_groups, strict=True):
        assert {k: v for k, v in mine.items() if k != "params"} == {
            k: v for k, v in theirs.items() if k != "params"
        }
    # Each group holds the copied model's own parameters, in order, and nothing else.
    copied = list(copy_model.parameters())
    held = [p for group in copy_opt.param_groups for p in group["params"]]
    assert len(held) == len(copied) and all(a is b for a, b in zip(held, copied, strict=True))
    assert not any(p is q for p in copied for q in model.parameters())
    # A step moves the copy, not the original.
    before = [p.detach().clone() for p in model.parameters()]
    copy_opt.zero_grad()
    default_loss(copy_model, batch).backward()
    copy_opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, copy_model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert copy_opt.state and not optimizer.state


def test_an_optimizer_over_another_models_parameters_is_refused_naming_the_count() -> None:
    model, other = nn.Linear(4, 2), nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"the optimizer holds 2 parameter\(s\) that are not the model's"):
        _check_optimizer(model, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        _check_optimizer(model, "adamw")
    _check_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))


def profile_in_job() -> tuple[int, float, float, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    batch = (torch.randn(8, 16), torch.randint(4, (8,)))
    profile = distkit.profile_scaling(model, batch, world_sizes=(2,), steps=3, warmup_steps=1, min_time_s=0)
    options = tuple((o.name, o.comm.step_s) for o in profile.comm_options)
    return profile.comm.world_size, profile.comm.step_s, profile.compute_s, profile.rank_compute_s, options


def test_inside_a_job_profile_scaling_measures_with_the_jobs_group_on_every_rank(ranks) -> None:
    results = ranks.run(profile_in_job, world_size=2)
    assert results[0] == results[1]  # one reduced answer on every rank
    world_size, comm_s, compute_s, rank_compute_s, options = results[0]
    assert world_size == 2 and comm_s > 0 and compute_s == rank_compute_s > 0
    # The options are measured with the job's group too, through the hooks the Trainer registers.
    assert [name for name, _ in options] == ["fp16", "bf16", "powersgd"] and all(t >= 0 for _, t in options)


def test_comm_time_follows_the_ring_all_reduce_model() -> None:
    comm = CommProfile(2, "gloo", 8_000_000, 2, step_s=0.010, latency_s=0.001, source="measured")
    assert comm.time_at(1) == 0.0
    assert comm.time_at(2) == pytest.approx(0.010)
    # 4 ranks: the per-call part (2 x 1 ms) triples, the per-byte part (8 ms) grows by 1.5.
    assert comm.time_at(4) == pytest.approx(0.002 * 3 + 0.008 * 1.5)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        comm.time_at(0)


def test_a_bandwidth_model_predicts_without_starting_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_ranks(*args: object, **kwargs: object) -> None:
        raise AssertionError("a bandwidth model must not start ranks")

    monkeypatch.setattr(_spawn, "RankGroup", no_ranks)
    model = nn.Linear(1000, 250)  # 250,250 parameters: 1,001,000 bytes of fp32 gradients
    batch = (torch.randn(4, 1000), torch.randn(4, 250))
    profile = profile_scaling(
        model, batch, steps=1, warmup_steps=0, min_time_s=0, bandwidth_gbps=8.0, latency_us=0.0
    )
    assert profile.comm.source == "bandwidth model"
    assert profile.comm.step_s == pytest.approx(1_001_000 / 1e9)  # 8 Gbit/s = 1 GB/s
    assert profile.rank_compute_s == profile.compute_s
    # Compression halves the bytes on the wire; PowerSGD's work depends on the shapes: left out.
    assert [(o.name, o.comm.step_s) for o in profile.comm_options] == [
        ("fp16", pytest.approx(500_500 / 1e9)),
        ("bf16", pytest.approx(500_500 / 1e9)),
    ]


def test_profile_scaling_rejects_bad_arguments_and_foreign_comm() -> None:
    model, batch = nn.Linear(4, 2), torch.randn(3, 4)
    comm = CommProfile(2, "gloo", 12345, 1, 0.001, 0.0001, "measured")
    with pytest.raises(ValueError, match="comm was measured for 12345 bytes of gradients, this model has 40"):
        profile_scaling(model, batch, comm=comm, steps=1)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        profile_scaling(model, batch, steps=0)
    with pytest.raises(ValueError, match="comm_world_size must be an integer >= 2, got 1"):
        profile_scaling(model, batch, comm_world_size=1)
    frozen = nn.Linear(4, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        profile_scaling(frozen, batch, bandwidth_gbps=1.0)


def _profile(compute_ms: float, comm_ms: float) -> ScalingProfile:
    comm = CommProfile(2, "gloo", 4 * 2**20, 1, comm_ms / 1e3, 0.0, "measured")
    base = ScalingProfile(32, compute_ms / 1e3, compute_ms / 1e3, 0.0, 0.0, 1000, comm, False, "cpu", 1)
    return ScalingProfile(**{**base.__dict__, "predictions": tuple(base.predict(n) for n in (1, 2, 4, 8))})


def test_recommendation_tells_when_more_ranks_make_training_slower() -> None:
    text = _profile(compute_ms=1.0, comm_ms=10.0).recommendation()
    assert "ratio 0.1" in text and "slower, not faster" in text and "no_sync()" in text
    # 4 batches per all-reduce: 8 ranks take 4 x 1 ms + 17.5 ms per 4 batches: 8 x 4 / 21.5 = 1.49x.
    assert "predicted to give 1.49x (19%) on 8 ranks" in text
    # One batch size alone cannot show that a larger one scales better: no advice to raise it.
    assert "raise the batch" not in text.lower()


def test_several_profiles_advise_a_larger_batch_only_when_it_is_predicted_to_scale_better() -> None:
    small, large = _profile(compute_ms=2.0, comm_ms=4.0), _profile(compute_ms=8.0, comm_ms=4.0)
    large = ScalingProfile(**{**large.__dict__, "batch_size": 128})
    assert "Raise the batch per rank" in report.recommend_profiles([small, large])
    flat = ScalingProfile(**{**small.__dict__, "batch_size": 128})
    assert "Raise the batch" not in report.recommend_profiles([small, flat])
    assert "the batch size is not the lever here" in report.recommend_profiles([small, flat])


def test_recommendation_tells_when_scaling_pays() -> None:
    assert "Scales well" in _profile(compute_ms=100.0, comm_ms=1.0).recommendation()
    # 8 ranks: 10 ms of compute and 3 ms x 1.75 of communication give 5.25x: each added rank brings 0.61.
    assert "Worth it up to about 8 ranks" in _profile(compute_ms=10.0, comm_ms=3.0).recommendation()
    assert (
        "Pays poorly: at best 3.33x with 8 ranks" in _profile(compute_ms=10.0, comm_ms=8.0).recommendation()
    )


def test_default_loss_understands_pairs_mappings_and_tensors() -> None:
    torch.manual_seed(0)
    classifier = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    labels = torch.tensor([0, 1, 2, 0, 1])
    assert default_loss(classifier, (x, labels)) == nn.functional.cross_entropy(classifier(x), labels)
    target = torch.randn(5, 3)
    assert default_loss(classifier, (x, target)) == nn.functional.mse_loss(classifier(x), target)
    assert default_loss(classifier, x) == classifier(x).mean()

    class WithLoss(nn.Module):
        def forward(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": features.sum()}

    assert default_loss(WithLoss(), {"features": torch.ones(2)}) == 2.0
    with pytest.raises(TypeError, match="Pass compute_loss=\\(model, batch\\) -> loss"):
        default_loss(classifier, "text")


def test_presets_build_models_and_batches_that_train() -> None:
    for name in PRESETS:
        workload = load_workload(name)
        loss = workload.loss(workload.make_batch(2))
        loss.backward()
        assert loss.dim() == 0 and workload.description, name
    assert load_workload("tiny").num_parameters == 2762
    assert tuple(PRESETS) == _names.PRESET_NAMES  # what `distkit bench --help` lists without torch
    text = load_workload("transformer")
    assert isinstance(text.model, TextClassifier) and 1_900_000 < text.num_parameters < 2_000_000
    assert type(text.optimizer(text.model)) is torch.optim.AdamW
    assert type(load_workload("tiny").optimizer(load_workload("tiny").model)) is torch.optim.SGD
    a, b = load_workload("small").make_batch(4), load_workload("small").make_batch(4)
    assert torch.equal(a[0], b[0])  # the same data in every process


USER_MODULE = """
import torch
from torch import nn

def build():
    return nn.Linear(8, 2), lambda n: (torch.randn(n, 8), torch.randint(2, (n,)))

def build_with_loss():
    return nn.Linear(8, 1), lambda n: torch.randn(n, 8), lambda model, batch: model(batch).abs().mean()

def wrong():
    return "not a model"
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"bench_user_models_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_load_workload_imports_a_factory_from_the_current_directory(user_module: str) -> None:
    workload = load_workload(f"{user_module}:build")
    assert isinstance(workload, Workload) and workload.num_parameters == 18
    assert workload.loss(workload.make_batch(3)).dim() == 0
    custom = load_workload(f"{user_module}:build_with_loss")
    assert custom.compute_loss is not None and custom.loss(custom.make_batch(3)) >= 0
    with pytest.raises(TypeError, match="returned str; a benchmark factory must return"):
        load_workload(f"{user_module}:wrong")
    with pytest.raises(AttributeError, match=r"has no attribute 'missing'.*its public callables: build, "):
        load_workload(f"{user_module}:missing")
    with pytest.raises(
        ValueError, match=r"unknown model 'huge': tried the presets \(tiny, small, medium, conv"
    ):
        load_workload("huge")
    with pytest.raises(ValueError, match="Did you mean 'small'"):
        load_workload("smal")
    with pytest.raises(
        ImportError, match=r"importing module 'no_such_module_here' failed .*looked in the current"
    ):
        load_workload("no_such_module_here:build")


def test_run_benchmark_trains_a_user_factory_in_repeated_runs_with_an_a_a_noise_floor(
    user_module: str,
) -> None:
    lines: list[tuple[int, int, str]] = []
    result = run_benchmark(
        f"{user_module}:build",
        strategies=("single",),
        world_sizes=(1,),
        steps=3,
        warmup_steps=1,
        min_time_s=0,
        on_progress=lambda done, total, text: lines.append((done, total, text)),
    )
    (row,) = result.rows
    assert (row.strategy, row.world_size, row.status, row.params) == ("single", 1, "ok", 18)
    assert row.samples_per_s_low <= row.samples_per_s <= row.samples_per_s_high
    assert row.step_time_p50_ms > 0 and row.memory_mib > 0
    assert row.speedup == 1.0 and row.steps == 3 and row.repeats == 3
    # Measured at the start and at the end of each of the 3 rounds: 6 runs, the A/A noise floor.
    assert [(done, total) for done, total, _ in lines] == [(i, 6) for i in range(1, 7)]
    assert "(A/A)" in lines[1][2] and result.noise_floor >= 0 and not result.notes
    assert result.repeats == 3 and result.threads_per_rank >= 1 and result.cores >= 1


_calls: dict[tuple[str, int, int], int] = {}


def scripted_measure(
    spec: str,
    strategy: str,
    world_size: int,
    batch_size: int,
    steps: int,
    warmup_steps: int,
    min_time_s: float,
) -> dict[str, object]:
    """Stands in for _measure.measure_config in the ranks: a script of step times, no clock.

    One process takes 1 ms per step. ddp (on one process, so that one group suffices) takes 0.4 ms
    in its first 3 rounds (250 % efficiency, impossible), then 1.25 ms at batch 8 (80 %) but still
    0.4 ms at batch 16.
    """
    key = (strategy, world_size, batch_size)
    _calls[key] = _calls.get(key, 0) + 1
    step_s = 1e-3
    if strategy == "ddp":
        step_s = 0.4e-3 if _calls[key] <= 3 or batch_size == 16 else 1.25e-3
    timing = _timing.Timing(step_s, step_s, (step_s,))
    timings = {"step": timing}
    if strategy == "ddp":
        timings.update(compute=timing, comm=_timing.Timing(0.0, 0.0, (0.0,)), latency=timing)
    return {"timings": timings, "p90_s": step_s, "steps": 3, "memory_mib": 1.0}


def test_an_efficiency_above_100_percent_is_measured_again_and_flagged_if_it_stays(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from distkit.bench import _measure
    from distkit.cli import main

    # The ranks run what the parent sends them, by name: this module's script instead of the clock.
    monkeypatch.setattr(_measure, "measure_config", scripted_measure)
    argv = ["bench", "--model", "tiny", "--strategies", "single", "ddp", "--world-sizes", "1",
            "--batch-sizes", "8", "16", "--steps", "3", "--min-time-s", "0", "--threads-per-rank", "1",
            "--json", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    payload = json.loads(captured.out)  # --json: one object on stdout, progress lines on stderr
    rows = {(r["strategy"], r["batch_size"]): r for r in payload["rows"]}
    recovered, stuck = rows[("ddp", 8)], rows[("ddp", 16)]
    # Both came out at 250 % and were measured again, with their baselines, in 3 more rounds.
    lines = captured.err.splitlines()
    assert sum("round 4" in line for line in lines) == 2 * 2 + 2  # two baselines twice, two configurations
    assert lines[-1].startswith(f"[{len(lines)}/{len(lines)}] single x1 batch 16, round 6 (A/A)")
    assert [n for n in payload["notes"] if n.startswith("Re-measured")] == [
        f"Re-measured ddp on 1 process at batch {b}: its efficiency came out at 250%, above the 100 % "
        f"that a fixed batch per process allows, so the first measurement was noise or its baseline was "
        f"disturbed."
        for b in (8, 16)
    ]
    assert (recovered["flag"], recovered["efficiency"]) == ("", pytest.approx(0.8))
    assert (stuck["flag"], stuck["efficiency"]) == ("superlinear", pytest.approx(2.5))
    assert "not a finding" in stuck["note"] and stuck["repeats"] == 3
    assert payload["noise_floor"] == 0.0 and "load_during" in payload and payload["threads_per_rank"] == 1
    text = payload["recommendation"]
    assert text == (tmp_path / "recommendation.txt").read_text().strip()
    assert "ddp on 1 process at batch 16" not in text.splitlines()[0]
    assert "250% even after re-measuring" in text


def test_run_benchmark_rejects_bad_settings_before_starting_processes() -> None:
    with pytest.raises(ValueError, match="strategies must be among"):
        run_benchmark("tiny", strategies=("fsdp",))
    with pytest.raises(ValueError, match="each of batch_sizes must be an integer >= 1, got 0"):
        run_benchmark("tiny", batch_sizes=(0,))
    with pytest.raises(ValueError, match="unknown model"):
        run_benchmark("nonexistent")
    with pytest.raises(ValueError, match=r"repeats must be an integer >= 3 .* got 2"):
        run_benchmark("tiny", repeats=2)


def test_min_time_adds_steps_to_fast_operations() -> None:
    durations: list[float] = []

    def timed_sleep() -> None:
        start = time.perf_counter()
        time.sleep(0.01)
        durations.append(time.perf_counter() - start)

    # Only the calibration runs run here (the count is returned, not run), so a long min_time_s
    # costs nothing: 10 s, so that the count stays far above the minimum of 1 however long a
    # 10 ms sleep takes on a busy machine (it would have to take 5 s in two of three runs).
    count = _timing.agreed_count(timed_sleep, 1, 10.0, torch.device("cpu"))
    assert len(durations) == _timing._CALIBRATION_RUNS
    # agreed_count times each run from outside (our durations and a call), so its median is at
    # least ours: the count is at most 10 s over our median, whatever the load made of the sleeps.
    assert 2 <= count <= math.ceil(10.0 / statistics.median(durations))
    assert _timing.agreed_count(lambda: time.sleep(0.01), 50, 0.1, torch.device("cpu")) == 50
    assert _timing.agreed_count(lambda: None, 7, 0.0, torch.device("cpu")) == 7


def counts_per_rank() -> int:
    # Rank 1 is far slower, yet both must run the same number of (collective) steps. Alone, rank 1
    # would choose 1 (its 0.3 s sleep already fills 0.25 s; sleeps never run short) and rank 0 at
    # least 2: its 1 ms sleep would have to last 125 ms, in two of three calibration runs, to fill
    # half of 0.25 s. A loaded machine delays a sleep's wake-up by milliseconds, not by that much
    # (with 0.06 s, 30 ms of delay sufficed to make both ranks choose 1 and the test pass blind).
    pause = (0.001, 0.3)[distkit.get_rank()]
    return _timing.agreed_count(lambda: time.sleep(pause), 1, 0.25, torch.device("cpu"))


def test_every_rank_runs_the_count_rank_zero_chose(ranks) -> None:
    first, second = ranks.run(counts_per_rank, world_size=2)
    assert first == second >= 2


# How long rank 0 would wait for rank 1 in fail_on_rank_one's barrier.
BARRIER_TIMEOUT_S = 30


def fail_on_rank_one() -> int:
    if distkit.get_rank() == 1:
        raise RuntimeError(f"boom on purpose at {time.time()!r}")  # when, for the parent's check
    distkit.barrier(timeout_s=BARRIER_TIMEOUT_S)  # the peer never arrives: must not hang the parent
    return 0


def test_a_failing_rank_is_reported_with_its_traceback_and_nothing_hangs() -> None:
    with pytest.raises(distkit.DistkitError) as info:
        _spawn.run_group(fail_on_rank_one, (), world_size=2, timeout_s=120)
    reported = time.time()
    message = str(info.value)
    assert message.startswith(
        "[rank 1/2] failed in a benchmark group of 2 processes: RuntimeError: boom on purpose at "
    )
    assert "in fail_on_rank_one" in message  # the rank's traceback
    # Nothing waited for rank 0's barrier to time out: the failure reached the parent sooner after
    # rank 1 raised. Timed from the raise, not from the start, because starting two interpreters
    # that import torch takes 3 s on an idle machine and as long as the load makes it on a busy one.
    raised = float(message.split("boom on purpose at ", 1)[1].split()[0])
    assert reported - raised < BARRIER_TIMEOUT_S


def sleep_long() -> None:
    time.sleep(120)


def test_a_group_that_does_not_finish_times_out_naming_the_ranks() -> None:
    # The group starts with a long deadline: with run_group(timeout_s=6) a busy machine can take
    # over 6 s to start the interpreter and import torch, and the same error then comes from the
    # start-up, never from the task this test is about.
    with _spawn.RankGroup(1, timeout_s=120) as group:
        group.wait_ready()
        started = time.monotonic()
        with pytest.raises(distkit.CollectiveTimeoutError) as info:
            group.run(sleep_long, (), timeout_s=6)
        elapsed = time.monotonic() - started
    assert info.value.missing_ranks == [0] and "did not finish within 6 s" in str(info.value)
    # Ended by the task's deadline (not before it), and not by the rank's 120 s sleep: the only
    # time after the deadline is killing one process.
    assert 6 <= elapsed < 60, elapsed


def test_the_oversubscription_rule_counts_threads_on_cpu_and_devices_on_gpus() -> None:
    cpu = {"cores": 2, "gpus": 0, "device": "cpu"}
    assert oversubscription("ddp", 4, threads_per_rank=1, **cpu) == "4 processes x 1 thread > 2 cores"
    assert oversubscription("ddp", 2, threads_per_rank=2, **cpu) == "2 processes x 2 threads > 2 cores"
    assert not is_oversubscribed("ddp", 2, threads_per_rank=1, **cpu)
    assert is_oversubscribed("single", 1, threads_per_rank=3, **cpu)  # one process, too many threads
    gpu = {"threads_per_rank": 1, "cores": 2, "gpus": 2, "device": "cuda"}
    assert oversubscription("ddp", 4, **gpu) == "4 ranks > 2 GPUs"
    assert not is_oversubscribed("ddp", 2, **gpu) and not is_oversubscribed("single", 1, **gpu)
    assert is_oversubscribed("dp", 3, **gpu)


def test_intervals_are_the_range_of_repetitions_widened_to_the_noise_floor() -> None:
    assert spread([100.0, 110.0, 90.0]) == Interval(100.0, 90.0, 110.0)
    assert spread([100.0, 101.0, 99.0], floor=0.1) == Interval(100.0, 95.0, 105.0)
    assert ratio_spread([1.0, 1.0, 1.0], floor=0.1) == Interval(1.0, 0.9, 1.1)
    assert noise_floor([(100.0, 100.0), (90.0, 110.0)]) == pytest.approx(0.2)
    assert math.isnan(noise_floor([])) and math.isnan(spread([]).value)


def _option(label: str, low: float, value: float, high: float, devices: int) -> Option:
    return Option(label, Interval(value, low, high), (devices,))


def test_the_decision_rule_recommends_only_a_winner_whose_interval_clears_every_other() -> None:
    clear = decide(
        [
            _option("single", 95, 100, 105, 1),
            _option("ddp x2", 150, 160, 170, 2),
            _option("ddp x4", 90, 120, 140, 4),
        ]
    )
    assert clear.significant and clear.winner is not None and clear.winner.label == "ddp x2"
    assert clear.runner_up is not None and clear.runner_up.label == "ddp x4"
    # The runner-up's interval reaches into the winner's: no winner, the cheapest of the tied instead.
    overlap = decide([_option("single", 95, 100, 105, 1), _option("ddp x2", 101, 108, 115, 2)])
    assert overlap.winner is None and not overlap.significant
    assert [o.label for o in overlap.tied] == ["ddp x2", "single"] and overlap.cheapest.label == "single"
    assert overlap.noise == pytest.approx(7 / 108)
    # A third option with a wide interval also blocks a winner that clears the second-best median.
    wide = decide(
        [_option("a", 150, 160, 170, 1), _option("b", 100, 110, 120, 1), _option("c", 60, 100, 155, 2)]
    )
    assert wide.winner is None and [o.label for o in wide.tied] == ["a", "c"]
    with pytest.raises(ValueError, match="needs at least one candidate"):
        decide([])


def _row(strategy: str, n: int, b: int, rate: float, spread_pct: float, **kw: object) -> BenchRow:
    low, high = rate * (1 - spread_pct), rate * (1 + spread_pct)
    fields: dict[str, object] = {
        "samples_per_s": rate,
        "samples_per_s_low": low,
        "samples_per_s_high": high,
        "memory_mib": 300.0 + n,
        "memory_kind": "cpu_rss",
        "device": "cpu",
        "threads_per_rank": 1,
        "steps": 5,
        "repeats": 3,
        "step_time_p50_ms": 1e3 * b * n / rate,
    }
    fields.update(kw)
    return BenchRow("tiny", 2762, strategy, n, b, b * n, "ok", **fields)  # type: ignore[arg-type]


def _scaled(
    strategy: str, n: int, b: int, rate: float, base: float, spread_pct: float, **kw: object
) -> BenchRow:
    speedup = rate / base
    low, high = speedup * (1 - 2 * spread_pct), speedup * (1 + 2 * spread_pct)
    ends = {
        "speedup": speedup,
        "speedup_low": low,
        "speedup_high": high,
        "efficiency": speedup / n,
        "efficiency_low": low / n,
        "efficiency_high": high / n,
    }
    return _row(strategy, n, b, rate, spread_pct, **{**ends, **kw})


def _result(rows: list[BenchRow], *, load: float = 0.01, floor: float = 0.02) -> BenchResult:
    note = "Added the single baseline (one process, no wrapper): it compares."
    return BenchResult(
        tuple(rows),
        3,
        1,
        2,
        0,
        "cpu",
        floor,
        load_before=load,
        load_during=load,
        load_worst=load,
        notes=(note,),
    )


def _singles(spread_pct: float = 0.02) -> list[BenchRow]:
    return [
        _row("single", 1, 32, 1000.0, spread_pct, speedup=1.0, efficiency=1.0),
        _row("single", 1, 256, 4000.0, spread_pct, speedup=1.0, efficiency=1.0),
    ]


def test_recommend_names_a_clear_winner_with_its_intervals_noise_floor_and_load() -> None:
    rows = [
        *_singles(),
        BenchRow("tiny", 2762, "dp", 2, 32, 64, "skipped", "DataParallel needs CUDA GPUs"),
        _scaled("ddp", 2, 32, 600.0, 1000.0, 0.03),
        _scaled("ddp", 2, 256, 7000.0, 4000.0, 0.03),
    ]
    text = report.recommend(_result(rows))
    first = text.splitlines()[0]
    assert first.startswith(
        "Recommendation (confidence: high): ddp on 2 processes at batch 256: 7,000 [6,790-7,210]"
    )
    assert "1.75x [1.65-1.85] one process, 88% [82%-93%] efficiency" in first
    assert "It beats the runner-up, single (one process) at batch 256 (4,000 [3,920-4,080]), by 75%" in first
    assert "differed by up to 2.0%" in text and "1% of the CPUs in the second before the run" in text
    assert "1 torch thread(s), the one-process baseline too" in text
    assert "Added the single baseline" in text and "dp: skipped, DataParallel needs CUDA GPUs." in text
    # The efficiency at batch 256 clears the one at batch 32, so raising the batch is advised.
    assert "Larger batches per process scale better: 88% at batch 256 against 30% at batch 32" in text


def test_recommend_says_no_significant_difference_and_names_the_cheapest_when_intervals_overlap() -> None:
    # Efficiency 50 % [45-55] at batch 32 against 52 % [47-58] at batch 256: not "raise the batch" either.
    rows = [
        *_singles(0.05),
        _scaled("ddp", 2, 32, 1000.0, 1000.0, 0.05),
        _scaled("ddp", 2, 256, 4200.0, 4000.0, 0.05),
    ]
    text = report.recommend(_result(rows, floor=0.1))
    first = text.splitlines()[0]
    assert first.startswith(
        "No recommendation (confidence: none): no significant difference at this noise (±5%) between "
        "ddp on 2 processes at batch 256"
    )
    assert first.endswith("The cheapest of them: single (one process) at batch 256.")
    assert "Recommendation (" not in text and "raise the batch" not in text.lower()


def test_recommend_withholds_a_recommendation_on_a_loaded_machine() -> None:
    rows = [*_singles(), _scaled("ddp", 2, 256, 7000.0, 4000.0, 0.03)]
    text = report.recommend(_result(rows, load=0.45))
    assert text.startswith(
        "No recommendation (confidence: low): other processes used 45% of this machine's CPUs"
    )
    assert "On this loaded machine the fastest was ddp on 2 processes at batch 256" in text
    assert "Recommendation (confidence: high)" not in text


def test_recommend_never_draws_from_oversubscribed_or_superlinear_configurations() -> None:
    rows = [
        *_singles(),
        _scaled("ddp", 2, 256, 5000.0, 4000.0, 0.03),
        _scaled(
            "ddp",
            4,
            256,
            20000.0,
            4000.0,
            0.03,
            oversubscribed=True,
            note="oversubscribed: 4 processes x 1 thread > 2 cores",
        ),
        _scaled("ddp", 2, 32, 2400.0, 1000.0, 0.03, flag="superlinear", note="efficiency above 100 %"),
    ]
    text = report.recommend(_result(rows))
    assert text.startswith("Recommendation (confidence: high): ddp on 2 processes at batch 256: 5,000")
    assert (
        "Oversubscribed, so never recommended: ddp on 4 processes (4 processes x 1 thread > 2 cores)." in text
    )
    assert "120% even after re-measuring" in text and "not a finding" in text
    assert "20,000" not in text.splitlines()[0] and "120% efficiency" not in text.splitlines()[0]


def test_recommend_says_communication_outweighs_compute_only_when_the_numbers_show_it() -> None:
    split = {"compute_ms": 2.0, "compute_ms_low": 1.9, "compute_ms_high": 2.1}
    heavy = _scaled(
        "ddp", 2, 32, 600.0, 1000.0, 0.03, comm_ms=4.0, comm_ms_low=3.8, comm_ms_high=4.2, **split
    )
    text = report.recommend(_result([*_singles(), heavy]))
    assert "compute 2.00 ms [1.90-2.10], communication 4.00 ms [3.80-4.20]" in text
    assert "Communication outweighs compute at batch 32" in text
    close = _scaled(
        "ddp", 2, 32, 600.0, 1000.0, 0.03, comm_ms=2.05, comm_ms_low=1.8, comm_ms_high=2.3, **split
    )
    assert "outweighs" not in report.recommend(_result([*_singles(), close]))


def test_plots_are_valid_pngs_with_error_bars_and_the_csv_has_every_column(tmp_path: Path) -> None:
    rows = [
        *_singles(),
        _scaled("ddp", 2, 32, 600.0, 1000.0, 0.03),
        _scaled("ddp", 2, 256, 7000.0, 4000.0, 0.03),
        _scaled("ddp", 4, 256, 6000.0, 4000.0, 0.1, oversubscribed=True),
    ]
    paths = report.plot_rows(rows, tmp_path)
    assert [p.name for p in paths] == ["throughput.png", "scaling_efficiency.png", "memory.png"]
    assert [_png_size(p) for p in paths] == [(640, 420), (960, 420), (640, 420)]
    for path in paths:
        assert 10_000 < path.stat().st_size < 200_000  # drawn, and small enough for the docs
    csv_path = report.write_csv([r.as_dict() for r in rows], tmp_path / "results.csv", BenchRow.columns())
    lines = csv_path.read_text().splitlines()
    assert lines[0].split(",") == BenchRow.columns() and len(lines) == 1 + len(rows)
    assert {"samples_per_s_low", "speedup_high", "oversubscribed", "flag", "foreign_cpu_pct"} <= set(
        BenchRow.columns()
    )
    assert lines[-1].split(",")[BenchRow.columns().index("oversubscribed")] == "True"


# A child that uses 0.6 s of CPU (its own CPU time, however long the machine's load makes that
# take), says so, then stays alive and idle until its stdin closes: a meter reads the CPU time of
# live processes only.
BURN_THEN_IDLE = (
    "import sys, time\n"
    "end = time.process_time() + 0.6\n"
    "while time.process_time() < end:\n"
    "    pass\n"
    "print('burnt', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_the_load_meter_counts_our_own_processes_out_of_the_foreign_load() -> None:
    own: list[int] = []
    theirs, ours = _load.LoadMeter(lambda: []), _load.LoadMeter(lambda: own)
    if not theirs.available:
        pytest.skip("no /proc: the load is not measured on this platform")
    started = time.monotonic()
    theirs.start()
    ours.start()
    child = subprocess.Popen(
        [sys.executable, "-c", BURN_THEN_IDLE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        own.append(child.pid)  # started inside the window: a meter counts it from zero
        assert child.stdout is not None and child.stdout.readline() == "burnt\n"
        as_foreign, as_own = theirs.stop(), ours.stop()
        window_s = time.monotonic() - started
        child_s = _load._process_cpu_s(child.pid)
    finally:
        child.communicate(timeout=60)
    # It burnt its 0.6 s (process_time and /proc's ticks round differently: 0.59 was read once).
    assert child_s is not None and child_s >= 0.5
    # The child's CPU seconds are foreign to one meter and ours to the other: the two shares differ
    # by exactly them, over the window and the CPUs. Compared in CPU seconds, not as a share, since
    # the share the child gets depends on how many other processes run beside it. The slack: both
    # counters tick every 10 ms, per CPU for the machine's.
    difference_s = (as_foreign - as_own) * window_s * (os.cpu_count() or 1)
    assert difference_s == pytest.approx(child_s, abs=0.1), (difference_s, child_s, as_foreign, as_own)


def _profile_with_load(load: float) -> Any:
    from distkit.bench._prediction import ScalingProfile
    from distkit.bench.profile import CommProfile

    comm = CommProfile(2, "gloo", 4_000_000, 1, 0.001, 0.0001, "measured")
    profile = ScalingProfile(
        batch_size=32,
        compute_s=0.02,
        rank_compute_s=0.02,
        forward_s=0.008,
        backward_s=0.01,
        num_parameters=1_000_000,
        comm=comm,
        overlap=False,
        device="cpu",
        num_threads=1,
        load=load,
    )
    return dataclasses.replace(profile, predictions=tuple(profile.predict(n) for n in (1, 2, 4)))


def test_the_advisor_withholds_its_verdict_on_a_loaded_machine_and_says_why() -> None:
    # Seed 004's case: at a load of 40 the analysis said "Scales well" with no caveat.
    idle, loaded = _profile_with_load(0.02), _profile_with_load(0.4)
    assert "Scales well" in idle.recommendation() and "confidence" not in idle.recommendation()
    text = loaded.recommendation()
    assert text.startswith("No verdict (confidence: low: other processes used 40% of this machine's CPUs")
    assert "Scales well" not in text and "Worth it" not in text and "Predicted:" in text
    assert "Scales well" in loaded.recommendation(max_load=0.5)


def _red_in_bottom_left(path: Path) -> bool:
    from matplotlib.image import imread

    pixels = imread(str(path))[..., :3]
    corner = pixels[-int(pixels.shape[0] * 0.05) :, : pixels.shape[1] // 2]
    red = (corner[..., 0] > 0.55) & (corner[..., 1] < 0.35) & (corner[..., 2] < 0.35)
    return bool(red.any())


def test_every_png_states_its_confidence_and_the_load(tmp_path: Path) -> None:
    # The advisor's plot: a loaded machine's figure carries the low-confidence line (in red) at its
    # foot; an idle machine's carries its own, in grey. The bench's plots get report.trust(result).
    loaded = report.plot_profiles([_profile_with_load(0.4)], tmp_path / "loaded.png")
    idle = report.plot_profiles([_profile_with_load(0.02)], tmp_path / "idle.png")
    assert _red_in_bottom_left(loaded) and not _red_in_bottom_left(idle)
    assert "measured on an idle machine (other processes used 2% of its CPUs)" in _load.trust_line(0.02)
    assert "not measured" in _load.trust_line(math.nan)


def busy_loop(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_profile_scaling_measures_the_load_of_processes_beside_it() -> None:
    if not Path("/proc/stat").exists():
        pytest.skip("no /proc: the load is not measured on this platform")
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    ctx = multiprocessing.get_context("spawn")
    hogs = [ctx.Process(target=busy_loop, args=(30.0,)) for _ in range(2)]
    for hog in hogs:
        hog.start()
    try:
        time.sleep(1.0)  # the hogs are running before the measurement starts
        profile = profile_scaling(
            model, batch, world_sizes=(2,), steps=3, warmup_steps=1, min_time_s=1.0, options=False
        )
    finally:
        for hog in hogs:
            hog.kill()
            hog.join()
    assert profile.load > 0.1, profile.load
    assert profile.recommendation().startswith("No verdict (confidence: low")


def _weighed(
    compute_ms: float,
    comm_ms: float,
    options: dict[str, float],
    *,
    double_ms: float = math.nan,
    spread: float = 0.0,
    exact: tuple[str, ...] = (),
    load: float = math.nan,
) -> ScalingProfile:
    """A profile with DDP options measured at the given ms; every interval +-``spread`` of its value."""

    def comm(ms: float) -> CommProfile:
        s = ms / 1e3
        return CommProfile(2, "gloo", 4 * 2**20, 1, s, 0.0, "measured", s * (1 - spread), s * (1 + spread))

    c, d = compute_ms / 1e3, double_ms / 1e3
    profile = ScalingProfile(
        32, c, c, 0.0, 0.0, 1000, comm(comm_ms), False, "cpu", 1,
        compute_low=c * (1 - spread), compute_high=c * (1 + spread),
        rank_compute_low=c * (1 - spread), rank_compute_high=c * (1 + spread),
        load=load,
        comm_options=tuple(
            CommOption(name, f"change {name}", f"setting {name}", f"cost {name}", name in exact, comm(ms))
            for name, ms in options.items()
        ),
        double_batch_s=d, double_batch_low=d * (1 - spread), double_batch_high=d * (1 + spread),
    )  # fmt: skip
    return dataclasses.replace(profile, predictions=tuple(profile.predict(n) for n in (1, 2)))


def test_each_change_is_predicted_from_its_own_measurement_and_the_fastest_clear_one_is_prescribed() -> None:
    profile = _weighed(10.0, 10.0, {"fp16": 6.0, "powersgd": 2.0}, double_ms=18.0)
    found = {p.name: p.prediction for p in profile.prescriptions(2)}
    assert profile.predict(2).speedup == pytest.approx(1.0)  # 2 x 10 / (10 + 10)
    assert found["fp16"].speedup == pytest.approx(2 * 10 / 16)
    assert found["powersgd"].speedup == pytest.approx(2 * 10 / 12)
    assert found["accumulate"].speedup == pytest.approx(2 * 10 / (10 + 10 / 4))  # one all-reduce per 4
    # Twice the batch: 2 ranks x 2 batches in 18 + 10 ms, against one process's batch in 10 ms.
    assert found["batch"].speedup == pytest.approx(4 * 10 / 28)
    assert found["batch"].samples_per_s == pytest.approx(2 * 64 / 0.028)
    assert [p.name for p in profile.prescriptions(2)] == ["powersgd", "accumulate", "batch", "fp16"]
    best = profile.prescribed(2)
    assert best is not None and best.name == "powersgd"
    text = profile.recommendation()
    assert "What each change is predicted to give on 2 ranks" in text
    assert "  change powersgd  " in text and "Trainer(accumulate_grad_batches=4)" in text
    assert text.splitlines()[-1] == (
        "Prescription for 2 ranks: change powersgd: setting powersgd. Predicted 1.67x against 1.00x as it "
        "is (1.67x its samples/s, 1.67-1.67 over the blocks), which makes 2 ranks worth their cost. What it "
        "costs: cost powersgd."
    )
    assert profile.as_dict()["prescribed"] == "powersgd"
    assert profile.as_dict()["prescriptions"][0]["name"] == "powersgd"


def test_an_exact_change_is_prescribed_when_its_interval_reaches_the_fastest_ones() -> None:
    profile = _weighed(10.0, 10.0, {"powersgd": 2.0, "bucket": 2.6}, spread=0.03, exact=("bucket",))
    best = profile.prescribed(2)
    assert best is not None and best.name == "bucket" and best.exact
    # Far slower than the fastest: the fastest it is, exact or not.
    profile = _weighed(10.0, 10.0, {"powersgd": 2.0, "bucket": 7.0}, spread=0.03, exact=("bucket",))
    best = profile.prescribed(2)
    assert best is not None and best.name == "powersgd"


def test_nothing_is_prescribed_inside_the_spread_for_a_job_that_scales_or_on_a_loaded_machine() -> None:
    # Every change's interval overlaps the job's as it is: the report says it cannot tell.
    wide = _weighed(10.0, 3.0, {"fp16": 2.5}, spread=0.3)
    assert wide.prescribed(2) is None
    assert (
        "No change is predicted faster than the job as it is on 2 ranks in every block"
        in wide.recommendation()
    )
    # 91 % efficient: nothing to change, and no table of changes.
    scales = _weighed(100.0, 10.0, {"powersgd": 1.0})
    assert scales.prescribed(2) is None and "What each change" not in scales.recommendation()
    # On a loaded machine the verdict is withheld, the prescription with it.
    loaded = _weighed(10.0, 10.0, {"powersgd": 2.0}, load=0.4)
    assert "Prescription" not in loaded.recommendation() and "What each change" not in loaded.recommendation()
    assert loaded.prescribed(2) is not None  # the arithmetic stays available
    assert _weighed(10.0, 10.0, {}).prescriptions(1) == ()


def test_accumulation_waits_for_the_slowest_rank_and_steps_the_optimizer_once_per_all_reduce() -> None:
    # 10 ms per rank in lockstep, 2 of them waiting for the slower rank and 1 in the optimizer:
    # 4 batches per all-reduce wait and step once, so a batch computes in 10 - 3 x 3/4 = 7.75 ms
    # and carries 10 / 4 ms of communication.
    profile = dataclasses.replace(_weighed(10.0, 10.0, {}), rank_wait_s=0.002, optimizer_s=0.001)
    assert profile.predict(2, accumulate=4).step_s == pytest.approx(0.00775 + 0.0025)
    assert profile.predict(2).step_s == pytest.approx(0.020)


def _blocks(
    profile: ScalingProfile, compute_ms: list[float], comm_ms: list[float], fp16_ms: list[float]
) -> ScalingProfile:
    """``profile`` with its compute, communication and fp16 option measured in the given blocks."""
    (option,) = profile.comm_options
    fp16 = dataclasses.replace(option.comm, step_blocks=tuple(ms / 1e3 for ms in fp16_ms))
    return dataclasses.replace(
        profile,
        comm=dataclasses.replace(profile.comm, step_blocks=tuple(ms / 1e3 for ms in comm_ms)),
        rank_compute_blocks=tuple(ms / 1e3 for ms in compute_ms),
        comm_options=(dataclasses.replace(option, comm=fp16),),
    )


def test_a_change_is_weighed_against_the_job_block_by_block() -> None:
    # Load came and went: compute ranged over +-30 %, so the two speedup intervals overlap, but in
    # every block the fp16 option communicated faster than the plain all-reduce measured beside it.
    base = _weighed(10.0, 6.0, {"fp16": 4.0}, spread=0.3)
    fp16 = next(p for p in base.prescriptions(2) if p.name == "fp16")
    assert fp16.prediction.speedup_low < base.predict(2).speedup_high  # unpaired: cannot tell
    assert base.prescribed(2) is None
    paired = _blocks(base, [7.0, 10.0, 13.0, 10.0, 9.0], [4.5, 6.0, 7.5, 6.0, 5.5], [3.0, 4.0, 5.0, 4.0, 3.5])
    fp16 = next(p for p in paired.prescriptions(2) if p.name == "fp16")
    # Block by block: (7 + 4.5) / (7 + 3) = 1.15 ... (10 + 6) / (10 + 4) = 1.14 ... (13 + 7.5) / 18 = 1.14.
    assert fp16.gain_low == pytest.approx(min(11.5 / 10, 16 / 14, 20.5 / 18, 14.5 / 12.5))
    assert fp16.gain_low > 1
    # One block where the option was slower: not faster in every block, so not prescribed.
    mixed = _blocks(base, [10.0] * 5, [6.0] * 5, [4.0, 4.0, 7.0, 4.0, 4.0])
    assert next(p for p in mixed.prescriptions(2) if p.name == "fp16").gain_low < 1


def test_the_doubled_batch_doubles_every_batch_sized_tensor_or_is_refused() -> None:
    import collections

    x, y, mask = torch.randn(4, 3), torch.arange(4), torch.ones(7)  # mask: not batch-sized
    pair = _doubled((x, y), 4)
    assert isinstance(pair, tuple) and torch.equal(pair[0], torch.cat([x, x])) and pair[1].shape == (8,)
    mapping = _doubled(collections.UserDict({"input_ids": x, "labels": y, "mask": mask}), 4)
    assert mapping["input_ids"].shape == (8, 3) and mapping["mask"] is mask  # a tokenizer's BatchEncoding
    Batch = collections.namedtuple("Batch", "inputs targets")
    named = _doubled(Batch(x, y), 4)
    assert isinstance(named, Batch) and named.inputs.shape == (8, 3)

    class Odd(tuple):  # a container it cannot rebuild: no doubled batch rather than the same one
        def __new__(cls, a: torch.Tensor, b: torch.Tensor) -> Odd:
            return super().__new__(cls, (a, b))

    assert _doubled(Odd(x, y), 4) is None
    assert _doubled(("text", 3), None) is None

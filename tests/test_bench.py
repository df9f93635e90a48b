"""The scaling advisor, workloads, the benchmark runner's processes, and its report."""

from __future__ import annotations

import math
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import distkit
from distkit.bench import _spawn, _timing, profile_scaling, report
from distkit.bench.profile import CommProfile, ScalingProfile
from distkit.bench.runner import BenchRow, run_benchmark
from distkit.bench.workloads import PRESETS, Workload, default_loss, load_workload

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_profile_scaling_is_importable_from_distkit_and_distkit_bench() -> None:
    assert distkit.profile_scaling is profile_scaling


def test_profile_scaling_measures_compute_and_ddp_communication_in_spawned_ranks() -> None:
    workload = load_workload("tiny")
    before = [p.detach().clone() for p in workload.model.parameters()]
    profile = profile_scaling(
        workload.model,
        workload.make_batch(16),
        world_sizes=(1, 2, 4),
        steps=3,
        warmup_steps=1,
        min_time_s=0,
        num_threads=1,
    )
    comm = profile.comm
    assert (comm.source, comm.backend, comm.world_size, comm.num_buckets) == ("measured", "gloo", 2, 1)
    assert comm.grad_bytes == 4 * workload.num_parameters
    assert comm.step_s > 0 and comm.latency_s > 0
    assert profile.compute_s > 0 and profile.rank_compute_s > 0  # the latter timed in the spawned ranks
    assert profile.batch_size == 16 and profile.num_threads == 1 and profile.overlap is False
    assert profile.ratio == pytest.approx(profile.rank_compute_s / comm.step_s)
    one, two, four = profile.predictions
    assert (one.world_size, one.step_s, one.speedup) == (1, profile.compute_s, 1.0)
    assert two.step_s == pytest.approx(profile.rank_compute_s + comm.step_s)
    assert four.step_s == pytest.approx(profile.rank_compute_s + comm.time_at(4))
    assert two.speedup == pytest.approx(2 * profile.compute_s / two.step_s)
    assert four.samples_per_s == pytest.approx(4 * 16 / four.step_s)
    # No optimizer: the weights are untouched and the gradients cleared.
    assert all(torch.equal(a, b) for a, b in zip(before, workload.model.parameters(), strict=True))
    assert all(p.grad is None for p in workload.model.parameters())


def profile_in_job() -> tuple[int, float, float, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    batch = (torch.randn(8, 16), torch.randint(4, (8,)))
    profile = distkit.profile_scaling(model, batch, world_sizes=(2,), steps=3, warmup_steps=1, min_time_s=0)
    return profile.comm.world_size, profile.comm.step_s, profile.compute_s, profile.rank_compute_s


def test_inside_a_job_profile_scaling_measures_with_the_jobs_group_on_every_rank(ranks) -> None:
    results = ranks.run(profile_in_job, world_size=2)
    assert results[0] == results[1]  # one reduced answer on every rank
    world_size, comm_s, compute_s, rank_compute_s = results[0]
    assert world_size == 2 and comm_s > 0 and compute_s == rank_compute_s > 0


def test_comm_time_follows_the_ring_all_reduce_model() -> None:
    comm = CommProfile(2, "gloo", 8_000_000, 2, step_s=0.010, latency_s=0.001, source="measured")
    assert comm.time_at(1) == 0.0
    assert comm.time_at(2) == pytest.approx(0.010)
    # 4 ranks: the per-call part (2 x 1 ms) triples, the per-byte part (8 ms) grows by 1.5.
    assert comm.time_at(4) == pytest.approx(0.002 * 3 + 0.008 * 1.5)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        comm.time_at(0)


def test_a_bandwidth_model_predicts_without_starting_processes() -> None:
    model = nn.Linear(1000, 250)  # 250,250 parameters: 1,001,000 bytes of fp32 gradients
    batch = (torch.randn(4, 1000), torch.randn(4, 250))
    started = time.perf_counter()
    profile = profile_scaling(
        model, batch, steps=1, warmup_steps=0, min_time_s=0, bandwidth_gbps=8.0, latency_us=0.0
    )
    assert time.perf_counter() - started < 5  # far below the cost of starting ranks
    assert profile.comm.source == "bandwidth model"
    assert profile.comm.step_s == pytest.approx(1_001_000 / 1e9)  # 8 Gbit/s = 1 GB/s
    assert profile.rank_compute_s == profile.compute_s


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
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        load_workload(f"{user_module}:missing")
    with pytest.raises(ValueError, match="unknown model 'huge': use a preset"):
        load_workload("huge")


def test_run_benchmark_trains_a_user_factory_in_spawned_processes(user_module: str) -> None:
    rows = run_benchmark(
        f"{user_module}:build",
        strategies=("single",),
        world_sizes=(1,),
        steps=3,
        warmup_steps=1,
        min_time_s=0,
    )
    (row,) = rows
    assert (row.strategy, row.world_size, row.status, row.params) == ("single", 1, "ok", 18)
    assert row.samples_per_s > 0 and row.step_time_p50_ms > 0 and row.memory_mib > 0
    assert row.speedup == 1.0 and row.steps == 3 and row.memory_kind in {"cpu_rss", "cuda_peak_allocated"}


def test_run_benchmark_rejects_bad_settings_before_starting_processes() -> None:
    with pytest.raises(ValueError, match="strategies must be among"):
        run_benchmark("tiny", strategies=("fsdp",))
    with pytest.raises(ValueError, match="each of batch_sizes must be an integer >= 1, got 0"):
        run_benchmark("tiny", batch_sizes=(0,))
    with pytest.raises(ValueError, match="unknown model"):
        run_benchmark("nonexistent")


def test_min_time_adds_steps_to_fast_operations() -> None:
    count = _timing.agreed_count(lambda: time.sleep(0.01), 2, 0.1, torch.device("cpu"))
    assert 4 <= count <= 11  # about 0.1 s / 0.01 s; sleeps only ever run long
    assert _timing.agreed_count(lambda: time.sleep(0.01), 50, 0.1, torch.device("cpu")) == 50
    assert _timing.agreed_count(lambda: None, 7, 0.0, torch.device("cpu")) == 7


def counts_per_rank() -> int:
    # Rank 1 is ten times slower, yet both must run the same number of (collective) steps.
    pause = (0.002, 0.02)[distkit.get_rank()]
    return _timing.agreed_count(lambda: time.sleep(pause), 1, 0.05, torch.device("cpu"))


def test_every_rank_runs_the_count_rank_zero_chose(ranks) -> None:
    first, second = ranks.run(counts_per_rank, world_size=2)
    assert first == second >= 10  # rank 0's estimate: 0.05 s / 2 ms


def fail_on_rank_one() -> int:
    if distkit.get_rank() == 1:
        raise RuntimeError("boom on purpose")
    distkit.barrier(timeout_s=30)  # the peer never arrives: must not hang the parent
    return 0


def test_a_failing_rank_is_reported_with_its_traceback_and_nothing_hangs() -> None:
    started = time.monotonic()
    with pytest.raises(distkit.DistkitError) as info:
        _spawn.run_group(fail_on_rank_one, (), world_size=2, timeout_s=60)
    message = str(info.value)
    assert message.startswith(
        "[rank 1/2] failed in a benchmark group of 2 processes: RuntimeError: boom on purpose"
    )
    assert "in fail_on_rank_one" in message  # the rank's traceback
    assert time.monotonic() - started < 30


def sleep_long() -> None:
    time.sleep(120)


def test_a_group_that_does_not_finish_times_out_naming_the_ranks() -> None:
    started = time.monotonic()
    with pytest.raises(distkit.CollectiveTimeoutError) as info:
        _spawn.run_group(sleep_long, (), world_size=1, timeout_s=6)
    assert info.value.missing_ranks == [0] and "did not finish within 6 s" in str(info.value)
    assert time.monotonic() - started < 20


def _rows() -> list[BenchRow]:
    def row(strategy: str, n: int, b: int, rate: float, **kw: object) -> BenchRow:
        return BenchRow("tiny", 2762, strategy, n, b, b * n, "ok", samples_per_s=rate, memory_mib=300.0 + n,
                        memory_kind="cpu_rss", device="cpu", threads_per_rank=1, steps=5, **kw)  # fmt: skip

    return [
        row("single", 1, 32, 1000.0, speedup=1.0, efficiency=1.0),
        row("single", 1, 256, 4000.0, speedup=1.0, efficiency=1.0),
        BenchRow("tiny", 2762, "dp", 2, 32, 64, "skipped", "DataParallel needs CUDA GPUs", device="cpu"),
        row("ddp", 2, 32, 600.0, speedup=0.6, efficiency=0.3),
        row("ddp", 2, 256, 7000.0, speedup=1.75, efficiency=0.875),
    ]


def test_recommend_reads_the_rows_in_plain_language() -> None:
    text = report.recommend(_rows())
    assert text.startswith("Fastest: ddp on 2 processes at batch 256: 7,000 samples/s (1.75x one process")
    assert "ddp on 2: pays at some batch sizes; 0.60x (30%) at batch 32, 1.75x (88%) at batch 256." in text
    assert "Larger batches per process scale better" in text
    assert "Recommendation: ddp on 2 processes at batch 256 (1.75x one process, 88% efficiency)." in text
    assert "dp: skipped, DataParallel needs CUDA GPUs." in text
    assert "CPU processes over gloo, 1 torch thread(s)" in text


def test_recommend_keeps_one_process_when_a_second_adds_little() -> None:
    rows = [r for r in _rows() if r.batch_size == 256]
    marginal = BenchRow(
        **{**rows[-1].as_dict(), "samples_per_s": 4200.0, "speedup": 1.05, "efficiency": 0.525}
    )
    text = report.recommend([*rows[:-1], marginal])
    assert "ddp on 2: pays poorly" in text
    assert "Recommendation: one process at batch 256" in text


def test_plots_are_valid_pngs_and_the_csv_has_every_column(tmp_path: Path) -> None:
    rows = _rows()
    paths = report.plot_rows(rows, tmp_path)
    assert [p.name for p in paths] == ["throughput.png", "scaling_efficiency.png", "memory.png"]
    for path in paths:
        assert _png_size(path) == (640, 420)
        assert 10_000 < path.stat().st_size < 200_000  # drawn, and small enough for the docs
    csv_path = report.write_csv([r.as_dict() for r in rows], tmp_path / "results.csv", BenchRow.columns())
    lines = csv_path.read_text().splitlines()
    assert lines[0].split(",") == BenchRow.columns() and len(lines) == 1 + len(rows)
    assert math.isnan(rows[2].samples_per_s) and ",skipped," in lines[3]

"""GPUMonitor (real NVML where present, a stand-in driver otherwise), memory_stats, ThroughputMeter."""

from __future__ import annotations

import math
import threading
import time
import types
import warnings

import pytest
import torch

import distkit
from distkit import monitor

THREAD_NAME = "distkit-gpu-monitor"


def _nvml_works() -> bool:
    try:
        pynvml = monitor._init_nvml()
    except monitor._NvmlUnavailable:
        return False
    pynvml.nvmlShutdown()
    return True


def _monitor_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


@pytest.fixture
def fresh_warning_state(monkeypatch: pytest.MonkeyPatch) -> None:
    # The "once per process" flag: every test starts as a new process would.
    monkeypatch.setattr(monitor, "_unavailable_warned", False)


@pytest.mark.skipif(_nvml_works(), reason="NVML works on this machine; the no-NVML path cannot be exercised")
def test_without_nvml_the_monitor_is_a_noop_with_exactly_one_warning(fresh_warning_state: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # only distkit's own once-per-process rule may dedupe
        with distkit.GPUMonitor(interval_s=0.01) as first:
            assert not first.available
            assert not _monitor_threads()
        second = distkit.GPUMonitor(interval_s=0.01).start()
        second.stop()
    ours = [w for w in caught if "GPUMonitor records nothing" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert issubclass(ours[0].category, RuntimeWarning)
    assert ours[0].filename == __file__  # points at the caller's line, not distkit's internals
    assert "NVML" in str(ours[0].message)
    assert first.summary() == {} and first.latest() == {}
    assert first.reason is not None and "NVML" in first.reason
    assert not _monitor_threads()


class FakeNvml(types.ModuleType):
    """A stand-in NVML driver with four GPUs; GPU 1 reports no power (like a MIG slice)."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.uuids = ["GPU-aaaa0000", "GPU-bbbb1111", "GPU-cccc2222", "GPU-dddd3333"]
        self.inits = 0
        self.shutdowns = 0
        self.reads = [0] * 4

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "999.1"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        raise self.NVMLError("not found")

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return self.uuids[handle].encode()  # the deprecated bindings return bytes

    def nvmlDeviceGetName(self, handle: int) -> str:
        return f"Fake GPU {handle}"

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(gpu=50 + handle, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> types.SimpleNamespace:
        # Used memory grows by 1 MiB per sample, so the mean and max are known from the count.
        self.reads[handle] += 1
        mib = 1024 * 1024
        return types.SimpleNamespace(used=self.reads[handle] * mib, total=(1000 + handle) * mib)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        if handle == 1:
            raise self.NVMLError("Not Supported")
        return 250_000  # milliwatts

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return 60


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    if torch.cuda.is_available():
        pytest.skip("torch sees real GPUs; the stand-in driver's GPUs would not match their UUIDs")
    fake = FakeNvml()
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


def _wait_for_samples(mon: distkit.GPUMonitor, count: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(s["samples"] >= count for s in mon.summary().values()) and mon.summary():
            return
        time.sleep(0.005)
    raise AssertionError(f"fewer than {count} samples within {timeout_s} s: {mon.summary()}")


def test_monitor_thread_samples_every_gpu_and_stops_leaving_no_thread(fake_nvml: FakeNvml) -> None:
    with distkit.GPUMonitor(interval_s=0.01) as mon:
        assert mon.available and len(_monitor_threads()) == 1
        _wait_for_samples(mon, 3)
    assert not _monitor_threads()
    assert fake_nvml.inits == fake_nvml.shutdowns == 1
    summary = mon.summary()
    assert sorted(summary) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    for index, (label, stats) in enumerate(sorted(summary.items())):
        n = stats["samples"]
        assert n == fake_nvml.reads[index], label
        assert stats["util_pct_mean"] == stats["util_pct_max"] == 50 + index
        assert stats["mem_used_mib_max"] == n
        assert stats["mem_used_mib_mean"] == pytest.approx((n + 1) / 2)
        assert stats["mem_total_mib"] == 1000 + index
        assert stats["temp_c_max"] == 60
    assert "power_w_mean" not in summary["cuda:1"]  # not supported there: left out, not zero
    assert summary["cuda:0"]["power_w_max"] == 250.0
    assert mon.latest()["cuda:2"]["mem_used_mib"] == summary["cuda:2"]["mem_used_mib_max"]


def test_monitor_restarts_and_reset_forgets_samples(fake_nvml: FakeNvml) -> None:
    mon = distkit.GPUMonitor(interval_s=0.01).start()
    with pytest.raises(distkit.DistkitError, match="already running"):
        mon.start()
    _wait_for_samples(mon, 1)
    mon.stop()
    mon.stop()  # idempotent
    before = mon.summary()["cuda:0"]["samples"]
    with mon:
        _wait_for_samples(mon, before + 1)
    assert mon.summary()["cuda:0"]["samples"] > before  # a restart keeps counting
    mon.reset()
    assert mon.summary() == {}
    assert fake_nvml.inits == fake_nvml.shutdowns == 2
    assert not _monitor_threads()


@pytest.mark.parametrize(
    ("visible", "expected_totals"),
    [
        ("2,GPU-bbbb", [1002, 1001]),  # an index, then a unique UUID prefix, in that order
        ("3,9,0", [1003]),  # CUDA ignores every entry after the first invalid one
        ("GPU-dddd3333", [1003]),
    ],
)
def test_cuda_visible_devices_decides_which_gpus_are_monitored(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch, visible: str, expected_totals: list[int]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with distkit.GPUMonitor(interval_s=0.01) as mon:
        _wait_for_samples(mon, 1)
    summary = mon.summary()
    assert [summary[f"cuda:{i}"]["mem_total_mib"] for i in range(len(summary))] == expected_totals


def test_an_empty_cuda_visible_devices_disables_the_monitor_with_the_reason(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch, fresh_warning_state: None
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.warns(RuntimeWarning, match="no GPU is visible to this process"):
        mon = distkit.GPUMonitor().start()
    assert not mon.available and mon.summary() == {}
    assert fake_nvml.inits == fake_nvml.shutdowns == 1
    assert not _monitor_threads()


@pytest.mark.skipif(not (torch.cuda.is_available() and _nvml_works()), reason="needs CUDA GPUs and NVML")
def test_real_gpus_are_matched_to_torch_devices_by_uuid() -> None:
    with distkit.GPUMonitor(interval_s=0.05) as mon:
        _wait_for_samples(mon, 2)
    summary = mon.summary()
    assert sorted(summary) == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for i in range(torch.cuda.device_count()):
        total = torch.cuda.get_device_properties(i).total_memory / 2**20
        assert summary[f"cuda:{i}"]["mem_total_mib"] == pytest.approx(total, rel=0.01)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1", True])
def test_monitor_rejects_an_interval_that_is_not_a_positive_number(bad: object) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        distkit.GPUMonitor(interval_s=bad)  # type: ignore[arg-type]


def test_memory_stats_on_cpu_reports_resident_memory_that_follows_allocations() -> None:
    before = distkit.memory_stats("cpu")
    assert sorted(before) == ["peak_rss_mib", "rss_mib"]
    block = torch.ones(32 * 2**20 // 4)  # 32 MiB, written, so resident
    after = distkit.memory_stats()  # this process's device: the CPU here
    assert after["rss_mib"] - before["rss_mib"] >= 24
    assert after["peak_rss_mib"] >= after["rss_mib"] > 0
    del block


@pytest.mark.parametrize(
    ("bad", "meant"), [("gpu", " (did you mean 'cuda'?)"), ("GPU:1", " (did you mean 'cuda:1'?)"), (-1, "")]
)
def test_memory_stats_of_an_unknown_device_names_the_argument_the_value_and_what_it_takes(
    bad: object, meant: str
) -> None:
    # Was torch's RuntimeError listing every device type it knows ("Expected one of cpu, cuda, ipu...").
    with pytest.raises(ValueError) as refused:
        distkit.memory_stats(bad)  # type: ignore[arg-type]
    assert str(refused.value) == (
        "memory_stats(): device must be 'cuda' (the current CUDA device), 'cuda:N' or an int N (CUDA "
        "device N), 'cpu' (this process's memory only), a torch.device, or None (this rank's device), "
        f"got {bad!r}{meant}."
    )
    with pytest.raises(TypeError, match=r"memory_stats\(\): device must be .*, got float 1.5\.$"):
        distkit.memory_stats(1.5)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_memory_stats_of_a_cuda_device_without_cuda_says_so() -> None:
    with pytest.raises(distkit.DistkitError, match="CUDA is not available"):
        distkit.memory_stats("cuda:0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_stats_on_cuda_reports_allocator_numbers() -> None:
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda:0")
    stats = distkit.memory_stats(0)
    assert stats["allocated_mib"] >= 64 and stats["peak_allocated_mib"] >= 64
    assert stats["reserved_mib"] >= stats["allocated_mib"] and stats["total_mib"] > 0
    del block


def test_throughput_first_update_only_marks_time_and_warmup_is_left_out() -> None:
    meter = distkit.ThroughputMeter(warmup_steps=2)
    assert meter.update(8) is None  # no start(): this only marks the time
    times = [meter.update(8) for _ in range(5)]
    assert all(t is not None and t >= 0 for t in times)
    stats = meter.compute()
    assert meter.steps == 3 and stats["steps"] == 3.0 and stats["samples"] == 24.0
    assert stats["samples_per_s"] == pytest.approx(24 / sum(times[2:]))


def test_throughput_with_every_step_in_warmup_says_why_its_figures_are_nan() -> None:
    meter = distkit.ThroughputMeter(warmup_steps=10)  # more than the steps this run takes
    meter.start()
    for _ in range(3):
        meter.update(8)
    with pytest.warns(UserWarning, match=r"the 3 step\(s\) timed here were all warm-up \(warmup_steps=10\)"):
        stats = meter.compute()
    assert stats["steps"] == 0.0 and math.isnan(stats["samples_per_s"])


def test_throughput_window_keeps_the_most_recent_steps_and_reset_starts_over() -> None:
    meter = distkit.ThroughputMeter(window=2)
    meter.start()
    for samples in (1, 2, 3):
        meter.update(samples)
    assert meter.compute()["samples"] == 5.0
    meter.reset()
    assert meter.update(4) is None
    empty = meter.compute()
    assert empty["steps"] == 0.0 and empty["samples"] == 0.0
    assert empty["step_time_p50_s"] != empty["step_time_p50_s"]  # nan: nothing measured


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"window": 0}, "window"), ({"warmup_steps": -1}, "warmup_steps")]
)
def test_throughput_rejects_bad_settings(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        distkit.ThroughputMeter(**kwargs)


def test_throughput_rejects_negative_samples() -> None:
    with pytest.raises(ValueError, match="num_samples must be a number >= 0, got -1"):
        distkit.ThroughputMeter().update(-1)


def uneven_steps() -> tuple[list[float], dict[str, float]]:
    # Rank 0: 3 steps of 10 samples; rank 1: 5 steps of 20 samples, a little slower.
    rank = distkit.get_rank()
    meter = distkit.ThroughputMeter()
    meter.start()
    durations = []
    for _ in range((3, 5)[rank]):
        time.sleep(0.002 * (rank + 1))
        durations.append(meter.update((10, 20)[rank]))
    return durations, meter.compute()


def test_throughput_is_reduced_over_all_ranks_steps(ranks) -> None:
    results = ranks.run(uneven_steps, world_size=2)
    everything = torch.tensor([d for durations, _ in results for d in durations], dtype=torch.float64)
    longest = max(sum(durations) for durations, _ in results)
    p50, p90, p99 = torch.quantile(everything, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    for _, stats in results:
        assert stats["samples"] == 130.0 and stats["steps"] == 5.0
        assert stats["samples_per_s"] == pytest.approx(130 / longest)
        assert stats["samples_per_s_per_rank"] == pytest.approx(65 / longest)
        assert (
            stats["step_time_p50_s"],
            stats["step_time_p90_s"],
            stats["step_time_p99_s"],
        ) == pytest.approx((p50, p90, p99))
        assert stats["step_time_max_s"] == pytest.approx(float(everything.max()))
    assert results[0][1] == results[1][1]  # every rank gets the same numbers

"""GPU monitoring through NVML, memory statistics, and a throughput meter reduced across ranks.

:class:`GPUMonitor` samples the GPUs this process can see in a daemon thread; :func:`memory_stats`
reads the allocator and the process's resident memory; :class:`ThroughputMeter` times training steps
and reduces samples/s and step-time percentiles across ranks in one place.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from distkit import collectives, runtime
from distkit.errors import DistkitError

__all__ = ["GPUMonitor", "ThroughputMeter", "memory_stats"]

_MIB = 1024 * 1024
# NVML queries return in milliseconds; a sampling thread still busy after this is stuck in the
# driver, and waiting longer would only stall the training loop that called stop().
_STOP_TIMEOUT_S = 10.0

# "Says so once": a job that creates a monitor per epoch on a machine without NVML gets one warning
# per process, not one per epoch.
_unavailable_warned = False
_warn_lock = threading.Lock()


class _NvmlUnavailable(Exception):
    """NVML cannot be used in this process; the message says why."""


def _init_nvml() -> Any:
    """Import the NVML bindings and initialise NVML; the caller pairs it with ``nvmlShutdown``."""
    try:
        import pynvml
    except ImportError as err:
        raise _NvmlUnavailable(
            "the NVML bindings are not installed (pip install nvidia-ml-py, which provides `pynvml`)"
        ) from err
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise _NvmlUnavailable(
            f"NVML could not start ({err}); check that an NVIDIA driver is installed"
        ) from err
    return pynvml


def _text(value: str | bytes) -> str:
    # nvidia-ml-py returns str since 11.5; the deprecated `pynvml` package returned bytes.
    return value.decode() if isinstance(value, bytes) else value


def _uuid_key(uuid: str) -> str:
    # NVML spells UUIDs "GPU-<hex>" (or "MIG-<hex>"); torch spells the same device "<hex>".
    key = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _visible_handles(pynvml: Any) -> list[tuple[int, Any]]:
    """``(CUDA index in this process, NVML handle)`` for every GPU this process can see.

    NVML numbers every GPU of the machine in PCI order and ignores ``CUDA_VISIBLE_DEVICES``; CUDA
    numbers only the visible ones, in its own order. Matching by UUID is the only exact mapping.
    """
    by_uuid: dict[str, Any] = {}
    nvml_order: list[Any] = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        by_uuid[_uuid_key(_text(pynvml.nvmlDeviceGetUUID(handle)))] = handle
        nvml_order.append(handle)

    if torch.cuda.is_available():
        visible: list[tuple[int, Any]] = []
        for cuda_index in range(torch.cuda.device_count()):
            key = _uuid_key(str(torch.cuda.get_device_properties(cuda_index).uuid))
            handle = by_uuid.get(key)
            if handle is None:
                # A MIG slice is not among the enumerated physical GPUs but NVML finds it by UUID.
                try:
                    handle = pynvml.nvmlDeviceGetHandleByUUID(f"MIG-{key}")
                except pynvml.NVMLError:
                    continue
            visible.append((cuda_index, handle))
        return visible

    # torch cannot use CUDA (a CPU build on a GPU machine): apply CUDA_VISIBLE_DEVICES as CUDA
    # would. Integer entries follow NVML's PCI order, which is CUDA's order only with
    # CUDA_DEVICE_ORDER=PCI_BUS_ID; UUID entries are exact.
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(enumerate(nvml_order))
    chosen: list[Any] = []
    for entry in (part.strip() for part in raw.split(",")):
        if entry.isdigit():
            if int(entry) >= len(nvml_order):
                break  # CUDA ignores everything after the first invalid entry
            chosen.append(nvml_order[int(entry)])
            continue
        matches = [h for key, h in by_uuid.items() if entry and key.startswith(_uuid_key(entry))]
        if len(matches) != 1:
            break
        chosen.append(matches[0])
    return list(enumerate(chosen))


def _gpu_inventory() -> tuple[list[dict[str, Any]], str | None, str | None]:
    """The visible GPUs as dictionaries, the driver version, and why NVML is unusable (or None)."""
    try:
        pynvml = _init_nvml()
    except _NvmlUnavailable as err:
        return [], None, str(err)
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for cuda_index, handle in _visible_handles(pynvml):
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                {
                    "device": f"cuda:{cuda_index}",
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                    "memory_total_mib": round(memory.total / _MIB, 1),
                }
            )
        return gpus, driver, None
    except pynvml.NVMLError as err:
        return [], None, f"NVML failed while listing GPUs: {err}"
    finally:
        pynvml.nvmlShutdown()


@dataclass
class _Series:
    # Running aggregates instead of every sample: a monitor left on for a week stays O(1) in memory.
    count: int = 0
    total: float = 0.0
    peak: float = -math.inf
    last: float = math.nan

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.peak = max(self.peak, value)
        self.last = value


@dataclass
class _Gpu:
    label: str
    handle: Any
    memory_total_mib: float = math.nan
    samples: int = 0
    series: dict[str, _Series] = field(default_factory=dict)
    # Metrics this GPU does not report (NVML_ERROR_NOT_SUPPORTED, e.g. power on a MIG slice).
    unsupported: set[str] = field(default_factory=set)


class GPUMonitor:
    """Sample utilization, memory, power and temperature of this process's GPUs in the background.

    Local: no communication. Each rank monitors the GPUs it can see; reduce the summaries yourself
    (for example ``distkit.all_gather_object(monitor.summary())``) to see the whole job.

    A daemon thread reads NVML every ``interval_s`` seconds. GPUs are matched to NVML by UUID, so
    ``cuda:0`` in the summary is the device torch calls ``cuda:0`` whatever ``CUDA_VISIBLE_DEVICES``
    says. Without NVML (no driver, bindings missing) or without a visible GPU the monitor does
    nothing, starts no thread, and says so in one warning per process; :meth:`summary` then
    returns ``{}``. Aggregates are kept as running sums, so memory stays constant however long it
    runs. Its cost on a training loop is measured by ``benchmarks/bench_monitor_overhead.py``.

    Args:
        interval_s: Seconds between two samples (> 0). NVML refreshes utilization about every
            1/6 s, so intervals below 0.2 s add cost without adding information.

    Raises:
        ValueError: ``interval_s`` is not a positive number.

    Example:
        >>> import distkit
        >>> with distkit.GPUMonitor(interval_s=1.0) as monitor:
        ...     pass  # train
        >>> monitor.summary()  # {"cuda:0": {"util_pct_mean": 87.5, ...}}; {} without GPUs
        {}
    """

    #: The metrics sampled, with their units in their names.
    METRICS = ("util_pct", "mem_used_mib", "power_w", "temp_c")

    def __init__(self, interval_s: float = 1.0) -> None:
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ValueError(f"interval_s must be a number > 0, got {interval_s!r}.")
        if not math.isfinite(interval_s):
            raise ValueError(f"interval_s must be finite, got {interval_s!r}.")
        self.interval_s = float(interval_s)
        # Sampling state, shared with the thread under the lock.
        self._lock = threading.Lock()
        self._gpus: list[_Gpu] = []
        # Thread control. NVML is initialised while the thread may run and shut down after it ended.
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._pynvml: Any = None
        # Why the monitor records nothing, once start() found out.
        self._reason: str | None = None

    @property
    def available(self) -> bool:
        """True while the monitor samples at least one GPU."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def reason(self) -> str | None:
        """Why the last :meth:`start` recorded nothing (no NVML, no GPU); ``None`` otherwise."""
        return self._reason

    def start(self) -> GPUMonitor:
        """Start sampling (the first sample is taken at once); return ``self``.

        Raises:
            DistkitError: The monitor is already running.
        """
        self._start(stacklevel=3)
        return self

    def _start(self, stacklevel: int) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise DistkitError("GPUMonitor is already running; call stop() before start() again.")
        self._reason = None
        try:
            pynvml = _init_nvml()
        except _NvmlUnavailable as err:
            self._disable(str(err), stacklevel + 1)
            return
        try:
            handles = _visible_handles(pynvml)
        except pynvml.NVMLError as err:
            pynvml.nvmlShutdown()
            self._disable(f"NVML failed while listing GPUs: {err}", stacklevel + 1)
            return
        if not handles:
            pynvml.nvmlShutdown()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            self._disable(f"no GPU is visible to this process{where}", stacklevel + 1)
            return
        self._pynvml = pynvml
        with self._lock:
            known = {gpu.label: gpu for gpu in self._gpus}
            # A restart keeps the aggregates of GPUs seen before; reset() clears them.
            self._gpus = [known.get(f"cuda:{i}") or _Gpu(f"cuda:{i}", None) for i, _ in handles]
            for gpu, (_, handle) in zip(self._gpus, handles, strict=True):
                gpu.handle = handle
        self._stop_event.clear()
        self._thread = threading.Thread(target=self._loop, name="distkit-gpu-monitor", daemon=True)
        self._thread.start()

    def _disable(self, reason: str, stacklevel: int) -> None:
        global _unavailable_warned
        self._reason = reason
        with _warn_lock:
            if _unavailable_warned:
                return
            _unavailable_warned = True
        warnings.warn(
            f"GPUMonitor records nothing: {reason}. summary() will return {{}}; "
            f"this warning is shown once per process.",
            RuntimeWarning,
            stacklevel=stacklevel,
        )

    def stop(self) -> None:
        """Stop sampling and wait for the thread to end. Idempotent.

        The samples taken so far stay available through :meth:`summary`.
        """
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop_event.set()
        thread.join(_STOP_TIMEOUT_S)
        if thread.is_alive():
            # NVML must not be shut down under a thread that is still inside it; the daemon thread
            # dies with the process.
            warnings.warn(
                f"GPUMonitor's sampling thread did not stop within {_STOP_TIMEOUT_S:g} s (stuck in "
                f"an NVML call; check the driver with nvidia-smi); it is left running as a daemon.",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        if self._pynvml is not None:
            self._pynvml.nvmlShutdown()
            self._pynvml = None

    def reset(self) -> None:
        """Forget the samples taken so far (for example at the start of an epoch)."""
        with self._lock:
            for gpu in self._gpus:
                gpu.samples = 0
                gpu.series.clear()

    def _loop(self) -> None:
        while True:
            try:
                self._sample()
            except Exception as err:  # a crashed thread would print a traceback on every rank
                warnings.warn(f"GPUMonitor stopped sampling: {err!r}.", RuntimeWarning, stacklevel=1)
                return
            if self._stop_event.wait(self.interval_s):
                return

    def _read(self, gpu: _Gpu, metric: str) -> float:
        pynvml, handle = self._pynvml, gpu.handle
        if metric == "util_pct":
            return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        if metric == "mem_used_mib":
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpu.memory_total_mib = memory.total / _MIB
            return float(memory.used / _MIB)
        if metric == "power_w":
            return float(pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)  # milliwatts
        return float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))

    def _sample(self) -> None:
        error_type = self._pynvml.NVMLError
        for gpu in self._gpus:
            values: dict[str, float] = {}
            for metric in self.METRICS:
                if metric in gpu.unsupported:
                    continue
                try:
                    values[metric] = self._read(gpu, metric)
                except error_type:
                    # Not supported on this GPU (power on MIG slices, temperature on some boards):
                    # asking again every interval would only cost time.
                    gpu.unsupported.add(metric)
            with self._lock:
                if values:
                    gpu.samples += 1
                for metric, value in values.items():
                    gpu.series.setdefault(metric, _Series()).add(value)

    def summary(self) -> dict[str, dict[str, float]]:
        """Mean and max of every metric per GPU since the start (or the last :meth:`reset`).

        Returns:
            ``{"cuda:0": {"samples": 12, "util_pct_mean": 87.5, "util_pct_max": 99.0,
            "mem_used_mib_mean": ..., "mem_used_mib_max": ..., "mem_total_mib": ...,
            "power_w_mean": ..., "power_w_max": ..., "temp_c_mean": ..., "temp_c_max": ...}}``;
            metrics a GPU does not report are left out; ``{}`` when nothing was sampled.
        """
        out: dict[str, dict[str, float]] = {}
        with self._lock:
            for gpu in self._gpus:
                if gpu.samples == 0:
                    continue
                stats: dict[str, float] = {"samples": float(gpu.samples)}
                for metric in self.METRICS:
                    series = gpu.series.get(metric)
                    if series is None or series.count == 0:
                        continue
                    stats[f"{metric}_mean"] = series.total / series.count
                    stats[f"{metric}_max"] = series.peak
                    if metric == "mem_used_mib":
                        stats["mem_total_mib"] = gpu.memory_total_mib
                out[gpu.label] = stats
        return out

    def latest(self) -> dict[str, dict[str, float]]:
        """The most recent sample of every metric per GPU; ``{}`` when nothing was sampled."""
        with self._lock:
            return {
                gpu.label: {metric: series.last for metric, series in gpu.series.items()}
                for gpu in self._gpus
                if gpu.samples
            }

    def __enter__(self) -> GPUMonitor:
        self._start(stacklevel=3)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _host_memory_mib() -> tuple[float, float]:
    """Resident set size of this process and its peak so far, in MiB (``nan`` when unknown)."""
    try:
        # Linux: both numbers in one read, without psutil.
        with open("/proc/self/status", encoding="ascii") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        pass
    current = peak = math.nan
    try:
        import psutil

        info = psutil.Process().memory_info()
        current = info.rss / _MIB
        peak = getattr(info, "peak_wset", math.nan) / _MIB  # Windows only
    except ImportError:
        pass
    try:
        import resource

        # ru_maxrss is in bytes on macOS and in KiB elsewhere.
        unit = 1 if sys.platform == "darwin" else 1024
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / _MIB
    except ImportError:
        pass
    return current, peak


# What memory_stats(device=...) takes, for its errors.
_STATS_DEVICES = (
    "'cuda' (the current CUDA device), 'cuda:N' or an int N (CUDA device N), 'cpu' (this process's "
    "memory only), a torch.device, or None (this rank's device)"
)


def _stats_device(device: object) -> torch.device:
    """``device`` as a ``torch.device``; the error names the argument, not torch's list of every
    device type it knows."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise TypeError(
            f"memory_stats(): device must be {_STATS_DEVICES}, got {type(device).__name__} {device!r}."
        )
    try:
        return torch.device(device)
    except RuntimeError:
        meant = ""
        if isinstance(device, str) and device.strip().lower().startswith("gpu"):
            meant = f" (did you mean {'cuda' + device.strip()[3:]!r}?)"
        raise ValueError(f"memory_stats(): device must be {_STATS_DEVICES}, got {device!r}{meant}.") from None


def memory_stats(device: str | int | torch.device | None = None) -> dict[str, float]:
    """Memory of one device and of this process, in MiB.

    Local: no communication. The keys are the same on every rank of a job, so
    ``distkit.reduce_metrics(distkit.memory_stats(), op="max")`` gives the job's worst rank.

    For a CUDA device: ``allocated_mib`` and ``reserved_mib`` (by torch's caching allocator),
    their peaks ``peak_allocated_mib`` and ``peak_reserved_mib`` (reset them with
    ``torch.cuda.reset_peak_memory_stats``), and ``total_mib``. Always: the process's resident set
    ``rss_mib`` and its high-water mark ``peak_rss_mib`` (``nan`` where the platform cannot tell).

    Args:
        device: The device to report; ``None`` is this rank's device (:func:`distkit.get_device`),
            an ``int`` is a CUDA index.

    Returns:
        Names to MiB.

    Raises:
        DistkitError: A CUDA device was asked for on a machine without CUDA.
        ValueError: ``device`` is a string torch does not read as a device (``"gpu"``), or a
            negative index.
        TypeError: ``device`` is neither a string, an int, a ``torch.device`` nor ``None``.

    Example:
        >>> import distkit
        >>> sorted(distkit.memory_stats("cpu"))
        ['peak_rss_mib', 'rss_mib']
    """
    dev = runtime.get_device() if device is None else _stats_device(device)
    stats: dict[str, float] = {}
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DistkitError(
                f"memory_stats({str(dev)!r}): CUDA is not available on this machine; "
                f"pass device='cpu' or None."
            )
        index = torch.cuda.current_device() if dev.index is None else dev.index
        stats["allocated_mib"] = torch.cuda.memory_allocated(index) / _MIB
        stats["reserved_mib"] = torch.cuda.memory_reserved(index) / _MIB
        stats["peak_allocated_mib"] = torch.cuda.max_memory_allocated(index) / _MIB
        stats["peak_reserved_mib"] = torch.cuda.max_memory_reserved(index) / _MIB
        stats["total_mib"] = torch.cuda.get_device_properties(index).total_memory / _MIB
    rss, peak = _host_memory_mib()
    stats["rss_mib"] = rss
    stats["peak_rss_mib"] = peak
    return stats


class ThroughputMeter:
    """Time training steps and report samples/s and step-time percentiles for the whole job.

    :meth:`update` is local and costs one clock read; :meth:`compute` is collective and gathers every
    rank's step times in one gather, so the percentiles are over all ranks' steps and samples/s is
    the job's total. A step's time runs from one :meth:`update` (or :meth:`start`) to the next, so
    the first :meth:`update` after construction or :meth:`reset` only marks the time unless
    :meth:`start` was called before the step.

    CUDA runs asynchronously: without ``synchronize=True`` a step's time is when the CPU got
    through it, which matches the GPU over many steps only if something in the loop waits for the
    GPU (``loss.item()``, a metric). ``synchronize=True`` waits for the device at every update,
    which is exact but stops the CPU from running ahead.

    Args:
        window: How many recent steps each rank keeps (>= 1); :meth:`compute` reports over them.
        warmup_steps: Steps to leave out after construction (compilation, allocator warm-up).
        synchronize: Wait for this rank's CUDA device before reading the clock.

    Raises:
        ValueError: ``window`` < 1 or ``warmup_steps`` < 0.

    Example:
        >>> import distkit
        >>> meter = distkit.ThroughputMeter(warmup_steps=0)
        >>> meter.start()
        >>> for _ in range(3):
        ...     _ = meter.update(32)  # after each training step
        >>> stats = meter.compute()  # collective: every rank calls it
        >>> stats["samples"], stats["steps"]
        (96.0, 3.0)
    """

    def __init__(self, *, window: int = 1000, warmup_steps: int = 0, synchronize: bool = False) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}.")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}.")
        self.window = window
        self.warmup_steps = warmup_steps
        self.synchronize = synchronize
        # (step seconds, samples) of the most recent steps, and the clock at the last mark.
        self._steps: deque[tuple[float, float]] = deque(maxlen=window)
        self._last: float | None = None
        self._warmup_left = warmup_steps

    def _now(self) -> float:
        if self.synchronize and torch.cuda.is_available():
            device = runtime.get_device()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return time.perf_counter()

    def start(self) -> None:
        """Mark the beginning of the next step. Local."""
        self._last = self._now()

    def update(self, num_samples: int | float) -> float | None:
        """Record the end of a step that processed ``num_samples`` samples (or tokens). Local.

        Returns:
            The step's time in seconds, or ``None`` when this call only marked the start.

        Raises:
            ValueError: ``num_samples`` is negative or not a number.
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, (int, float)) or num_samples < 0:
            raise ValueError(f"num_samples must be a number >= 0, got {num_samples!r}.")
        now = self._now()
        last, self._last = self._last, now
        if last is None:
            return None
        step_s = now - last
        if self._warmup_left > 0:
            self._warmup_left -= 1
        else:
            self._steps.append((step_s, float(num_samples)))
        return step_s

    def reset(self) -> None:
        """Forget the recorded steps and the start mark (warm-up is not repeated). Local."""
        self._steps.clear()
        self._last = None

    @property
    def steps(self) -> int:
        """Steps this rank holds for :meth:`compute`."""
        return len(self._steps)

    def compute(self) -> dict[str, float]:
        """Reduce the recorded steps of every rank.

        Collective: call on every rank (ranks may hold different numbers of steps). Without a
        process group it reports this process alone.

        Returns:
            ``samples_per_s`` (all ranks' samples over the longest rank's measured time),
            ``samples_per_s_per_rank``, ``step_time_mean_s``, ``step_time_p50_s``,
            ``step_time_p90_s``, ``step_time_p99_s``, ``step_time_max_s`` (over every rank's steps),
            ``steps`` (the most any rank recorded) and ``samples`` (all ranks). Times are ``nan``
            when no step was recorded.
        """
        local = torch.tensor(list(self._steps), dtype=torch.float64).reshape(-1, 2)
        per_rank = collectives.all_gather(local)
        everything = torch.cat(per_rank)
        world_size = len(per_rank)
        samples = float(everything[:, 1].sum())
        longest = max(float(part[:, 0].sum()) for part in per_rank)
        steps = float(max(part.shape[0] for part in per_rank))
        if everything.shape[0] == 0:
            if self._warmup_left < self.warmup_steps:  # steps were timed, but all as warm-up
                warnings.warn(
                    f"ThroughputMeter.compute(): no step measured on any rank: the "
                    f"{self.warmup_steps - self._warmup_left} step(s) timed here were all warm-up "
                    f"(warmup_steps={self.warmup_steps}), so every figure is nan. Lower warmup_steps "
                    f"below the number of steps, or call compute() later.",
                    stacklevel=2,
                )
            nan = math.nan
            return {
                "samples_per_s": nan,
                "samples_per_s_per_rank": nan,
                "step_time_mean_s": nan,
                "step_time_p50_s": nan,
                "step_time_p90_s": nan,
                "step_time_p99_s": nan,
                "step_time_max_s": nan,
                "steps": 0.0,
                "samples": 0.0,
            }
        times = everything[:, 0]
        p50, p90, p99 = torch.quantile(times, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
        rate = samples / longest if longest > 0 else math.nan
        return {
            "samples_per_s": rate,
            "samples_per_s_per_rank": rate / world_size,
            "step_time_mean_s": float(times.mean()),
            "step_time_p50_s": p50,
            "step_time_p90_s": p90,
            "step_time_p99_s": p99,
            "step_time_max_s": float(times.max()),
            "steps": steps,
            "samples": samples,
        }

"""What GPUMonitor's sampling thread costs a training loop, against the same loop without it.

Run by hand (not in CI):  .venv/bin/python benchmarks/bench_monitor_overhead.py [--blocks 20]

The loop trains the ``small`` preset (400 K parameters, batch 64) in this process. Variants run
interleaved block by block, so drifts in machine load hit all of them alike:

* ``none``: no monitor.
* ``GPUMonitor(1 s)``: the real monitor. Without NVML (a machine with no NVIDIA driver) it starts
  no thread, so this row shows the cost of the no-op path.
* ``simulated N GPUs, interval I``: the real monitor and its thread, driven by a stand-in NVML whose
  every query busy-waits ``--query-us`` while holding the GIL. Real NVML queries go through ctypes,
  which releases the GIL, so this is an upper bound on what the thread takes from the loop.

Prints the median step time of each variant and its overhead against ``none``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
import warnings

import torch

import distkit
from distkit.bench.workloads import load_workload


class _SlowNvml(types.ModuleType):
    """NVML with ``gpus`` devices whose queries each hold the GIL for ``query_us`` microseconds."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self, gpus: int, query_us: float) -> None:
        super().__init__("pynvml")
        self.gpus = gpus
        self.query_s = query_us / 1e6

    def _spin(self) -> None:
        end = time.perf_counter() + self.query_s
        while time.perf_counter() < end:
            pass

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-{handle:08x}"

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> types.SimpleNamespace:
        self._spin()
        return types.SimpleNamespace(gpu=90)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> types.SimpleNamespace:
        self._spin()
        return types.SimpleNamespace(used=2**30, total=2**34)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        self._spin()
        return 300_000

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        self._spin()
        return 65


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20, help="interleaved blocks per variant")
    parser.add_argument("--steps", type=int, default=50, help="training steps per block")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the simulated driver")
    parser.add_argument("--query-us", type=float, default=100.0, help="cost of one simulated NVML query")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training loop")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    workload = load_workload("small")
    model = workload.model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = workload.make_batch(64)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        workload.loss(batch).backward()
        optimizer.step()

    real_pynvml = sys.modules.get("pynvml")
    slow = _SlowNvml(args.gpus, args.query_us)

    def with_driver(driver: types.ModuleType | None, interval_s: float | None) -> distkit.GPUMonitor | None:
        if interval_s is None:
            return None
        if driver is None:
            sys.modules.pop("pynvml", None)
            if real_pynvml is not None:
                sys.modules["pynvml"] = real_pynvml
        else:
            sys.modules["pynvml"] = driver
        return distkit.GPUMonitor(interval_s=interval_s)

    variants: list[tuple[str, types.ModuleType | None, float | None]] = [
        ("none", None, None),
        ("GPUMonitor(1 s), this machine", None, 1.0),
        (f"simulated {args.gpus} GPUs, interval 1 s", slow, 1.0),
        (f"simulated {args.gpus} GPUs, interval 0.1 s", slow, 0.1),
        (f"simulated {args.gpus} GPUs, interval 0.01 s", slow, 0.01),
    ]
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for _ in range(5):
        step()
    warnings.simplefilter("ignore", RuntimeWarning)  # the no-NVML notice, once
    for _ in range(args.blocks):
        for name, driver, interval in variants:
            mon = with_driver(driver, interval)
            if mon is not None:
                mon.start()
            block = []
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                block.append(time.perf_counter() - start)
            if mon is not None:
                mon.stop()
            times[name].append(statistics.median(block))

    base = statistics.median(times["none"])
    print(f"GPUMonitor overhead on a training step (small MLP, batch 64, {args.threads} thread(s)), "
          f"{args.blocks} blocks x {args.steps} steps, simulated query {args.query_us:g} us")  # fmt: skip
    print(f"{'variant':<40} {'step ms':>9} {'overhead':>9}")
    for name, _, _ in variants:
        value = statistics.median(times[name])
        print(f"{name:<40} {value * 1e3:>9.3f} {value / base - 1:>+9.1%}")


if __name__ == "__main__":
    main()

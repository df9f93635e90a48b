"""Checkpoint costs for a ~200 MB model + optimizer state, against hand-written code in the same run.

Run by hand (not in CI):  .venv/bin/python benchmarks/bench_checkpoint.py [--repeats 7] [--dir DIR]

One process, no process group (rank 0's work in a real job). Each round runs every way once, the
ways compared with each other in an order rotated every round, so drifts in machine load,
page-cache writeback and memory reuse hit all of them alike. Prints medians and:

- save throughput: ``distkit.save_checkpoint`` (serialize, CRC32, fsync, manifest, atomic rename,
  directory fsyncs) against writing the same bytes with ``open/write/fsync`` (target >= 80 %), with
  a plain ``torch.save(path)`` + fsync beside it for reference;
- async stall: what ``CheckpointManager(async_save=True).save()`` blocks the loop for, against
  cloning the same tensors to CPU memory by hand (target <= 1.2x);
- load: ``distkit.load_checkpoint`` (checksum, then ``weights_only`` load) against
  ``torch.load(weights_only=True)`` of the same file.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import distkit


def build_state() -> dict[str, Any]:
    # 4 x (2048 x 2048 + 2048) parameters = 16.8 M floats: 67 MB of weights + 134 MB of Adam moments.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 2048)).square().mean().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "step": 1}


def clone_by_hand(state: dict[str, Any]) -> dict[str, Any]:
    # The least a background writer must copy before the loop may change the weights again.
    def clone(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, dict):
            return {k: clone(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clone(v) for v in value]
        return value

    return {"model": clone(state["model"].state_dict()), "optimizer": clone(state["optimizer"].state_dict())}


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    del result  # freeing a 200 MB result (munmap) is not part of the work being measured
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="rounds; each runs every way once")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="distkit-bench-ckpt-", dir=args.dir)
    try:
        run(root, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(root: str, repeats: int) -> None:
    state = build_state()
    reference = distkit.save_checkpoint(os.path.join(root, "reference"), state)
    with open(os.path.join(reference, "state.pt"), "rb") as f:
        data = f.read()  # the exact bytes distkit writes, for the plain-write baseline
    manager = distkit.CheckpointManager(os.path.join(root, "managed"), keep_last=1, async_save=True)
    names = (
        "raw write",
        "torch.save",
        "save_checkpoint",
        "cpu copy",
        "async stall",
        "torch.load",
        "load_checkpoint",
    )
    times: dict[str, list[float]] = {name: [] for name in names}

    def raw_write(path: str) -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def torch_save(path: str) -> None:
        torch.save({"model": state["model"].state_dict(), "optimizer": state["optimizer"].state_dict()}, path)
        fsync_path(path)

    def async_stall(step: int) -> float:
        stall = timed(functools.partial(manager.save, step, state))
        manager.wait()  # the write itself is not part of the stall
        return stall

    state_file = os.path.join(reference, "state.pt")
    for i in range(repeats):
        paths = {name: os.path.join(root, f"{name}_{i}") for name in ("raw", "torch", "ckpt")}
        groups = [
            [
                ("raw write", functools.partial(timed, functools.partial(raw_write, paths["raw"]))),
                ("torch.save", functools.partial(timed, functools.partial(torch_save, paths["torch"]))),
                (
                    "save_checkpoint",
                    functools.partial(
                        timed, functools.partial(distkit.save_checkpoint, paths["ckpt"], state)
                    ),
                ),
            ],
            [
                ("cpu copy", functools.partial(timed, functools.partial(clone_by_hand, state))),
                ("async stall", functools.partial(async_stall, i)),
            ],
            [
                (
                    "torch.load",
                    functools.partial(timed, functools.partial(torch.load, state_file, weights_only=True)),
                ),
                (
                    "load_checkpoint",
                    functools.partial(timed, functools.partial(distkit.load_checkpoint, reference)),
                ),
            ],
        ]
        # Each group is rotated every round: whoever runs first pays for page-cache writeback, file
        # deletions and fresh memory (page faults) that the next one may be spared.
        for group in groups:
            shift = i % len(group)
            for name, measure in group[shift:] + group[:shift]:
                times[name].append(measure())
        for path in paths.values():
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)

    med = {name: statistics.median(values) for name, values in times.items()}
    mb = len(data) / 1e6
    rows = [
        ("raw write", "open/write/fsync of the same bytes"),
        ("torch.save", "torch.save(path) + fsync"),
        ("save_checkpoint", "serialize + CRC32 + fsync + manifest + rename"),
        ("cpu copy", "hand-written clone of every tensor"),
        ("async stall", "CheckpointManager(async_save=True).save()"),
        ("torch.load", "torch.load(weights_only=True)"),
        ("load_checkpoint", "CRC32 check, then weights_only load"),
    ]
    print(f"checkpoint of {mb:.0f} MB (model + Adam state), {repeats} interleaved rounds, medians:")
    for name, what in rows:
        print(f"  {name:<16} {med[name] * 1e3:8.1f} ms  {mb / med[name]:6.0f} MB/s   {what}")
    ratios = [
        (
            "save_checkpoint throughput / raw write",
            med["raw write"] / med["save_checkpoint"],
            "target >= 0.80",
        ),
        ("torch.save throughput / raw write", med["raw write"] / med["torch.save"], ""),
        ("async stall / cpu copy", med["async stall"] / med["cpu copy"], "target <= 1.20"),
        ("load_checkpoint / torch.load", med["load_checkpoint"] / med["torch.load"], ""),
    ]
    for name, ratio, target in ratios:
        print(f"{name:<40} {ratio:5.2f}  {target}")


if __name__ == "__main__":
    main()

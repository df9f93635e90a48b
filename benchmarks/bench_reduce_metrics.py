"""reduce_metrics (one collective) against one all_reduce per metric, gloo, 2 ranks on this machine.

Run by hand (not in CI):  .venv/bin/python benchmarks/bench_reduce_metrics.py [--iters 300]

Both ways are timed in the same processes, interleaved block by block, so drifts in machine speed hit
both alike. Prints the median latency per call and the ratio (separate / distkit) for each K.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KS = (1, 8, 32, 128)


def _separate(metrics: dict[str, float]) -> dict[str, float]:
    # What users write today: one all_reduce per metric, then divide (gloo has no AVG).
    out = {}
    for key, value in metrics.items():
        t = torch.tensor(value, dtype=torch.float64)
        dist.all_reduce(t)
        out[key] = t.item() / dist.get_world_size()
    return out


def _worker(rank: int, port: int, iters: int, blocks: int, queue: mp.Queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import distkit

    distkit.init(backend="gloo")
    results: dict[int, dict[str, list[float]]] = {k: {"distkit": [], "separate": []} for k in KS}
    for k in KS:
        metrics = {f"metric_{i}": float(rank + i) for i in range(k)}
        assert distkit.reduce_metrics(metrics) == _separate(metrics)  # same numbers first
        for _ in range(blocks):
            for name, fn in (("distkit", distkit.reduce_metrics), ("separate", _separate)):
                distkit.barrier()
                for _ in range(iters // blocks):
                    start = time.perf_counter()
                    fn(metrics)
                    results[k][name].append(time.perf_counter() - start)
    if rank == 0:
        queue.put(results)
    distkit.barrier()
    distkit.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300, help="calls per way and K")
    parser.add_argument("--blocks", type=int, default=10, help="interleaved blocks per way and K")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(_worker, args=(port, args.iters, args.blocks, queue), nprocs=2, join=True)
    results = queue.get(timeout=10)
    print(f"reduce_metrics vs one all_reduce per metric (gloo, 2 ranks, {args.iters} calls each)")
    print(f"{'K':>5} {'distkit ms':>11} {'separate ms':>12} {'separate/distkit':>17}")
    for k in KS:
        ours = statistics.median(results[k]["distkit"]) * 1e3
        theirs = statistics.median(results[k]["separate"]) * 1e3
        print(f"{k:>5} {ours:>11.3f} {theirs:>12.3f} {theirs / ours:>16.1f}x")


if __name__ == "__main__":
    main()

"""Per-rank memory and step time of FSDP (torch's FSDP2 through distkit.shard_model) against DDP, gloo.

Run by hand (not in CI):  .venv/bin/python benchmarks/bench_fsdp_memory.py [--ranks 2 4] [--blocks 5]

The model: a stack of residual MLP blocks (width 512, 8 blocks: 8.4 M parameters, 32 MiB in
float32), AdamW, batch 32 per rank. Each FSDP block is a sharding unit.

Memory, per rank, for each strategy and world size, each in newly started processes (so the peak
RSS of one configuration is not the other's): bytes of the parameters, of the gradients after a
backward pass and of the optimizer state, counted from the tensors this rank holds (its local
shards under FSDP, ``DTensor.to_local()``), and how far the process's peak resident set size
(``ru_maxrss``) rose above its level before the model was made, after 5 steps: the model, its
gradients, the optimizer state, activations, DDP's buckets or FSDP's all-gather and reduce-scatter
buffers, and whatever the allocator keeps. Both strategies import the same modules (FSDP, DTensor)
before the baseline is taken. The goal for the sharded parts is FSDP = DDP / N. Every rank first
builds the whole model (FSDP shards it after), so the RSS growth includes one full copy.

Step time: DDP and FSDP run in the same processes, in alternating blocks (reversing the order every
block so that drifts in machine speed hit both alike); a block times 10 steps after 2 untimed ones.
The ratio FSDP / DDP of the two block medians is taken per block; the median over blocks is printed
with its spread (lowest and highest block). On a 2-core machine 4 ranks oversubscribe the cores:
absolute times there measure the machine, the ratio is what carries over.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any

import torch
from torch import nn

import distkit
from distkit.testing import run_ranks

WIDTH, DEPTH, BATCH = 512, 8, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(DEPTH)))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _build(strategy: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model: nn.Module = Model()
    if strategy == "fsdp":
        model = distkit.shard_model(model, unit_classes=Block)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bytes(tensors: Any) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def memory(strategy: str) -> dict[str, float]:
    """One rank's bytes of parameters, gradients and optimizer state, and its peak RSS growth (MiB)."""
    # The same modules in both strategies' baseline.
    import torch.distributed.fsdp
    import torch.distributed.tensor

    baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    model, optimizer = _build(strategy)
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
    for _ in range(4):
        _step(model, optimizer, x, y)
    nn.functional.cross_entropy(model(x), y).backward()
    grads = _bytes(p.grad for p in model.parameters() if p.grad is not None)
    optimizer.step()
    state = _bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    optimizer.zero_grad(set_to_none=True)
    mib = 1024 * 1024
    return {
        "params_mib": _bytes(model.parameters()) / mib,
        "grads_mib": grads / mib,
        "optimizer_mib": state / mib,
        "rss_growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline_kib) / 1024,
    }


def step_times(blocks: int, steps: int) -> list[float]:
    """Per block: the ratio FSDP / DDP of the median step times (every rank returns the same)."""
    built = {name: _build(name) for name in ("ddp", "fsdp")}
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
    ratios = []
    for block in range(blocks):
        order = ("ddp", "fsdp") if block % 2 == 0 else ("fsdp", "ddp")
        medians = {}
        for name in order:
            model, optimizer = built[name]
            for _ in range(2):
                _step(model, optimizer, x, y)
            times = []
            for _ in range(steps):
                distkit.barrier()
                start = time.perf_counter()
                _step(model, optimizer, x, y)
                times.append(time.perf_counter() - start)
            # The slowest rank sets the pace of a synchronous job.
            medians[name] = float(distkit.all_reduce(torch.tensor(statistics.median(times)), op="max"))
        ratios.append(medians["fsdp"] / medians["ddp"])
    return ratios


def main() -> None:
    # Host memory over gloo: on a machine with GPUs the ranks would put the sharded model on
    # cuda:0 (distkit's device) while the batches stay on the CPU.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    params = sum(p.numel() for p in Model().parameters())
    print(f"model: {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.1f} MiB fp32), AdamW, batch {BATCH}")
    print()
    print(
        "| ranks | strategy | params MiB/rank | grads MiB/rank | optimizer MiB/rank | peak RSS growth MiB |"
    )
    print("|---|---|---|---|---|---|")
    for world_size in args.ranks:
        for strategy in ("ddp", "fsdp"):
            results = run_ranks(memory, strategy, world_size=world_size, fresh=True, timeout_s=600)
            r = results[0]
            rss = max(result["rss_growth_mib"] for result in results)
            print(
                f"| {world_size} | {strategy.upper()} | {r['params_mib']:.2f} | {r['grads_mib']:.2f} | "
                f"{r['optimizer_mib']:.2f} | {rss:.0f} |"
            )
    print()
    print("| ranks | step time FSDP / DDP: median over blocks | lowest | highest | blocks |")
    print("|---|---|---|---|---|")
    for world_size in args.ranks:
        ratios = run_ranks(
            step_times, args.blocks, args.steps, world_size=world_size, fresh=True, timeout_s=600
        )[0]
        print(
            f"| {world_size} | {statistics.median(ratios):.2f} | {min(ratios):.2f} | {max(ratios):.2f} | "
            f"{len(ratios)} |"
        )


if __name__ == "__main__":
    main()

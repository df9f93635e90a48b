"""What the hang doctor costs a training step: its watchdog on against off, gloo, 2 CPU ranks.

Run by hand (not in CI):  .venv/bin/python benchmarks/bench_hang_doctor.py [--blocks 30] [--hang 20]

Three comparisons, each interleaved block by block in the same two processes (the order reversed
every block, so drifts in machine speed hit every arm alike), each with an A/A pair that shows the
noise of the comparison itself:

1. The tiny-MLP DDP step of FACTS.md (32->64->10, batch 32, Adam; about 2.2 ms here), hand-written,
   with the watchdog off and on (``hang_timeout_s=--hang``: it samples the main thread every
   min(2 s, hang/10)). Arms: off A, off B, on A, on B.
2. The same model under ``Trainer.fit`` with ``hang_timeout_s=None`` and ``"auto"`` (the default).
3. The collective under ``reduce_metrics``: a 265-element float64 all-reduce on distkit's gloo group,
   blocking (as before the doctor) against ``async_op=True`` + distkit's bounded first wait (now).

Each block gives one median per arm; a ratio is taken between arms of the same block, and the
median and quartiles of those ratios over blocks are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

_SKIP = 3  # steps at the start of a block that carry set-up (iterator, DDP's bucket rebuild)


def _loader(steps: int, rank: int) -> DataLoader:  # type: ignore[type-arg]
    n = 2 * 32 * (steps + 2)
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(n, 32, generator=generator), torch.randint(0, 10, (n,)))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=32, sampler=sampler)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def _steps_of(stamps: list[float]) -> float:
    steady = stamps[_SKIP:]
    return statistics.median(b - a for a, b in itertools.pairwise(steady))


def _hand_block(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader) -> float:  # type: ignore[type-arg]
    criterion = nn.CrossEntropyLoss()
    stamps = []
    for data, target in loader:
        optimizer.zero_grad()
        loss = criterion(model(data), target)
        loss.backward()
        optimizer.step()
        loss.item()
        stamps.append(time.perf_counter())
    return _steps_of(stamps)


def _trainer_block(hang: object, loader: DataLoader, root: str) -> float:  # type: ignore[type-arg]
    from distkit.trainer import Callback, Trainer

    class Stamps(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
            self.stamps.append(time.perf_counter())

    stamps = Stamps()
    model = _model()
    trainer = Trainer(
        strategy="ddp",
        max_steps=len(loader),
        batch_size=32,
        default_root_dir=root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        logger=False,
        callbacks=[stamps],
        hang_timeout_s=hang,  # type: ignore[arg-type]
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(
            model, loader, optimizer=torch.optim.Adam(model.parameters(), 1e-3), loss_fn=nn.CrossEntropyLoss()
        )
    return _steps_of(stamps.stamps)


def _collective_block(way: str, group: object, calls: int) -> float:
    from distkit.collectives import _wait

    buffer = torch.zeros(265, dtype=torch.float64)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        if way.startswith("blocking"):
            dist.all_reduce(buffer, group=group)
        else:
            _wait(dist.all_reduce(buffer, group=group, async_op=True), "reduce_metrics")
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleave(arms: list[str], blocks: int, run: object) -> dict[str, list[float]]:
    import distkit

    out: dict[str, list[float]] = {arm: [] for arm in arms}
    for block in range(blocks + 1):
        for arm in arms if block % 2 == 0 else list(reversed(arms)):
            distkit.barrier()
            value = run(arm)  # type: ignore[operator]
            if block:  # block 0 warms every arm up
                out[arm].append(value)
    return out


def _worker(rank: int, port: int, blocks: int, hang: float, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("DISTKIT_HANG_TIMEOUT_S", None)
    torch.set_num_threads(1)  # as torchrun would: 2 ranks on 2 cores
    import distkit
    from distkit import runtime

    distkit.init(backend="gloo")
    doctor = runtime._runtime.doctor  # type: ignore[union-attr]
    assert doctor is not None
    results: dict[str, dict[str, list[float]]] = {}

    loader = _loader(200, rank)
    models = {arm: DDP(_model()) for arm in ("off A", "off B", "on A", "on B")}
    optimizers = {arm: torch.optim.Adam(m.parameters(), lr=1e-3) for arm, m in models.items()}

    def hand(arm: str) -> float:
        doctor.configure(hang if arm.startswith("on") else None)
        try:
            return _hand_block(models[arm], optimizers[arm], loader)
        finally:
            doctor.configure(None)

    results["hand-written DDP step"] = _interleave(list(models), blocks, hand)

    with tempfile.TemporaryDirectory() as root:
        trainer_loader = _loader(100, rank)
        trainer_arms = {"Trainer off A": None, "Trainer off B": None, "Trainer auto": "auto"}
        results["Trainer step"] = _interleave(
            list(trainer_arms),
            max(4, blocks // 2),
            lambda arm: _trainer_block(trainer_arms[arm], trainer_loader, root),
        )

    # One watchdog sample, taken here while the main thread runs (its frames are this stack).
    sample_s = []
    for _ in range(2000):
        start = time.perf_counter()
        doctor.sample()
        sample_s.append(time.perf_counter() - start)
    results["one watchdog sample"] = {"sample": [statistics.median(sample_s)]}

    group = runtime._cpu_group()
    results["reduce_metrics' all-reduce"] = _interleave(
        ["blocking A", "blocking B", "async + bounded wait"],
        blocks,
        lambda arm: _collective_block(arm, group, 200),
    )
    if rank == 0:
        queue.put(results)
    distkit.barrier()
    distkit.shutdown()


def _ratios(a: list[float], b: list[float]) -> str:
    ratios = sorted(x / y for x, y in zip(a, b, strict=True))
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return f"{median:.4f} (quartiles {q1:.4f}-{q3:.4f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=30, help="timed blocks per arm")
    parser.add_argument("--hang", type=float, default=20.0, help="hang_timeout_s of the 'on' arms")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(rank, port, args.blocks, args.hang, queue)) for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    results = queue.get(timeout=3600)
    for proc in procs:
        proc.join(timeout=60)
    period = min(2.0, max(0.1, args.hang / 10))
    sample = results.pop("one watchdog sample")["sample"][0]
    print(
        f"rank 0, gloo, 2 CPU ranks; watchdog on: hang_timeout_s={args.hang:g}, a sample every {period:g} s"
    )
    for name, arms in results.items():
        print(f"\n{name}: medians over {len(next(iter(arms.values())))} blocks of the per-block median")
        for arm, values in arms.items():
            print(f"  {arm:24s} {statistics.median(values) * 1e3:8.4f} ms")
    print(
        f"\none watchdog sample: {sample * 1e6:.1f} us, {sample / period * 100:.4f} % of one core at one "
        f"sample every {period:g} s"
    )
    hand = results["hand-written DDP step"]
    trainer = results["Trainer step"]
    collective = results["reduce_metrics' all-reduce"]
    rows = [
        ("hand-written on A / off A", hand["on A"], hand["off A"], ""),
        ("hand-written on B / off B", hand["on B"], hand["off B"], ""),
        ("hand-written off B / off A", hand["off B"], hand["off A"], "(A/A)"),
        ("hand-written on B / on A", hand["on B"], hand["on A"], "(A/A)"),
        ("Trainer auto / off A", trainer["Trainer auto"], trainer["Trainer off A"], ""),
        ("Trainer off B / off A", trainer["Trainer off B"], trainer["Trainer off A"], "(A/A)"),
        ("all-reduce async / blocking A", collective["async + bounded wait"], collective["blocking A"], ""),
        ("all-reduce blocking B / A", collective["blocking B"], collective["blocking A"], "(A/A)"),
    ]
    print("\nratios of arms in the same block: median (quartiles)")
    for label, a, b, note in rows:
        print(f"  {label:32s} {_ratios(a, b)} {note}")


if __name__ == "__main__":
    main()

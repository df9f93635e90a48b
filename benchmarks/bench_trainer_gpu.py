"""Per-step time of distkit.Trainer against hand-written loops on one CUDA GPU.

Run by hand where a GPU is (not in CI):  python benchmarks/bench_trainer_gpu.py [--blocks 20]

Why: every step the Trainer reads the loss and one gradient element on the host (the non-finite
check and the logged loss), which waits for the GPU to finish the step. A hand-written loop that
never reads anything lets the host queue the next steps while the GPU works. This measures what
that costs, per model size, against two hand-written loops in the same process:

- "hand, no sync": zero_grad, forward, loss, backward, step; the host never waits for the GPU;
- "hand, loss.item()": the same plus ``loss.item()`` every step (seed 002's loop, and what most
  training scripts do to print the loss);
- "Trainer": ``Trainer(strategy="single")`` on the same DataLoader, with its defaults (CSV logs every
  50 steps) except checkpointing and the progress bar;
- "hand, no sync (A/A)": the first loop again, as the run's own noise floor.

All four read the same pinned-memory DataLoader and copy each batch with ``non_blocking=True``. The
loops run block by block, the order reversed every block; a block times its steps after the first
three, between two ``torch.cuda.synchronize()`` calls, so queued GPU work is counted. The headline
ratio is the median over blocks of (loop's block time / "hand, no sync" block time in the same
block), with the lowest and highest block ratios as the spread.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

_SKIP = 3  # steps at the start of every block that are not timed


def _mlp(*widths: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1])

    return build


# name: (model factory, input features, batch size, timed steps per block)
MODELS: dict[str, tuple[Callable[[], nn.Module], int, int, int]] = {
    "tiny MLP (2.7 K params, batch 32)": (_mlp(32, 64, 10), 32, 32, 600),
    "medium MLP (1.6 M params, batch 128)": (_mlp(256, 1024, 1024, 256, 10), 256, 128, 600),
    "large MLP (101 M params, batch 512)": (
        _mlp(2048, 4096, 4096, 4096, 4096, 4096, 4096, 10),
        2048,
        512,
        200,
    ),
}

LOOPS = ("hand, no sync", "hand, loss.item()", "Trainer", "hand, no sync (A/A)")


def _loader(features: int, batch_size: int, steps: int) -> DataLoader:  # type: ignore[type-arg]
    n = batch_size * (steps + _SKIP + 2)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, features, generator=g), torch.randint(0, 10, (n,), generator=g))
    return DataLoader(data, batch_size=batch_size, shuffle=True, pin_memory=True, drop_last=True)


def _hand_block(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, item: bool) -> float:  # type: ignore[type-arg]
    criterion = nn.CrossEntropyLoss()
    device = torch.device("cuda")
    start = 0.0
    for i, (data, target) in enumerate(loader):
        if i == _SKIP:
            torch.cuda.synchronize()
            start = time.perf_counter()
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        optimizer.zero_grad()
        loss = criterion(model(data), target)
        loss.backward()
        optimizer.step()
        if item:
            loss.item()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _trainer_block(
    model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, root: str
) -> float:  # type: ignore[type-arg]
    from distkit.trainer import Callback, Trainer

    class Clock(Callback):
        def __init__(self) -> None:
            self.steps = 0
            self.start = 0.0

        def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
            self.steps += 1
            if self.steps == _SKIP:  # after the step before the hand loops' first timed one
                torch.cuda.synchronize()
                self.start = time.perf_counter()

    clock = Clock()
    trainer = Trainer(
        strategy="single",
        max_steps=len(loader),
        batch_size=loader.batch_size or 1,
        default_root_dir=root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[clock],
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the start-up report, once per block
        trainer.fit(model, loader, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())
    torch.cuda.synchronize()
    return time.perf_counter() - clock.start


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20, help="timed blocks per loop and model")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_trainer_gpu.py needs a CUDA GPU; benchmarks/bench_trainer.py is the CPU one.")
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.blocks} blocks per loop")
    with tempfile.TemporaryDirectory() as root:
        for name, (factory, features, batch_size, steps) in MODELS.items():
            loader = _loader(features, batch_size, steps)
            models = {}
            for way in LOOPS:
                torch.manual_seed(0)
                models[way] = factory().cuda()
            optimizers = {way: torch.optim.Adam(models[way].parameters(), lr=1e-4) for way in LOOPS}
            times: dict[str, list[float]] = {way: [] for way in LOOPS}
            for block in range(args.blocks + 1):
                for way in LOOPS if block % 2 == 0 else reversed(LOOPS):
                    model, optimizer = models[way], optimizers[way]
                    if way == "Trainer":
                        seconds = _trainer_block(model, optimizer, loader, root)
                    else:
                        seconds = _hand_block(model, optimizer, loader, item=way == "hand, loss.item()")
                    if block:  # block 0 warms every loop up (allocator, cuBLAS handles, imports)
                        times[way].append(seconds / (len(loader) - _SKIP))
            base = times[LOOPS[0]]
            print(f"\n{name}: {len(loader) - _SKIP} timed steps per block")
            header = "ratio to hand, no sync: median [min, max]"
            print(f"  {'loop':22} {'ms/step median [min, max]':>30} {header:>44}")
            for way in LOOPS:
                per_step = [t * 1e3 for t in times[way]]
                ratios = [t / b for t, b in zip(times[way], base, strict=True)]
                print(f"  {way:22} {_spread(per_step):>30} {_spread(ratios):>44}")


if __name__ == "__main__":
    main()

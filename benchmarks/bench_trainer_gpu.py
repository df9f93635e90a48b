"""Per-step time of distkit.Trainer against hand-written loops on one CUDA GPU, per strategy and precision.

Run by hand where a GPU is (not in CI):
    python benchmarks/bench_trainer_gpu.py [--strategy single ddp fsdp] [--precision fp32 bf16]
        [--models tiny medium large] [--blocks 10] [--quick]

Why: every step the Trainer reads the loss and one gradient element on the host (the non-finite
check and the logged loss), which waits for the GPU to finish the step. A hand-written loop that
never reads anything lets the host queue the next steps while the GPU works. This measures what
that costs, per model size, against two hand-written loops in the same process:

- "hand, no sync": zero_grad, forward, loss, backward, step; the host never waits for the GPU;
- "hand, loss.item()": the same plus ``loss.item()`` every step (seed 002's loop, and what most
  training scripts do to print the loss);
- "Trainer": ``Trainer(strategy=...)`` on the same DataLoader, with its defaults (CSV logs every
  50 steps) except checkpointing and the progress bar;
- "hand, no sync (A/A)": the first loop again, as the run's own noise floor.

One table per strategy, precision and model (``--strategy``, ``--precision``, ``--models`` pick a
subset; all by default). What the hand-written loops do per strategy:

- single: the plain model on cuda:0;
- ddp: ``DistributedDataParallel(model, device_ids=[0])``;
- fsdp: torch's ``fully_shard`` on every Linear (one unit each) and on the root, kept gathered
  after forward (the root's backward comes first), as ``distkit.shard_model`` shards the root.

For ddp and fsdp the script first joins a world of one NCCL process itself
(``torch.distributed.init_process_group``, a free port on 127.0.0.1), as a hand-written script on
one GPU would. The Trainer adopts that group. In a world of one it wraps and shards nothing
(``DDPStrategy``'s docstring, docs/fsdp.md): it trains the plain model, so those tables compare it
with the wrapper's cost in the hand-written loop, not with DDP or FSDP of its own.

Precision: fp32 (TF32 matmuls allowed) or bf16. With bf16 the single and ddp hand loops run
forward and loss under ``torch.autocast("cuda", dtype=torch.bfloat16)``; the fsdp hand loops have
no autocast but ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
on every unit (the root's output in float32, so the loss is computed in float32 as under
autocast); the Trainer runs ``precision="bf16-mixed"``.

All four read the same pinned-memory DataLoader and copy each batch with ``non_blocking=True``. The
loops run block by block, the order reversed every block; a block times its steps after the first
three, between two ``torch.cuda.synchronize()`` calls, so queued GPU work is counted. Block 0 of each
table warms every loop up and is not counted. The headline ratio is the median over blocks of
(loop's block time / "hand, no sync" block time in the same block), with the lowest and highest
block ratios as the spread.

Run time: the defaults (10 blocks; 150, 150 and 50 timed steps per block for the tiny, medium and
large model) are sized to stay under about 4 minutes on one H100 or H200 for all 18 tables, FSDP's
per-unit hooks and DTensor optimizer steps being the slowest. ``--quick`` (5 blocks of a quarter of
the steps) is a smoke test of every variant in well under a minute; its ratios are rough.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class _Model:
    title: str
    factory: Callable[[], nn.Module]
    features: int
    batch_size: int
    steps: int  # timed steps per block


MODELS: dict[str, _Model] = {
    "tiny": _Model("tiny MLP (2.7 K params, batch 32)", _mlp(32, 64, 10), 32, 32, 150),
    "medium": _Model("medium MLP (1.6 M params, batch 128)", _mlp(256, 1024, 1024, 256, 10), 256, 128, 150),
    "large": _Model(
        "large MLP (101 M params, batch 512)",
        _mlp(2048, 4096, 4096, 4096, 4096, 4096, 4096, 10),
        2048,
        512,
        50,
    ),
}

STRATEGIES = ("single", "ddp", "fsdp")
PRECISIONS = ("fp32", "bf16")
LOOPS = ("hand, no sync", "hand, loss.item()", "Trainer", "hand, no sync (A/A)")

# What each table's loops run, printed under its title.
_HAND = {
    "single": "the plain model",
    "ddp": "DistributedDataParallel(model, device_ids=[0])",
    "fsdp": "fully_shard per Linear and the root",
}


def _loader(features: int, batch_size: int, steps: int) -> DataLoader[Any]:
    n = batch_size * (steps + _SKIP + 2)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, features, generator=g), torch.randint(0, 10, (n,), generator=g))
    return DataLoader(data, batch_size=batch_size, shuffle=True, pin_memory=True, drop_last=True)


def _hand_model(factory: Callable[[], nn.Module], strategy: str, precision: str) -> nn.Module:
    """The model on cuda:0 as the hand-written loops of ``strategy`` train it."""
    model = factory().cuda()
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_ids=[0])
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if precision == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            root = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
            )
        else:
            policy = root = MixedPrecisionPolicy()
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, reshard_after_forward=True, mp_policy=policy)
        fully_shard(model, reshard_after_forward=False, mp_policy=root)
    return model


def _hand_block(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[Any],
    *,
    item: bool,
    autocast: bool,
) -> float:
    criterion = nn.CrossEntropyLoss()
    device = torch.device("cuda")
    start = 0.0
    for i, (data, target) in enumerate(loader):
        if i == _SKIP:
            torch.cuda.synchronize()
            start = time.perf_counter()
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = criterion(model(data), target)
        loss.backward()
        optimizer.step()
        if item:
            loss.item()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _trainer_block(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[Any],
    root: str,
    *,
    strategy: str,
    precision: str,
) -> float:
    from distkit.trainer import Callback, Trainer, TrainerView

    class Clock(Callback):
        def __init__(self) -> None:
            self.steps = 0
            self.start = 0.0

        def on_train_step_end(self, trainer: TrainerView, loss: torch.Tensor) -> None:
            self.steps += 1
            if self.steps == _SKIP:  # after the step before the hand loops' first timed one
                torch.cuda.synchronize()
                self.start = time.perf_counter()

    clock = Clock()
    trainer = Trainer(
        strategy=strategy,
        precision="bf16-mixed" if precision == "bf16" else "32",
        max_steps=len(loader),
        batch_size=loader.batch_size or 1,
        default_root_dir=tempfile.mkdtemp(dir=root),  # a run of its own each block (its metrics.csv)
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[clock],
    )
    # The start-up report, once per block. The same model and optimizer go to every block's fit:
    # in a world of one no strategy wraps or shards the model, so nothing is applied twice.
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(model, loader, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())
    torch.cuda.synchronize()
    return time.perf_counter() - clock.start


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


@contextlib.contextmanager
def _world_of_one(needed: bool) -> Iterator[None]:
    """A world of one NCCL process on cuda:0 for the DDP and FSDP loops, as a hand-written script on
    one GPU joins it (a free port on 127.0.0.1), destroyed at the end."""
    if not needed:
        yield
        return
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _table(spec: _Model, strategy: str, precision: str, blocks: int, steps: int, root: str) -> None:
    """Time the four loops on one model in one strategy and precision, and print the table."""
    loader = _loader(spec.features, spec.batch_size, steps)
    models: dict[str, nn.Module] = {}
    for way in LOOPS:
        torch.manual_seed(0)
        models[way] = (
            spec.factory().cuda() if way == "Trainer" else _hand_model(spec.factory, strategy, precision)
        )
    optimizers = {way: torch.optim.Adam(models[way].parameters(), lr=1e-4) for way in LOOPS}
    # fsdp's bf16 is its MixedPrecisionPolicy; single's and ddp's is autocast.
    autocast = precision == "bf16" and strategy != "fsdp"
    times: dict[str, list[float]] = {way: [] for way in LOOPS}
    began = time.perf_counter()
    for block in range(blocks + 1):
        for way in LOOPS if block % 2 == 0 else reversed(LOOPS):
            model, optimizer = models[way], optimizers[way]
            if way == "Trainer":
                seconds = _trainer_block(
                    model, optimizer, loader, root, strategy=strategy, precision=precision
                )
            else:
                seconds = _hand_block(
                    model, optimizer, loader, item=way == "hand, loss.item()", autocast=autocast
                )
            if block:  # block 0 warms every loop up (allocator, cuBLAS handles, imports)
                times[way].append(seconds / (len(loader) - _SKIP))
    base = times[LOOPS[0]]
    print(f"\n{strategy}, {precision}, {spec.title}: {len(loader) - _SKIP} timed steps per block")
    hand = _HAND[strategy] + (" under autocast(bfloat16)" if autocast else "")
    if strategy == "fsdp" and precision == "bf16":
        hand += " with MixedPrecisionPolicy(bfloat16, reduce float32)"
    trainer = f"Trainer(strategy={strategy!r}, precision={'bf16-mixed' if precision == 'bf16' else '32'!r})"
    if strategy != "single":
        trainer += ", which trains the plain model in a world of one"
    print(f"  hand loops: {hand}; {trainer}; {time.perf_counter() - began:.0f} s")
    header = "ratio to hand, no sync: median [min, max]"
    print(f"  {'loop':22} {'ms/step median [min, max]':>30} {header:>44}")
    for way in LOOPS:
        per_step = [t * 1e3 for t in times[way]]
        ratios = [t / b for t, b in zip(times[way], base, strict=True)]
        print(f"  {way:22} {_spread(per_step):>30} {_spread(ratios):>44}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10, help="timed blocks per loop and table (default 10)")
    # action="extend": `--strategy ddp fsdp` and `--strategy ddp --strategy fsdp` alike.
    parser.add_argument(
        "--strategy",
        nargs="+",
        action="extend",
        choices=STRATEGIES,
        help="what the loops run: the plain model, DDP or FSDP (default: all three)",
    )
    parser.add_argument("--precision", nargs="+", action="extend", choices=PRECISIONS, help="default: both")
    parser.add_argument(
        "--models", nargs="+", action="extend", choices=list(MODELS), help="default: all three"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 5 blocks of a quarter of the steps per table"
    )
    args = parser.parse_args()
    if args.blocks < 1:
        parser.error(f"--blocks must be >= 1, got {args.blocks}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_trainer_gpu.py needs a CUDA GPU; benchmarks/bench_trainer.py is the CPU one.")
    blocks = 5 if args.quick else args.blocks
    # Each once, in this order.
    strategies = [s for s in STRATEGIES if s in (args.strategy or STRATEGIES)]
    precisions = [p for p in PRECISIONS if p in (args.precision or PRECISIONS)]
    names = [m for m in MODELS if m in (args.models or MODELS)]
    torch.backends.cuda.matmul.allow_tf32 = True
    print(
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {blocks} blocks per loop"
        + (" (--quick)" if args.quick else "")
    )
    began = time.perf_counter()
    with _world_of_one(any(s != "single" for s in strategies)), tempfile.TemporaryDirectory() as root:
        for strategy in strategies:
            for precision in precisions:
                for name in names:
                    spec = MODELS[name]
                    steps = max(20, spec.steps // 4) if args.quick else spec.steps
                    _table(spec, strategy, precision, blocks, steps, root)
                    gc.collect()  # the table's four models and optimizers, before the next table's
                    torch.cuda.empty_cache()
    print(f"\ntotal {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()

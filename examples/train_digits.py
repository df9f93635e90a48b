"""Train a small network on scikit-learn's bundled digits with DDP on 2 CPU processes.

The digits (1,797 8x8 images of handwritten 0-9) ship inside scikit-learn: nothing is downloaded.
The run writes checkpoints, a CSV log and a PNG plot of the loss and accuracy curves to --out, and
exits with code 1 if the validation accuracy ends below --min-accuracy.

Run:  torchrun --standalone --nproc_per_node=2 examples/train_digits.py
      python examples/train_digits.py           (the Trainer starts its 2 processes itself)
      python examples/train_digits.py --resume  (continue from the latest checkpoint)

Without --resume a run starts over in a directory of its own: when --out holds an earlier run,
this one writes to the first free --out-2, --out-3, ... (and says so), so no run's checkpoints are
lost. --resume continues the run in --out.
"""

from __future__ import annotations

import argparse
import csv
import functools
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.trainer import LearningRateMonitor, ModelCheckpoint, accuracy


def load_digits_split(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """80/20 split, stratified by class, pixels scaled from 0..16 to 0..1."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(
        images, labels, test_size=0.2, stratify=labels, random_state=seed
    )

    def tensors(x: object, y: object) -> TensorDataset:
        return TensorDataset(
            torch.as_tensor(x, dtype=torch.float32) / 16.0, torch.as_tensor(y, dtype=torch.long)
        )

    return tensors(x_train, y_train), tensors(x_val, y_val)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def plot_curves(metrics_csv: Path, png: Path) -> None:
    """Training loss per logging step, validation loss and accuracy per epoch."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    with open(metrics_csv, newline="") as handle:
        rows = list(csv.DictReader(handle))
    train = [(int(r["step"]), float(r["train_loss"])) for r in rows if r.get("train_loss")]
    epochs = [r for r in rows if r.get("val_loss")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(*zip(*train, strict=True), label="train loss (per 10 steps)", alpha=0.7)
    epoch_steps = [int(r["step"]) for r in epochs]
    left.plot(epoch_steps, [float(r["val_loss"]) for r in epochs], "o-", label="val loss")
    left.set_xlabel("optimizer step")
    left.set_ylabel("cross-entropy")
    left.set_yscale("log")
    left.legend()
    right.plot([int(r["epoch"]) for r in epochs], [100 * float(r["val_acc"]) for r in epochs], "o-")
    right.set_xlabel("epoch (0-based, as in the log and metrics.csv)")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_ylabel("validation accuracy (%)")
    right.grid(alpha=0.3)
    fig.suptitle("digits: MLP, DDP on 2 CPU processes")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def fresh_directory(out: Path) -> Path:
    """``out``, or the first free ``out-2``, ``out-3``, ... when ``out`` holds an earlier run."""
    if not (out / "checkpoints").exists() and not (out / "metrics.csv").exists():
        return out
    n = 2
    while Path(f"{out}-{n}").exists():
        n += 1
    return Path(f"{out}-{n}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("runs/digits"), help="checkpoints, logs and plot")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--min-accuracy", type=float, default=0.95)
    parser.add_argument(
        "--devices",
        default="2",
        help="processes when started with python; under torchrun/srun, 'auto' (or the per-node count)",
    )
    args = parser.parse_args()

    if not args.resume:
        # Decided once (on rank 0 under torchrun) so that every rank writes to the same directory.
        distkit.init()
        out = distkit.run_on_main(fresh_directory, args.out)
        if out != args.out and distkit.is_main_process():
            print(f"{args.out} holds an earlier run (--resume continues it); this run writes to {out}")
        args.out = out
    train_set, val_set = load_digits_split(args.seed)
    torch.manual_seed(args.seed)
    model = make_model()
    trainer = distkit.Trainer(
        strategy="ddp",
        devices="auto" if args.devices == "auto" else int(args.devices),
        max_epochs=args.epochs,
        batch_size=args.batch_size,
        seed=args.seed,
        log_every_n_steps=10,
        default_root_dir=args.out,
        resume="auto" if args.resume else None,
        callbacks=[
            ModelCheckpoint(monitor="val_acc", mode="max", keep_last=2, keep_best=1),
            LearningRateMonitor(),
        ],
    )
    steps = args.epochs * -(-len(train_set) // (2 * args.batch_size))
    trainer.fit(
        model,
        train_set,
        val_set,
        optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=1e-4),
        lr_scheduler=functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=steps),
        loss_fn=nn.CrossEntropyLoss(),
        metrics={"acc": accuracy},
    )

    # Under torchrun every rank runs this; under python only this launching process does.
    if not distkit.is_main_process():
        return
    plot_curves(args.out / "metrics.csv", args.out / "curves.png")
    val_acc = trainer.callback_metrics["val_acc"]
    print(
        f"validation accuracy {100 * val_acc:.2f}% after {trainer.current_epoch} epochs "
        f"({trainer.global_step} steps); checkpoints in {args.out / 'checkpoints'}, log "
        f"{args.out / 'metrics.csv'}, plot {args.out / 'curves.png'}"
    )
    if val_acc < args.min_accuracy:
        raise SystemExit(f"validation accuracy {val_acc:.4f} is below {args.min_accuracy}")


if __name__ == "__main__":
    main()

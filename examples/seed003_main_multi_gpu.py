"""Seed 003's ``main_multi_gpu.py`` on ``distkit.Trainer``: ``--multi-gpu dp|ddp``, LR scaling, warm-up.

A port of the training script that seed 003's multi-GPU guide drives. Its flags keep their meaning;
the data is scikit-learn's bundled digits (1,797 8x8 images, nothing is downloaded) instead of the
guide's HAR dataset, and the model a small MLP with dropout.

Run:
    torchrun --standalone --nproc_per_node=2 examples/seed003_main_multi_gpu.py \\
        --multi-gpu ddp --epochs 20 --lr 1e-3 --warmup-epochs 2 --save-dir runs/seed003_ddp
    python examples/seed003_main_multi_gpu.py --multi-gpu ddp --processes 2   (the Trainer starts them)
    python examples/seed003_main_multi_gpu.py --multi-gpu dp --gpu-ids 0,1    (CUDA only)

The guide's flags (with the guide's example values; --help shows the defaults), here:

    --multi-gpu dp|ddp    Trainer(strategy="dp"|"ddp"); "none" is one device (the guide's main.py).
                          DP needs CUDA: on a CPU machine the Trainer's error is printed, exit code 2.
    --gpu-ids 0,1,3       devices=[0, 1, 3] (DP: the GPUs one process splits each batch over; DDP:
                          the GPU of each local rank). Without it: every visible GPU.
    --batch-size 32       per GPU (per process on CPU), as in the guide: the effective batch is
                          batch x replicas x --grad-accum-steps, printed at start-up.
    --lr 1e-3             the learning rate tuned for ONE replica's batch. The Trainer scales it
                          (Trainer(scale_lr="linear", base_batch_size=--batch-size), distkit.scale_lr:
                          x replicas x accumulation, the guide's "lr = base_lr x num_gpus"), also
                          after a resume on another number of ranks; the start-up report shows both
                          rates. The guide's commands pass the scaled value by hand (--lr 4e-3 on 4
                          GPUs): run those with --scale-lr none.
    --warmup-epochs 2     linear warm-up to the scaled rate over that many epochs of optimizer steps,
                          then cosine decay to 0 at the last step (distkit.trainer.warmup_schedule:
                          the Trainer turns epochs into steps once its loaders exist).
    --num-workers 4       DataLoader worker processes per rank (Trainer(num_workers=...)).
    --save-dir DIR        checkpoints (DIR/checkpoints: the last 2 and the best by val_acc) and
                          DIR/metrics.csv. --resume continues from the latest checkpoint there (the
                          guide's "resume works automatically"); without it a run starts over.
    --grad-accum-steps N  Trainer(accumulate_grad_batches=N).
    --precision           "32", "bf16-mixed" or "16-mixed" (CUDA) for the guide's AMP.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.trainer import LearningRateMonitor, ModelCheckpoint, accuracy, warmup_schedule


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
        nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )


def parse_gpu_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--gpu-ids takes comma-separated integers like 0,1,3, got {text!r}"
        ) from None
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(
            f"--gpu-ids takes distinct non-negative integers like 0,1,3, got {text!r}"
        )
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--multi-gpu", choices=["dp", "ddp", "none"], default="ddp")
    parser.add_argument("--gpu-ids", type=parse_gpu_ids, default=None, help="e.g. 0,1,3 (default: every GPU)")
    parser.add_argument(
        "--processes", type=int, default=2, help="DDP without CUDA and without a launcher: processes to start"
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per GPU / per process")
    parser.add_argument("--lr", type=float, default=1e-3, help="for one replica's batch; scaled (--scale-lr)")
    parser.add_argument("--scale-lr", choices=["linear", "sqrt", "none"], default="linear")
    parser.add_argument("--warmup-epochs", type=int, default=2)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--grad-accum-steps", type=int, default=1)
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    parser.add_argument("--precision", choices=["32", "bf16-mixed", "16-mixed"], default="32")
    parser.add_argument("--save-dir", type=Path, default=Path("runs/seed003"))
    parser.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in --save-dir"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every-n-steps", type=int, default=10)
    return parser


def strategy_and_devices(args: argparse.Namespace) -> tuple[str, int | str | list[int]]:
    """The Trainer's ``strategy`` and ``devices`` for the flags."""
    if args.multi_gpu == "none":
        return "single", args.gpu_ids[:1] if args.gpu_ids else "auto"
    if args.multi_gpu == "dp":
        return "dp", args.gpu_ids or "auto"
    if args.gpu_ids:
        return "ddp", args.gpu_ids  # under torchrun: the GPU of each local rank
    if distkit.get_env().launcher != "none" or torch.cuda.is_available():
        return "ddp", "auto"  # the launcher's processes, or one process per visible GPU
    return "ddp", args.processes  # CPU, no launcher: the Trainer starts this many processes


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    for name in ("epochs", "batch_size", "grad_accum_steps", "processes", "log_every_n_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_workers < 0:
        parser.error(f"--num-workers must be >= 0, got {args.num_workers}")
    if not 0 <= args.warmup_epochs < args.epochs:
        parser.error(
            f"--warmup-epochs must be in [0, --epochs), got {args.warmup_epochs} with --epochs {args.epochs}"
        )

    if args.gpu_ids and not torch.cuda.is_available() and args.multi_gpu != "dp":
        # (DP without CUDA gets the Trainer's own error below.)
        parser.error("--gpu-ids needs CUDA, which this machine lacks; on CPU leave it out (--processes N)")
    strategy, devices = strategy_and_devices(args)
    scaling = None if args.scale_lr == "none" else args.scale_lr
    try:
        trainer = distkit.Trainer(
            strategy=strategy,
            devices=devices,
            precision=args.precision,
            max_epochs=args.epochs,
            batch_size=args.batch_size,
            num_workers=args.num_workers,
            accumulate_grad_batches=args.grad_accum_steps,
            # --lr was tuned for one replica's batch: the Trainer scales it for the effective batch.
            scale_lr=scaling,
            base_batch_size=None if scaling is None else args.batch_size,
            log_every_n_steps=args.log_every_n_steps,
            default_root_dir=args.save_dir,
            resume="auto" if args.resume else None,
            seed=args.seed,
            callbacks=[
                ModelCheckpoint(
                    monitor="val_acc", mode="max", keep_last=2, keep_best=1, overwrite=not args.resume
                ),
                LearningRateMonitor(),
            ],
        )
    except distkit.DistkitError as err:
        # A flag that does not fit this machine or launch (DP without CUDA, DP on a torchrun rank):
        # the Trainer's message says which and what to run instead; no traceback.
        parser.error(str(err))

    train_set, val_set = load_digits_split(args.seed)
    torch.manual_seed(args.seed)
    model = make_model()
    trainer.fit(
        model,
        train_set,
        val_set,
        optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=args.weight_decay),
        lr_scheduler=warmup_schedule(warmup_epochs=args.warmup_epochs, decay="cosine"),
        loss_fn=nn.CrossEntropyLoss(),
        metrics={"acc": accuracy},
    )

    # Under torchrun every rank runs this; under python only this launching process does.
    if distkit.is_main_process() and "val_acc" in trainer.callback_metrics:
        print(
            f"seed003: val_acc {trainer.callback_metrics['val_acc']:.4f} after {trainer.current_epoch} "
            f"epoch(s), {trainer.global_step} steps, {trainer.steps_per_epoch} per epoch; checkpoints "
            f"in {args.save_dir / 'checkpoints'}",
            flush=True,
        )


if __name__ == "__main__":  # fit() may start processes that import this file: keep work below
    sys.exit(main())

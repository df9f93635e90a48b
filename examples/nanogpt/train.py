"""Train a character-level GPT on Python's own documentation, the way nanoGPT's train.py trains one.

The model (model.py) is nanoGPT's architecture; the text (data.py) ships with Python, so nothing
is downloaded. distkit.Trainer runs nanoGPT's loop: AdamW with decayed and non-decayed groups,
linear warm-up then cosine decay of the learning rate, gradient clipping at 1.0, gradient
accumulation, the validation loss every --eval-interval steps, checkpoints every
--checkpoint-interval steps, and a dropout stream of its own on every rank (seed + rank). The model's
forward(idx, targets) returns (logits, loss), which the Trainer trains as it is: no loss_fn, no
training_step, no callback of our own (only the built-in ModelCheckpoint and LearningRateMonitor).

Run:  torchrun --standalone --nproc_per_node=2 examples/nanogpt/train.py --out-dir runs/nanogpt
      python examples/nanogpt/train.py --devices 2      (the Trainer starts its 2 processes itself)
      python examples/nanogpt/train.py --resume         (continue from the latest checkpoint)

Outputs in --out-dir: metrics.csv (train_loss every --log-interval steps, val_loss every
--eval-interval), checkpoints/, and meta.json (vocabulary and model shape, for sample.py).
Without --resume a run starts over and deletes the checkpoints an earlier run left in --out-dir.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from dataclasses import asdict
from pathlib import Path

import torch
from data import load_splits
from model import GPT, GPTConfig, make_optimizer

import distkit
from distkit.trainer import LearningRateMonitor, ModelCheckpoint, warmup_schedule


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    io = parser.add_argument_group("run")
    io.add_argument("--out-dir", type=Path, default=Path("runs/nanogpt"), help="metrics, checkpoints, meta")
    io.add_argument("--max-steps", type=int, default=5000, help="optimizer steps (nanoGPT: max_iters)")
    io.add_argument("--eval-interval", type=int, default=100, help="steps between validations")
    io.add_argument("--log-interval", type=int, default=10, help="steps between logged training losses")
    io.add_argument(
        "--checkpoint-interval",
        type=int,
        default=None,
        help="steps between checkpoints (default: --eval-interval); also every 30 minutes",
    )
    io.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    io.add_argument("--seed", type=int, default=1337)
    io.add_argument(
        "--devices",
        default=None,
        help="processes when started with python (default 2); under torchrun or srun, the launcher's",
    )
    data = parser.add_argument_group("data")
    data.add_argument("--batch-size", type=int, default=64, help="sequences per micro-batch on each rank")
    data.add_argument("--block-size", type=int, default=256, help="context length in characters")
    data.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    model = parser.add_argument_group("model")
    model.add_argument("--n-layer", type=int, default=6)
    model.add_argument("--n-head", type=int, default=6)
    model.add_argument("--n-embd", type=int, default=384)
    model.add_argument("--dropout", type=float, default=0.2)
    model.add_argument("--bias", action="store_true", help="biases in linear layers and LayerNorms")
    optim = parser.add_argument_group("optimizer")
    optim.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    optim.add_argument("--min-lr", type=float, default=None, help="final learning rate (default: lr / 10)")
    optim.add_argument("--warmup-steps", type=int, default=100)
    optim.add_argument("--weight-decay", type=float, default=0.1)
    optim.add_argument("--beta1", type=float, default=0.9)
    optim.add_argument("--beta2", type=float, default=0.99)
    optim.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip; 0 for none")
    system = parser.add_argument_group("system")
    system.add_argument(
        "--precision",
        default=None,
        help="'32', 'bf16-mixed' or '16-mixed' (default: bf16-mixed on CUDA, else 32)",
    )
    system.add_argument("--compile", action="store_true", help="torch.compile the model")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    train_set, val_set, tokenizer = load_splits(args.block_size)
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
        bias=args.bias,
    )
    if distkit.is_main_process():
        args.out_dir.mkdir(parents=True, exist_ok=True)
        meta = {"vocab": tokenizer.chars, "model": asdict(config)}
        (args.out_dir / "meta.json").write_text(json.dumps(meta, indent=1))

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT(config)

    if args.devices is None:
        devices: int | str = "auto" if distkit.detect_env().launcher != "none" else 2
    else:
        devices = "auto" if args.devices == "auto" else int(args.devices)
    if args.precision is None:
        cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        args.precision = "bf16-mixed" if cuda_bf16 else "32"
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr

    trainer = distkit.Trainer(
        strategy="ddp",
        devices=devices,
        precision=args.precision,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.grad_clip or None,
        log_every_n_steps=args.log_interval,
        val_check_interval=args.eval_interval,
        check_val_every_n_epoch=None,  # nanoGPT evaluates by steps only
        # nanoGPT's seed + rank: each rank its own dropout stream; the data order stays the common
        # seed's, and checkpoints keep every rank's stream, so a resumed run goes on exactly.
        seed=args.seed,
        seed_per_rank=True,
        default_root_dir=args.out_dir,
        resume="auto" if args.resume else None,
        compile=args.compile,
        callbacks=[
            # Every --checkpoint-interval steps, and every 30 minutes (ModelCheckpoint's default);
            # the one with the best val_loss is kept too, as nanoGPT keeps its best.
            ModelCheckpoint(
                every_n_steps=args.checkpoint_interval or args.eval_interval,
                monitor="val_loss",
                keep_best=1,
                overwrite=not args.resume,
            ),
            LearningRateMonitor(),
        ],
    )
    trainer.fit(
        model,
        train_set,
        val_set,
        optimizer=functools.partial(
            make_optimizer, lr=args.lr, weight_decay=args.weight_decay, betas=(args.beta1, args.beta2)
        ),
        # Linear warm-up, then a cosine down to min_lr at the last step (nanoGPT's get_lr with
        # lr_decay_iters = max_iters); the Trainer makes it knowing the total number of steps.
        lr_scheduler=warmup_schedule(
            warmup_steps=args.warmup_steps, decay="cosine", min_lr_ratio=min_lr / args.lr
        ),
    )

    # Under torchrun every rank runs this; under python only this launching process does.
    if distkit.is_main_process():
        metrics = trainer.callback_metrics
        print(
            f"step {trainer.global_step}: train loss {metrics.get('train_loss', math.nan):.4f}, "
            f"val loss {metrics.get('val_loss', math.nan):.4f}; metrics in {args.out_dir / 'metrics.csv'}, "
            f"checkpoints in {args.out_dir / 'checkpoints'}"
        )


if __name__ == "__main__":
    main()

"""Self-launched validate and predict (strategy="ddp", devices=2 under plain `python`): the metrics
and predictions that come back, against one process computing them over the whole set.

Usage: python evaluate_job.py RUN_DIR RESULT_JSON
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

import distkit
from distkit.trainer import Callback, Trainer, accuracy
from test_trainer_evaluation import Blobs, Net


class WorldSize(Callback):
    pass


def main() -> None:
    run_dir, result_path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = Net()
    data = Blobs(101, seed=3)
    trainer = Trainer(
        strategy="ddp",
        devices=2,
        max_epochs=1,
        val_batch_size=8,
        default_root_dir=run_dir,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    metrics = trainer.validate(model, data, loss_fn=nn.functional.cross_entropy, metrics={"acc": accuracy})
    predicted = trainer.predict(model, data)
    with torch.no_grad():
        out = model(data.data)
    result = {
        "world_size_seen": 2 if not distkit.is_initialized() and metrics else 0,
        "val_loss": metrics["val_loss"],
        "val_acc": metrics["val_acc"],
        "exact_loss": nn.functional.cross_entropy(out, data.targets).item(),
        "exact_acc": (out.argmax(1) == data.targets).float().mean().item(),
        "predict_matches": bool(torch.allclose(predicted, out, atol=1e-6)),
        "predict_rows": int(predicted.shape[0]),
    }
    with open(result_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()

"""A Trainer job on a stream, started by tests/test_trainer_stream.py under torchrun: tar shards or
a streaming Hugging Face dataset, stopped at --max-steps or resumed with resume="auto"; each rank
writes the sample ids it trained on to <out>/seen-<world_size>-<rank>.json.

    torchrun --nproc_per_node=2 stream_job.py tar DATA RUN OUT --max-steps 5
    torchrun --nproc_per_node=3 stream_job.py tar DATA RUN OUT
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import torch
from torch import nn

import distkit
from distkit.trainer import ModelCheckpoint

SAMPLES = 115  # the tests' corpus: ids 0..114, in 5 tar shards or one streaming dataset


def rows(n: int):  # type: ignore[no-untyped-def]
    for i in range(n):
        yield {"id": i}


class IdModel(nn.Module):
    """Learns from the ids, and lists those it trained on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(1, 1)
        self.seen: list[int] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:  # type: ignore[type-arg]
        ids = [int(i) for i in (batch["__key__"] if "__key__" in batch else batch["id"])]
        self.seen.extend(ids)
        x = torch.tensor(ids, dtype=torch.float32).reshape(-1, 1) / SAMPLES
        return (self.lin(x) - 1.0).pow(2).mean()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["tar", "hf"])
    parser.add_argument("data")
    parser.add_argument("run")
    parser.add_argument("out")
    parser.add_argument("--max-steps", type=int, default=None)
    args = parser.parse_args()
    if args.kind == "tar":
        stream = distkit.ShardFiles(sorted(glob.glob(os.path.join(args.data, "*.tar"))))
    else:
        import datasets

        stream = datasets.IterableDataset.from_generator(rows, gen_kwargs={"n": SAMPLES})
    trainer = distkit.Trainer(
        max_epochs=1,
        max_steps=args.max_steps,
        batch_size=4,
        seed=0,
        num_workers=2 if args.kind == "tar" else 0,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=args.run,
        resume="auto",
        callbacks=[ModelCheckpoint(every_n_steps=5, every_n_minutes=None)],
    )
    model = IdModel()
    trainer.fit(model, stream, optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    env = distkit.get_env()
    with open(os.path.join(args.out, f"seen-{env.world_size}-{env.rank}.json"), "w") as f:
        json.dump({"seen": model.seen, "step": trainer.global_step}, f)


if __name__ == "__main__":
    main()

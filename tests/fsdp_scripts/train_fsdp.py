"""One FSDP training job, started as a user would: ``python train_fsdp.py OUT 2`` (fit starts two
processes itself) or under torchrun (``train_fsdp.py OUT auto``). The main process writes rank 0's
step losses, the full weights and the optimizer state's shapes after fit to OUT/result.json."""

from __future__ import annotations

import functools
import json
import pathlib
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.trainer import Callback, FSDPStrategy, Trainer


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 20)),
            nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class Record(Callback):
    """Rank 0's step losses; its state travels back to the process that started the workers."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        self.losses.append(loss.item())

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = list(state["losses"])


def full(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    # Under torchrun the model stays sharded after fit: gather (collective on every rank).
    return value.full_tensor() if isinstance(value, DTensor) else value


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    devices: int | str = sys.argv[2] if sys.argv[2] == "auto" else int(sys.argv[2])
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(256, 20, generator=generator), torch.randint(0, 10, (256,), generator=generator)
    )
    torch.manual_seed(0)
    model = MLP()
    record = Record()
    trainer = Trainer(
        strategy=FSDPStrategy(min_unit_params=1000),
        devices=devices,
        max_steps=6,
        batch_size=16,
        seed=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[record],
        default_root_dir=out,
    )
    trainer.fit(
        model,
        data,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        loss_fn=nn.functional.cross_entropy,
    )
    weights = [full(p.detach()).reshape(-1).tolist() for p in model.parameters()]
    assert trainer.optimizer is not None
    state = trainer.optimizer.state_dict()["state"]
    shapes = {str(k): list(full(v["exp_avg"]).shape) for k, v in state.items()}
    if distkit.is_main_process():
        result = {
            "losses": record.losses,
            "weights": weights,
            "exp_avg_shapes": shapes,
            "step": trainer.global_step,
        }
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

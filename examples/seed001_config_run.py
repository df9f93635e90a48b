"""Seed 001's config-file run: an autoencoder trained from a YAML config, with command-line overrides.

The seed trains an encoder/decoder autoencoder through LightningCLI (``python -m lightning_trainer fit
-c config/cli_config.yaml``) and praises what the CLI gives: ``--help`` listing everything that can be
set, a config file with model, data and trainer sections, and overrides. ``distkit.TrainerCLI`` gives
the same from the type hints below, for distkit's Trainer: the model's arguments under ``model.``,
the data's under ``data.``, the optimizer as a class path with init args, the Trainer's under
``trainer.``. Data: scikit-learn's bundled digits (8x8 images), nothing is downloaded.

Run (the config asks for DDP on 2 processes):

    torchrun --standalone --nproc_per_node=2 examples/seed001_config_run.py \\
        --config examples/configs/seed001.yaml --trainer.max_epochs 5 --model.latent_dim 16
    python examples/seed001_config_run.py --config examples/configs/seed001.yaml   (self-launch)
    python examples/seed001_config_run.py --config examples/configs/seed001.yaml --print_config
    python examples/seed001_config_run.py --help

The resolved config is saved as ``<trainer.default_root_dir>/config.yaml`` (run it again with
``--config runs/seed001/config.yaml``); ``--trainer.resume auto`` continues a run, refusing if a
``model.*`` value changed. The seed's note that its CLI could not seed the loader workers: here
``trainer.seed`` seeds every rank, the model's initial weights, the loaders and their workers.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit import TrainerCLI


class Autoencoder(nn.Module):
    """An MLP encoder and decoder for 8x8 images, trained to reconstruct their input (seed 001's model).

    Args:
        input_dim: Pixels per image (64 for the digits).
        hidden_dim: Width of the hidden layer of the encoder and the decoder.
        latent_dim: Size of the code between them.
        dropout: Dropout after the hidden layers.
    """

    def __init__(
        self, input_dim: int = 64, hidden_dim: int = 32, latent_dim: int = 8, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, latent_dim),
        )
        self.decoder = nn.Sequential(
            nn.Linear(latent_dim, hidden_dim),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, input_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, _ = batch
        return nn.functional.mse_loss(self(images), images)

    def validation_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> dict[str, torch.Tensor]:
        images, _ = batch
        # Per-sample errors: the Trainer averages them exactly over every validation sample.
        return {"val_loss": ((self(images) - images) ** 2).mean(dim=1)}


class DigitsData:
    """scikit-learn's digits, pixels scaled to 0..1, split into training and validation sets.

    Args:
        val_fraction: Share of the images held out for validation.
        split_seed: Seed of the (stratified) split.
    """

    def __init__(self, val_fraction: float = 0.2, split_seed: int = 0) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}.")
        images, labels = load_digits(return_X_y=True)
        x_train, x_val, y_train, y_val = train_test_split(
            images, labels, test_size=val_fraction, stratify=labels, random_state=split_seed
        )
        self._train = _tensors(x_train, y_train)
        self._val = _tensors(x_val, y_val)

    def train_dataset(self) -> TensorDataset:
        return self._train

    def val_dataset(self) -> TensorDataset:
        return self._val


def _tensors(x: object, y: object) -> TensorDataset:
    return TensorDataset(torch.as_tensor(x, dtype=torch.float32) / 16.0, torch.as_tensor(y, dtype=torch.long))


def main() -> None:
    cli = TrainerCLI(
        Autoencoder,
        DigitsData,
        optimizer=torch.optim.Adam,
        # The script's defaults; the config file and the command line override them.
        trainer_defaults={"max_epochs": 10, "default_root_dir": "runs/seed001", "seed": 0},
    )
    val_loss = cli.trainer.callback_metrics.get("val_loss")
    if val_loss is not None:
        distkit.rank_zero_print(f"validation reconstruction MSE: {val_loss:.4f}")


if __name__ == "__main__":
    main()

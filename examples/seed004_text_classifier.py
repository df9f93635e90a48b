"""Seed 004's YAML-configured transformer text classifier with DDP, and its compute-versus-communication
analysis.

The seed (a course project) trains a transformer encoder on AG News from ``configs/*.yaml`` under
``torchrun --nproc_per_node=4 src/train.py --config ...``, found that 4 GPUs trained *slower* than one
(0.46x for 2 M parameters), and explained it with the ratio R = T_compute / T_comm (its rule: R >= 3
for a speedup). This example is that program with distkit: the config file and its overrides through
``distkit.TrainerCLI``, DDP through the Trainer, and the analysis through ``distkit.profile_scaling``,
which measures both times on this job's own process group and predicts other rank counts.

Data: synthetic token sequences (no download): each of the ``num_classes`` topics draws a share of
its tokens from its own band of the vocabulary, the rest from all of it, so the classes are
learnable and the model sees AG News' shape (4 classes, sequences of ``seq_len`` tokens).

Run:

    torchrun --standalone --nproc_per_node=2 examples/seed004_text_classifier.py \\
        --config examples/configs/seed004.yaml
    torchrun --standalone --nproc_per_node=2 examples/seed004_text_classifier.py \\
        --config examples/configs/seed004.yaml --model.d_model 256 --model.num_layers 4   (the "large" model)
    python examples/seed004_text_classifier.py --config examples/configs/seed004.yaml --print_config

``--analysis.profile false`` skips the analysis; ``--analysis.world_sizes [1,2,4,8]`` predicts other
rank counts. The analysis runs after training, on every rank (it is collective), and rank 0 prints
the measured ratio, the predictions and the verdict. See ``docs/scaling.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit import TrainerCLI
from distkit.trainer import accuracy


class TransformerClassifier(nn.Module):
    """A transformer encoder text classifier (the seed's ``transformer_model.py``): token and position
    embeddings, ``num_layers`` encoder layers, mean pooling, a linear head.

    Args:
        vocab_size: Tokens in the vocabulary.
        max_len: Longest sequence (positions embedded).
        d_model: Width of the embeddings and the encoder.
        n_heads: Attention heads per layer (must divide ``d_model``).
        num_layers: Encoder layers.
        dim_feedforward: Width of each layer's feed-forward block.
        dropout: Dropout inside the encoder layers.
        num_classes: Classes to predict.
    """

    def __init__(
        self,
        vocab_size: int = 8000,
        max_len: int = 64,
        d_model: int = 128,
        n_heads: int = 4,
        num_layers: int = 2,
        dim_feedforward: int = 512,
        dropout: float = 0.1,
        num_classes: int = 4,
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"model.n_heads must divide model.d_model, got {n_heads} and {d_model}.")
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, dim_feedforward, dropout, batch_first=True)
        # Nested tensors only speed up padded inference; their warning is noise here.
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.tokens(tokens) + self.positions.weight[: tokens.shape[1]]
        return self.head(self.encoder(hidden).mean(dim=1))


def synthetic_topics(
    num_samples: int = 4096,
    num_val_samples: int = 512,
    seq_len: int = 64,
    vocab_size: int = 8000,
    num_classes: int = 4,
    topic_share: float = 0.25,
    seed: int = 0,
) -> tuple[TensorDataset, TensorDataset]:
    """Synthetic topic classification: token sequences whose topic shows in the tokens they use.

    Args:
        num_samples: Training sequences.
        num_val_samples: Validation sequences.
        seq_len: Tokens per sequence (at most ``model.max_len``).
        vocab_size: Tokens in the vocabulary (``model.vocab_size``).
        num_classes: Topics (``model.num_classes``).
        topic_share: Share of each sequence's tokens drawn from its topic's band of the vocabulary.
        seed: Seed of the generator (the same data on every rank).
    """
    if not 0.0 <= topic_share <= 1.0:
        raise ValueError(f"data.topic_share must be in [0, 1], got {topic_share}.")
    generator = torch.Generator().manual_seed(seed)
    band = vocab_size // num_classes

    def make(n: int) -> TensorDataset:
        labels = torch.randint(num_classes, (n,), generator=generator)
        tokens = torch.randint(vocab_size, (n, seq_len), generator=generator)
        topical = torch.rand(n, seq_len, generator=generator) < topic_share
        in_band = labels[:, None] * band + torch.randint(band, (n, seq_len), generator=generator)
        return TensorDataset(torch.where(topical, in_band, tokens), labels)

    return make(num_samples), make(num_val_samples)


@dataclass
class ScalingAnalysis:
    """The compute-versus-communication analysis after training (``distkit.profile_scaling``).

    Args:
        profile: Run it.
        world_sizes: Rank counts to predict.
        steps: Measured steps per part, at least.
        min_time_s: Measure each part at least this long (0: exactly ``steps``).
    """

    profile: bool = True
    world_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    steps: int = 10
    min_time_s: float = 1.0


class Seed004CLI(TrainerCLI):
    """The TrainerCLI with the analysis' options under ``analysis.``."""

    def add_arguments_to_parser(self, parser) -> None:  # type: ignore[no-untyped-def]
        parser.add_class_arguments(ScalingAnalysis, "analysis", instantiate=False)


def analyse(cli: TrainerCLI) -> None:
    """Measure compute and gradient communication of the trained model on this job; rank 0 prints.

    Collective inside a job: every rank calls it (profile_scaling then uses the job's own group).
    """
    options = ScalingAnalysis(**vars(cli.config.analysis))
    if not options.profile:
        return
    batch_size = cli.trainer.batch_size
    tokens, labels = cli.train_data[:batch_size]  # one batch per rank, as training saw it
    model = cli.model
    optimizer = cli.optimizer(model.parameters())  # the configured optimizer: its step is compute too
    profile = distkit.profile_scaling(
        model,
        (tokens, labels),
        world_sizes=tuple(options.world_sizes),
        optimizer=optimizer,
        steps=options.steps,
        warmup_steps=2,
        min_time_s=options.min_time_s,
    )
    lines = [
        "compute-versus-communication analysis (distkit.profile_scaling)",
        f"  parameters            {profile.num_parameters:,} ({profile.comm.grad_bytes / 2**20:.1f} MiB of "
        f"gradients, {profile.comm.num_buckets} DDP bucket(s))",
        f"  T_compute per step    {1e3 * profile.rank_compute_s:.2f} ms (batch {batch_size} per rank)",
        f"  T_comm per step       {1e3 * profile.comm.step_s:.2f} ms ({profile.comm.backend}, "
        f"{profile.comm.world_size} ranks)",
        f"  R = compute/comm      {profile.ratio:.2f} (the seed's rule: >= 3 for a speedup)",
    ]
    for prediction in profile.predictions:
        lines.append(
            f"  {prediction.world_size} rank(s): predicted speedup {prediction.speedup:.2f}x "
            f"[{prediction.speedup_low:.2f}-{prediction.speedup_high:.2f}], efficiency "
            f"{100 * prediction.efficiency:.0f}%"
        )
    lines.append(profile.recommendation())
    distkit.rank_zero_print("\n".join(lines))


def main() -> None:
    cli = Seed004CLI(
        TransformerClassifier,
        synthetic_topics,
        optimizer=torch.optim.AdamW,
        loss_fn=nn.functional.cross_entropy,
        metrics={"acc": accuracy},
        trainer_defaults={
            "strategy": "ddp",
            "devices": 2,
            "max_epochs": 3,
            "default_root_dir": "runs/seed004",
        },
    )
    acc = cli.trainer.callback_metrics.get("val_acc")
    if acc is not None and math.isfinite(acc):
        distkit.rank_zero_print(f"validation accuracy: {100 * acc:.1f}%")
    # Under torchrun or srun every rank measures together, on the job's group; under plain python
    # (fit ran in processes it started) profile_scaling starts local ranks of its own.
    analyse(cli)


if __name__ == "__main__":
    main()

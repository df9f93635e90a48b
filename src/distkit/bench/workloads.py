"""What a benchmark trains: built-in presets from a tiny MLP to a small transformer, or ``module:factory``."""

from __future__ import annotations

import difflib
import functools
import importlib
import itertools
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "PRESETS",
    "LossFn",
    "OptimizerFactory",
    "TextClassifier",
    "Workload",
    "batch_size_of",
    "default_loss",
    "load_workload",
    "to_device",
]

#: ``compute_loss(model, batch) -> loss``: how one training step turns a batch into a scalar loss.
LossFn = Callable[[nn.Module, Any], torch.Tensor]
#: ``make_optimizer(parameters) -> optimizer``, e.g. ``functools.partial(torch.optim.AdamW, lr=1e-3)``.
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Workload:
    """A model, a way to make a batch of any size, and how to compute the loss.

    Attributes:
        model: The model, on the CPU; each benchmark configuration trains a fresh copy.
        make_batch: ``make_batch(batch_size)`` returns one batch as the training loop sees it,
            e.g. ``(inputs, targets)``.
        compute_loss: ``compute_loss(model, batch)`` returns the loss; ``None`` uses
            :func:`default_loss`.
        description: One line for listings.
        make_optimizer: ``make_optimizer(parameters)`` builds the optimizer every configuration
            trains with; ``None``: plain SGD (lr 1e-3), the cheapest, so that the numbers are the
            model and the communication.

    Example:
        >>> import torch
        >>> w = Workload(torch.nn.Linear(4, 2), lambda n: (torch.randn(n, 4), torch.randint(2, (n,))))
        >>> w.loss(w.make_batch(8)).shape
        torch.Size([])
    """

    model: nn.Module
    make_batch: Callable[[int], Any]
    compute_loss: LossFn | None = None
    description: str = ""
    make_optimizer: OptimizerFactory | None = None

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """A fresh optimizer over ``model``'s parameters (SGD with lr 1e-3 unless ``make_optimizer``)."""
        if self.make_optimizer is not None:
            return self.make_optimizer(model.parameters())
        return torch.optim.SGD(model.parameters(), lr=1e-3)

    def loss(self, batch: Any, model: nn.Module | None = None) -> torch.Tensor:
        """The loss of ``batch`` through ``model`` (default: this workload's model)."""
        fn = self.compute_loss or default_loss
        return fn(self.model if model is None else model, batch)

    @property
    def num_parameters(self) -> int:
        """Number of trainable parameters."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss used when none is given.

    ``(inputs, targets)``: cross-entropy for integer targets, mean squared error otherwise
    (``inputs`` may be a tuple of positional inputs). A mapping: ``model(**batch)`` and its
    ``loss`` (Hugging Face style). A bare tensor: the mean of the output, which costs the same
    backward pass as any loss.

    Raises:
        TypeError: The batch has another shape; pass ``compute_loss`` instead.
    """
    if isinstance(batch, torch.Tensor):
        output: torch.Tensor = model(batch)  # nn.Module.__call__ is typed as returning Any
        return output.float().mean()
    if isinstance(batch, Mapping):
        out = model(**batch)
        loss: torch.Tensor | None = (
            out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        )
        if loss is None:
            raise TypeError(
                "the model's output for a mapping batch has no 'loss'; "
                "pass compute_loss=(model, batch) -> loss."
            )
        return loss
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = batch
        out = model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)
        if not targets.is_floating_point() and out.dim() >= 2:
            return nn.functional.cross_entropy(out, targets)
        return nn.functional.mse_loss(out, targets.to(out.dtype))
    raise TypeError(
        f"cannot compute a loss for a batch of type {type(batch).__name__}; the default understands "
        f"(inputs, targets), a mapping for model(**batch), or a tensor. "
        f"Pass compute_loss=(model, batch) -> loss."
    )


class _RandomTokens:
    # Token ids and labels of a text classifier; a class for the same reasons as below.
    def __init__(self, vocab: int, length: int, classes: int) -> None:
        self.vocab = vocab
        self.length = length
        self.classes = classes

    def __call__(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(batch_size)
        tokens = torch.randint(self.vocab, (batch_size, self.length), generator=gen)
        return tokens, torch.randint(self.classes, (batch_size,), generator=gen)


class _RandomClassification:
    # A class (not a closure) so that a Workload can travel to spawned ranks by pickle if needed;
    # seeded so that every rank and every run sees the same data.
    def __init__(self, shape: tuple[int, ...], classes: int) -> None:
        self.shape = shape
        self.classes = classes

    def __call__(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(batch_size)
        inputs = torch.randn((batch_size, *self.shape), generator=gen)
        return inputs, torch.randint(self.classes, (batch_size,), generator=gen)


def _mlp(widths: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _mlp_workload(widths: list[int], description: str) -> Callable[[], Workload]:
    def factory() -> Workload:
        torch.manual_seed(0)
        return Workload(_mlp(widths), _RandomClassification((widths[0],), widths[-1]), None, description)

    return factory


def _conv() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 10),
    )
    return Workload(
        model, _RandomClassification((3, 32, 32), 10), None, "conv net on 3x32x32 images, 60 K params"
    )


class TextClassifier(nn.Module):
    """A small transformer text classifier, the shape of ``../shared/seeds/004``'s "small model".

    Token and position embeddings, ``layers`` encoder layers (``d_model``, ``heads`` heads, a
    feed-forward of ``ffn``), mean pooling, a linear head. With the defaults: 1.94 M parameters,
    1.54 M of them in the token embedding, whose gradient DDP all-reduces whole at every step.

    Example:
        >>> TextClassifier()(torch.randint(12_000, (2, 64))).shape
        torch.Size([2, 4])
    """

    def __init__(
        self,
        vocab: int = 12_000,
        d_model: int = 128,
        heads: int = 4,
        layers: int = 2,
        ffn: int = 512,
        length: int = 64,
        classes: int = 4,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(length, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, ffn, batch_first=True)
        # Nested tensors only speed up padded inference; the warning about them is noise here.
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.tokens(tokens) + self.positions.weight[: tokens.shape[1]]
        logits: torch.Tensor = self.head(self.encoder(hidden).mean(dim=1))
        return logits


def _transformer() -> Workload:
    torch.manual_seed(0)
    return Workload(
        TextClassifier(),
        _RandomTokens(12_000, 64, 4),
        None,
        "transformer text classifier (2 layers, d_model 128, 64 tokens, 4 classes), 1.9 M params, AdamW",
        functools.partial(torch.optim.AdamW, lr=1e-3),
    )


#: Built-in workloads by name: MLPs from tiny to medium, a small conv net (compute-heavy for its
#: size, so it scales better than an MLP with as many parameters) and a small transformer text
#: classifier trained with AdamW (most of its gradient is the embedding's, as in seed 004).
PRESETS: dict[str, Callable[[], Workload]] = {
    "tiny": _mlp_workload([32, 64, 10], "MLP 32-64-10, 2.8 K params"),
    "small": _mlp_workload([256, 512, 512, 10], "MLP 256-512-512-10, 400 K params"),
    "medium": _mlp_workload([784, 1024, 1024, 512, 10], "MLP 784-1024-1024-512-10, 2.4 M params"),
    "conv": _conv,
    "transformer": _transformer,
}


def _normalize(value: Any, spec: str) -> Workload:
    if isinstance(value, Workload):
        return value
    if isinstance(value, (tuple, list)) and len(value) in (2, 3) and isinstance(value[0], nn.Module):
        return Workload(value[0], value[1], value[2] if len(value) == 3 else None, spec)
    raise TypeError(
        f"{spec} returned {type(value).__name__}; a benchmark factory must return a "
        f"distkit.bench.workloads.Workload or a tuple (model, make_batch) or "
        f"(model, make_batch, compute_loss), where make_batch(batch_size) returns one batch."
    )


def load_workload(spec: str) -> Workload:
    """Build the workload a name stands for: a preset, or ``module:factory``.

    Local: no communication. ``module:factory`` imports ``module`` (the current directory is
    searched first, as ``python -m`` does) and calls ``factory()``, which returns a
    :class:`Workload` or ``(model, make_batch)`` / ``(model, make_batch, compute_loss)``.

    Args:
        spec: A preset (``"tiny"``, ``"small"``, ``"medium"``, ``"conv"``, ``"transformer"``) or
            ``"package.module:factory"``.

    Returns:
        The workload, its model on the CPU.

    Raises:
        ValueError: ``spec`` names no preset and is not ``module:factory`` (the message lists
            what was tried).
        ImportError: The module cannot be imported (names the module and where it was looked for).
        AttributeError: The module has no such factory (lists what it has).
        TypeError: The factory returned something else.

    Example:
        >>> load_workload("tiny").num_parameters
        2762
    """
    if spec in PRESETS:
        return PRESETS[spec]()
    cwd = os.getcwd()
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        close = difflib.get_close_matches(spec, PRESETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown model {spec!r}: tried the presets ({', '.join(PRESETS)}) and 'module:factory', "
            f"which needs a ':' (e.g. 'mymodels:build' for a function build() in mymodels.py in "
            f"the current directory, {cwd}).{hint}"
        )
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(
            f"cannot load model {spec!r}: importing module {module_name!r} failed ({err}); looked in "
            f"the current directory {cwd} first, then sys.path. Run from the directory that holds "
            f"{module_name.replace('.', '/')}.py, or install its package.",
            name=module_name,
        ) from err
    try:
        target = getattr(module, attr)
    except AttributeError:
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        where = getattr(module, "__file__", None) or module_name
        raise AttributeError(
            f"module {module_name!r} ({where}) has no attribute {attr!r} (from {spec!r}); "
            f"its public callables: {', '.join(names) or 'none'}."
        ) from None
    return _normalize(target if isinstance(target, Workload) else target(), spec)


def batch_size_of(batch: Any) -> int | None:
    """The first dimension of the first tensor in ``batch``, or ``None`` when it holds none."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    items = (
        batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    )
    for item in items:
        size = batch_size_of(item)
        if size is not None:
            return size
    return None


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device`` (tuples, lists and mappings are walked)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch

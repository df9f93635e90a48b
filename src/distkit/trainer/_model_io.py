"""How the Trainer calls a model that has no ``training_step``, and where it finds the loss. Local.

Three conventions, picked once per ``fit`` from the model and the arguments (see ``docs/trainer.md``,
"Plain models"):

* ``loss_fn`` given: batches are ``(inputs, target)``, the loss is ``loss_fn(model(inputs), target)``.
* no ``loss_fn``, batches ``(inputs, target)`` and a ``forward`` with a parameter named ``targets``,
  ``target``, ``labels`` or ``label`` (nanoGPT's ``forward(idx, targets=None)``): the Trainer calls
  ``model(inputs, <name>=target)``. The target goes by name, never by position: a Hugging Face
  model's second positional parameter is ``attention_mask``, and a target passed there would train
  silently on nonsense.
* no ``loss_fn`` and dict batches (Hugging Face style, the labels inside the dict): ``model(**batch)``.

In the last two the model computes its own loss, found in its output: the output itself when it
is a one-element tensor, ``output["loss"]`` or ``output.loss`` (a ``ModelOutput``), or the one
one-element tensor of a tuple (nanoGPT's ``(logits, loss)``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from distkit.errors import DistkitError

__all__: list[str] = []

# The names under which a forward takes the target, in the order they are looked for.
TARGET_NAMES = ("targets", "target", "labels", "label")

_TRAINING_STEP_EXAMPLE = (
    "Give the model a training_step that returns the loss, e.g.:\n\n"
    "    def training_step(self, batch, batch_idx):\n"
    "        inputs, target = batch\n"
    "        return torch.nn.functional.cross_entropy(self(inputs), target)\n"
)


def target_parameter(module: nn.Module) -> str | None:
    """The name of ``module.forward``'s parameter that takes the target, or ``None``."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented forward: no names to read
        return None
    return next((name for name in TARGET_NAMES if name in parameters), None)


def convention(module: nn.Module, loss_fn: Callable[..., Any] | None) -> str:
    """``"training_step"``, ``"loss_fn"`` or ``"model_loss"`` (the model computes its loss); raises
    when a plain model has no way to a loss. Local."""
    if callable(getattr(module, "training_step", None)):
        return "training_step"
    if loss_fn is not None:
        return "loss_fn"
    if target_parameter(module) is not None:
        return "model_loss"
    # Dict batches are known only when the first one arrives (model_loss checks it then).
    if _takes_var_keywords(module):
        return "model_loss"
    raise ValueError(
        f"{type(module).__name__} has no training_step(batch, batch_idx), no loss_fn was given, and its "
        f"forward takes no target (a parameter named {', '.join(TARGET_NAMES)}). Pass "
        f"loss_fn=... (e.g. torch.nn.functional.cross_entropy) to train it as a plain model, or "
        f"{_TRAINING_STEP_EXAMPLE[0].lower()}{_TRAINING_STEP_EXAMPLE[1:]}"
    )


def _takes_var_keywords(module: nn.Module) -> bool:
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def split_batch(batch: Any) -> tuple[Any, Any]:
    """A plain model's ``(inputs, target)`` batch, or a ``TypeError`` naming what came instead."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"with a plain model the batches must be (inputs, target) pairs, got {type(batch).__name__}"
        f"{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}. For other batches "
        f"give the model a training_step(batch, batch_idx) method that returns the loss."
    )


def call_with_target(module: nn.Module, batch: Any, target_name: str | None) -> Any:
    """The model's output under the ``model_loss`` convention (it computes its loss)."""
    if isinstance(batch, Mapping):
        return module(**batch)
    if target_name is None:
        raise TypeError(
            f"{type(module).__name__}.forward takes **kwargs but the batches are "
            f"{type(batch).__name__}, not dicts: pass loss_fn=..., name the forward's target "
            f"parameter one of {', '.join(TARGET_NAMES)}, or give the model a training_step."
        )
    inputs, target = split_batch(batch)
    return module(inputs, **{target_name: target})


def loss_of(output: Any, module: nn.Module) -> torch.Tensor:
    """The loss a model returned in ``output`` (see the module docstring), or a ``DistkitError``."""
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output.reshape(())
    found: Any = None
    if isinstance(output, Mapping):
        found = output.get("loss")
    elif isinstance(output, (tuple, list)):
        scalars = [item for item in output if isinstance(item, torch.Tensor) and item.numel() == 1]
        found = scalars[0] if len(scalars) == 1 else None
    else:
        found = getattr(output, "loss", None)
    if isinstance(found, torch.Tensor) and found.numel() == 1:
        return found.reshape(())
    raise DistkitError(
        f"{type(module).__name__}'s forward took the target but returned no loss the Trainer can find "
        f"(got {_describe(output)}). It looks for a one-element tensor, output['loss'] or "
        f"output.loss, or the one one-element tensor of a tuple such as (logits, loss). "
        + _TRAINING_STEP_EXAMPLE
    )


def logits_of(output: Any) -> Any:
    """What validation metrics compare with the target when the model returned its loss too."""
    if isinstance(output, Mapping):
        return output.get("logits")
    if isinstance(output, (tuple, list)):
        rest = [item for item in output if not (isinstance(item, torch.Tensor) and item.numel() == 1)]
        return rest[0] if rest else None
    return getattr(output, "logits", None)


def check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
        raise TypeError(
            f"loss_fn must return a one-element tensor (the batch mean), got {type(loss).__name__}"
            f"{shape}; use reduction='mean'."
        )


def first_failure(module: nn.Module, batch: Any, err: Exception) -> DistkitError:
    """The error for ``loss_fn(model(inputs), target)`` failing on the first batch: most often a
    model whose forward wants the target, or batches that are not ``(inputs, target)``."""
    shapes = ", ".join(_describe(item) for item in batch) if isinstance(batch, (tuple, list)) else ""
    return DistkitError(
        f"loss_fn(model(inputs), target) failed on the first batch ({shapes}) with "
        f"{type(err).__name__}: {err}\n"
        f"If {type(module).__name__}.forward takes the target itself and returns the loss, drop "
        f"loss_fn and name that parameter one of {', '.join(TARGET_NAMES)} (the Trainer then passes "
        f"it by name and finds the loss in the output). Otherwise: " + _TRAINING_STEP_EXAMPLE
    )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}: " + ", ".join(_describe(v) for v in value)
    return type(value).__name__

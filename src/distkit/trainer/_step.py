"""What the loop calls once per micro-batch: the step module (the model and its loss, which the
strategy wraps), and the small readers of batches, losses and validation values. Local throughout."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distkit import runtime

if TYPE_CHECKING:
    pass

__all__: list[str] = []

_log = runtime.get_logger("distkit.trainer", main_process_only=True)


class _StepModule(nn.Module):
    """What the strategy wraps: the user's module and its loss (``training_step`` or ``loss_fn``)."""

    def __init__(self, module: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, *, per_device: bool):
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn
        self.has_training_step = callable(getattr(module, "training_step", None))
        # Under nn.DataParallel every device returns 1-element vectors, which it concatenates.
        self.per_device = per_device
        # The batch and loss of a plain model are checked on the first step only (hot path).
        self.checked = False

    def forward(self, batch: Any, batch_idx: int) -> tuple[torch.Tensor, dict[str, Any]]:
        # _modules/_parameters directly: nn.Module.__getattr__ costs a microsecond per lookup.
        module = self._modules["module"]
        extras: dict[str, Any] = _NO_EXTRAS
        if self.has_training_step:
            loss, extras = _split_step_output(module.training_step(batch, batch_idx))
        else:
            if not self.checked:
                _split_batch(batch)
            inputs, target = batch
            # A function sits in __dict__, a loss module (nn.CrossEntropyLoss()) in _modules.
            loss_fn = self.__dict__.get("loss_fn") or self._modules["loss_fn"]
            loss = loss_fn(module(inputs), target)  # type: ignore[misc]
            if not self.checked:
                _check_loss(loss)
                self.checked = True
        if self.per_device:
            # nn.DataParallel gathers tensors only: numbers travel as 1-element tensors too.
            extras = {k: torch.as_tensor(v, device=loss.device).reshape(1) for k, v in extras.items()}
            return loss.reshape(1), extras
        return loss, extras

    # Called once per micro-batch by the Trainer, DDP or DataParallel, and never hooked: skip
    # nn.Module.__call__'s hook dispatch (measurable on an overhead-bound model).
    __call__ = forward


_NO_EXTRAS: dict[str, Any] = {}


def _mean_over_devices(loss: torch.Tensor, extras: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    # nn.DataParallel concatenated one value per GPU; the batch's value is their mean.
    return loss.mean(), {k: v.mean() for k, v in extras.items()}


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
        raise TypeError(
            f"loss_fn must return a one-element tensor (the batch mean), got {type(loss).__name__}"
            f"{shape}; use reduction='mean'."
        )


def _split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"with a plain model the batches must be (inputs, target) pairs, got {type(batch).__name__}"
        f"{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}. For other batches "
        f"give the model a training_step(batch, batch_idx) method that returns the loss."
    )


def _split_step_output(output: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    if isinstance(output, torch.Tensor):
        loss, extras = output, {}
    elif isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
        extras = {
            k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in output.items() if k != "loss"
        }
    else:
        raise TypeError(
            f"training_step() must return the loss tensor or a dict with a 'loss' entry, got "
            f"{type(output).__name__}."
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise TypeError(
            "training_step() must return a one-element loss tensor that requires grad (computed from "
            "the model's output, not detached or converted with .item())."
        )
    return loss.reshape(()), extras


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch  # loaders yield CPU tensors; .to() would only cost dispatch time
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [_to_device(item, device) for item in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, Mapping):
        return {key: _to_device(value, device) for key, value in batch.items()}
    return batch


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    if isinstance(batch, Mapping) and batch:
        return _batch_size(next(iter(batch.values())))
    raise TypeError(f"cannot tell the number of samples in a batch of type {type(batch).__name__}.")


def _metric_value(name: str, value: Any, batch_size: int) -> tuple[torch.Tensor | float, float]:
    """A validation value as a ``(sum, count)`` pair: pairs pass, per-sample tensors are summed,
    scalars are batch means weighted by the batch size."""
    if isinstance(value, tuple) and len(value) == 2:
        total, count = value
        return (total.detach().double() if isinstance(total, torch.Tensor) else float(total)), float(count)
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.numel() == 1:
            return value.double().reshape(()) * batch_size, float(batch_size)
        return value.double().sum(), float(value.numel())
    if isinstance(value, (int, float)):
        return float(value) * batch_size, float(batch_size)
    raise TypeError(
        f"validation metric {name!r} must be a tensor (per sample, or the batch mean), a number or a "
        f"(sum, count) pair, got {type(value).__name__}."
    )

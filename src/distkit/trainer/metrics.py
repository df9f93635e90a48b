"""Per-sample metric functions for ``Trainer.fit(metrics=...)``.

A metric function takes ``(output, target)`` of a validation batch and returns one value per sample
(summed and counted exactly across ranks) or a single batch mean (weighted by the batch size).
Functions must be defined at module level so that ``fit`` can send them to the processes it starts.
"""

from __future__ import annotations

import torch

__all__ = ["accuracy"]


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """1.0 where the class with the highest score (last dimension of ``output``) equals ``target``.

    Local: no communication.

    Args:
        output: Scores of shape ``(N, C)`` (or ``(..., C)``).
        target: Class indices of shape ``(N,)`` (or ``output.shape[:-1]``).

    Returns:
        A float tensor with one value per sample.

    Example:
        >>> import torch
        >>> accuracy(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
        tensor([1., 0.])
    """
    if output.shape[:-1] != target.shape:
        raise ValueError(
            f"accuracy() needs scores of shape (N, C) and class indices of shape (N,), got "
            f"{tuple(output.shape)} and {tuple(target.shape)}."
        )
    return (output.argmax(dim=-1) == target).to(torch.float32)

"""Seeds and random-number-generator state.

RNG states are kept as tensors and plain lists only, so a checkpoint that holds them loads with
``torch.load(weights_only=True)`` (numpy's own state tuple would be refused).
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states: python, numpy (when installed), torch CPU and every CUDA device.

    Local: no communication; each rank captures its own streams.

    Returns:
        A dict of tensors and plain lists, safe for ``torch.load(weights_only=True)``.

    Example:
        >>> state = capture_rng_state()
        >>> a = torch.rand(1); restore_rng_state(state); bool(torch.rand(1) == a)
        True
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:
        np = None  # type: ignore[assignment]
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back RNG states captured by :func:`capture_rng_state`. Local.

    Missing parts (numpy absent when captured, no CUDA) are left as they are.

    Example:
        >>> restore_rng_state(capture_rng_state())
    """
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(int(x) for x in internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            np = None  # type: ignore[assignment]
        if np is not None:
            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state(
                (kind, keys.numpy().astype("uint32"), int(pos), int(has_gauss), float(cached))
            )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])

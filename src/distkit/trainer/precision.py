"""Numeric precision of training: autocast and, for fp16, the gradient scaler, behind one interface.

- ``"32"``: float32 throughout.
- ``"bf16-mixed"``: the forward pass under ``torch.autocast(dtype=torch.bfloat16)``, on CPU or
  CUDA; no scaler (bfloat16 has float32's exponent range, so gradients do not underflow).
- ``"16-mixed"``: the forward pass under ``torch.autocast("cuda", dtype=torch.float16)`` and the
  loss scaled by ``torch.amp.GradScaler``; CUDA only.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from distkit.errors import DistkitError

__all__: list[str] = []

PRECISIONS = ("32", "16-mixed", "bf16-mixed")


# Other tools' names for the precisions distkit has (Lightning's 16 and "bf16", "fp16", "32-true"):
# what they most likely meant. distkit trains the weights in float32 always ("-true" half
# precision, the weights themselves in 16 bits, is not offered).
_MEANT = {
    "16": "'16-mixed'",
    "fp16": "'16-mixed'",
    "16-true": "'16-mixed' (the weights stay float32; distkit has no 16-bit weights)",
    "bf16": "'bf16-mixed'",
    "bfloat16": "'bf16-mixed'",
    "bf16-true": "'bf16-mixed' (the weights stay float32; distkit has no 16-bit weights)",
    "32-true": "'32'",
    "fp32": "'32'",
    "float32": "'32'",
}


def check_precision(precision: object) -> str:
    """Validate the ``precision`` argument; ``32`` (an int) is accepted for ``"32"``. Local."""
    value = "32" if precision == 32 and not isinstance(precision, bool) else precision
    if value not in PRECISIONS:
        meant = _MEANT.get(str(precision).lower())
        hint = f" Did you mean {meant}?" if meant else ""
        raise ValueError(
            f"precision must be one of {list(PRECISIONS)}, got {precision!r}.{hint} 'bf16-mixed' works "
            f"on CPU and recent GPUs; '16-mixed' (fp16 with a gradient scaler) needs CUDA."
        )
    if value == "16-mixed" and not torch.cuda.is_available():
        # Running fp32 instead would hide a configuration error behind a slower, different run.
        raise DistkitError(
            "precision='16-mixed' needs CUDA (fp16 autocast with torch.amp.GradScaler), but CUDA is not "
            "available on this machine. Use precision='bf16-mixed' on CPU, or '32'."
        )
    return str(value)


class Precision:
    """Autocast, backward and optimizer step for one precision on one device.

    With fp16 the loss is scaled before backward; :meth:`unscale` (before clipping) and
    :meth:`step` unscale each optimizer step's gradients exactly once between them.
    """

    def __init__(self, precision: str, device: torch.device, *, autocast: bool = True) -> None:
        self.precision = precision
        self.device = device
        dtypes = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
        # autocast=False: the strategy applies the precision itself (FSDP's MixedPrecisionPolicy).
        self.dtype: torch.dtype | None = dtypes.get(precision) if autocast else None
        if precision == "16-mixed" and device.type != "cuda":
            raise DistkitError(
                f"precision='16-mixed' needs a CUDA device, but this rank trains on {device}; use "
                f"precision='bf16-mixed' on CPU."
            )
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
        )

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context of the forward pass."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, through the scaler under fp16."""
        if self.scaler is None:
            loss.backward()
        else:
            self.scaler.scale(loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale before clipping (fp16 only)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; under fp16 the scaler skips steps with inf gradients and adapts."""
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()

    def step_and_report(self, optimizer: torch.optim.Optimizer) -> bool:
        """:meth:`step`, and whether the optimizer stepped: False when the fp16 scaler found inf
        gradients and skipped it. Costs two host syncs more than :meth:`step` under fp16."""
        if self.scaler is None:
            optimizer.step()
            return True
        # GradScaler.update() multiplies the scale by backoff_factor (< 1, which torch enforces)
        # exactly when it skipped the step, and never lowers it otherwise.
        before = self.scaler.get_scale()
        self.step(optimizer)
        return self.scaler.get_scale() >= before

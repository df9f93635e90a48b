"""The FSDP strategy: torch's FSDP2 (``fully_shard``) under the Trainer's one loop.

The model is sharded in place by :func:`distkit.shard_model` before the optimizer is made, so the
optimizer holds this rank's shards (``DTensor`` parameters) and its state is sharded with them.
Nothing wraps the Trainer's step module: FSDP's hooks sit on the user's modules, and calling the
step module runs them.

How a bad step reaches every rank differs from DDP: FSDP's gradients are reduce-scattered from
unsharded parameters that exist only during the backward pass, so a hook on the (sharded) parameter
would never fire. The poisoned backward multiplies the loss by nan instead, which turns every
gradient of this rank to nan; the reduce-scatter carries it into every rank's shards. Each rank
holds a different shard, so a rank reads the first element of its own shard of the sentinel, and
the ranks agree on the value with one scalar all-reduce per optimizer step (a genuine overflow in
one rank's shard would otherwise send that rank alone down the rare path). An FSDP step already
runs two or three collectives per sharding unit; this is one more, of 8 bytes.

Buffers: FSDP2 neither shards nor synchronises them, so BatchNorm's running statistics would
follow each rank's own batches, and a checkpoint (which holds one copy) would resume every rank
from one rank's. With ``broadcast_buffers`` (the default) rank 0's persistent buffers reach every
rank once per optimizer step, after its forward passes: one broadcast, none without buffers. Rank
0's statistics then follow rank 0's batches alone, as under DDP, and every rank holds them at
every step boundary (checkpoints, validation, the end of fit).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from distkit import runtime
from distkit.sharding import _broadcast_buffers, _buffer_slots, shard_model
from distkit.trainer.strategies import _Plan
from distkit.trainer.strategies._base import _NULL_CONTEXT, Strategy, _tree_to_cpu

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__: list[str] = []


def _dtensor_type() -> type[DTensor]:
    from torch.distributed.tensor import DTensor

    return DTensor


class FSDPStrategyRunner(Strategy):
    """FSDP2 over the processes of the job (several processes only; a world of one runs plainly)."""

    checkpoint_format = "sharded"
    lockstep_forward = True

    def __init__(self, plan: _Plan, *, compile: bool = False) -> None:
        super().__init__(plan, compile=compile)
        self._dtensor = _dtensor_type()
        self._model: nn.Module | None = None
        # The gradient-sync flag as last set: set_requires_gradient_sync walks every module, so it
        # is called only when the flag changes.
        self._sync = True
        self._buffers: list[tuple[nn.Module, str]] = []

    def uses_autocast(self) -> bool:
        # FSDP's MixedPrecisionPolicy casts the gathered parameters to bfloat16 per unit (and
        # reduces in float32); autocast on top would cast again per operation.
        return False

    def prepare(self, model: nn.Module, device: torch.device, precision: str) -> None:
        options = self.plan.fsdp
        if not options.cpu_offload:
            model.to(device)
        shard_model(
            model,
            unit_classes=options.unit_classes,
            min_unit_params=options.min_unit_params,
            reshard_after_forward=options.reshard_after_forward,
            mixed_precision="bf16" if precision == "bf16-mixed" else None,
            cpu_offload=options.cpu_offload,
            activation_checkpointing=options.activation_checkpointing,
            compile=self.compile,
            reduce_dtype=options.reduce_dtype,
        )
        self._model = model
        self._sync = True
        self._buffers = _buffer_slots(model) if options.broadcast_buffers else []

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        # No wrapper: FSDP's hooks are on the model. Only a loss module beside it moves (the
        # sharded model is where prepare() put it, on the CPU under cpu_offload).
        for child in module.children():
            if child is not self._model:
                child.to(device)
        return module

    def accumulation(self, wrapped: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        if sync != self._sync:
            assert self._model is not None  # prepare() ran
            self._model.set_requires_gradient_sync(sync)  # type: ignore[operator]
            self._sync = sync
        return _NULL_CONTEXT

    def after_evaluation(self, model: nn.Module) -> None:
        # A unit that is not resharded after forward (the root always) waits for its backward
        # pass to reshard, and validation has none: its gathered parameters would stay registered
        # on the module, so model.parameters() would no longer be the optimizer's shards (and a
        # checkpoint would find no module holding them). Local: reshard() frees, gathers nothing.
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def sync_buffers(self) -> None:
        if self._buffers:
            _broadcast_buffers(self._buffers)

    def poisoned_backward(
        self, backward: Callable[[torch.Tensor], None], loss: torch.Tensor, params: Sequence[nn.Parameter]
    ) -> None:
        backward(loss * math.nan)

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, self._dtensor) else tensor

    def agreed(self, flag: torch.Tensor) -> float:
        # float64: a sum of two finite float32 gradients cannot overflow.
        value = flag.detach().reshape(1).to(torch.float64)
        dist.all_reduce(value)
        return value.item()

    def clip_gradients(self, params: Sequence[nn.Parameter], max_value: float, algorithm: str) -> bool:
        if algorithm == "norm":
            # torch reduces the shards' norms into the global norm (a DTensor): the same everywhere.
            norm = nn.utils.clip_grad_norm_(params, max_value)
            if isinstance(norm, self._dtensor):
                norm = norm.full_tensor()
            return math.isfinite(norm.item())
        nn.utils.clip_grad_value_(params, max_value)
        return True


def is_sharded(model: nn.Module) -> bool:
    """Whether some part of ``model`` is sharded by FSDP2 (``fully_shard``). Local."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


def full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The whole model's and optimizer's ``state_dict()`` on the CPU, on the main process (``None``
    on the others), whatever strategy trained them. Collective when ``model`` is sharded (every
    rank sends its shards, rank 0 assembles them): call on every rank."""
    if not is_sharded(model):
        if not runtime.is_main_process():
            return None
        model_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        return model_state, _tree_to_cpu(optimizer.state_dict())
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    if not runtime.is_main_process():
        return None
    return dict(model_state), _by_index(_tree_to_cpu(optim_state))


def _by_index(state: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter names as ``torch.optim.Optimizer.state_dict()``
    keys it: parameters numbered in the order of the groups. Local."""
    names: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        numbered = []
        for name in group["params"]:
            names.setdefault(name, len(names))
            numbered.append(names[name])
        groups.append({**group, "params": numbered})
    return {"state": {names[name]: value for name, value in state["state"].items()}, "param_groups": groups}

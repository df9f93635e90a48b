"""What the training loop asks of a strategy, and the strategies of one device, DP and DDP.

The loop in :mod:`distkit.trainer.trainer` never asks which wrapper it holds: it calls one small
interface, :class:`Strategy`, which the strategy objects fill in (this module for one device,
``nn.DataParallel`` and DDP; :mod:`distkit.trainer.strategies._fsdp` for FSDP). A new strategy is one new
subclass, not a new branch in the loop.

The interface, in the order ``fit`` uses it:

- :meth:`Strategy.prepare`: the user's model on its device, compiled, sharded (before the
  optimizer is made, so the optimizer holds what the strategy made of the parameters).
- :meth:`Strategy.wrap`: the module the loop calls (DDP's or DP's wrapper, or the module itself).
- :meth:`Strategy.accumulation`: the context of a micro-batch's forward and backward (DDP's
  ``no_sync`` or FSDP's gradient-sync flag on all but the last micro-batch).
- :meth:`Strategy.poisoned_backward` and :meth:`Strategy.agreed`: how a rank's bad step reaches
  every rank, and how the ranks read it (the loop's module docs explain the protocol).
- :meth:`Strategy.sync_buffers`: the ranks' buffers made equal once the step's forward passes ran.
- :meth:`Strategy.clip_gradients`: clipping, and whether the norm was finite.
- :meth:`Strategy.finish_step`: after each optimizer step, whether it was taken (a skipped or
  discarded step puts back what its gradient reduction changed in the strategy's own state).
- :attr:`Strategy.checkpoint_format`: ``"full"`` (one file written by the main process) or
  ``"sharded"`` (every rank writes its shards; the CheckpointManager chooses by the state), and
  :meth:`Strategy.checkpoint_entries`: the strategy's own state in checkpoints (DDP's PowerSGD).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from distkit import runtime
from distkit.trainer.strategies import DEFAULT_POWERSGD_RANK, DEFAULT_POWERSGD_WARMUP_STEPS, _comm, _Plan

__all__: list[str] = []

_NULL_CONTEXT = contextlib.nullcontext()  # reusable: one fewer object per micro-batch
_SHORT_SENTINEL = 32  # elements up to which DDP reads its sentinel with tolist()


def _poison(grad: torch.Tensor) -> torch.Tensor:
    # The gradient hook of a poisoned backward pass (see the loop's module docs).
    return torch.full_like(grad, math.nan)


def compile_forward(module: nn.Module) -> None:
    """``torch.compile`` ``module.forward`` in place. Local.

    The compiled forward replaces the method on the instance: no ``OptimizedModule`` wrapper, so
    the parameter names (and the checkpoints) stay free of ``_orig_mod.``.
    """
    module.forward = torch.compile(module.forward)


class Strategy:
    """One device, or a world of one: no wrapper, no communication. The base of every strategy.

    Attributes:
        plan: What :func:`distkit.trainer.strategies.resolve` decided.
        compile: Whether :meth:`prepare` compiles the model.
        checkpoint_format: ``"full"`` or ``"sharded"``.
        scan_all: Whether some parameters may get no gradient in a step on some rank, so the first
            element of every gradient is read instead of one sentinel's.
    """

    checkpoint_format = "full"
    # Whether the model's forward pass is collective, so every rank must run as many (validation).
    lockstep_forward = False
    # Whether the gradient reduction keeps state across steps (DDP's PowerSGD), which
    # finish_step(False) puts back: the loop then also learns when the fp16 scaler skipped a step,
    # and calls finish_step after each optimizer step only then.
    step_state = False
    # Whether the strategy defines sync_buffers (FSDP): the loop calls it each optimizer step only
    # then (set for every subclass by __init_subclass__).
    syncs_buffers = False

    def __init__(self, plan: _Plan, *, compile: bool = False) -> None:
        self.plan = plan
        self.compile = compile
        self.scan_all = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.syncs_buffers = cls.sync_buffers is not Strategy.sync_buffers

    def uses_autocast(self) -> bool:
        """Whether the Trainer's mixed precision runs as autocast (FSDP: its own policy instead)."""
        return True

    def prepare(self, model: nn.Module, device: torch.device, precision: str) -> None:
        """Move ``model`` to ``device`` and compile it when asked. Local here; FSDP: collective."""
        model.to(device)
        if self.compile:
            compile_forward(model)

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        """The module the loop calls for ``module`` (the Trainer's step module: the model and a loss
        module, both moved to ``device``). Collective for DDP."""
        return module.to(device)

    def accumulation(self, wrapped: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        """The context of one micro-batch; ``sync`` is False on all but the last of an optimizer step."""
        return _NULL_CONTEXT

    def after_evaluation(self, model: nn.Module) -> None:
        """Put the model back as training and checkpoints expect it after forward passes without a
        backward pass (validation). Local."""

    def poisoned_backward(
        self, backward: Callable[[torch.Tensor], None], loss: torch.Tensor, params: Sequence[nn.Parameter]
    ) -> None:
        """Backward with every gradient of this rank turned to nan (a one-off hook per parameter),
        so the gradient reduction carries the nan to every rank."""
        handles = [p.register_hook(_poison) for p in params]
        try:
            backward(loss)
        finally:
            for handle in handles:
                handle.remove()

    def sync_buffers(self) -> None:
        """Make every rank's buffers equal after the forward passes of an optimizer step (FSDP:
        rank 0's; DDP broadcasts them before each forward itself). Collective where it acts; the
        loop calls it each optimizer step only for a strategy that defines it (``syncs_buffers``)."""

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a parameter or gradient (all of it unless the strategy shards)."""
        return tensor

    def agreed(self, flag: torch.Tensor) -> float:
        """The value of a one-element gradient flag, the same on every rank.

        DDP's gradients are identical after the all-reduce, so reading is agreeing.
        """
        return flag.item()

    def read_sentinel(self, grad: torch.Tensor) -> float:
        """One element of the sentinel's gradient (a bias: ``grad[0]`` is the cheapest read), the
        same on every rank: non-finite when any rank poisoned its backward pass. DDP's gradients
        are identical after the all-reduce, so reading is agreeing; FSDP's shards differ, and its
        :meth:`agreed` is an all-reduce."""
        grad = self.local(grad)
        return self.agreed(grad[0] if grad.dim() == 1 else grad.reshape(-1)[0])

    def sentinel_reader(self, sentinel: nn.Parameter) -> Callable[[torch.Tensor], float]:
        """What the loop calls on ``sentinel``'s gradient each optimizer step: :meth:`read_sentinel`,
        or a faster read chosen once from the parameter's shape. Local."""
        return self.read_sentinel

    def clip_gradients(self, params: Sequence[nn.Parameter], max_value: float, algorithm: str) -> bool:
        """Clip the gradients of ``params`` by ``"norm"`` or ``"value"``; False when the norm is not
        finite (the same on every rank: the gradients are reduced first)."""
        if algorithm == "norm":
            norm = nn.utils.clip_grad_norm_(params, max_value)
            return math.isfinite(norm.item())
        nn.utils.clip_grad_value_(params, max_value)
        return True

    def finish_step(self, taken: bool) -> None:
        """After an optimizer step was decided: ``taken`` is False when it changed no weight
        (skipped on every rank for a non-finite value, discarded for a stop request, or skipped by
        the fp16 scaler). Such a step leaves the strategy's state as it was before its gradient
        reduction. Local; called after each optimizer step only where :attr:`step_state` is set."""

    def checkpoint_entries(self) -> dict[str, Any]:
        """The strategy's own entries of the Trainer's checkpoints (objects with ``state_dict`` and
        ``load_state_dict``); none unless the strategy keeps state of its own."""
        return {}

    def teardown(self, model: nn.Module) -> None:
        """Undo what :meth:`prepare` did to the user's module that should not outlive ``fit``."""
        if self.compile and "forward" in vars(model):
            del model.forward  # back to the class's (uncompiled) forward


class DataParallelStrategy(Strategy):
    """``nn.DataParallel`` over the GPUs of one process."""

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        module.to(device)
        return nn.DataParallel(module, device_ids=list(self.plan.cuda_indices), output_device=device)


class DDPStrategyRunner(Strategy):
    """``DistributedDataParallel`` over the processes (a world of one: no wrapper), with its
    gradient compression (:mod:`distkit.trainer.strategies._comm`)."""

    def __init__(self, plan: _Plan, *, compile: bool = False) -> None:
        super().__init__(plan, compile=compile)
        options = plan.ddp
        self.scan_all = options.find_unused_parameters or options.static_graph
        # Made in a world of one too, so that its checkpoints hold the entry a resume on several
        # ranks looks for.
        self._powersgd: _comm.PowerSGD | None = None
        if options.comm_hook == "powersgd":
            self._powersgd = _comm.PowerSGD(
                rank=options.powersgd_rank or DEFAULT_POWERSGD_RANK,
                warmup_steps=options.powersgd_warmup_steps or DEFAULT_POWERSGD_WARMUP_STEPS,
            )
            self.step_state = True

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        module.to(device)
        if runtime.get_world_size() == 1:
            return module
        device_ids = [device.index] if device.type == "cuda" else None
        options = self.plan.ddp
        ddp = nn.parallel.DistributedDataParallel(module, device_ids=device_ids, **options.ddp_kwargs())
        _comm.register(ddp, options.comm_hook, self._powersgd)
        return ddp

    def finish_step(self, taken: bool) -> None:
        if self._powersgd is not None:
            self._powersgd.finish_step(taken)

    def checkpoint_entries(self) -> dict[str, Any]:
        return {} if self._powersgd is None else {"comm_hook": self._powersgd}

    def accumulation(self, wrapped: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        if sync or not isinstance(wrapped, nn.parallel.DistributedDataParallel):
            return _NULL_CONTEXT
        return wrapped.no_sync()

    def read_sentinel(self, grad: torch.Tensor) -> float:
        # The gradients are whole and reduced: reading is agreeing.
        return grad.reshape(-1)[0].item()

    def sentinel_reader(self, sentinel: nn.Parameter) -> Callable[[torch.Tensor], float]:
        # A short bias is copied out whole, which costs a quarter of an indexing and .item() (10
        # elements: 0.2 against 0.8 us warm; equal at about 64). Its shape is the parameter's, so
        # it is looked at once here, not each step: right after the backward pass, when little of
        # the interpreter is in the CPU's caches, dim() and len() cost about 3 us a step (issue 29).
        if sentinel.dim() == 1 and len(sentinel) <= _SHORT_SENTINEL:
            return _first_of_short
        return self.read_sentinel


def _first_of_short(grad: torch.Tensor) -> float:
    """The first element of a short one-dimensional gradient (DDP's sentinel, a bias)."""
    return grad.tolist()[0]  # type: ignore[no-any-return]


def _tree_to_cpu(obj: Any) -> Any:
    """``obj`` with its tensors copied to the CPU (for sending to another process)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return {key: _tree_to_cpu(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_tree_to_cpu(value) for value in obj]
    if isinstance(obj, tuple):
        return tuple(_tree_to_cpu(value) for value in obj)
    return obj

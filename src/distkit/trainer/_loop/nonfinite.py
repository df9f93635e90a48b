"""The rare path of an optimizer step: a non-finite loss or gradient, or a stop request.

Ranks agree without a collective of their own. A rank whose loss is not finite, or that must stop
(SIGTERM, ``should_stop``), poisons its backward pass (the strategy's
:meth:`~distkit.trainer.strategies._base.Strategy.poisoned_backward`: a one-off gradient hook on every
parameter under DDP, a nan-scaled loss under FSDP) so that its gradients turn to nan before they
are reduced. The reduction carries the nan to every rank, so every rank sees the sentinel go
non-finite after the same backward, and only then do the ranks exchange one small message
(:func:`agree`) to learn why. Normal steps run no extra operation besides reading the sentinel
(FSDP: one scalar all-reduce, as each rank holds another shard of it). DDP without
``find_unused_parameters``/``static_graph`` makes every rank use every parameter in every step, so
one element of one parameter suffices; otherwise the first element of every gradient is read. A
stop request costs the step it travels in: that step is discarded (its batches and random draws are
given back) and training stops after the step before it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from distkit import runtime
from distkit.collectives import all_gather_object
from distkit.errors import DistkitError

if TYPE_CHECKING:
    from distkit.trainer.trainer import Trainer

__all__: list[str] = []

_log = runtime.get_logger("distkit.trainer", main_process_only=True)


def scan_gradients(trainer: Trainer) -> float:
    """The sentinel's stand-in when it got no gradient or some parameters may go unused."""
    strategy = trainer._strategy
    assert strategy is not None  # set up by fit() before the first step
    local = strategy.local
    grads = [local(p.grad) for p in trainer._params if p.grad is not None]
    firsts = [grad.reshape(-1)[0].float() for grad in grads if grad.numel() > 0]
    # Under find_unused_parameters a rank's poison reaches the parameters that rank used; the
    # sum of first elements is nan if any of them is.
    total = torch.stack(firsts).sum() if firsts else torch.zeros((), device=trainer.device)
    return strategy.agreed(total)


def agree(trainer: Trainer, value: float, micro: int) -> tuple[bool | None, bool]:
    """The rare path, when the sentinel is not finite: learn why from every rank and decide.

    Collective: one small gather, reached by every rank at the same step because the sentinel
    is the same on every rank. Returns ``(take_step, stop_now)``; ``take_step`` is ``None`` when
    a stop request discarded the step (its batches and RNG draws are given back).
    """
    mine = (value, trainer._preempt_requested, trainer._request_stop and not trainer._preempt_requested)
    everyone = all_gather_object(mine)
    bad = [rank for rank, (loss, _, _) in enumerate(everyone) if not math.isfinite(loss)]
    preempt = any(flag for _, flag, _ in everyone)
    stop = preempt or any(flag for _, _, flag in everyone)
    trainer._request_stop = False
    if stop and not bad:
        discard(trainer, micro, preempt)
        return None, True
    if stop:
        trainer._should_stop = True
        trainer._job_preempt = preempt
    if bad:
        skip(trainer, f"non-finite loss on rank(s) {bad}", bad)
        return False, stop
    # Every loss finite, no stop: the gradients themselves overflowed. Under fp16 that is the
    # scaler's business (it skips the step and lowers the scale); otherwise skip the step.
    if trainer._precision is not None and trainer._precision.scaler is not None:
        trainer._nonfinite_run.clear()
        return True, False
    skip(trainer, "non-finite gradients (every loss was finite)", [])
    return False, False


def discard(trainer: Trainer, micro: int, preempt: bool) -> None:
    """Undo the step in flight for a stop request: no update, its batches and RNG draws back."""
    assert trainer.optimizer is not None
    trainer.optimizer.zero_grad(set_to_none=True)
    for p in trainer._params:
        p.grad = None  # also the poisoned ones the optimizer does not hold
    for generator, state in zip(trainer._generators, trainer._states_at_step, strict=True):
        generator.set_state(state)
    if trainer._extras_at_step is not None and trainer._extras_at_step[0] == trainer.global_step:
        _, trainer._extra_sums, trainer._extra_count = trainer._extras_at_step
    trainer._batches_done -= micro
    trainer._given_back = micro
    trainer._should_stop = True
    trainer._job_preempt = preempt


def skip(trainer: Trainer, why: str, ranks: list[int]) -> None:
    """Count a step skipped on every rank; raise after ``max_consecutive_nonfinite`` in a row."""
    assert trainer.optimizer is not None and trainer._strategy is not None
    local = trainer._strategy.local
    for p in trainer._params:
        grad = None if p.grad is None else local(p.grad)
        if grad is not None and grad.numel() and not math.isfinite(grad.reshape(-1)[0].item()):
            p.grad = None  # a poisoned gradient the optimizer does not clear
    step = trainer.global_step + 1
    trainer.skipped_steps += 1
    trainer._nonfinite_run.append(step)
    _log.warning("step %d skipped on every rank: %s (%d in a row)", step, why, len(trainer._nonfinite_run))
    if len(trainer._nonfinite_run) >= trainer.max_consecutive_nonfinite:
        where = f", last on rank(s) {ranks}" if ranks else ""
        raise DistkitError(
            f"[rank {runtime.get_rank()}/{runtime.get_world_size()}] the loss or gradients were "
            f"non-finite (nan or inf) for {len(trainer._nonfinite_run)} consecutive optimizer steps "
            f"{trainer._nonfinite_run}{where}; every rank skipped them ({why}). Lower the learning "
            f"rate, set gradient_clip_val, check the data for nan/inf, or use "
            f"precision='bf16-mixed' instead of '16-mixed'; raise max_consecutive_nonfinite (now "
            f"{trainer.max_consecutive_nonfinite}) to tolerate longer runs."
        )

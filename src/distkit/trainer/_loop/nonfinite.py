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
    from distkit.trainer._run import Run

__all__: list[str] = []

_log = runtime.get_logger("distkit.trainer", main_process_only=True)


def scan_gradients(run: Run) -> float:
    """The sentinel's stand-in when it got no gradient or some parameters may go unused."""
    strategy = run.strategy
    local = strategy.local
    grads = [local(p.grad) for p in run.params if p.grad is not None]
    firsts = [grad.reshape(-1)[0].float() for grad in grads if grad.numel() > 0]
    # Under find_unused_parameters a rank's poison reaches the parameters that rank used; the
    # sum of first elements is nan if any of them is.
    total = torch.stack(firsts).sum() if firsts else torch.zeros((), device=run.device)
    return strategy.agreed(total)


def agree(run: Run, value: float, micro: int) -> tuple[bool | None, bool]:
    """The rare path, when the sentinel is not finite: learn why from every rank and decide.

    Collective: one small gather, reached by every rank at the same step because the sentinel
    is the same on every rank. Returns ``(take_step, stop_now)``; ``take_step`` is ``None`` when
    a stop request discarded the step (its batches and RNG draws are given back).
    """
    mine = (value, run.preempt_requested, run.request_stop and not run.preempt_requested)
    everyone = all_gather_object(mine)
    bad = [rank for rank, (loss, _, _) in enumerate(everyone) if not math.isfinite(loss)]
    preempt = any(flag for _, flag, _ in everyone)
    stop = preempt or any(flag for _, _, flag in everyone)
    run.request_stop = False
    if stop and not bad:
        discard(run, micro, preempt)
        return None, True
    if stop:
        run.should_stop = True
        run.job_preempt = preempt
    if bad:
        skip(run, f"non-finite loss on rank(s) {bad}", bad)
        return False, stop
    # Every loss finite, no stop: the gradients themselves overflowed. Under fp16 that is the
    # scaler's business (it skips the step and lowers the scale); otherwise skip the step.
    if run.precision is not None and run.precision.scaler is not None:
        run.nonfinite_run.clear()
        return True, False
    skip(run, "non-finite gradients (every loss was finite)", [])
    return False, False


def discard(run: Run, micro: int, preempt: bool) -> None:
    """Undo the step in flight for a stop request: no update, its batches and RNG draws back, and
    the strategy's state (PowerSGD's) as before the step's reduction."""
    run.strategy.finish_step(False)
    run.optimizer.zero_grad(set_to_none=True)
    for p in run.params:
        p.grad = None  # also the poisoned ones the optimizer does not hold
    for generator, state in zip(run.generators, run.states_at_step, strict=True):
        generator.set_state(state)
    if run.extras_at_step is not None and run.extras_at_step[0] == run.global_step:
        _, run.extra_sums, run.extra_count = run.extras_at_step
    run.batches_done -= micro
    run.given_back = micro
    run.should_stop = True
    run.job_preempt = preempt


def skip(run: Run, why: str, ranks: list[int]) -> None:
    """Count a step skipped on every rank; raise after ``max_consecutive_nonfinite`` in a row."""
    local = run.strategy.local
    for p in run.params:
        grad = None if p.grad is None else local(p.grad)
        if grad is not None and grad.numel() and not math.isfinite(grad.reshape(-1)[0].item()):
            p.grad = None  # a poisoned gradient the optimizer does not clear
    step = run.global_step + 1
    run.skipped_steps += 1
    run.nonfinite_run.append(step)
    _log.warning("step %d skipped on every rank: %s (%d in a row)", step, why, len(run.nonfinite_run))
    if len(run.nonfinite_run) >= run.trainer.max_consecutive_nonfinite:
        where = f", last on rank(s) {ranks}" if ranks else ""
        raise DistkitError(
            f"{runtime._rank_label()} the loss or gradients were "
            f"non-finite (nan or inf) for {len(run.nonfinite_run)} consecutive optimizer steps "
            f"{run.nonfinite_run}{where}; every rank skipped them ({why}). Lower the learning "
            f"rate, set gradient_clip_val, check the data for nan/inf, or use "
            f"precision='bf16-mixed' instead of '16-mixed'; raise max_consecutive_nonfinite (now "
            f"{run.trainer.max_consecutive_nonfinite}) to tolerate longer runs."
        )

"""What the loop calls once per micro-batch and once per optimizer step: the step module (the model
and its loss, which the strategy wraps) and the optimizer step with its clipping, skip and stop
decisions. The small readers of batches live in :mod:`distkit.trainer._loop.batches`."""

from __future__ import annotations

import difflib
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distkit import runtime
from distkit.trainer._loop import (
    evaluate as _evaluate,
    logs as _logs,
    model_io as _model_io,
    nonfinite as _nonfinite,
    preemption as _preemption,
)

if TYPE_CHECKING:
    from distkit.trainer._run import Run

__all__: list[str] = []

_log = runtime.get_logger("distkit.trainer", main_process_only=True)


class _StepModule(nn.Module):
    """What the strategy wraps: the user's module and its loss (``training_step``, ``loss_fn``, or
    the model's own loss: :mod:`distkit.trainer._loop.model_io`)."""

    def __init__(self, module: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, *, per_device: bool):
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn
        self.convention = _model_io.convention(module, loss_fn)
        self.target_name = _model_io.target_parameter(module)
        # Under nn.DataParallel every device returns 1-element vectors, which it concatenates.
        self.per_device = per_device
        # The batch and loss of a plain model are checked on the first step only (hot path).
        self.checked = False

    def forward(self, batch: Any, batch_idx: int) -> tuple[torch.Tensor, dict[str, Any]]:
        # _modules/_parameters directly: nn.Module.__getattr__ costs a microsecond per lookup.
        # Any: the user's module, whose training_step (when it has one) nn.Module's type does not know.
        module: Any = self._modules["module"]
        extras: dict[str, Any] = _NO_EXTRAS
        convention = self.convention
        if convention == "training_step":
            loss, extras = _split_step_output(module.training_step(batch, batch_idx))
        elif convention == "model_loss":
            loss = _model_io.loss_of(_model_io.call_with_target(module, batch, self.target_name), module)
            self.checked = True
        elif self.checked:
            inputs, target = batch
            # A function sits in __dict__, a loss module (nn.CrossEntropyLoss()) in _modules.
            loss_fn = self.__dict__.get("loss_fn") or self._modules["loss_fn"]
            loss = loss_fn(module(inputs), target)  # type: ignore[misc]
        else:
            loss = self._first_plain_step(module, batch)
        if self.per_device:
            # nn.DataParallel gathers tensors only: numbers travel as 1-element tensors too.
            extras = {k: torch.as_tensor(v, device=loss.device).reshape(1) for k, v in extras.items()}
            return loss.reshape(1), extras
        return loss, extras

    # Called once per micro-batch by the Trainer, DDP or DataParallel, and never hooked: skip
    # nn.Module.__call__'s hook dispatch (measurable on an overhead-bound model).
    __call__ = forward

    def _first_plain_step(self, module: nn.Module, batch: Any) -> torch.Tensor:
        """``loss_fn(model(inputs), target)`` on the first batch, with errors that say what to do."""
        inputs, target = _model_io.split_batch(batch)
        loss_fn = self.__dict__.get("loss_fn") or self._modules["loss_fn"]
        # Two steps, so that the error says which of them raised: a dtype error inside the
        # model is no problem of loss_fn or the target.
        try:
            output = module(inputs)
        except torch.OutOfMemoryError:
            raise
        except (TypeError, ValueError, RuntimeError, IndexError) as err:
            raise _model_io.first_failure(module, batch, err, in_model=True) from err
        try:
            loss = loss_fn(output, target)  # type: ignore[misc]
        except torch.OutOfMemoryError:
            raise
        except (TypeError, ValueError, RuntimeError, IndexError) as err:
            raise _model_io.first_failure(module, batch, err, in_model=False, output=output) from err
        _model_io.check_loss(loss)
        self.checked = True
        return loss  # type: ignore[no-any-return]


_NO_EXTRAS: dict[str, Any] = {}


def _mean_over_devices(loss: torch.Tensor, extras: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    # nn.DataParallel concatenated one value per GPU; the batch's value is their mean.
    return loss.mean(), {k: v.mean() for k, v in extras.items()}


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
            f"{_returned(output)}"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise TypeError(
            "training_step() must return a one-element loss tensor that requires grad (computed from "
            "the model's output, not detached or converted with .item())."
        )
    return loss.reshape(()), extras


def _returned(output: Any) -> str:
    """What a training_step returned instead of the loss, and what to return instead."""
    if output is None:
        return (
            "None: end it with `return loss`. The Trainer calls backward() and the optimizer itself, "
            "so training_step does not."
        )
    if isinstance(output, Mapping):
        keys = [str(key) for key in output]
        close = difflib.get_close_matches("loss", keys, n=1, cutoff=0.6)
        hint = f" Did you mean 'loss' instead of {close[0]!r}?" if close else ""
        return f"a {type(output).__name__} without it (keys: {', '.join(map(repr, keys))}).{hint}"
    if isinstance(output, (tuple, list)):
        return (
            f"a {type(output).__name__} of {len(output)}; return {{'loss': loss, 'name': value, ...}} "
            f"to log other values beside the loss."
        )
    if isinstance(output, (int, float)):
        return (
            f"a {type(output).__name__} ({output!r}): return the loss tensor itself, not loss.item() "
            f"(backward needs the tensor)."
        )
    return f"{type(output).__name__}."


def optimizer_step(run: Run, loss: torch.Tensor, value: float, micro: int) -> bool:
    """Take, skip or discard the optimizer step after the last micro-batch; True when training
    stops now. ``loss``/``value``: this rank's loss of the step (mean over its micro-batches);
    ``loss`` is detached when ``run.every_step_callbacks`` get it (epoch.py), else perhaps not."""
    start = time.perf_counter()  # the optimizer phase (distkit.stragglers), to zero_grad
    precision, optimizer, strategy = run.precision, run.optimizer, run.strategy
    take_step: bool | None = True  # None: discarded for a stop request
    stop = False
    if strategy.syncs_buffers:  # FSDP: rank 0's buffers, before checkpoints and validation read them
        strategy.sync_buffers()
    # One gradient element, non-finite on every rank if any rank poisoned its backward pass. A
    # world of one has no rank to agree with and knows whether it poisoned its own: no read (a
    # host read and an indexing a step, about 1 % of an overhead-bound step; issue 29).
    if run.world_size == 1:
        flag = math.nan if run.poisoned else 0.0
    else:
        grad = None if run.scan_all or run.sentinel is None else run.sentinel.grad
        read = run.read_sentinel
        flag = _nonfinite.scan_gradients(run) if grad is None or read is None else read(grad)
    run.poisoned = False
    if math.isfinite(flag):
        if run.nonfinite_run:
            run.nonfinite_run.clear()
        run.window_sum += value
        run.window_count += 1
        run.epoch_sum += value
        run.epoch_count += 1
    else:
        take_step, stop = _nonfinite.agree(run, value, micro)
        if take_step is None:  # discarded for a stop request
            if run.job_preempt:
                _preemption.preempt(run)
            return True

    clip = run.trainer.gradient_clip_val
    if take_step and clip is not None and not _clip_gradients(run, clip):
        take_step = precision.scaler is not None  # the scaler skips it and lowers its scale
        if not take_step:
            _nonfinite.skip(run, "the gradients' norm was non-finite (every loss was finite)", [])
    taken = bool(take_step)
    if take_step:
        if precision.scaler is None:
            optimizer.step()
        elif strategy.step_state:
            taken = precision.step_and_report(optimizer)
        else:
            precision.step(optimizer)
        if run.lr_scheduler is not None and run.scheduler_interval == "step":
            run.lr_scheduler.step()
    if strategy.step_state:  # PowerSGD: a step not taken leaves its state as it was
        strategy.finish_step(taken)
    optimizer.zero_grad(set_to_none=True)
    timer = run.timer
    timer.sums[3] += time.perf_counter() - start
    timer.steps += 1
    step = run.global_step = run.global_step + 1
    if stop or step >= run.next_event:
        return _step_end_events(run, loss, stop)
    # Nothing is due at this step (schedule_events): only the callbacks that act at every step,
    # which the loop handed the detached loss.
    for cb in run.every_step_callbacks:
        cb.on_train_step_end(run.trainer, loss)
    return (run.job_preempt or run.request_stop) and _stops_now(run)


def _step_end_events(run: Run, loss: torch.Tensor, stop: bool) -> bool:
    """The end of a step at which something may be due: a validation, the logging step, a
    scheduled callback's work, ``max_steps``. True when training stops now."""
    if run.val_loader is not None and _validation_due(run):
        _evaluate.validate_now(run)  # before the step-end callbacks save this step

    log = run.global_step % run.trainer.log_every_n_steps == 0
    if log:
        # The logging step's one collective, before the step-end callbacks: the Trainer's
        # ModelCheckpoint learns from it whether to save by time. A checkpoint saved by a step-end
        # callback logs this step's metrics first (_Counters).
        _logs.reduce_window(run)
        run.log_pending = True
    detached = loss.detach()
    for cb in run.step_end_callbacks:
        cb.on_train_step_end(run.trainer, detached)
    if log and run.log_pending:
        _logs.log_step(run)
    schedule_events(run)
    if (run.job_preempt or run.request_stop) and _stops_now(run):
        return True
    return stop or run.finished()


def _stops_now(run: Run) -> bool:
    """After a step: whether a preemption or, in a world of one, a stop request ends training now."""
    if run.job_preempt:
        _preemption.preempt(run)
        return True
    if run.request_stop and run.world_size == 1:
        # A world of one stops after the step a request came in (a callback's should_stop, SIGTERM):
        # the step is kept, as no other rank needs telling (epoch.py).
        run.request_stop = False
        run.should_stop = True
        if run.preempt_requested:
            run.job_preempt = True
            _preemption.preempt(run)
        return True
    return False


def schedule_events(run: Run) -> None:
    """Set ``run.next_event``: the first global step after this one whose end may have work to do
    (a validation, the logging step, ``max_steps``, a scheduled callback's next call). Steps before
    it run only the callbacks that act at every step: one comparison a step instead of the checks
    (issue 29). Early is harmless (the step's end finds nothing due), late would skip work."""
    step, trainer = run.global_step, run.trainer
    every = trainer.log_every_n_steps
    due: float = (step // every + 1) * every
    if trainer.max_steps is not None:
        due = min(due, trainer.max_steps)
    if run.val_loader is not None:
        if run.val_every is not None:
            due = min(due, (step // run.val_every + 1) * run.val_every)
        elif run.val_steps_in_epoch:
            # Counted in this epoch's optimizer steps, one more at each step's end.
            done = -(-run.batches_done // trainer.accumulate_grad_batches)
            later = [s - done for s in run.val_steps_in_epoch if s > done]
            if later:
                due = min(due, step + min(later))
    for cb in run.scheduled_callbacks:
        due = min(due, cb._next_step_end(trainer))
    run.next_event = due


def _validation_due(run: Run) -> bool:
    """Whether ``val_check_interval`` asks for a validation after this optimizer step."""
    every = run.val_every
    if every is not None:
        return run.global_step % every == 0
    steps = run.val_steps_in_epoch
    if steps is None or not _evaluate.validated_epoch(run):
        return False
    return -(-run.batches_done // run.trainer.accumulate_grad_batches) in steps


def _clip_gradients(run: Run, clip: float) -> bool:
    """Clip (unscaling first under fp16); False when the gradients' norm is not finite."""
    run.precision.unscale(run.optimizer)  # fp16: exactly once per optimizer step
    params = [p for p in run.model.parameters() if p.grad is not None]
    # The norm is the same on every rank (the gradients are reduced), so every rank decides alike.
    return run.strategy.clip_gradients(params, clip, run.trainer.gradient_clip_algorithm)

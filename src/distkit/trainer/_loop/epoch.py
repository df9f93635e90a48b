"""The hot loop: one epoch of micro-batches and optimizer steps (the scheme in
:mod:`distkit.trainer.trainer`'s docstring). Collective, as ``fit`` is."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distkit import runtime
from distkit.data import StreamLoader
from distkit.data._loader import _DatasetResized
from distkit.errors import DistkitError
from distkit.trainer._loop import evaluate as _evaluate, logs as _logs
from distkit.trainer._loop.batches import length, to_device
from distkit.trainer._loop.step import (
    _mean_over_devices,
    _step_end_events,
    _StepModule,
    _stops_now,
    optimizer_step,
    schedule_events,
)

if TYPE_CHECKING:
    from distkit.trainer._run import Run

__all__: list[str] = []


def train(run: Run) -> None:
    """Epochs until ``max_epochs``/``max_steps``, a stop or a preemption; then the callbacks'
    ``on_fit_end`` and the loggers' record of the last checkpoint."""
    while not run.finished():
        try:
            run_epoch(run)
        except _DatasetResized as err:
            kind = "validation" if err.evaluation else "training"
            raise DistkitError(
                f"the {kind} dataset had {err.made} samples when fit() made its loader and has "
                f"{err.now} now: the epochs, the exact evaluation and the resume positions are counted "
                f"on the first length. Keep the dataset's size fixed during fit(); to train on the "
                f"changed dataset, start another fit() (a loader you passed to fit must be made again)."
            ) from None
        if run.preempted:
            break
        if run.epoch_finished:
            # After fit, current_epoch counts the completed epochs (as max_epochs does), and the
            # position is the next epoch's start (a checkpoint taken after fit resumes there).
            run.current_epoch += 1
            run.batches_done = 0
            run.epoch_finished = False
            run.epoch_sum, run.epoch_count = 0.0, 0
        if run.should_stop:
            break
    if run.trainer.profiler == "simple" and run.stragglers is not None:
        # The steps since the last logging step: one collective per fit, on every rank alike.
        if run.timer.steps:
            run.stragglers.check(run.timer)
        runtime.rank_zero_print(run.stragglers.summary())
    for cb in run.callbacks:
        cb.on_fit_end(run.trainer)
    _logs.log_final_checkpoint(run)  # committed by now (ModelCheckpoint.on_fit_end waited)


def run_epoch(run: Run) -> None:
    """One pass over the training loader (or the rest of it, after a resume), then the epoch's end."""
    loader = run.train_loader
    first = run.batches_done
    if callable(getattr(loader, "set_epoch", None)):
        loader.set_epoch(run.current_epoch)  # keeps a restored mid-epoch position
    elif callable(getattr(getattr(loader, "sampler", None), "set_epoch", None)):
        loader.sampler.set_epoch(run.current_epoch)
    run.epoch_finished = False
    if not first:  # a resumed epoch keeps the restored sums of its first steps
        run.epoch_sum, run.epoch_count = 0.0, 0
    run.model.train()
    for cb in run.callbacks:
        cb.on_train_epoch_start(run.trainer)
    schedule_events(run)

    # Held until the epoch's end work is done: a distkit loader closes its pass (and moves to
    # the next epoch) when the iterator goes, and a checkpoint taken at the end of an epoch cut
    # short (max_steps, should_stop) must record this epoch's position.
    iterator: Iterable[Any] = iter(loader)
    if first and not callable(getattr(loader, "load_state_dict", None)):
        iterator = itertools.islice(iterator, first, None)
    if run.num_batches is not None and run.num_batches != length(loader):
        # The ranks' own loaders differ in length: every rank stops at the shortest (set-up).
        iterator = itertools.islice(iterator, run.num_batches - first)
    # A loader without a length (a stream) says when the epoch's last batch comes, where an
    # accumulation is synced and the epoch ends.
    ends: Callable[[], bool] | None = None
    if run.num_batches is None:
        iterator, ends = _epoch_end(loader, iterator)
    # The hot loop reads locals only: on an overhead-bound model attribute lookups and calls are
    # a visible share of the step (benchmarks/bench_trainer.py).
    wrapped, precision, device = run.wrapped, run.precision, run.device
    move = device.type != "cpu"
    accumulate = run.trainer.accumulate_grad_batches
    strategy = run.strategy
    accumulation, poison, params = strategy.accumulation, strategy.poisoned_backward, run.params
    per_device = run.per_device
    plain = precision.dtype is None and precision.scaler is None
    # Without fp16's scaler the backward pass is the loss's own: one Python call fewer a step.
    backward = precision.backward if precision.scaler is not None else torch.Tensor.backward
    last_index = -1 if run.num_batches is None else run.num_batches - 1
    generators = run.generators
    one_generator = len(generators) == 1
    cpu_generator = generators[0]
    # With several ranks a stop request poisons the step in flight, which every rank discards
    # (giving back its batches and random draws). A world of one has no rank to tell: it finishes
    # the step and stops after it (optimizer_step), so it keeps no generator state (about 1 % of
    # an overhead-bound step; issue 29).
    world_of_one = run.world_size == 1
    # The loss the callbacks get is detached; at a step with no callback to call (most steps when
    # only the Trainer's own scheduled ones are there, schedule_events) no detach is needed.
    detach = accumulate > 1 or bool(run.every_step_callbacks)
    micro_losses: list[torch.Tensor] = []
    micro_sum = 0.0
    exhausted = False
    # This rank's time per phase (distkit.stragglers.PHASES: data, forward, backward; optimizer_step
    # adds the optimizer's): four perf_counter reads and additions, about 1 us a step. Host times,
    # no device sync; what is between the steps (validation, callbacks, logging) is no phase's.
    sums, clock = run.timer.sums, time.perf_counter
    # The plain step of a world of one (below): its step module, model and loss function.
    lean = _lean_parts(run) if world_of_one and accumulate == 1 and plain and not per_device else None
    step_module, lean_model, lean_loss = lean or (None, None, None)
    optimizer, every_step = run.optimizer, run.every_step_callbacks
    step_scheduler = run.lr_scheduler is not None and run.scheduler_interval == "step"
    mark = clock()
    for batch_idx, batch in enumerate(iterator, start=first):
        if step_module is not None and step_module.checked:
            # A world of one, a model with loss_fn, one batch a step, nothing timed, no clipping:
            # the step a hand-written loop takes, and optimizer_step's outcome for a finite one.
            # Each line the interpreter runs between the backward pass and the next forward costs
            # several times its warm time: this way takes 2 to 5 % less time a step on the guard's
            # one-process model (issue 29; benchmarks/bench_trainer_guard.py --checks single).
            if move:
                batch = to_device(batch, device)
            inputs, target = batch
            loss = lean_loss(lean_model(inputs), target)  # type: ignore[misc]
            value = loss.item()
            run.batches_done = batch_idx + 1
            if math.isfinite(value):
                loss.backward()
                # optimizer_step's outcome for a finite step, inline (a call a step less): keep
                # the two alike (tests/test_trainer.py compares them bitwise).
                if run.nonfinite_run:
                    run.nonfinite_run.clear()
                run.window_sum += value
                run.window_count += 1
                run.epoch_sum += value
                run.epoch_count += 1
                optimizer.step()
                if step_scheduler:
                    run.lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step = run.global_step = run.global_step + 1
                if step >= run.next_event:
                    if _step_end_events(run, loss, False):
                        break
                    continue
                if every_step:
                    detached = loss.detach()
                    for cb in every_step:
                        cb.on_train_step_end(run.trainer, detached)
                if (run.job_preempt or run.request_stop) and _stops_now(run):
                    break
                continue
            poison(precision.backward, loss, params)
            run.poisoned = True
            if optimizer_step(run, loss.detach() if detach else loss, value, 1):
                break
            continue
        if move:
            batch = to_device(batch, device)
        now = clock()
        sums[0] += now - mark
        if not world_of_one and (accumulate == 1 or not micro_losses):
            # The step's first micro-batch: what a stop request would give back (about 1 us).
            run.states_at_step = (
                [cpu_generator.get_state()] if one_generator else [gen.get_state() for gen in generators]
            )
        sync = (
            accumulate == 1
            or (batch_idx + 1) % accumulate == 0
            or batch_idx == last_index
            or (ends is not None and ends())
        )
        with accumulation(wrapped, sync):
            if plain:
                loss, extras = wrapped(batch, batch_idx)
            else:
                with precision.autocast():
                    loss, extras = wrapped(batch, batch_idx)
            if per_device:
                loss, extras = _mean_over_devices(loss, extras)
            # The one host sync of a micro-batch, after the forward pass.
            value = loss.item()
            # What the step-end callbacks get. Detached here, next to the forward pass's own tensor
            # work, it costs about 1.3 us less than after the backward pass (issue 29).
            handed = loss.detach() if detach else loss
            mark = clock()
            sums[1] += mark - now
            scaled = loss / accumulate if accumulate > 1 else loss
            if (run.request_stop and not world_of_one) or not math.isfinite(value):
                poison(precision.backward, scaled, params)
                run.poisoned = True
            else:
                backward(scaled)
        # Backward and, under DDP/FSDP, the gradient reduction's end: where a fast rank waits.
        now = clock()
        sums[2] += now - mark
        if extras:
            _logs.add_extras(run, extras, first=accumulate == 1 or not micro_losses)
        run.batches_done = batch_idx + 1
        if accumulate == 1:
            if optimizer_step(run, handed, value, 1):
                break
            mark = clock()
            continue
        micro_losses.append(handed)
        micro_sum += value
        if not sync:
            mark = now
            continue
        micro = len(micro_losses)
        step_loss, step_value = torch.stack(micro_losses).mean(), micro_sum / micro
        micro_losses, micro_sum = [], 0.0
        if optimizer_step(run, step_loss, step_value, micro):
            break
        mark = clock()
    else:
        exhausted = True  # the loader ran out
    if not run.preempted:
        if run.num_batches is None:
            run.epoch_finished = exhausted or (ends is not None and ends())
        else:
            run.epoch_finished = run.batches_done >= run.num_batches
        _evaluate.end_epoch(run)
    del iterator
    # The pass is over, so the loader has moved on by itself: nothing more to give back.
    run.given_back = 0


def _lean_parts(run: Run) -> tuple[_StepModule, nn.Module, Callable[..., torch.Tensor]] | None:
    """The step module, model and loss function of a fit whose finite steps the loop's lean step
    can take (a model with ``loss_fn``, no phase times read, no gradient clipping, a strategy that
    acts in no step: a world of one), else ``None``. The step module's first step still goes its own way
    (its checks of the batch and the loss)."""
    wrapped, strategy = run.wrapped, run.strategy
    if (
        type(wrapped) is not _StepModule  # not wrapped: FSDP's or compile's class would be a subclass
        or wrapped.convention != "loss_fn"
        or run.stragglers is not None
        or run.trainer.gradient_clip_val is not None
        or strategy.syncs_buffers
        or strategy.step_state
    ):
        return None
    loss_fn = wrapped.__dict__.get("loss_fn") or wrapped._modules["loss_fn"]
    return wrapped, wrapped._modules["module"], loss_fn  # type: ignore[return-value]


def _epoch_end(loader: Any, iterator: Iterable[Any]) -> tuple[Iterable[Any], Callable[[], bool]]:
    """``iterator``, and a function telling whether the batch it gave last is the epoch's last: a
    StreamLoader knows; any other loader without a length is read one batch ahead."""
    if isinstance(loader, StreamLoader):
        return iterator, lambda: loader.ends_epoch
    peeking = _Peeking(iterator)
    return peeking, lambda: peeking.last


class _Peeking:
    """An iterator read one item ahead: ``last`` says whether the item just returned is the final one."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self._iterator = iter(iterable)
        self._next = next(self._iterator, _END)
        self.last = self._next is _END

    def __iter__(self) -> _Peeking:
        return self

    def __next__(self) -> Any:
        item = self._next
        if item is _END:
            raise StopIteration
        self._next = next(self._iterator, _END)
        self.last = self._next is _END
        return item


_END = object()

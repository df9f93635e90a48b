"""The hot loop: one epoch of micro-batches and optimizer steps (the scheme in
:mod:`distkit.trainer.trainer`'s docstring). Collective, as ``fit`` is."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from distkit.trainer._loop import evaluate as _evaluate, logs as _logs
from distkit.trainer._loop.batches import to_device
from distkit.trainer._loop.step import _mean_over_devices, optimizer_step

if TYPE_CHECKING:
    from distkit.trainer.trainer import Trainer

__all__: list[str] = []


def run_epoch(trainer: Trainer) -> None:
    """One pass over the training loader (or the rest of it, after a resume), then the epoch's end."""
    loader = trainer._train_loader
    first = trainer._batches_done
    if callable(getattr(loader, "set_epoch", None)):
        loader.set_epoch(trainer.current_epoch)  # keeps a restored mid-epoch position
    elif callable(getattr(getattr(loader, "sampler", None), "set_epoch", None)):
        loader.sampler.set_epoch(trainer.current_epoch)
    trainer._epoch_finished = False
    if not first:  # a resumed epoch keeps the restored sums of its first steps
        trainer._epoch_sum, trainer._epoch_count = 0.0, 0
    assert trainer.model is not None  # set up by fit() before the first epoch
    trainer.model.train()
    for cb in trainer._active_callbacks:
        cb.on_train_epoch_start(trainer)

    # Held until the epoch's end work is done: a distkit loader closes its pass (and moves to
    # the next epoch) when the iterator goes, and a checkpoint taken at the end of an epoch cut
    # short (max_steps, should_stop) must record this epoch's position.
    iterator: Iterable[Any] = iter(loader)
    if first and not callable(getattr(loader, "load_state_dict", None)):
        iterator = itertools.islice(iterator, first, None)
    # The hot loop reads locals only: on an overhead-bound model attribute lookups and calls are
    # a visible share of the step (benchmarks/bench_trainer.py).
    wrapped, precision, device = trainer._wrapped, trainer._precision, trainer.device
    assert wrapped is not None and precision is not None and device is not None
    move = device.type != "cpu"
    accumulate = trainer.accumulate_grad_batches
    strategy = trainer._strategy
    assert strategy is not None and trainer._step_module is not None
    accumulation, poison, params = strategy.accumulation, strategy.poisoned_backward, trainer._params
    per_device = trainer._step_module.per_device
    plain = precision.dtype is None and precision.scaler is None
    last_index = trainer._num_batches - 1
    generators = trainer._generators
    one_generator = len(generators) == 1
    cpu_generator = generators[0]
    micro_losses: list[torch.Tensor] = []
    micro_sum = 0.0
    for batch_idx, batch in enumerate(iterator, start=first):
        if move:
            batch = to_device(batch, device)
        if accumulate == 1 or not micro_losses:
            # The step's first micro-batch: what a stop request would give back (about 1 us).
            trainer._states_at_step = (
                [cpu_generator.get_state()] if one_generator else [gen.get_state() for gen in generators]
            )
        sync = accumulate == 1 or (batch_idx + 1) % accumulate == 0 or batch_idx == last_index
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
            scaled = loss / accumulate if accumulate > 1 else loss
            if trainer._request_stop or not math.isfinite(value):
                poison(precision.backward, scaled, params)
            else:
                precision.backward(scaled)
        if extras:
            _logs.add_extras(trainer, extras, first=accumulate == 1 or not micro_losses)
        trainer._batches_done = batch_idx + 1
        if accumulate == 1:
            if optimizer_step(trainer, loss.detach(), value, 1):
                break
            continue
        micro_losses.append(loss.detach())
        micro_sum += value
        if not sync:
            continue
        micro = len(micro_losses)
        step_loss, step_value = torch.stack(micro_losses).mean(), micro_sum / micro
        micro_losses, micro_sum = [], 0.0
        if optimizer_step(trainer, step_loss, step_value, micro):
            break
    if not trainer._preempted:
        trainer._epoch_finished = trainer._batches_done >= trainer._num_batches
        _evaluate.end_epoch(trainer)
    del iterator
    # The pass is over, so the loader has moved on by itself: nothing more to give back.
    trainer._given_back = 0

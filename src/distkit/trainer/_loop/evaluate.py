"""Validation: exact metrics over every validation sample once, on the unwrapped module, every
``val_check_interval`` optimizer steps and at the end of an epoch."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distkit import runtime
from distkit.collectives import all_reduce, any_rank, reduce_metrics
from distkit.errors import DistkitError
from distkit.trainer._loop import logs as _logs, model_io as _model_io
from distkit.trainer._loop.batches import batch_size, length, metric_value, to_device
from distkit.trainer.precision import Precision

if TYPE_CHECKING:
    from distkit.trainer._run import Run

__all__: list[str] = []

_log = runtime.get_logger("distkit.trainer", main_process_only=True)


def validate(run: Run) -> dict[str, tuple[Any, float]]:
    """Validation sums and counts of every metric on this rank (reduced by the caller). Collective
    under FSDP (see :func:`lockstep_repeats`)."""
    module, device, precision = run.model, run.device, run.precision
    strategy = run.strategy
    sums = evaluate(
        module,
        run.val_loader,
        device=device,
        precision=precision,
        loss_fn=run.loss_fn,
        metric_fns=run.metric_fns,
        lockstep=strategy.lockstep_forward,
        prefix="val",
    )
    strategy.after_evaluation(module)
    return sums


@torch.no_grad()
def evaluate(
    module: nn.Module,
    loader: Iterable[Any],
    *,
    device: torch.device,
    precision: Precision,
    loss_fn: Callable[..., Any] | None,
    metric_fns: Mapping[str, Callable[..., Any]],
    lockstep: bool,
    prefix: str,
) -> dict[str, tuple[Any, float]]:
    """This rank's sums and counts of every metric over ``loader`` (``<prefix>_loss`` and
    ``<prefix>_<name>``; a ``validation_step``'s or ``test_step``'s own names). Collective when
    ``lockstep`` (a sharded module: see :func:`lockstep_repeats`), else local."""
    sums: dict[str, list[Any]] = {}

    def add(name: str, value: Any, size: int) -> None:
        total, count = metric_value(name, value, size)
        entry = sums.setdefault(name, [0.0, 0.0])
        entry[0] = entry[0] + total
        entry[1] += count

    step_fn = getattr(module, f"{prefix}_step", None) if prefix == "test" else None
    # test() through a validation_step: its val_* names become test_* (as test_step's would be),
    # so that a test does not report, or overwrite in callback_metrics, the validation's metrics.
    renamed = prefix == "test" and not callable(step_fn)
    step_fn = step_fn if callable(step_fn) else getattr(module, "validation_step", None)
    try:
        convention = None if callable(step_fn) else _model_io.convention(module, loss_fn)
    except ValueError as err:
        raise ValueError(
            f"{type(module).__name__} gives no {prefix} metric: pass loss_fn=... (and metrics=...), give "
            f"the model a {'test_step or ' if prefix == 'test' else ''}validation_step(batch, batch_idx) "
            f"returning a dict of metrics, or let its forward take the target (a parameter named "
            f"{', '.join(_model_io.TARGET_NAMES)}) and return the loss."
        ) from err
    if convention == "training_step":
        return {}  # a training_step without a validation_step: nothing to measure
    was_training = module.training
    module.eval()
    target_name = _model_io.target_parameter(module)
    # Validation runs on the unwrapped module: DDP's forward may broadcast buffers (a collective)
    # and evaluation shards may differ in length by a batch. A sharded module's forward is
    # collective (it gathers the parameters): a rank short of a batch repeats its last one.
    batches = lockstep_batches(loader, lockstep)
    last: Any = None
    for batch_idx, batch in batches:
        if batch_idx < 0:  # a repeat: the forward pass only, its results dropped
            with precision.autocast():
                if callable(step_fn):
                    step_fn(last, 0)
                elif convention == "model_loss":
                    _model_io.call_with_target(module, last, target_name)
                else:
                    module(_model_io.split_batch(last)[0])
            continue
        batch = last = to_device(batch, device)
        with precision.autocast():
            if callable(step_fn):
                out = step_fn(batch, batch_idx)
                if not isinstance(out, Mapping):
                    raise TypeError(_not_a_dict(step_fn.__name__, out))
                size = batch_size(batch)
                for name, value in out.items():
                    add(f"test_{name[4:]}" if renamed and name.startswith("val_") else name, value, size)
                continue
            if convention == "model_loss":
                output = _model_io.call_with_target(module, batch, target_name)
                loss = _model_io.loss_of(output, module)
                output = _model_io.logits_of(output)
                pair = not isinstance(batch, Mapping)
                target = _model_io.split_batch(batch)[1] if pair else batch.get("labels")
            else:
                inputs, target = _model_io.split_batch(batch)
                output = module(inputs)
                loss = loss_fn(output, target)  # type: ignore[misc]
            size = batch_size(batch)
            add(f"{prefix}_loss", loss, size)
            for name, fn in metric_fns.items():
                if output is None or target is None:
                    raise DistkitError(
                        f"metric {name!r} needs the model's output and the target, but the model "
                        f"returned no logits beside its loss (a tuple (logits, loss), or "
                        f"output['logits']); compute it in a validation_step instead."
                    )
                add(f"{prefix}_{name}", fn(output, target), size)
    module.train(was_training)
    return {name: (total, count) for name, (total, count) in sums.items()}


def lockstep_batches(loader: Any, lockstep: bool) -> Iterable[tuple[int, Any]]:
    """``enumerate(loader)``, followed under ``lockstep`` by ``(-1, None)`` for each forward pass
    this rank repeats so that every rank runs as many (:func:`lockstep_repeats`). Collective under
    ``lockstep``, else local."""
    if lockstep and length(loader) is None:
        return _agreed_batches(loader)
    batches: Iterable[tuple[int, Any]] = enumerate(loader)
    repeats = lockstep_repeats(loader) if lockstep else 0
    if repeats:
        batches = itertools.chain(batches, ((-1, None) for _ in range(repeats)))
    return batches


def _agreed_batches(loader: Any) -> Iterator[tuple[int, Any]]:
    """:func:`lockstep_batches` of a loader without a length (a stream): before each forward pass
    the ranks agree whether any still has a batch (one small collective per batch); a rank out of
    batches repeats its last one until every rank is. Collective."""
    iterator = iter(loader)
    index = 0
    while True:
        batch = next(iterator, _END)
        mine = batch is not _END
        # Whether any rank has a batch, and whether some rank has none at all to repeat.
        more, empty = all_reduce(torch.tensor([mine, not mine and index == 0]), op="max").tolist()
        if not more:
            return
        if empty:  # every rank raises: one that has no batch cannot repeat one
            raise DistkitError(
                f"{runtime._rank_label()} some rank has no validation "
                f"batch of the stream while others have some; a sharded model's forward pass runs on "
                f"every rank at once. Use a smaller val_batch_size or more validation samples."
            )
        if mine:
            yield index, batch
            index += 1
        else:
            yield -1, None


_END = object()


def lockstep_repeats(loader: Any) -> int:
    """Forward passes this rank adds to its evaluation so every rank runs as many. Collective."""
    mine = len(loader)
    most, negated_least = all_reduce(torch.tensor([mine, -mine]), op="max").tolist()
    if -negated_least == 0 < most:
        raise DistkitError(
            f"{runtime._rank_label()} some rank has no validation batch "
            f"while others have up to {most}; a sharded model's forward pass runs on every rank at "
            f"once. Use more validation samples (at least one batch per rank) or a smaller "
            f"val_batch_size."
        )
    return int(most - mine)


def validate_now(run: Run) -> dict[str, float]:
    """Validation every ``val_check_interval`` optimizer steps, mid-epoch: one collective for its
    metrics, then ``on_validation_end`` and the loggers. Collective.

    It runs before the step's ``on_train_step_end`` callbacks, so that a checkpoint of this step
    is saved after it: whatever validation draws from the random generators (a DataLoader's
    iterator takes a seed from the global one) is then in the saved state, and a run resumed
    from that checkpoint goes on exactly as the uninterrupted one.
    """
    metrics = reduce_metrics(validate(run))
    run.last_validation = (run.global_step, dict(metrics))
    run.callback_metrics.update(metrics)
    for cb in run.callbacks:
        cb.on_validation_end(run.trainer, metrics)
    _logs.write(run, metrics)
    return metrics


def validated_epoch(run: Run) -> bool:
    """Whether ``check_val_every_n_epoch`` selects the current epoch for validation."""
    every = run.trainer.check_val_every_n_epoch
    return every is not None and (run.current_epoch + 1) % every == 0


def end_epoch(run: Run) -> None:
    """Validate (unless it was done at this very step), reduce the epoch's metrics in one
    collective, run the epoch-end hooks, and agree on stopping."""
    # A fraction of an epoch (val_check_interval=0.25) validates within the epoch instead.
    due = run.val_loader is not None and run.val_steps_in_epoch is None and validated_epoch(run)
    done_at, done_metrics = run.last_validation
    # Validated at this very step (val_check_interval): the epoch's metrics carry that validation,
    # so that an epoch-end checkpoint is ranked by it.
    already = done_at == run.global_step and (due or run.val_steps_in_epoch is not None)
    local = validate(run) if due and not already else {}
    local["train_loss_epoch"] = (run.epoch_sum, float(run.epoch_count))
    # The epoch end's one collective for metrics: the training loss and every validation sum
    # and count at once.
    metrics = reduce_metrics(local)
    metrics["epoch"] = float(run.current_epoch)
    if already:
        # Validated mid-epoch at this step (val_check_interval): the epoch's metrics carry it.
        metrics = {**done_metrics, **metrics}
    run.callback_metrics.update(metrics)
    if due and not already:
        run.last_validation = (run.global_step, dict(metrics))
        for cb in run.callbacks:
            cb.on_validation_end(run.trainer, metrics)
    _logs.write(run, metrics)
    if run.lr_scheduler is not None and run.scheduler_interval == "epoch":
        run.lr_scheduler.step()
    for cb in run.callbacks:
        cb.on_train_epoch_end(run.trainer, metrics)
    # Built-in callbacks decide from identical metrics, a user's callback may not: agree once.
    run.should_stop = any_rank(run.should_stop)


def _not_a_dict(step: str, out: Any) -> str:
    """What a validation_step/test_step returned instead of its metrics, and what to return."""
    prefix = "test" if step.startswith("test") else "val"
    example = f"{{'{prefix}_loss': loss, '{prefix}_acc': (correct, count)}}"
    if out is None:
        got = (
            f"None: return the metrics, e.g. {example}. There is no self.log: the dict's entries are "
            f"the metrics, reduced over every sample of every rank."
        )
    elif isinstance(out, (torch.Tensor, int, float)):
        got = f"a {type(out).__name__}: name it in a dict, e.g. {example}."
    else:
        got = f"{type(out).__name__}."
    return f"{step}() must return a dict of metrics, got {got}"

"""Training metrics between logging steps: this rank's partial sums, the one collective of a
logging step (which also carries the checkpoint's saves-by-time check), and the hand-over to the
loggers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from distkit import runtime
from distkit._utils.secrets import redact_url
from distkit.collectives import all_reduce, reduce_metrics
from distkit.stragglers import PHASES

if TYPE_CHECKING:
    from distkit.trainer._run import Run

__all__: list[str] = []

_log = runtime.get_logger("distkit.trainer", main_process_only=True)


def add_extras(run: Run, extras: Mapping[str, Any], *, first: bool) -> None:
    """Add a micro-batch's extra ``training_step`` metrics to this rank's sums. Local."""
    if first:  # the step's first micro-batch: what a discarded step gives back
        run.extras_at_step = (run.global_step, dict(run.extra_sums), run.extra_count)
    for name, value in extras.items():
        value = value.detach().double().reshape(()) if isinstance(value, torch.Tensor) else float(value)
        run.extra_sums[name] = run.extra_sums.get(name, 0.0) + value
    run.extra_count += 1


def log_sums(run: Run) -> dict[str, Any]:
    """This rank's partial sums of what is logged next, as a checkpoint saves them. Local."""
    epoch = (0.0, 0) if run.epoch_finished else (run.epoch_sum, run.epoch_count)
    return {
        "window": [run.window_sum, run.window_count],
        "epoch": list(epoch),
        "extras": {
            name: value.detach().cpu() if isinstance(value, torch.Tensor) else float(value)
            for name, value in run.extra_sums.items()
        },
        "extra_count": run.extra_count,
    }


def load_log_sums(run: Run, sums: Mapping[str, Any]) -> None:
    """Put back what :meth:`_log_sums` saved (tensors onto this rank's device). Local."""
    run.window_sum, run.window_count = float(sums["window"][0]), int(sums["window"][1])
    run.epoch_sum, run.epoch_count = float(sums["epoch"][0]), int(sums["epoch"][1])
    run.extra_sums = {
        name: value.to(run.device) if isinstance(value, torch.Tensor) else float(value)
        for name, value in sums["extras"].items()
    }
    run.extra_count = int(sums["extra_count"])


def reduce_window(run: Run) -> None:
    """The logging step's one collective, before the step-end callbacks: the window's loss, every
    extra training metric, each rank's phase times (straggler report) and the saves-by-time check of
    the Trainer's ModelCheckpoint, in one all-reduce. :func:`log_step` then logs the result."""
    # Each rank's phase times ride on the same collective (straggler report, profiler="simple"):
    # one slot per rank and phase, this rank's filled and the others' zero, so the sum gives every
    # rank every rank's times. world_size * 4 more numbers, no collective more.
    timed = run.stragglers is not None
    world, rank, phases = run.world_size, runtime.get_rank(), len(PHASES)
    # So does the checkpoint's question "have every_n_minutes passed on the main process's clock?",
    # which would otherwise cost a collective of its own at each logging step (a slot on every rank
    # alike, so that the ranks' tensors agree; 0 where there is no ModelCheckpoint).
    checkpoint = run.checkpoint
    due = float(checkpoint is not None and checkpoint._time_due_here())
    if run.extra_sums:
        local: dict[str, Any] = {"train_loss": (run.window_sum, float(run.window_count))}
        local.update({k: (v, float(run.extra_count)) for k, v in run.extra_sums.items()})
        local[_DUE] = (due, 1.0)  # a mean over ranks: positive when the main process's is 1
        if timed:
            # (sum, count) pairs: the slot's owner gives (time, 1), the others (0, 0): the reduced
            # mean is the owner's time.
            for r in range(world):
                mine = r == rank
                for p in range(phases):
                    local[f"_phase/{r}/{p}"] = (run.timer.sums[p] if mine else 0.0, float(mine))
        metrics = reduce_metrics(local)
        agreed_due = metrics.pop(_DUE) > 0
        per_rank = [[metrics.pop(f"_phase/{r}/{p}") for p in range(phases)] for r in range(world)]
    else:
        # The loss alone: numbers whose names cannot differ between ranks travel in half the time
        # of reduce_metrics' checked block (gloo, 2 ranks: about 0.15 against 0.3 ms).
        values = [run.window_sum, float(run.window_count), due]
        if timed:
            slots = [0.0] * (world * phases)
            slots[rank * phases : (rank + 1) * phases] = run.timer.sums
            values += slots
        reduced = all_reduce(torch.tensor(values, dtype=torch.float64)).tolist()
        total, count, agreed_due = reduced[0], reduced[1], reduced[2] > 0
        metrics = {"train_loss": total / count if count else math.nan}
        per_rank = [reduced[3 + r * phases : 3 + (r + 1) * phases] for r in range(world)]
    if checkpoint is not None:
        checkpoint._time_agreed = (run.global_step, agreed_due)
    run.window_reduced = (metrics, per_rank)


_DUE = "_checkpoint_due"  # the saves-by-time flag's name in reduce_metrics' block


def log_step(run: Run) -> None:
    """Log what :func:`reduce_window` reduced at this logging step: the straggler check, the
    callbacks' ``on_log`` and the loggers. Local."""
    run.log_pending = False
    assert run.window_reduced is not None  # reduce_window ran at this step
    metrics, per_rank = run.window_reduced
    run.window_reduced = None
    if run.stragglers is not None:
        straggler = run.stragglers.observe(per_rank, steps=run.timer.steps)
        if straggler is not None:
            metrics["straggler_rank"] = float(straggler.rank)
            metrics["straggler_slowdown"] = straggler.slowdown
            _log.warning("[step %d] %s", run.global_step, straggler.message())
    run.timer.reset()
    metrics["epoch"] = float(run.current_epoch)
    metrics["skipped_steps"] = float(run.skipped_steps)
    run.window_sum, run.window_count = 0.0, 0
    run.extra_sums, run.extra_count = {}, 0
    for cb in run.callbacks:
        cb.on_log(run.trainer, metrics)
    run.callback_metrics.update(metrics)
    write(run, metrics)


def write(run: Run, metrics: Mapping[str, float]) -> None:
    """Hand ``metrics`` to the loggers (main process only). Local."""
    if runtime.is_main_process():
        for logger in run.trainer.loggers:
            logger.log_metrics(metrics, run.global_step)


def log_final_checkpoint(run: Run) -> None:
    """Hand the run's last checkpoint to the loggers' ``log_checkpoint`` (main process only).

    Local. Called once the callbacks' ``on_fit_end`` has run: ``ModelCheckpoint`` has then waited
    for a save in flight, so the checkpoint is committed. Nothing when no checkpoint was saved or
    restored (a fresh fit's ``on_fit_start`` leaves the last saved step at 0, and no save is at 0).
    """
    checkpoint = run.checkpoint
    if not runtime.is_main_process() or checkpoint is None or checkpoint.manager is None:
        return
    step = checkpoint._last_saved_step
    if not step:
        return
    path = redact_url(str(checkpoint.manager.path_for(step)))
    for logger in run.trainer.loggers:
        logger.log_checkpoint(path, step)

"""The Trainer's own state in checkpoints (counters and partial metric sums, the callbacks' states,
a loader's position with a discarded step's batches given back) and the optimizer/scheduler
plumbing that set-up and the launching process share."""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distkit import runtime
from distkit.checkpoint import ResumeState
from distkit.collectives import all_gather_object
from distkit.data._loader import _SettingsChanged
from distkit.trainer._loop import logs as _logs
from distkit.trainer.callbacks import Callback

if TYPE_CHECKING:
    from distkit.trainer._run import Run

__all__: list[str] = []

_log = runtime.get_logger("distkit.trainer", main_process_only=True)


def _track_optimizer_steps(scheduler: Any) -> None:
    """Give a copied scheduler's optimizer back torch's record of ``optimizer.step()`` calls.

    An ``LRScheduler`` wraps its optimizer's ``step`` when it is made, to warn when the scheduler
    steps before the optimizer (pytorch/pytorch#20124). Pickling drops that wrapper
    (``Optimizer.__getstate__`` keeps the defaults, state and groups only), so in the processes
    ``fit`` starts, the first ``scheduler.step()`` after a real ``optimizer.step()`` warned that
    ``optimizer.step()`` "has been overridden". This puts the same wrapper back (as
    ``LRScheduler.__init__`` makes it, torch/optim/lr_scheduler.py); an optimizer that has it, or
    a scheduler that is not an ``LRScheduler``, is left alone.
    """
    optimizer = getattr(scheduler, "optimizer", None)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) or optimizer is None:
        return
    step = getattr(optimizer, "step", None)
    if step is None or hasattr(step, "_wrapped_by_lr_sched") or not hasattr(step, "__func__"):
        return
    optimizer_ref, func = weakref.ref(optimizer), step.__func__

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = optimizer_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper


def _rebind(optimizer: torch.optim.Optimizer, model: nn.Module, names: Mapping[int, str]) -> None:
    """Point ``optimizer``'s groups at the parameters that replaced the ones it was made over.

    FSDP replaces every parameter with its shard (a new ``nn.Parameter``), so an optimizer made
    over the model before ``fit`` would step tensors the model no longer uses. Parameters are
    matched by name, in place: the optimizer stays the object the user (and a scheduler) holds.
    An optimizer that has already stepped cannot be rebound (its state is the unsharded one).
    Local; does nothing when no parameter was replaced.
    """
    current = dict(model.named_parameters())
    own = {id(p) for p in current.values()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if all(id(p) in own for p in held) or not all(id(p) in names for p in held):
        return  # nothing replaced, or another model's optimizer (refused by the caller)
    if optimizer.state:
        raise ValueError(
            f"the optimizer ({type(optimizer).__name__}) has already stepped, and the strategy replaced "
            f"the model's parameters (FSDP shards them), so its state no longer fits. Pass a fresh "
            f"optimizer, or a function: optimizer=functools.partial(torch.optim.AdamW, lr=1e-3)."
        )
    for group in optimizer.param_groups:
        group["params"] = [current[names[id(p)]] for p in group["params"]]


class _Counters:
    """The Trainer's counters that ResumeState does not hold, its latest metrics, and the partial
    sums of what it logs next.

    The partial sums (training loss since the last logging step and over the epoch, extra
    ``training_step`` metrics) are each rank's own numbers: they are saved per rank, so that the
    first reduction after a resume adds exactly the numbers the uninterrupted run added. A checkpoint
    written before they were saved resumes with empty sums (the first window and epoch mean then
    cover the resumed steps only, as they used to).
    """

    def __init__(self, run: Run) -> None:
        self.run = run

    def state_dict(self) -> dict[str, Any]:
        """Collective: gathers every rank's partial sums (checkpoint saves run on every rank)."""
        run = self.run
        if run.log_pending:
            # Saved from on_train_step_end at a logging step, before the Trainer logged it: log
            # first (a collective, as this save is), so the checkpoint holds the step's state after
            # its log, which is where the uninterrupted run goes on from. The callbacks' state is
            # collected after this entry, so it includes what their on_log hooks did.
            _logs.log_step(run)
        return {
            "skipped_steps": run.skipped_steps,
            "nonfinite_run": list(run.nonfinite_run),
            "callback_metrics": _plain_metrics(run.callback_metrics),
            "world_size": runtime.get_world_size(),
            "log_sums": all_gather_object(_logs.log_sums(run)),
            # A mid-epoch resume must step on the same grid of micro-batches (checked on load).
            "accumulate_grad_batches": run.trainer.accumulate_grad_batches,
            "batches_in_epoch": 0 if run.epoch_finished else run.batches_done,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        run = self.run
        saved_accumulation = state.get("accumulate_grad_batches")
        now = run.trainer.accumulate_grad_batches
        batches = int(state.get("batches_in_epoch") or 0)
        if saved_accumulation is not None and saved_accumulation != now and batches:
            # Steps end where (batch + 1) % accumulation == 0: another accumulation would end one
            # within the saved step's micro-batches (a step of 1 scaled by 1/2), and the epoch would
            # take another number of steps than the scheduler was made for.
            raise ValueError(
                f"cannot resume mid-epoch ({batches} batches into the epoch) with "
                f"accumulate_grad_batches={now}: the checkpoint was saved with {saved_accumulation}, "
                f"and a changed accumulation would split its optimizer steps differently. Resume with "
                f"accumulate_grad_batches={saved_accumulation}, and change it from a checkpoint saved at "
                f"an epoch's end (ModelCheckpoint(every_n_epochs=1)), or start a new run."
            )
        run.skipped_steps = int(state["skipped_steps"])
        run.nonfinite_run = [int(step) for step in state.get("nonfinite_run", [])]
        run.callback_metrics = dict(state.get("callback_metrics", {}))
        saved = state.get("log_sums")
        if saved is None:
            return
        rank, world_size = runtime.get_rank(), runtime.get_world_size()
        if int(state["world_size"]) == world_size and len(saved) == world_size:
            _logs.load_log_sums(run, saved[rank])
        elif rank == 0:
            # Another world size: one rank carries the job's totals, so the next reduction (a sum
            # over ranks) still covers every saved step, up to rounding.
            _logs.load_log_sums(run, _merged_log_sums(saved))


def _plain_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics that are numbers, as floats (a checkpoint loads only plain types back)."""
    plain: dict[str, float] = {}
    for name, value in metrics.items():
        try:
            plain[str(name)] = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue  # a callback's non-numeric entry: not saved
    return plain


def _merged_log_sums(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every rank's partial sums added up, for a resume on another number of ranks."""
    extras: dict[str, float] = {}
    for sums in per_rank:
        for name, value in sums["extras"].items():
            extras[name] = extras.get(name, 0.0) + float(value)
    return {
        "window": [sum(float(s["window"][0]) for s in per_rank), sum(int(s["window"][1]) for s in per_rank)],
        "epoch": [sum(float(s["epoch"][0]) for s in per_rank), sum(int(s["epoch"][1]) for s in per_rank)],
        "extras": extras,
        "extra_count": sum(int(s["extra_count"]) for s in per_rank),
    }


class _TrainLoader:
    """The training loader's checkpoint entry: its state as if a discarded step's ``batches`` had not
    been handed out, and a mid-epoch state that does not fit the loader refused in a Trainer user's
    terms (the loader's own message tells how to edit its state)."""

    def __init__(self, loader: Any, batches: int) -> None:
        self.loader, self.batches = loader, batches

    def state_dict(self) -> dict[str, Any]:
        state = dict(self.loader.state_dict())
        if not self.batches:
            return state
        if "batches_consumed" in state:  # a DistributedLoader; other loaders' states are kept
            state["batches_consumed"] -= self.batches
        elif state.get("stream"):  # a StreamLoader: its position counts every rank's samples
            state["position"] -= self.batches * state["world_size"] * state["batch_size"]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            self.loader.load_state_dict(state)
        except _SettingsChanged as err:
            changed = ", ".join(_changed_setting(key, *values) for key, values in err.changed.items())
            raise ValueError(
                f"cannot resume mid-epoch ({err.consumed} batches into epoch {err.epoch}) with {changed}: "
                f"batch {err.consumed} would hold other samples. Resume with the saved settings, or from a "
                f"checkpoint saved at an epoch's end (resume=<its path>; `distkit checkpoint list "
                f"DIRECTORY` lists them, ModelCheckpoint(every_n_epochs=1) saves them), where they may "
                f"change."
            ) from None


def _changed_setting(key: str, saved: Any, now: Any) -> str:
    if key == "batch_size":
        return (
            f"another batch size (saved {saved}, now {now}: Trainer(batch_size={saved}), or the "
            f"batch_size of the loader given to fit)"
        )
    if key == "dataset_len":
        return f"a training dataset of another size (saved {saved} samples, now {now})"
    return f"another {key} (saved {saved!r}, now {now!r})"


class _CallbackStates:
    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = callbacks

    def state_dict(self) -> dict[str, Any]:
        return {f"{i}:{type(cb).__name__}": cb.state_dict() for i, cb in enumerate(self.callbacks)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for i, cb in enumerate(self.callbacks):
            saved = state.get(f"{i}:{type(cb).__name__}")
            if saved:
                cb.load_state_dict(saved)


def _is_inside(path: str, directory: str | os.PathLike[str]) -> bool:
    """Whether checkpoint ``path`` lies inside ``directory`` (local paths or URLs; a ``file://`` URL
    and a ``~`` path as the local path they name)."""
    path, directory = _local(os.fspath(path)), _local(os.fspath(directory))
    if "://" in path or "://" in directory:
        return path.rstrip("/").startswith(directory.rstrip("/") + "/")
    real_path, real_dir = os.path.realpath(path), os.path.realpath(directory)
    return real_path != real_dir and os.path.commonpath([real_path, real_dir]) == real_dir


def _is_same(path: str, directory: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names ``directory`` itself (in the forms :func:`_is_inside` accepts)."""
    path, directory = _local(os.fspath(path)), _local(os.fspath(directory))
    if "://" in path or "://" in directory:
        return path.rstrip("/") == directory.rstrip("/")
    return os.path.realpath(path) == os.path.realpath(directory)


def _local(path: str) -> str:
    """``path`` as a local path when it names one (``file:///x``, ``~/x``), else as it is."""
    if path.startswith("file://"):
        return path[len("file://") :]
    return os.path.expanduser(path) if path.startswith("~") else path


def checkpoint_state(run: Run) -> dict[str, Any]:
    """What :meth:`Trainer.checkpoint_state` returns (its docstring tells the contract)."""
    if run.epoch_finished:
        epoch, batches = run.current_epoch + 1, 0
    else:
        epoch, batches = run.current_epoch, run.batches_done
    state: dict[str, Any] = {
        "model": run.model,
        "optimizer": run.optimizer,
        "progress": ResumeState(epoch=epoch, global_step=run.global_step, batches_in_epoch=batches),
        "counters": _Counters(run),
        "callbacks": _CallbackStates(run.trainer.callbacks),
    }
    if run.lr_scheduler is not None:
        state["lr_scheduler"] = run.lr_scheduler
    if run.precision.scaler is not None:
        state["scaler"] = run.precision.scaler
    if callable(getattr(run.train_loader, "state_dict", None)):
        loader = run.train_loader
        state["train_loader"] = _TrainLoader(loader, run.given_back)
    # DDP's PowerSGD: "comm_hook", its error feedback and warm start; nothing for other strategies.
    state.update(run.strategy.checkpoint_entries())
    return state

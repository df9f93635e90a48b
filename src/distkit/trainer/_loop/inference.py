"""``Trainer.validate``, ``test`` and ``predict``: one pass over a dataset, every sample once.

Each rank evaluates its contiguous block of the dataset (a distkit evaluation loader: no padding,
no duplicates), so the reduced metrics equal one process's over the whole set, and the predictions
gathered in rank order are in dataset order. The model runs unwrapped (no gradients: nothing for
DDP to do); a model that ``fit`` left sharded by FSDP runs its forward on every rank in lockstep.
Outside a launcher, a multi-process strategy starts its processes as ``fit`` does and returns rank
0's result.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distkit import runtime
from distkit.checkpoint import load_checkpoint
from distkit.collectives import all_gather_object, reduce_metrics
from distkit.data import gather_for_metrics
from distkit.data._checks import check_not_tensor_tuple
from distkit.data._stream import is_stream
from distkit.trainer import launch, strategies
from distkit.trainer._loop import evaluate as _evaluate, model_io as _model_io, setup as _setup
from distkit.trainer._loop.batches import to_device
from distkit.trainer.precision import Precision
from distkit.trainer.strategies._fsdp import is_sharded

if TYPE_CHECKING:
    from distkit.trainer._run import Options, Outcome, Run

__all__: list[str] = []


def _prepare(
    trainer: Options,
    shown: Run | Outcome,
    model: nn.Module,
    data: Any,
    ckpt_path: str | os.PathLike[str] | None,
) -> tuple[Any, Precision, bool, torch.device]:
    """Join the job, put the model on this rank's device (loading ``ckpt_path``), and load
    ``data``; the Trainer shows the job's size and this device (``shown``). Collective under a
    launcher (the process group)."""
    plan = strategies.resolve(trainer.strategy, trainer.devices)
    _setup.join_job(plan)
    shown.world_size = world_size = runtime.get_world_size()
    shown.device = device = plan.device()
    sharded = is_sharded(model)
    if not sharded:
        model.to(device)
    if ckpt_path is not None:
        # Full or sharded, saved by any number of ranks: load_checkpoint reshards into this model.
        load_checkpoint(_setup.evaluation_checkpoint(trainer, ckpt_path), {"model": model}, strict=True)
    precision = Precision(trainer.precision, device, autocast=True)
    batch = trainer.val_batch_size * (len(plan.cuda_indices) if plan.kind == "dp" else 1)
    loader = _setup.make_loader(trainer, data, batch, evaluation=True, world_size=world_size)
    return loader, precision, sharded, device


@_model_io.noting_lightning_habits
def evaluate(
    trainer: Options,
    shown: Run | Outcome,
    prefix: str,
    model: nn.Module,
    data: Any,
    *,
    ckpt_path: str | os.PathLike[str] | None,
    loss_fn: Callable[..., torch.Tensor] | None,
    metrics: Mapping[str, Callable[..., Any]] | None,
) -> dict[str, float]:
    """``validate`` (``prefix="val"``) or ``test``: the metrics reduced over every rank."""
    check_not_tensor_tuple(data, "data")
    plan = strategies.resolve(trainer.strategy, trainer.devices)
    if plan.launch:
        kwargs = {"ckpt_path": ckpt_path, "loss_fn": loss_fn, "metrics": metrics}
        method = "validate" if prefix == "val" else "test"
        result: dict[str, float] = launch.run_method(trainer, plan, method, model, (data,), kwargs)
        shown.callback_metrics.update(result)
        return result
    loader, precision, sharded, device = _prepare(trainer, shown, model, data, ckpt_path)
    sums = _evaluate.evaluate(
        model,
        loader,
        device=device,
        precision=precision,
        loss_fn=loss_fn,
        metric_fns=dict(metrics or {}),
        lockstep=sharded,
        prefix=prefix,
    )
    if not sums:
        raise ValueError(
            f"{type(model).__name__} gives no {prefix} metric: its training_step is not used here. Pass "
            f"loss_fn=... (and metrics=...), or give the model a "
            f"{'test_step or ' if prefix == 'test' else ''}validation_step(batch, batch_idx) returning a "
            f"dict of metrics."
        )
    result = reduce_metrics(sums)  # one collective for every metric
    shown.callback_metrics.update(result)
    return result


@_model_io.noting_lightning_habits
@torch.no_grad()
def predict(
    trainer: Options,
    shown: Run | Outcome,
    model: nn.Module,
    data: Any,
    *,
    ckpt_path: str | os.PathLike[str] | None,
    all_ranks: bool,
) -> Any:
    """Every sample's prediction once, in dataset order, on the main process (or every rank)."""
    check_not_tensor_tuple(data, "data")
    plan = strategies.resolve(trainer.strategy, trainer.devices)
    if plan.launch:
        if all_ranks:
            raise ValueError(
                "predict(all_ranks=True) returns the predictions on every rank, but outside a launcher "
                "this process is the only one left when they come back; use all_ranks=False here, or "
                "start the script with torchrun."
            )
        kwargs = {"ckpt_path": ckpt_path, "all_ranks": False}
        return launch.run_method(trainer, plan, "predict", model, (data,), kwargs)
    # A dataset's samples carry their index, so that the predictions go back into dataset order
    # whatever the split; a DataLoader given as it is yields its own batches, kept in rank order.
    indexed = _setup.makes_loader(data)
    if indexed:
        data = _IndexedStream(data) if is_stream(data) else _Indexed(data)
    loader, precision, sharded, device = _prepare(trainer, shown, model, data, ckpt_path)
    predict_step = getattr(model, "predict_step", None)
    was_training = model.training
    model.eval()
    batches = _evaluate.lockstep_batches(loader, sharded)
    outputs: list[Any] = []
    indices: list[torch.Tensor] = []
    last: Any = None
    size = 0
    problem: str | None = None  # this rank's first output without one row per sample
    for batch_idx, batch in batches:
        if batch_idx >= 0:
            if indexed:
                index, batch = batch
                indices.append(index)
                size = len(index)
            batch = last = to_device(batch, device)
        with precision.autocast():
            if callable(predict_step):
                output = predict_step(last, max(batch_idx, 0))
            elif isinstance(last, torch.Tensor):
                output = model(last)
            elif isinstance(last, Mapping):
                output = model(**last)
            else:
                output = model(_model_io.split_batch(last)[0])
        if batch_idx >= 0:  # a repeat's output is dropped
            output = _per_sample(_detached(output))
            if indexed and problem is None:
                problem = _rows_problem(output, size, batch_idx)
            outputs.append(output)
    model.train(was_training)
    if indexed:
        # Agreed before the outputs are gathered, so that every rank raises, not only the one
        # whose batch showed the problem.
        problems = all_gather_object(problem)
        rank, found = next(((r, p) for r, p in enumerate(problems) if p is not None), (0, None))
        if found is not None:
            source = "predict_step()" if callable(predict_step) else f"{type(model).__name__}'s forward"
            label = f"[rank {rank}/{len(problems)}] " if len(problems) > 1 else ""
            raise ValueError(
                f"{label}predict() puts every sample's prediction back in dataset order, so each "
                f"output needs one row per sample, but {source} returned {found}. Return one row per "
                f"sample (a predict_step(batch, batch_idx) can pick them), or pass a DataLoader to get "
                f"the outputs batch by batch, in rank order."
            )
    local = _concatenate(outputs)
    if isinstance(local, list):
        gathered: Any = [item for part in all_gather_object(local) for item in part]
    else:
        gathered = gather_for_metrics(local)
    order = torch.argsort(gather_for_metrics(torch.cat(indices))) if indexed else None
    if not (all_ranks or runtime.is_main_process()):
        return None
    return gathered if order is None else _reordered(gathered, order)


class _Indexed(torch.utils.data.Dataset[tuple[int, Any]]):
    """A map-style dataset whose samples come with their index: ``(index, sample)``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.dataset[index]


class _IndexedStream(torch.utils.data.IterableDataset[tuple[int, Any]]):
    """A stream whose samples come with their place in it: ``(index, sample)`` (the loader of
    ``predict`` reads it in order, so the places are the same on every rank)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return enumerate(iter(self.stream))


def _reordered(gathered: Any, order: torch.Tensor) -> Any:
    if isinstance(gathered, torch.Tensor):
        return gathered[order.to(gathered.device)]
    if isinstance(gathered, Mapping):
        return {key: _reordered(value, order) for key, value in gathered.items()}
    if isinstance(gathered, tuple):
        return tuple(_reordered(value, order) for value in gathered)
    return [gathered[i] for i in order.tolist()]


def _is_per_batch(value: Any) -> bool:
    """``None`` or a 0-dim tensor: one value for the whole batch (a loss), not one per sample."""
    return value is None or (isinstance(value, torch.Tensor) and value.dim() == 0)


def _per_sample(output: Any) -> Any:
    """A dict or tuple output without its per-batch entries (:func:`_is_per_batch`): the loss a
    Hugging Face model adds when the batch has ``labels``, nanoGPT's ``(logits, None)`` without
    targets. A tuple with one entry left is that entry."""
    if isinstance(output, Mapping):
        return {key: value for key, value in output.items() if not _is_per_batch(value)}
    if isinstance(output, tuple) and any(_is_per_batch(item) for item in output):
        kept = tuple(item for item in output if not _is_per_batch(item))
        return kept[0] if len(kept) == 1 else kept
    return output


def _rows_problem(output: Any, size: int, batch_idx: int, where: str = "") -> str | None:
    """What in one batch's ``output`` has not one row per sample (``size``), or ``None``: only rows
    can be put back in dataset order."""
    if isinstance(output, Mapping):
        parts = ((f"{where}[{key!r}]", value) for key, value in output.items())
    elif isinstance(output, tuple):
        parts = ((f"{where}[{i}]", value) for i, value in enumerate(output))
    else:
        if isinstance(output, torch.Tensor):
            rows, shown = (output.shape[0] if output.dim() else 1), f"a tensor of shape {tuple(output.shape)}"
        elif isinstance(output, list):
            rows, shown = len(output), f"a list of {len(output)}"
        else:
            rows, shown = 1, type(output).__name__
        if rows == size:
            return None
        return f"{shown}{f' at output{where}' if where else ''} for batch {batch_idx} ({size} samples)"
    return next(
        (found for part, value in parts if (found := _rows_problem(value, size, batch_idx, part))), None
    )


def _detached(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, Mapping):
        return {key: _detached(value) for key, value in output.items()}
    if isinstance(output, (tuple, list)):
        return type(output)(_detached(value) for value in output)
    return output


def _concatenate(outputs: list[Any]) -> Any:
    """This rank's batch outputs as one: tensors (and the tensors of dicts and tuples) joined along
    the batch dimension; other outputs as a flat list."""
    if not outputs:
        return []
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([out.reshape(-1) if out.dim() == 0 else out for out in outputs])
    if isinstance(first, Mapping):
        return {key: _concatenate([out[key] for out in outputs]) for key in first}
    if isinstance(first, tuple):
        return tuple(_concatenate([out[i] for out in outputs]) for i in range(len(first)))
    return [item for out in outputs for item in (out if isinstance(out, list) else [out])]

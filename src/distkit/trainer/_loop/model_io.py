"""How the Trainer calls a model that has no ``training_step``, and where it finds the loss. Local.

Three conventions, picked once per ``fit`` from the model and the arguments (see ``docs/trainer.md``,
"Plain models"):

* ``loss_fn`` given: batches are ``(inputs, target)``, the loss is ``loss_fn(model(inputs), target)``.
* no ``loss_fn``, batches ``(inputs, target)`` and a ``forward`` with a parameter named ``targets``,
  ``target``, ``labels`` or ``label`` (nanoGPT's ``forward(idx, targets=None)``): the Trainer calls
  ``model(inputs, <name>=target)``. The target goes by name, never by position: a Hugging Face
  model's second positional parameter is ``attention_mask``, and a target passed there would train
  silently on nonsense.
* no ``loss_fn`` and dict batches (Hugging Face style, the labels inside the dict): ``model(**batch)``.

In the last two the model computes its own loss, found in its output: the output itself when it
is a one-element tensor, ``output["loss"]`` or ``output.loss`` (a ``ModelOutput``), or the one
one-element tensor of a tuple (nanoGPT's ``(logits, loss)``).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import traceback
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

from distkit.errors import DistkitError

__all__: list[str] = []

# The names under which a forward takes the target, in the order they are looked for.
TARGET_NAMES = ("targets", "target", "labels", "label")

_TRAINING_STEP_EXAMPLE = (
    "Give the model a training_step that returns the loss, e.g.:\n\n"
    "    def training_step(self, batch, batch_idx):\n"
    "        inputs, target = batch\n"
    "        return torch.nn.functional.cross_entropy(self(inputs), target)\n"
)

P = ParamSpec("P")
R = TypeVar("R")


def target_parameter(module: nn.Module) -> str | None:
    """The name of ``module.forward``'s parameter that takes the target, or ``None``."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented forward: no names to read
        return None
    return next((name for name in TARGET_NAMES if name in parameters), None)


def convention(module: nn.Module, loss_fn: Callable[..., Any] | None) -> str:
    """``"training_step"``, ``"loss_fn"`` or ``"model_loss"`` (the model computes its loss); raises
    when a plain model has no way to a loss. Local."""
    if inspect.isclass(loss_fn) and issubclass(loss_fn, nn.Module):
        # loss_fn=nn.CrossEntropyLoss: calling the class builds a module from (output, target).
        short = getattr(nn, loss_fn.__qualname__, None) is loss_fn
        name = f"torch.nn.{loss_fn.__qualname__}" if short else f"{loss_fn.__module__}.{loss_fn.__qualname__}"
        raise TypeError(
            f"loss_fn={name} is a class: pass an instance, loss_fn={name}() (or a function such as "
            f"torch.nn.functional.cross_entropy)."
        )
    if callable(getattr(module, "training_step", None)):
        return "training_step"
    if loss_fn is not None:
        return "loss_fn"
    if target_parameter(module) is not None:
        return "model_loss"
    # Dict batches are known only when the first one arrives (model_loss checks it then).
    if _takes_var_keywords(module):
        return "model_loss"
    raise ValueError(
        f"{type(module).__name__} has no training_step(batch, batch_idx), no loss_fn was given, and its "
        f"forward takes no target (a parameter named {', '.join(TARGET_NAMES)}). Pass "
        f"loss_fn=... (e.g. torch.nn.functional.cross_entropy) to train it as a plain model, or "
        f"{_TRAINING_STEP_EXAMPLE[0].lower()}{_TRAINING_STEP_EXAMPLE[1:]}"
    )


def _takes_var_keywords(module: nn.Module) -> bool:
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def split_batch(batch: Any) -> tuple[Any, Any]:
    """A plain model's ``(inputs, target)`` batch, or a ``TypeError`` naming what came instead."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        keys = ", ".join(repr(key) for key in batch)
        raise TypeError(
            f"the batch is the problem: with loss_fn the batches must be (inputs, target) pairs, got a "
            f"dict with keys {keys}. For dict batches leave out loss_fn: the Trainer calls "
            f"model(**batch) and takes the loss from its output (Hugging Face style, the target under "
            f"'labels'); or give the model a training_step(batch, batch_idx) that returns the loss."
        )
    raise TypeError(
        f"with a plain model the batches must be (inputs, target) pairs, got {type(batch).__name__}"
        f"{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}. For other batches "
        f"give the model a training_step(batch, batch_idx) method that returns the loss."
    )


def call_with_target(module: nn.Module, batch: Any, target_name: str | None) -> Any:
    """The model's output under the ``model_loss`` convention (it computes its loss)."""
    if isinstance(batch, Mapping):
        output = module(**batch)
        # "labels" first: the usual batch costs one lookup per step.
        if (
            "labels" not in batch
            and not any(name in batch for name in TARGET_NAMES)
            and _found_loss(output) is None
        ):
            raise DistkitError(
                f"model(**batch) returned no loss (got {_describe(output)}), and the batch has no "
                f"target: its keys are {', '.join(repr(key) for key in batch)}, none of "
                f"{', '.join(TARGET_NAMES)}. A Hugging Face model computes its loss only when the "
                f"batch carries 'labels' (for a causal language model, labels=input_ids). Add them to "
                f"the batches, or give the model a validation_step(batch, batch_idx) (and "
                f"training_step) of its own; predict() needs no labels."
            )
        return output
    if target_name is None:
        raise TypeError(
            f"{type(module).__name__}.forward takes **kwargs but the batches are "
            f"{type(batch).__name__}, not dicts: pass loss_fn=..., name the forward's target "
            f"parameter one of {', '.join(TARGET_NAMES)}, or give the model a training_step."
        )
    inputs, target = split_batch(batch)
    return module(inputs, **{target_name: target})


def loss_of(output: Any, module: nn.Module) -> torch.Tensor:
    """The loss a model returned in ``output`` (see the module docstring), or a ``DistkitError``."""
    found = _found_loss(output)
    if found is not None:
        return found
    raise DistkitError(
        f"{type(module).__name__}'s forward took the target but returned no loss the Trainer can find "
        f"(got {_describe(output)}). It looks for a one-element tensor, output['loss'] or "
        f"output.loss, or the one one-element tensor of a tuple such as (logits, loss). "
        + _TRAINING_STEP_EXAMPLE
    )


def _found_loss(output: Any) -> torch.Tensor | None:
    """The loss in a model's output (see the module docstring) as a 0-dim tensor, or ``None``."""
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output.reshape(())
    found: Any = None
    if isinstance(output, Mapping):
        found = output.get("loss")
    elif isinstance(output, (tuple, list)):
        scalars = [item for item in output if isinstance(item, torch.Tensor) and item.numel() == 1]
        found = scalars[0] if len(scalars) == 1 else None
    else:
        found = getattr(output, "loss", None)
    if isinstance(found, torch.Tensor) and found.numel() == 1:
        return found.reshape(())
    return None


def logits_of(output: Any) -> Any:
    """What validation metrics compare with the target when the model returned its loss too."""
    if isinstance(output, Mapping):
        return output.get("logits")
    if isinstance(output, (tuple, list)):
        rest = [item for item in output if not (isinstance(item, torch.Tensor) and item.numel() == 1)]
        return rest[0] if rest else None
    return getattr(output, "logits", None)


def check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
        raise TypeError(
            f"loss_fn must return a one-element tensor (the batch mean), got {type(loss).__name__}"
            f"{shape}; use reduction='mean'."
        )


def first_failure(
    module: nn.Module, batch: Any, err: Exception, *, in_model: bool, output: Any = None
) -> DistkitError:
    """The error for ``loss_fn(model(inputs), target)`` failing on the first batch: first what
    raised it (the model's forward, or ``loss_fn`` given the model's output), then a guess.

    Args:
        module: The user's model (its submodules name where a forward failed).
        batch: The first batch, an ``(inputs, target)`` pair.
        err: What was raised.
        in_model: Raised by ``model(inputs)``; else by ``loss_fn(output, target)``.
        output: The model's output when ``loss_fn`` raised.
    """
    inputs, target = batch
    shapes = f"{_describe(inputs)}, {_describe(target)}"
    call = "model(inputs)" if in_model else "loss_fn(model(inputs), target)"
    line = _user_line(err)
    at = f", at {line}" if line else ""
    if in_model:
        inner = _raised_in(module, err)
        where = (
            f"The exception was raised in the model's forward"
            f"{f', in {inner}' if inner else ''}{at}: loss_fn and the target were not reached, so "
            f"neither is the cause."
        )
        guess = _model_guess(module, inputs, err)
    else:
        where = (
            f"The exception was raised in loss_fn, after the model's forward had returned "
            f"{_describe(output)} (the target: {_describe(target)}){at}."
        )
        guess = (
            f"the output and the target do not fit loss_fn, or the model is meant to compute its own "
            f"loss. If {_model_name(module)}.forward takes the target itself and returns the loss, drop "
            f"loss_fn and name that parameter one of {', '.join(TARGET_NAMES)} (the Trainer then "
            f"passes it by name and finds the loss in the output). Otherwise: " + _TRAINING_STEP_EXAMPLE
        )
    return DistkitError(
        f"{call} failed on the first batch ({shapes}) with {type(err).__name__}: {err}\n"
        f"{where}\nLikely cause (a guess): {guess}"
    )


# What an error message says, read for a guess at its cause (first match wins).
_LOW_PRECISION = re.compile(r"bfloat16|BFloat16|\bHalf\b|float16")
_DTYPE = re.compile(r"dtype|scalar type|expected .* but found", re.IGNORECASE)
_SHAPE = re.compile(r"shape|size mismatch|sizes? of tensors? must match|cannot be multiplied", re.IGNORECASE)


def _model_guess(module: nn.Module, inputs: Any, err: Exception) -> str:
    text = str(err)
    name = _model_name(module)
    if isinstance(err, TypeError) and "positional argument" in text:
        return (
            f"{name}.forward wants other arguments than the inputs alone. If it takes the target and "
            f"returns the loss, drop loss_fn and name that parameter one of {', '.join(TARGET_NAMES)}; "
            f"for several inputs give the model a training_step(batch, batch_idx)."
        )
    if _LOW_PRECISION.search(text):
        return (
            "the message names a 16-bit dtype: the model computes in reduced precision "
            "(precision='bf16-mixed' or '16-mixed') and a layer met float32 values. Under FSDP, mixed "
            "precision casts the parameters to bfloat16 but not the buffers, and CPU kernels refuse "
            "the mix: distkit keeps BatchNorm layers in float32 itself, so look for another layer "
            "that computes with a float32 buffer or a float32 tensor made in forward (cast it to "
            "the input's dtype), or train with precision='32'."
        )
    if _DTYPE.search(text):
        return (
            f"a layer got values of another dtype than its parameters (the batch's inputs are "
            f"{_describe(inputs)}): convert the inputs in the dataset (e.g. .float()), or look for a "
            f"cast inside the forward."
        )
    if _SHAPE.search(text):
        return (
            f"the inputs ({_describe(inputs)}) do not fit a layer of the model: check its sizes "
            f"against the data (e.g. the first Linear's in_features)."
        )
    return (
        f"a bug in {name}'s forward, or inputs it does not expect; model(inputs) on one batch outside "
        f"the Trainer raises the same, with the debugger at hand."
    )


def _raised_in(module: nn.Module, err: BaseException) -> str | None:
    """The innermost of ``module``'s submodules whose code is in ``err``'s traceback, as
    ``"net.1 (BatchNorm1d)"``; ``None`` when no frame belongs to one."""
    names = {id(sub): name for name, sub in module.named_modules()}
    found: nn.Module | None = None
    tb = err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = owner
        tb = tb.tb_next
    if found is None:
        return None
    name = names[id(found)]
    return f"{name} ({_model_name(found)})" if name else f"{_model_name(found)}.forward itself"


# torch's and distkit's own directories: frames there are not the user's code.
_LIBRARY_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)


def _user_line(err: BaseException) -> str | None:
    """``file:line in function`` of the innermost frame of ``err``'s traceback outside torch and
    distkit (the user's code), or ``None``."""
    library = _LIBRARY_DIRS
    found = None
    for frame in traceback.extract_tb(err.__traceback__):
        if not frame.filename.startswith(library):
            found = frame
    return None if found is None else f"{found.filename}:{found.lineno} in {found.name}"


def _model_name(module: nn.Module) -> str:
    """The class name of the user's module, not FSDP's subclass of it (``FSDPNet`` is ``Net``)."""
    cls = next(
        (c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed")),
        type(module),
    )
    return cls.__name__


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}: " + ", ".join(_describe(v) for v in value)
    if isinstance(value, Mapping):
        return f"{type(value).__name__} with keys " + ", ".join(repr(key) for key in value)
    return type(value).__name__


def check_trains(model: nn.Module) -> None:
    """``model`` has a parameter that trains, and none that trains outside it.

    Without the first, fit would fail in torch's backward (or DDP's set-up) with a message that
    does not say why. The second is the plain Python list (or tuple, or dict) of layers: the model
    does not register them, so their parameters would be used in the forward pass yet never
    updated, saved, moved to the device or synchronised across ranks, in silence. Local.
    """
    params = list(model.parameters())
    name = type(model).__name__
    own = {id(p) for p in params}
    internal = _module_attributes()
    for prefix, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr in internal or not isinstance(value, (list, tuple, dict)):
                continue
            items = value.values() if isinstance(value, dict) else value
            layers = [item for item in items if isinstance(item, nn.Module)]
            loose = [
                p for layer in layers for p in layer.parameters() if p.requires_grad and id(p) not in own
            ]
            if loose:
                kind = type(value).__name__
                holder = "nn.ModuleDict" if isinstance(value, dict) else "nn.ModuleList"
                where = f"{name}.{prefix + '.' if prefix else ''}{attr}"
                raise ValueError(
                    f"{where} is a plain {kind} of {len(layers)} module(s) that the model does not "
                    f"register: their {len(loose)} trainable parameter(s) would be used in the "
                    f"forward pass but never updated, saved, moved to the device or synchronised "
                    f"across ranks. Hold them in {holder}(...); if they are meant to stay fixed, "
                    f"freeze them (requires_grad_(False))."
                )
    if not params:
        raise ValueError(
            f"the model given to fit() ({name}) has no parameters, so there is nothing to train. "
            f"Pass the module that holds the weights (its layers are attributes of it, or in an "
            f"nn.ModuleList: a plain Python list of layers is not registered)."
        )
    if not any(p.requires_grad for p in params):
        raise ValueError(
            f"the model given to fit() ({name}) has nothing to train: all {len(params)} of its "
            f"parameters have requires_grad=False (frozen). Unfreeze the parts to train "
            f"(module.requires_grad_(True)), or only evaluate it: trainer.validate(model, data), "
            f"trainer.test(...) or trainer.predict(...)."
        )


def _module_attributes() -> set[str]:
    """The names of the attributes every nn.Module has (``_modules``, ``_parameters``, hooks)."""
    return set(vars(nn.Module()))


# What a LightningModule has that an nn.Module here does not, and what to use instead.
_LIGHTNING_HAS = {
    "log": "return the values instead: training_step's dict beside 'loss' ({'loss': loss, "
    "'train_acc': acc}), validation_step's dict of metrics; the Trainer logs them, reduced over "
    "the ranks",
    "trainer": "a Callback's hooks get the Trainer (on_train_step_end(trainer, loss)); the model "
    "does not hold it",
    "device": "use the batch's device, or next(self.parameters()).device",
    "print": "distkit.rank_zero_print(...) prints once",
    "all_gather": "distkit.all_gather(tensor) (on every rank)",
    "hparams": "TrainerCLI saves the run's whole config beside its checkpoints (docs/config.md)",
    "manual_backward": "the Trainer calls backward() and the optimizer itself; training_step only "
    "returns the loss",
}
_LIGHTNING_HAS.update(
    log_dict=_LIGHTNING_HAS["log"],
    current_epoch=_LIGHTNING_HAS["trainer"],
    global_step=_LIGHTNING_HAS["trainer"],
    logger=_LIGHTNING_HAS["trainer"],
    save_hyperparameters=_LIGHTNING_HAS["hparams"],
    optimizers=_LIGHTNING_HAS["manual_backward"],
    lr_schedulers=_LIGHTNING_HAS["manual_backward"],
)


def note_lightning_habit(err: BaseException) -> None:
    """Add a note to an AttributeError a model raised asking itself for a LightningModule's member
    (``self.log``, ``self.trainer``, ``self.device``): what to write here instead. Local."""
    if not isinstance(err, AttributeError) or err.__traceback__ is None:
        return
    tb = err.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    found = re.search(r"has no attribute '(\w+)'", str(err))
    if (
        frame.f_code.co_name != "__getattr__"
        or not isinstance(frame.f_locals.get("self"), nn.Module)
        or found is None
        or found.group(1) not in _LIGHTNING_HAS
    ):
        return
    name = found.group(1)
    # In the message itself (exception notes need Python 3.11).
    err.args = (
        f"{err}\ndistkit: self.{name} is a LightningModule's, not an nn.Module's, and distkit's models are "
        f"plain modules: {_LIGHTNING_HAS[name]}. See docs/migrating.md.",
    )


def noting_lightning_habits(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` (validate, test, predict), with :func:`note_lightning_habit` on its AttributeError."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except AttributeError as err:
            note_lightning_habit(err)
            raise

    return call

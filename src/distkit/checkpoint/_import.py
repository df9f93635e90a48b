"""``distkit checkpoint import``: another tool's checkpoint as a committed distkit checkpoint (private).

Two layouts are converted, read with ``torch.load(weights_only=True)`` (and ``safetensors``) only:

* a Lightning ``.ckpt`` file (``lightning/pytorch/trainer/connectors/checkpoint_connector.py``,
  ``dump_checkpoint``): ``state_dict`` becomes ``"model"`` (the LightningModule's attribute prefix,
  such as ``model.``, stripped when every key has it), ``optimizer_states[0]`` becomes
  ``"optimizer"``, ``global_step`` the manifest's step;
* an Accelerate ``save_state`` directory (``accelerate/checkpointing.py``,
  ``save_accelerator_state``): ``model.safetensors`` or ``pytorch_model.bin`` (DDP's ``module.``
  removed) becomes ``"model"``, ``optimizer.bin`` ``"optimizer"``; the step comes from a custom
  state or a directory named ``step_<N>``.

The result is written by distkit's own save (staged, fsynced, renamed into place, manifest last)
with a ``source`` field in its manifest, so it verifies and loads like any distkit checkpoint, and a
resume from it starts distkit's bookkeeping (progress, counters, callbacks) fresh. What is not
carried over (loops, callbacks, schedulers, hyper-parameters, RNG states, scalers, custom objects)
is listed in the :class:`ImportReport`, with the reason.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import stat
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from distkit._utils.secrets import redact_url
from distkit.checkpoint._commit import _step_for_manifest
from distkit.checkpoint._files import _LocalStorage
from distkit.checkpoint._foreign import _identify_directory, _unknown
from distkit.checkpoint._format import _MANIFEST_FILE
from distkit.checkpoint._io import _check_new_target, _save_checkpoint
from distkit.checkpoint._state import _without_compile_segments
from distkit.errors import DistkitError

# What each of Lightning's top-level keys holds, for the report of what is not carried over. Other
# keys are a precision plugin's or a datamodule's state (named by class) or an on_save_checkpoint's.
_LIGHTNING_LEFT = {
    "loops": "Lightning's loop progress (a distkit Trainer resuming from the import counts from step 0)",
    "callbacks": "Lightning callbacks' states (ModelCheckpoint, EarlyStopping...)",
    "lr_schedulers": "LR scheduler states: a scheduler's state belongs to its class and schedule, so "
    "build the scheduler again",
    "hyper_parameters": "the LightningModule's init arguments: build the model from them yourself",
    "hparams_name": "the name of the hyper-parameters' attribute",
    "hparams_type": "the hyper-parameters' container type",
    "datamodule_hyper_parameters": "the LightningDataModule's init arguments",
}
_LIGHTNING_CARRIED = frozenset(
    {"state_dict", "optimizer_states", "global_step", "epoch", "pytorch-lightning_version"}
)
_LIGHTNING_MARKERS = frozenset({"pytorch-lightning_version", "optimizer_states", "global_step"})

# Accelerate's files (accelerate/utils/constants.py): the first model and optimizer are carried over.
_ACCELERATE_MODELS = ("model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp.bin")
_ACCELERATE_OPTIMIZER = "optimizer.bin"
_ACCELERATE_LEFT = (
    (re.compile(r"^model_\d+\.safetensors$|^pytorch_model(_fsdp)?_\d+\.bin$"), "another model's weights"),
    (re.compile(r"^optimizer_\d+\.bin$"), "another optimizer's state"),
    (re.compile(r"^scheduler(_\d+)?\.bin$"), "an LR scheduler's state: build the scheduler again"),
    (re.compile(r"^scaler\.pt$"), "the GradScaler's state (it calibrates again within a few steps)"),
    (
        re.compile(r"^random_states_\d+\.pkl$"),
        "a process's RNG states (and Accelerate's gradient-accumulation counter); a resume reseeds",
    ),
    (
        re.compile(r"^(sampler|dl_state_dict)(_\d+)?\.bin$"),
        "a data loader's position: the data order restarts",
    ),
    (re.compile(r"^custom_checkpoint_\d+\.pkl$"), "an object registered with register_for_checkpointing"),
    (re.compile(r"^(pytorch_model_fsdp|optimizer)_\d+$"), "an FSDP sharded state (a DCP directory)"),
)
# Accelerate's examples name their save_state directories step_<N> (a training step); automatic
# checkpoint naming's checkpoint_<N> counts saves (ProjectConfiguration.iteration), not steps.
_STEP_DIR_RE = re.compile(r"^(?:global_)?step[-_]?(\d+)$")
_SAVE_COUNT_DIR_RE = re.compile(r"^checkpoint_(\d+)$")
_CUSTOM_STEP_KEYS = ("global_step", "step", "completed_steps")


@dataclass(frozen=True)
class ImportReport:
    """What :func:`import_checkpoint` carried over from another tool's checkpoint, and what it left.

    ``str(report)`` is what ``distkit checkpoint import`` prints.

    Attributes:
        source: The checkpoint read (a path without the credentials it may carry).
        layout: What it was: ``"Lightning checkpoint"`` or ``"Accelerate save_state directory"``.
        destination: The distkit checkpoint written.
        step: The step recorded in its manifest, or ``None`` where the source had none.
        carried: Each entry of the new checkpoint (``"model"``, ``"optimizer"``) -> what it came from.
        not_carried: Each part of the source left behind -> why.
        notes: What else to know (a prefix stripped or found, where the step came from).

    Example:
        >>> report = distkit.import_checkpoint("last.ckpt", "imported")  # doctest: +SKIP
        >>> report.carried["model"]  # doctest: +SKIP
        "state_dict: 6 tensors, prefix 'model.' stripped"
    """

    source: str
    layout: str
    destination: str
    step: int | None
    carried: dict[str, str] = field(default_factory=dict)
    not_carried: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        step = "no step" if self.step is None else f"step {self.step}"
        lines = [f"imported {self.layout} {self.source} into {self.destination} ({step})", "carried over:"]
        width = max([len(k) for k in (*self.carried, *self.not_carried)] + [8])
        lines += [f"  {key:<{width}}  {what}" for key, what in self.carried.items()]
        if self.not_carried:
            lines.append("not carried over:")
            lines += [f"  {key:<{width}}  {why}" for key, why in self.not_carried.items()]
        lines += [f"note: {note}" for note in self.notes]
        lines.append(
            f"load it with Trainer(resume={self.destination!r}) or distkit.load_checkpoint("
            f"{self.destination!r}, {{'model': model, 'optimizer': optimizer}})"
        )
        return "\n".join(lines)


# Public as distkit.checkpoint.ImportReport: reprs and tracebacks say so.
ImportReport.__module__ = "distkit.checkpoint"


@dataclass
class _Converted:
    """A source read: the state to save and what the report says about it."""

    layout: str
    tool: str
    version: str
    state: dict[str, Any]
    step: int | None
    carried: dict[str, str]
    not_carried: dict[str, str]
    notes: list[str]


# --------------------------------------------------------------------------------------------------
# Reading files safely: weights_only, regular files only.


_UNSAFE_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _load_weights_only(file: str, what: str, hint: str = "") -> Any:
    mode = os.stat(file).st_mode
    if not stat.S_ISREG(mode):
        raise DistkitError(f"{file} ({what}) is not a regular file; distkit reads regular files only.")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        try:
            refused = torch.serialization.get_unsafe_globals_in_checkpoint(file)
        except Exception:  # not a torch.save file at all, or a damaged one: nothing to scan
            refused = []
        # The scan reads the zip format only; torch's message names a global of the older format.
        refused = refused or _UNSAFE_GLOBAL.findall(str(err))
        if isinstance(err, pickle.UnpicklingError) and refused:
            raise DistkitError(
                f"refused to load {file} ({what}): it holds objects that torch.load(weights_only=True) "
                f"does not allow ({', '.join(refused[:6])}). distkit never unpickles arbitrary objects, "
                f"because unpickling can run code.{hint}"
            ) from err
        # Truncated (a copy that did not finish), damaged, or another kind of file: torch's own
        # words (a KeyError of a byte, miniz's "central directory") name neither.
        said = re.split(r"(?<=\.)\s", str(err).strip(), maxsplit=1)[0][:160] or "(no message)"
        raise DistkitError(
            f"cannot read {file} (read as {what}): it is not a complete file written by torch.save "
            f"(truncated, damaged, or another kind of file; torch.load says {type(err).__name__}: "
            f"{said}). Copy it again from where it was saved, or pass the checkpoint it belongs to."
        ) from err


def _is_optimizer_state(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and isinstance(value.get("state"), Mapping)
        and isinstance(value.get("param_groups"), list)
        and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in value["param_groups"])
    )


def _optimizer_summary(value: Mapping[str, Any]) -> str:
    params = sum(len(group["params"]) for group in value["param_groups"])
    groups = len(value["param_groups"])
    return f"{params} parameter(s) in {groups} group(s), {len(value['state'])} with state"


# --------------------------------------------------------------------------------------------------
# The model's keys: wrappers removed, the prefix the user asked for (or Lightning's attribute) stripped.


def _common_prefix(keys: list[str]) -> str | None:
    """The first name every key starts with (``"model."``), when there is one and every key has more."""
    firsts = {key.split(".", 1)[0] for key in keys}
    if len(firsts) != 1 or any("." not in key for key in keys):
        return None
    return f"{next(iter(firsts))}."


def _model_state(
    state_dict: Mapping[str, Any], strip_prefix: str | None, *, attribute_prefix: bool
) -> tuple[OrderedDict[str, Any], list[str], dict[str, str]]:
    """The model's state dict to save, the notes on its keys, and the keys left out (-> why).

    DDP's ``module.`` and ``torch.compile``'s ``_orig_mod.`` are removed (distkit saves modules
    unwrapped). ``strip_prefix``: ``None`` strips the prefix common to every key when
    ``attribute_prefix`` (Lightning: the LightningModule's attribute that holds the model) and only
    names it otherwise; ``""`` strips nothing; a prefix strips it, leaving out the keys without it.
    """
    if not state_dict:
        raise DistkitError("the model's state dict is empty: there are no weights to import.")
    notes: list[str] = []
    if any("_orig_mod" in key.split(".") for key in state_dict):
        notes.append("removed torch.compile's '_orig_mod.' from the keys (distkit saves modules unwrapped)")
    ddp = all(_without_compile_segments(key).startswith("module.") for key in state_dict)
    if ddp:
        notes.append("removed DDP's 'module.' from every key (distkit saves modules unwrapped)")

    def unwrapped(key: str) -> str:
        key = _without_compile_segments(key)
        return key[len("module.") :] if ddp and key.startswith("module.") else key

    names = [unwrapped(key) for key in state_dict]
    common = _common_prefix(names)
    left: dict[str, str] = {}
    prefix = ""
    if strip_prefix is None and common is not None and attribute_prefix:
        prefix = common
        notes.append(
            f"stripped the prefix {common!r} that every key has (the LightningModule's attribute "
            f"{common[:-1]!r}, which holds the model), so the weights load into that module itself; "
            f"import again with --strip-prefix '' (strip_prefix='') to keep it"
        )
    elif strip_prefix is None and common is not None:
        notes.append(
            f"every key of the model starts with {common!r}: if the module you train is that attribute's "
            f"(not the whole model), import again with --strip-prefix {common}"
        )
    elif strip_prefix:
        prefix = strip_prefix if strip_prefix.endswith(".") else strip_prefix + "."
        if not any(name.startswith(prefix) for name in names):
            firsts = sorted({name.split(".", 1)[0] + "." for name in names})
            raise ValueError(
                f"no key of the model's state dict starts with {prefix!r} (strip_prefix); they start with "
                f"{firsts[:8]}. Pass one of those, or '' to keep the keys as they are."
            )
        notes.append(f"stripped the prefix {prefix!r} (strip_prefix)")
    outside = [name for name in names if not name.startswith(prefix)]
    if outside:
        shown = ", ".join(outside[:5])
        left[f"model keys outside {prefix!r}"] = f"{len(outside)} key(s) ({shown}): not part of that module"

    def final(key: str) -> str | None:
        name = unwrapped(key)
        return name[len(prefix) :] if name.startswith(prefix) else None

    out: OrderedDict[str, Any] = OrderedDict()
    for key, value in state_dict.items():
        name = final(key)
        if name is not None:
            out[name] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # module versions (BatchNorm's...), keyed by module path, "" the root
        kept: OrderedDict[str, Any] = OrderedDict()
        for path, value in metadata.items():
            name = final(f"{path}." if path else "")
            if name is not None:
                kept.setdefault(name[:-1] if name.endswith(".") else name, value)
        out._metadata = kept  # type: ignore[attr-defined]
    return out, notes, left


# --------------------------------------------------------------------------------------------------
# Lightning: one .ckpt file.

_LIGHTNING_HINT = (
    " In a Lightning checkpoint they are usually in hyper_parameters or callbacks, which import does "
    "not carry over anyway. If you trust the file, allow them for the import in Python: `with "
    "torch.serialization.safe_globals([...]): distkit.import_checkpoint(src, dest)`, or write a copy "
    "without them: `ckpt = torch.load(src, weights_only=False); ckpt.pop('hyper_parameters', None); "
    "torch.save(ckpt, 'clean.ckpt')`."
)


def _read_lightning(path: str, strip_prefix: str | None, step: int | None) -> _Converted:
    checkpoint = _load_weights_only(path, "a Lightning checkpoint", _LIGHTNING_HINT)
    keys = sorted(checkpoint) if isinstance(checkpoint, dict) else []
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), Mapping):
        what = f"a dict of {keys[:8]}" if isinstance(checkpoint, dict) else f"a {type(checkpoint).__name__}"
        raise DistkitError(
            f"{path} is not a Lightning checkpoint: torch.load gives {what}, and a Lightning checkpoint is a "
            f"dict with 'state_dict' and 'pytorch-lightning_version', 'optimizer_states', 'global_step'. "
            f"A plain state dict saves as a distkit checkpoint with distkit.save_checkpoint(dest, "
            f"{{'model': torch.load(path, weights_only=True)}})."
        )
    if not _LIGHTNING_MARKERS & set(checkpoint):
        raise DistkitError(
            f"{path} holds a 'state_dict' but none of {sorted(_LIGHTNING_MARKERS)}, so it is not a "
            f"Lightning checkpoint (its keys: {keys[:8]}). Save it with distkit.save_checkpoint(dest, "
            f"{{'model': <its state dict>}}) instead."
        )
    model, notes, not_carried = _model_state(checkpoint["state_dict"], strip_prefix, attribute_prefix=True)
    state: dict[str, Any] = {"model": model}
    carried = {"model": f"state_dict: {len(model)} tensor(s)"}
    optimizers = checkpoint.get("optimizer_states") or []
    if optimizers and _is_optimizer_state(optimizers[0]):
        state["optimizer"] = optimizers[0]
        carried["optimizer"] = f"optimizer_states[0]: {_optimizer_summary(optimizers[0])}"
    elif optimizers:
        not_carried["optimizer_states[0]"] = "not a torch optimizer state dict"
    else:
        notes.append("the checkpoint holds no optimizer state (saved with weights_only=True?)")
    if len(optimizers) > 1:
        not_carried["optimizer_states[1:]"] = (
            f"{len(optimizers) - 1} more optimizer(s): a distkit Trainer trains one; save them yourself"
        )
    saved_step = checkpoint.get("global_step")
    if step is None and isinstance(saved_step, int) and not isinstance(saved_step, bool):
        step = saved_step
        notes.append(f"step {step} is Lightning's global_step (epoch {checkpoint.get('epoch')})")
    for key in sorted(set(checkpoint) - _LIGHTNING_CARRIED):
        value = checkpoint[key]
        why = _LIGHTNING_LEFT.get(key, "not a model or optimizer state (a plugin's, a datamodule's or yours)")
        if key == "callbacks" and isinstance(value, Mapping) and value:
            why += f": {', '.join(str(k).split('{')[0] for k in list(value)[:4])}"
        not_carried[key] = why
    version = checkpoint.get("pytorch-lightning_version")
    return _Converted(
        layout="Lightning checkpoint",
        tool="lightning",
        version=str(version) if version is not None else "",
        state=state,
        step=step,
        carried=carried,
        not_carried=not_carried,
        notes=notes,
    )


# --------------------------------------------------------------------------------------------------
# Accelerate: one save_state directory.


def _read_safetensors(file: str) -> OrderedDict[str, Any]:
    try:
        from safetensors.torch import load_file
    except ImportError as err:
        raise DistkitError(
            f"{file} is in the safetensors format (Accelerate's default), and reading it needs the "
            f"safetensors package: pip install safetensors. (save_state(..., safe_serialization=False) "
            f"writes pytorch_model.bin instead, which distkit reads without it.)"
        ) from err
    return OrderedDict(load_file(file, device="cpu"))


def _custom_step(directory: str, names: set[str]) -> tuple[int | None, str | None]:
    """A step found in a registered custom object's state (``{"step": N}`` and the like)."""
    for name in sorted(n for n in names if n.startswith("custom_checkpoint_")):
        try:
            value = torch.load(os.path.join(directory, name), map_location="cpu", weights_only=True)
        except Exception:  # an object weights_only refuses: not read, and not needed for the rest
            continue
        if isinstance(value, Mapping):
            for key in _CUSTOM_STEP_KEYS:
                found = value.get(key)
                if isinstance(found, torch.Tensor) and found.numel() == 1:
                    found = int(found.item())
                if isinstance(found, int) and not isinstance(found, bool) and found >= 0:
                    return found, f"step {found} is {key!r} of {name}"
    return None, None


def _read_accelerate(
    directory: str, names: set[str], strip_prefix: str | None, step: int | None
) -> _Converted:
    model_file = next((name for name in _ACCELERATE_MODELS if name in names), None)
    if model_file is None:
        fsdp = sorted(name for name in names if name.startswith("pytorch_model_fsdp_"))
        if fsdp:
            where = os.path.join(directory, fsdp[0])
            raise DistkitError(
                f"{directory} is an Accelerate save_state directory of an FSDP model saved with a sharded "
                f"state dict: its model is the torch.distributed.checkpoint directory {fsdp[0]}, which "
                f"import does not read. distkit loads it as it is: "
                f"distkit.load_checkpoint({where!r}, {{'model': model}}) (the optimizer's state is not "
                f"carried over)."
            )
        raise DistkitError(
            f"{directory} is an Accelerate save_state directory without model weights (none of "
            f"{list(_ACCELERATE_MODELS)}): nothing to import."
        )
    file = os.path.join(directory, model_file)
    if model_file.endswith(".safetensors"):
        raw = _read_safetensors(file)
    else:
        raw = _load_weights_only(file, "Accelerate's model weights")
        if not isinstance(raw, Mapping):
            raise DistkitError(f"{file} holds a {type(raw).__name__}, not a model's state dict.")
    model, notes, not_carried = _model_state(raw, strip_prefix, attribute_prefix=False)
    state: dict[str, Any] = {"model": model}
    carried = {"model": f"{model_file}: {len(model)} tensor(s)"}
    if "model.safetensors" in names and "pytorch_model.bin" in names:
        not_carried["pytorch_model.bin"] = "model.safetensors was read instead"
    if _ACCELERATE_OPTIMIZER in names:
        optimizer = _load_weights_only(
            os.path.join(directory, _ACCELERATE_OPTIMIZER), "Accelerate's optimizer"
        )
        if _is_optimizer_state(optimizer):
            state["optimizer"] = optimizer
            carried["optimizer"] = f"{_ACCELERATE_OPTIMIZER}: {_optimizer_summary(optimizer)}"
        else:
            not_carried[_ACCELERATE_OPTIMIZER] = "not a torch optimizer state dict"
    else:
        notes.append(f"the directory holds no {_ACCELERATE_OPTIMIZER}: no optimizer state to carry over")
    custom, why = _custom_step(directory, names) if step is None else (None, None)
    name = os.path.basename(os.path.normpath(directory))
    if step is None and custom is not None:
        step = custom
        notes.append(str(why))
    elif step is None and (match := _STEP_DIR_RE.match(name)):
        step = int(match.group(1))
        notes.append(f"step {step} is taken from the directory's name ({name})")
    elif step is None and _SAVE_COUNT_DIR_RE.match(name):
        notes.append(
            f"no step recorded: {name} is Accelerate's automatic checkpoint naming, which counts saves, "
            f"not steps; pass --step N (step=N) to record one"
        )
    for entry in sorted(names - {model_file, _ACCELERATE_OPTIMIZER} - set(not_carried)):
        reason = next((why for pattern, why in _ACCELERATE_LEFT if pattern.match(entry)), None)
        not_carried[entry] = reason or "not part of Accelerate's save_state"
    return _Converted(
        layout="Accelerate save_state directory",
        tool="accelerate",
        version="",
        state=state,
        step=step,
        carried=carried,
        not_carried=not_carried,
        notes=notes,
    )


# --------------------------------------------------------------------------------------------------
# The command and the public function.


def _read_source(source: str, strip_prefix: str | None, step: int | None) -> _Converted:
    if not os.path.lexists(source):
        raise FileNotFoundError(
            errno.ENOENT,
            f"nothing to import: {source} does not exist. Pass a Lightning .ckpt file or an "
            f"Accelerate save_state directory.",
        )
    if not os.path.isdir(source):
        return _read_lightning(source, strip_prefix, step)
    names = set(os.listdir(source))
    if _MANIFEST_FILE in names:
        raise ValueError(
            f"{source} is a distkit checkpoint already (it holds {_MANIFEST_FILE}); load it as it is, or "
            f"copy it with distkit.consolidate_checkpoint(src, dst)."
        )
    layout = _identify_directory(names) or _unknown(names)
    if layout.kind != "accelerate":
        raise layout.error(source)
    return _read_accelerate(source, names, strip_prefix, step)


def _import_checkpoint(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    strip_prefix: str | None,
    step: int | None,
    file_mode: int,
) -> ImportReport:
    """:func:`distkit.checkpoint.import_checkpoint`: read ``src``, save it as a distkit checkpoint at
    ``dest``."""
    step = _step_for_manifest(step)
    if strip_prefix is not None and not isinstance(strip_prefix, str):
        raise TypeError(f"strip_prefix must be a string or None, got {strip_prefix!r}.")
    source = os.fspath(src)
    if source.startswith("file://"):
        source = source[len("file://") :]
    if "://" in source:
        raise ValueError(
            f"import reads local files, got {redact_url(source)}: copy the checkpoint to a local directory "
            f"first (distkit.download(url, local_dir)); the destination may be an fsspec URL."
        )
    target = os.fspath(dest)
    local = _LocalStorage()
    _check_new_target(local, source, target, None, command="import")  # before reading anything big
    converted = _read_source(source, strip_prefix, step)
    _check_new_target(local, source, target, converted.step, command="import")  # and its step_<N> name
    written = _save_checkpoint(
        target,
        converted.state,
        step=converted.step,
        metrics=None,
        collective=False,
        file_mode=file_mode,
        timeout_s=None,
        guard=None,
        storage=None,
        sharded=False,
        source={"tool": converted.tool, "version": converted.version},
    )
    return ImportReport(
        source=redact_url(source),
        layout=converted.layout,
        destination=redact_url(written),
        step=converted.step,
        carried=converted.carried,
        not_carried=converted.not_carried,
        notes=converted.notes,
    )

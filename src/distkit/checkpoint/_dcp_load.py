"""Reading ``torch.distributed.checkpoint`` (DCP) directories (private): distkit's sharded
checkpoints, and other tools' DCP checkpoints (torchtitan's, ``dcp.save``'s).

Each rank reads what its own objects hold: the pieces of its shards for an FSDP2 module, whole
tensors for a DDP or plain one, whatever world size wrote the checkpoint. Modules go through DCP's
``get_model_state_dict``/``set_model_state_dict`` and optimizers through
``get_optimizer_state_dict``/``set_optimizer_state_dict``, in whichever of three forms the
checkpoint keyed the optimizer (:class:`_DcpEntry`). Writing sharded checkpoints is
:mod:`distkit.checkpoint._sharded`'s concern.

Loading never unpickles arbitrary objects: DCP's ``.metadata`` is read with an unpickler that allows
DCP's own metadata classes only, and DCP's non-tensor values with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distkit._utils.secrets import redact_url
from distkit.checkpoint._files import _open_regular
from distkit.checkpoint._format import _DCP_METADATA_FILE
from distkit.checkpoint._sharded import _this_ranks_failure
from distkit.checkpoint._state import _optimizer_owners
from distkit.errors import DistkitError


def _metadata_classes() -> frozenset[Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    return frozenset(
        value
        for value in vars(metadata).values()
        if isinstance(value, type) and value.__module__ == metadata.__name__
    ) | {filesystem._StorageInfo}


# Globals that DCP's .metadata names besides its own classes and torch's dtypes and layouts: the
# checkpoint id is a path, and layouts are rebuilt by name.
_METADATA_GLOBALS = frozenset(
    {
        ("collections", "OrderedDict"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: DCP's metadata classes, torch sizes, dtypes and layouts, paths."""

    allowed: frozenset[Any] = frozenset()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        found = super().find_class(module, name) if module == "torch" or module.startswith("torch.") else None
        if found is not None and (
            found in self.allowed
            or found is torch.Size
            or isinstance(found, (torch.dtype, torch.layout, torch.memory_format))
        ):
            return found
        raise pickle.UnpicklingError(f"global {module}.{name} is not one of DCP's metadata types")


def _check_metadata(path: str) -> None:
    """Refuse DCP's ``.metadata`` unless it holds DCP's metadata types only (it is then unpickled)."""
    file = os.path.join(path, _DCP_METADATA_FILE)
    with os.fdopen(_open_regular(path, file), "rb") as handle:
        unpickler = _MetadataUnpickler(handle)
        unpickler.allowed = _metadata_classes()
        try:
            unpickler.load()
        except (pickle.UnpicklingError, AttributeError, ImportError, EOFError) as err:
            raise DistkitError(
                f"refused to load {redact_url(file)}: {err}. distkit never unpickles arbitrary "
                f"objects, because unpickling can run code, and a sharded checkpoint's .metadata "
                f"holds torch.distributed.checkpoint's metadata types only."
            ) from err


def _reader(path: str) -> Any:
    """DCP's reader of ``path``, which checks ``.metadata`` before DCP unpickles it."""
    from torch.distributed.checkpoint import FileSystemReader

    _check_metadata(path)  # here, so that a refusal is raised as it is, not wrapped by DCP

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            _check_metadata(path)
            return super().read_metadata(*args, **kwargs)

    return SafeReader(path)


def _safe_bytes(value: io.BytesIO) -> io.BytesIO:
    """``value`` once ``torch.load(weights_only=True)`` accepted it (DCP then loads it as it is)."""
    position = value.tell()
    torch.load(value, weights_only=True)
    value.seek(position)
    return value


def _planner(*, everything: bool, strict: bool) -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    base = _EmptyStateDictLoadPlanner if everything else DefaultLoadPlanner

    class SafePlanner(base):  # type: ignore[valid-type,misc]
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            super().load_bytes(read_item, _safe_bytes(value))

    return SafePlanner() if everything else SafePlanner(allow_partial_load=not strict)


def _load_everything(path: str) -> dict[str, Any]:
    """Every DCP entry of the sharded checkpoint at ``path``, as full CPU tensors. Local."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    loaded: dict[str, Any] = {}
    _load_state_dict(
        loaded, storage_reader=_reader(path), planner=_planner(everything=True, strict=False), no_dist=True
    )
    return loaded


@dataclass(frozen=True)
class _DcpEntry:
    """Where one entry of a state (a module, or an optimizer) lies in a DCP checkpoint's keys.

    Attributes:
        key: The entry of the state.
        prefix: What precedes a name in DCP's keys: ``"<key>."`` in distkit's sharded checkpoints
            and in ``dcp.save({"model": ..., "optimizer": ...})``; ``""`` for a module whose keys
            are at the top level (torchtitan, which merges the model's state dict into the state it
            saves).
        optimizer_form: How an optimizer's state is keyed: ``"by_name"`` (DCP's
            ``get_optimizer_state_dict``, distkit's), ``"flat"`` (with
            ``flatten_optimizer_state_dict=True``, torchtitan's) or ``"by_index"``
            (``optimizer.state_dict()``, parameters numbered).
    """

    key: str
    prefix: str
    optimizer_form: str = "by_name"


def _numbered(by_name: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """An optimizer state keyed by parameter name, numbered as ``optimizer.state_dict()`` numbers its
    parameters (through the groups, in order); also the names in that order."""
    order = [name for group in by_name["param_groups"] for name in group["params"]]
    number = {name: i for i, name in enumerate(order)}
    return {
        "state": {number[name]: value for name, value in by_name["state"].items()},
        "param_groups": [
            {**group, "params": [number[name] for name in group["params"]]}
            for group in by_name["param_groups"]
        ],
    }, order


def _named(numbered: Mapping[str, Any], order: list[str]) -> dict[str, Any]:
    """The inverse of :func:`_numbered`: parameter numbers (as loaded) back to names."""
    if any(
        not isinstance(i, int) or not 0 <= i < len(order)
        for g in numbered["param_groups"]
        for i in g["params"]
    ):
        raise ValueError(
            f"the checkpoint's optimizer numbers its parameters "
            f"{[g['params'] for g in numbered['param_groups']]}, this optimizer has {len(order)}"
        )
    return {
        "state": {order[int(i)]: value for i, value in numbered["state"].items()},
        "param_groups": [
            {**group, "params": [order[i] for i in group["params"]]} for group in numbered["param_groups"]
        ],
    }


def _optimizer_target(
    module: nn.Module, optimizer: torch.optim.Optimizer, form: str
) -> tuple[Any, list[str]]:
    """This rank's state of ``optimizer`` in ``form`` (what DCP loads into), and the parameter names in
    the order the optimizer numbers them (for ``"by_index"``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if form == "flat":
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        return get_optimizer_state_dict(module, optimizer, options=options), []
    by_name = get_optimizer_state_dict(module, optimizer)
    if form == "by_index":
        return _numbered(by_name)
    return by_name, []


def _unsaved_settings(
    entries: list[_DcpEntry], targets: dict[str, Any], saved_keys: Collection[str]
) -> dict[tuple[str, int | None, str], Any]:
    """Take out of the optimizers' ``targets`` the group settings the checkpoint does not hold, so
    that DCP does not ask for them; return them, by (entry, group or None when flat, setting)."""
    kept: dict[tuple[str, int | None, str], Any] = {}
    for entry in entries:
        if entry.key not in targets or entry.prefix != f"{entry.key}.":
            continue  # a module's keys, not an optimizer's
        target = targets[entry.key]
        if entry.optimizer_form == "flat":
            for name in [n for n in target if n.startswith("param_groups.")]:
                if entry.prefix + name not in saved_keys:
                    kept[(entry.key, None, name)] = target.pop(name)
            continue
        for index, group in enumerate(target["param_groups"]):
            for name in [n for n in group if n != "params"]:
                if f"{entry.prefix}param_groups.{index}.{name}" not in saved_keys:
                    kept[(entry.key, index, name)] = group.pop(name)
    return kept


def _size_error(name: str, saved: torch.Size, current: torch.Size) -> str:
    # torch's own words (nn.Module.load_state_dict), which the Trainer reads back to list what changed.
    return (
        f"size mismatch for {name}: copying a param with shape {saved} from checkpoint, the shape in "
        f"current model is {current}."
    )


def _check_module(
    path: str,
    key: str,
    module: nn.Module,
    prefix: str,
    saved: Mapping[str, Any],
    others: frozenset[str],
    strict: bool,
) -> None:
    """Refuse, before anything is read, a module that does not fit its keys in the checkpoint: a shape
    that differs; with ``strict``, a name missing or one the checkpoint has and the module lacks."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    current: dict[str, Any] = dict(get_model_state_dict(module))
    problems = []
    missing = [name for name in current if prefix + name not in saved]
    if strict and missing:
        problems.append("Missing key(s) in state_dict: " + ", ".join(f'"{n}"' for n in missing) + ". ")
    if strict:
        own_segments = {name.split(".")[0] for name in current}
        unexpected = []
        for full, info in saved.items():
            if not full.startswith(prefix) or not isinstance(info, TensorStorageMetadata):
                continue
            name = full[len(prefix) :]
            first = name.split(".")[0]
            if name in current or (prefix == "" and first in others and first not in own_segments):
                continue  # another entry's key (torchtitan keeps the model's beside them)
            unexpected.append(name)
        if unexpected:
            problems.append(
                "Unexpected key(s) in state_dict: " + ", ".join(f'"{n}"' for n in unexpected) + ". "
            )
    for name, value in current.items():
        info = saved.get(prefix + name)
        if not isinstance(info, TensorStorageMetadata) or not isinstance(value, torch.Tensor):
            continue
        if tuple(info.size) != tuple(value.shape):
            problems.append(_size_error(name, info.size, value.shape))
    if problems:
        kind = type(module).__name__
        raise DistkitError(
            f"could not restore state[{key!r}] into {kind} from checkpoint {redact_url(path)}: "
            f"Error(s) in loading state_dict for {kind}:\n\t" + "\n\t".join(problems)
        )


def _restore_sharded(
    path: str, manifest: Mapping[str, Any], state: Mapping[str, Any], strict: bool
) -> dict[str, Any]:
    """Load the DCP entries of ``state`` from the sharded checkpoint at ``path``, resharded to this
    rank's objects (FSDP, DDP or plain); return them as this rank's state dicts. Local."""
    saved = manifest["sharded"]
    entries = [_DcpEntry(key, f"{key}.") for key in saved["keys"] if key in state]
    modules = [entry for entry in entries if isinstance(state[entry.key], nn.Module)]
    if modules:
        # Every changed shape and name at once, before anything is read (DCP's planner stops at
        # the first one it meets).
        metadata = _reader(path).read_metadata().state_dict_metadata
        for entry in modules:
            _check_module(path, entry.key, state[entry.key], entry.prefix, metadata, frozenset(state), strict)
    return _restore_dcp(path, entries, state, strict, saved_owners=saved["optimizers"])


def _restore_dcp(
    path: str,
    entries: list[_DcpEntry],
    state: Mapping[str, Any],
    strict: bool,
    *,
    saved_owners: Mapping[str, str],
    saved_keys: Collection[str] | None = None,
) -> dict[str, Any]:
    """Load ``entries`` of ``state`` from the DCP checkpoint at ``path`` (distkit's or another tool's),
    each rank reading what its own objects hold (the shards of an FSDP module, whole tensors of a DDP
    or plain one), and set them into the objects; return them as this rank's state dicts. Local.

    ``saved_owners`` (optimizer entry -> the module entry it was saved with) only names the module
    to pass when an optimizer of ``state`` comes without its module. ``saved_keys`` (the
    checkpoint's keys, for another tool's checkpoint) lets an optimizer's group keep the settings the
    checkpoint does not have (the Trainer's ``distkit_base_lr``, an option of a newer torch).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    owners = _optimizer_owners(state)
    targets: dict[str, Any] = {}
    names: dict[str, list[str]] = {}  # module entry: its names; optimizer entry: names by number
    for entry in entries:
        key, value = entry.key, state[entry.key]
        if isinstance(value, nn.Module):
            module_state = get_model_state_dict(value)
            names[key] = list(module_state)
            targets.update((entry.prefix + name, tensor) for name, tensor in module_state.items())
        elif isinstance(value, torch.optim.Optimizer) and key in owners:
            targets[key], names[key] = _optimizer_target(state[owners[key]], value, entry.optimizer_form)
        elif isinstance(value, torch.optim.Optimizer):
            raise DistkitError(
                f"checkpoint {redact_url(path)} saved state[{key!r}] by parameter name (a sharded "
                f"checkpoint), so restoring it needs the module it trains in the same state, e.g. "
                f"{{{saved_owners.get(key, 'model')!r}: model, {key!r}: optimizer}}."
            )
        else:
            raise DistkitError(
                f"checkpoint {redact_url(path)} holds state[{key!r}] as a sharded module or "
                f"optimizer, but the state given has a {type(value).__name__} there; pass the "
                f"module or optimizer."
            )
    if not targets:
        return {}
    kept = {} if saved_keys is None else _unsaved_settings(entries, targets, saved_keys)
    try:
        # DCP's loader without its process-group lookup: each rank plans its own reads (local).
        _load_state_dict(
            targets,
            storage_reader=_reader(path),
            planner=_planner(everything=False, strict=strict),
            no_dist=True,
        )
    except DistkitError:
        raise
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        err = _this_ranks_failure(err, rank=0) or err  # rank 0 of its own (no_dist) load
        if isinstance(err, DistkitError):
            raise err from None
        if not isinstance(err, Exception):
            raise
        loading = sorted(entry.key for entry in entries)
        raise DistkitError(f"could not restore {loading} from checkpoint {redact_url(path)}: {err}") from err
    for (key, group, setting), value in kept.items():  # back, as the optimizer has them now
        if group is None:
            targets[key][setting] = value
        else:
            targets[key]["param_groups"][group][setting] = value
    restored: dict[str, Any] = {}
    for entry in entries:
        key, value = entry.key, state[entry.key]
        try:
            if isinstance(value, nn.Module):
                restored[key] = {name: targets[entry.prefix + name] for name in names[key]}
                set_model_state_dict(value, restored[key], options=StateDictOptions(strict=strict))
            elif entry.optimizer_form == "flat":
                restored[key] = targets[key]
                options = StateDictOptions(strict=strict, flatten_optimizer_state_dict=True)
                set_optimizer_state_dict(state[owners[key]], value, restored[key], options=options)
            else:
                by_name = (
                    _named(targets[key], names[key]) if entry.optimizer_form == "by_index" else targets[key]
                )
                restored[key] = by_name
                options = StateDictOptions(strict=strict)
                set_optimizer_state_dict(state[owners[key]], value, by_name, options=options)
        except (RuntimeError, KeyError, ValueError) as err:
            raise DistkitError(
                f"could not restore state[{key!r}] into {type(value).__name__}: {err}"
            ) from err
    return restored

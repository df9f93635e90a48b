"""Live objects to a checkpoint's state and back (private).

Saving: modules unwrapped from DDP, DataParallel and ``torch.compile``, state dicts collected,
values that ``torch.load(weights_only=True)`` would refuse caught before anything is written, and
an asynchronous save's copy in CPU memory. Loading: saved keys matched to the target module's
(``module.`` and ``_orig_mod.`` prefixes), and each entry restored into its object; a full state
dict goes into a sharded (DTensor, FSDP2) module or optimizer through DCP's ``set_*_state_dict``,
each rank keeping its own slices, and an optimizer state saved by parameter name (a consolidated
sharded checkpoint) into any optimizer through its module.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections import Counter, OrderedDict
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from distkit._utils.secrets import redact_url
from distkit.errors import DistkitError
from distkit.runtime import _rank_label

# Exact types torch.load(weights_only=True) rebuilds without help (see torch._weights_only_unpickler):
# a subclass (a namedtuple, a numpy scalar, a defaultdict) is refused at load time.
_PLAIN_LEAVES = frozenset(
    {
        int,
        float,
        complex,
        bool,
        str,
        bytes,
        bytearray,
        type(None),
        torch.Size,
        torch.dtype,
        torch.device,
        torch.layout,
    }
)
_PLAIN_CONTAINERS = frozenset({dict, OrderedDict, Counter, list, tuple, set})
_PLAIN_TENSORS = frozenset({torch.Tensor, nn.Parameter})


# --------------------------------------------------------------------------------------------------
# Sharded parameters (DTensors, as FSDP2's fully_shard makes them) and the module of each optimizer.


def _is_dtensor(value: Any) -> bool:
    if type(value) in _PLAIN_TENSORS:
        return False  # the common case, without importing torch.distributed.tensor
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _parameters_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, nn.Module):
        return list(value.parameters())
    if isinstance(value, torch.optim.Optimizer):
        return [p for group in value.param_groups for p in group["params"]]
    return []


def _holds_dtensors(value: Any) -> bool:
    return any(_is_dtensor(p) for p in _parameters_of(value))


def _optimizer_owners(state: Mapping[str, Any]) -> dict[str, str]:
    """Optimizer entry -> the first module entry of ``state`` that holds all of its parameters."""
    modules = {
        key: {id(p) for p in value.parameters()}
        for key, value in state.items()
        if isinstance(value, nn.Module)
    }
    owners = {}
    for key, value in state.items():
        if isinstance(value, torch.optim.Optimizer):
            params = {id(p) for p in _parameters_of(value)}
            owner = next((name for name, ids in modules.items() if params <= ids), None)
            if owner is not None:
                owners[key] = owner
    return owners


# --------------------------------------------------------------------------------------------------
# From live objects to a state that torch.load(weights_only=True) can read back.


def _unwrap(module: nn.Module) -> nn.Module:
    """The user's module inside DDP, DataParallel and torch.compile wrappers."""
    while True:
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            module = module.module
            continue
        # torch.compile's wrapper; if dynamo was never imported no module can be compiled.
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
            module = module._orig_mod
            continue
        return module


def _without_compile_segments(key: str) -> str:
    # A compiled submodule (model.encoder = torch.compile(...)) puts "_orig_mod." inside the keys.
    return ".".join(part for part in key.split(".") if part != "_orig_mod")


def _module_state(module: nn.Module) -> dict[str, Any]:
    state = _unwrap(module).state_dict()
    if not any("_orig_mod" in key for key in state):
        return state
    clean: OrderedDict[str, Any] = OrderedDict(
        (_without_compile_segments(key), value) for key, value in state.items()
    )
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        clean_meta: OrderedDict[str, Any] = OrderedDict()
        for prefix, value in metadata.items():
            clean_meta.setdefault(_without_compile_segments(prefix), value)
        clean._metadata = clean_meta  # type: ignore[attr-defined]
    return clean


def _check_state(state: Any) -> None:
    if not isinstance(state, Mapping):
        raise TypeError(
            f"state must be a mapping of names to objects, e.g. {{'model': model}}, "
            f"got {type(state).__name__}."
        )
    for key in state:
        if not isinstance(key, str):
            raise TypeError(f"state keys must be strings, got {key!r}.")


def _collect(state: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            out[key] = _module_state(value)
        elif callable(getattr(value, "state_dict", None)):
            out[key] = value.state_dict()
        else:
            out[key] = value
    return out


def _safe_types() -> set[type]:
    extra = set()
    for entry in torch.serialization.get_safe_globals():
        obj = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(obj, type):
            extra.add(obj)
    return extra


def _check_loadable(payload: Mapping[str, Any]) -> None:
    """Refuse, before writing, a state that ``torch.load(weights_only=True)`` would refuse later."""
    allowed: set[type] | None = None
    stack: list[tuple[Any, str]] = [(value, f"[{key!r}]") for key, value in payload.items()]
    seen: set[int] = set()
    while stack:
        obj, where = stack.pop()
        kind = type(obj)
        if kind in _PLAIN_LEAVES or kind in _PLAIN_TENSORS:
            continue
        if kind in _PLAIN_CONTAINERS:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, dict):
                stack.extend((k, f"{where} key {k!r}") for k in obj)
                stack.extend((v, f"{where}[{k!r}]") for k, v in obj.items())
                if getattr(obj, "__dict__", None):
                    stack.extend((v, f"{where}.{a}") for a, v in vars(obj).items())
            else:
                stack.extend((v, f"{where}[{i}]") for i, v in enumerate(obj))
            continue
        if allowed is None:
            allowed = _safe_types()
        if kind in allowed:
            continue
        name = f"{kind.__module__}.{kind.__qualname__}"
        raise TypeError(
            f"state{where} is a {name}, which torch.load(weights_only=True) refuses to load, so "
            f"this checkpoint could never be restored. Store tensors, numbers, strings and "
            f"lists/dicts of them instead (torch.from_numpy() for arrays, .item() for numpy "
            f"scalars), give the object state_dict()/load_state_dict(), or allow the type with "
            f"torch.serialization.add_safe_globals([{kind.__qualname__}])."
        )


def _copy_storage(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    # torch leaves UntypedStorage.clone() and .cpu() unannotated: the annotations say what they return.
    if storage.device.type == "cpu":
        clone: torch.UntypedStorage = storage.clone()
        return clone
    if storage.device.type != "cuda":
        on_cpu: torch.UntypedStorage = storage.cpu()
        return on_cpu
    # Pinned host memory lets the device copies overlap; _to_cpu synchronizes once at the end.
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True).untyped_storage()
    host.copy_(storage, non_blocking=True)
    return host


def _to_cpu(obj: Any) -> Any:
    """A copy of ``obj`` in CPU memory that pickles to the same bytes as ``obj`` itself.

    Tensors that share a storage keep sharing one copy, containers referenced twice stay one
    object, and immutable leaves are the same objects: ``torch.save`` output depends on all three.
    """
    storages: dict[int, torch.UntypedStorage] = {}
    memo: dict[int, Any] = {}
    devices: set[torch.device] = set()

    def tensor(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            return t.detach()  # no data to copy
        if t.layout != torch.strided or type(t) not in _PLAIN_TENSORS or t.is_quantized or t.is_conj():
            # Rare in state dicts; a plain copy is right, only its bytes may differ from a sync save.
            return t.detach().to("cpu", copy=True)
        source = t.untyped_storage()
        key = source._cdata
        if key not in storages:
            if source.device.type == "cuda":
                devices.add(source.device)
            storages[key] = _copy_storage(source)
        out = torch.empty(0, dtype=t.dtype).set_(storages[key], t.storage_offset(), t.size(), t.stride())
        if isinstance(t, nn.Parameter):
            return nn.Parameter(out, requires_grad=t.requires_grad)
        return out.requires_grad_(t.requires_grad)

    def walk(value: Any) -> Any:
        kind = type(value)
        if kind in _PLAIN_LEAVES and kind is not bytearray:
            return value
        if id(value) in memo:
            return memo[id(value)]
        if isinstance(value, torch.Tensor):
            result: Any = tensor(value)
        elif kind in (dict, OrderedDict, Counter):
            result = kind()
            memo[id(value)] = result
            for k, v in value.items():
                result[k] = walk(v)
            for attr, v in getattr(value, "__dict__", {}).items():  # a module state dict's _metadata
                setattr(result, attr, copy.deepcopy(v))
        elif kind is list:
            result = []
            memo[id(value)] = result
            result.extend(walk(v) for v in value)
        elif kind is tuple:
            result = tuple(walk(v) for v in value)
        elif kind is set:
            result = {walk(v) for v in value}
        else:
            result = copy.deepcopy(value)
        memo[id(value)] = result
        return result

    copied = walk(obj)
    for device in devices:
        torch.cuda.synchronize(device)
    return copied


# --------------------------------------------------------------------------------------------------
# From a loaded state back into live objects.


def _key_map(source: list[str], target: list[str]) -> dict[str, str]:
    """Map keys saved with or without wrapper prefixes onto the target module's keys."""
    if set(source) <= set(target):
        return {}

    def canonical(key: str) -> str:
        key = _without_compile_segments(key)
        while key.startswith("module."):
            key = key[len("module.") :]
        return "" if key == "module" else key

    by_canonical: dict[str, str] = {}
    for key in target:
        if by_canonical.setdefault(canonical(key), key) != key:
            return {}  # ambiguous: leave the keys as they are and let load_state_dict report them
    return {key: by_canonical[canonical(key)] for key in source if canonical(key) in by_canonical}


def _load_module(name: str, module: nn.Module, saved: Mapping[str, Any], strict: bool) -> None:
    inner = _unwrap(module)
    target_keys = list(inner.state_dict(keep_vars=True))
    mapping = _key_map(list(saved), target_keys)
    if mapping:
        remapped: OrderedDict[str, Any] = OrderedDict((mapping.get(k, k), v) for k, v in saved.items())
        metadata = getattr(saved, "_metadata", None)
        if metadata is not None:
            prefixes = _key_map(list(metadata), [n for n, _ in inner.named_modules()])
            remapped._metadata = OrderedDict(  # type: ignore[attr-defined]
                (prefixes.get(k, k), v) for k, v in metadata.items()
            )
        saved = remapped
    try:
        if _holds_dtensors(inner):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            # Each rank copies its own slices out of the full tensors: no communication.
            options = StateDictOptions(full_state_dict=True, strict=strict)
            set_model_state_dict(inner, dict(saved), options=options)
        else:
            inner.load_state_dict(saved, strict=strict)
    except (RuntimeError, KeyError, ValueError) as err:
        raise DistkitError(f"could not restore state[{name!r}] into {type(inner).__name__}: {err}") from err


def _saved_by_name(saved: Any) -> bool:
    """Whether an optimizer state dict names its parameters (DCP's form) instead of numbering them."""
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not groups:
        return False
    return any(isinstance(p, str) for group in groups for p in group.get("params", []))


def _by_name(
    name: str, module: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
) -> dict[str, Any]:
    """``saved`` (parameters numbered in the order of the optimizer's groups) keyed by parameter name."""
    names = {id(p): _without_compile_segments(n) for n, p in _unwrap(module).named_parameters()}
    order = [names[id(p)] for p in _parameters_of(optimizer)]
    numbers = [i for group in saved["param_groups"] for i in group["params"]]
    if len(numbers) != len(order):
        raise DistkitError(
            f"could not restore state[{name!r}]: the checkpoint's optimizer has {len(numbers)} "
            f"parameters and this one {len(order)}; build the optimizer as it was when saved."
        )
    by_number = dict(zip(numbers, order, strict=True))
    return {
        "state": {by_number[i]: value for i, value in saved["state"].items()},
        "param_groups": [
            {**group, "params": [by_number[i] for i in group["params"]]} for group in saved["param_groups"]
        ],
    }


def _has_parameter_state(saved: Mapping[str, Any]) -> bool:
    return any(
        isinstance(value, torch.Tensor) and value.dim() > 0
        for per_param in saved.get("state", {}).values()
        for value in (per_param.values() if isinstance(per_param, Mapping) else ())
    )


def _restore_group_settings(name: str, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    groups = saved.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups):
        raise DistkitError(
            f"could not restore state[{name!r}] into {type(optimizer).__name__}: the checkpoint has "
            f"{len(groups)} parameter group(s), the optimizer {len(optimizer.param_groups)}."
        )
    for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
        group.update({key: value for key, value in saved_group.items() if key != "params"})


def _load_optimizer(
    name: str, optimizer: torch.optim.Optimizer, saved: Any, module: nn.Module | None, strict: bool
) -> None:
    by_name = _saved_by_name(saved)
    if not by_name and not _holds_dtensors(optimizer):
        optimizer.load_state_dict(saved)
        _check_optimizer_kind(name, optimizer, saved)
        return
    if module is None:
        raise DistkitError(
            f"restoring state[{name!r}] needs the module it trains in the same state, e.g. "
            f"{{'model': model, {name!r}: optimizer}}: "
            + (
                "the checkpoint saved this optimizer by parameter name."
                if by_name
                else "its parameters are sharded (DTensors), loaded by parameter name."
            )
        )
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    named = saved if by_name else _by_name(name, module, optimizer, saved)
    if not _has_parameter_state(named):
        # Nothing per parameter to place (SGD without momentum): torch's loader needs a tensor of
        # the optimizer's state to find the device and asserts without one, so only the groups'
        # settings are restored.
        _restore_group_settings(name, optimizer, named)
        return
    try:
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_optimizer_state_dict(module, optimizer, named, options=options)
    except (RuntimeError, KeyError, ValueError) as err:
        raise DistkitError(
            f"could not restore state[{name!r}] into {type(optimizer).__name__}: {err}"
        ) from err
    _check_optimizer_kind(name, optimizer, named)


def _check_optimizer_kind(name: str, optimizer: torch.optim.Optimizer, saved: Any) -> None:
    """Refuse an optimizer's state saved by another kind of optimizer (AdamW's into SGD): torch
    takes the saved settings as they are and fails only at the first step (KeyError: 'momentum'),
    far from the cause. Each optimizer fills in, as it loads, the settings that newer torch versions
    added; a setting of its own that is still missing comes from another kind."""
    missing = sorted(
        {key for key in optimizer.defaults for group in optimizer.param_groups if key not in group}
    )
    if not missing:
        return
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    theirs = sorted(key for key in (groups[0] if groups else {}) if key != "params")
    raise DistkitError(
        f"state[{name!r}] is a {type(optimizer).__name__}, but the checkpoint's optimizer lacks its "
        f"settings {missing} (it has {theirs}): another kind of optimizer saved it. Restore it into "
        f"that kind, or leave {name!r} out of state to start this optimizer afresh."
    )


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, Mapping) and "param_groups" in value and "state" in value


def _check_kind(key: str, target: Any, value: Any, loaded: Mapping[str, Any]) -> None:
    """Refuse an optimizer's state given to a module or the other way round (the names of
    ``state`` swapped), before torch fails on it with a bare KeyError."""
    if isinstance(target, nn.Module) and _is_optimizer_state(value):
        held = "an optimizer's state"
    elif isinstance(target, torch.optim.Optimizer) and not _is_optimizer_state(value):
        held = "no optimizer's state (no 'param_groups')"
    else:
        return
    others = [name for name in loaded if name != key]
    raise DistkitError(
        f"state[{key!r}] is a {type(target).__name__}, but the checkpoint's entry {key!r} holds "
        f"{held}. Are the names of state swapped? The checkpoint's other entries: {others}; pass "
        f"each object under the name it was saved with, e.g. {{'model': model, 'optimizer': optimizer}}."
    )


def _restore(
    path: str,
    loaded: Mapping[str, Any],
    state: Mapping[str, Any],
    strict: bool,
    *,
    elsewhere: frozenset[str] = frozenset(),
    stacklevel: int = 3,
    imported_from: str | None = None,
) -> None:
    """Restore ``loaded`` into the objects of ``state``; ``elsewhere`` names the entries a caller
    restores itself (a sharded checkpoint's modules and optimizers).

    A checkpoint ``imported_from`` another tool holds a model and an optimizer, none of distkit's
    bookkeeping: with ``strict`` only a module it lacks is refused; the other entries it lacks start
    fresh, named in one warning (as for a torch.distributed.checkpoint directory distkit did not write).
    """
    missing = [key for key in state if key not in loaded and key not in elsewhere]
    lost = missing if imported_from is None else [k for k in missing if isinstance(state[k], nn.Module)]
    if lost and strict:
        raise DistkitError(
            f"checkpoint {redact_url(path)} has no entries {lost}; it holds "
            f"{sorted({*loaded, *elsewhere})}. Rename "
            f"the keys of state to match, or pass strict=False to skip the missing ones."
        )
    if missing and imported_from is not None:
        warnings.warn(
            f"{_rank_label()} checkpoint {redact_url(path)} was imported from {imported_from} "
            f"(distkit checkpoint import): it has no {missing}, which start fresh (a Trainer resuming "
            f"from it counts from step 0, with fresh random streams and data order).",
            stacklevel=stacklevel,
        )
    elif missing:
        warnings.warn(
            f"{_rank_label()} checkpoint {redact_url(path)} has no entries {missing}; they were left "
            f"as they are.",
            stacklevel=stacklevel,
        )
    owners: dict[str, str] | None = None
    for key, target in list(state.items()):
        if key not in loaded or key in elsewhere:
            continue
        value = loaded[key]
        _check_kind(key, target, value, loaded)
        if isinstance(target, nn.Module):
            _load_module(key, target, value, strict)
        elif isinstance(target, torch.optim.Optimizer):
            owners = _optimizer_owners(state) if owners is None else owners
            _load_optimizer(key, target, value, state[owners[key]] if key in owners else None, strict)
        elif callable(getattr(target, "load_state_dict", None)):
            target.load_state_dict(value)
        elif isinstance(target, torch.Tensor):
            if not isinstance(value, torch.Tensor) or value.shape != target.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise DistkitError(
                    f"state[{key!r}] is a tensor of shape {tuple(target.shape)} but the checkpoint "
                    f"holds {shape}."
                )
            with torch.no_grad():
                target.copy_(value)
        elif isinstance(state, MutableMapping):
            state[key] = value

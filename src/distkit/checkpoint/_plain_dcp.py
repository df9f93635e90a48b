"""Loading a ``torch.distributed.checkpoint`` directory that distkit did not write (private).

torchtitan's ``step-N`` directories and anything ``dcp.save(...)`` wrote hold DCP's ``.metadata`` and
``*.distcp`` files and no distkit manifest. :func:`_load_plain_dcp` matches the entries of a state to
the checkpoint's keys (a module under ``"<key>."`` or, as torchtitan saves it, at the top level; an
optimizer keyed by parameter name, flattened, or by number), checks them before anything is read,
and loads them through :func:`distkit.checkpoint._dcp_load._restore_dcp`, resharded to this rank's
objects as a distkit sharded checkpoint is. Entries that such a checkpoint cannot hold (distkit's
progress, counters, callbacks, loader position) start fresh, named in one warning.

There is no manifest, so there are no sizes or checksums to verify first: DCP's metadata is all
there is. It is unpickled with DCP's metadata types only, and values with weights_only, as always.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from distkit._utils.secrets import redact_url
from distkit.checkpoint._dcp_load import _check_module, _DcpEntry, _load_everything, _reader, _restore_dcp
from distkit.checkpoint._files import _LocalStorage, _Storage
from distkit.checkpoint._state import _optimizer_owners
from distkit.errors import DistkitError
from distkit.runtime import _rank_label

# The entries torchtitan saves beside the model's keys, which it puts at the top level
# (torchtitan/components/checkpoint.py: MODEL is flattened, OPTIMIZER, LR_SCHEDULER, DATALOADER and
# TRAIN_STATE are not): keys under them never count as a module's unexpected keys.
_TORCHTITAN_ENTRIES = frozenset({"optimizer", "lr_scheduler", "dataloader", "train_state"})


def _module_prefix(key: str, names: list[str], saved: Mapping[str, Any]) -> tuple[str, int]:
    """Where the module of entry ``key`` lies among the checkpoint's keys: ``"<key>."`` (dcp.save of
    ``{"model": ...}``), the top level (torchtitan), either with DDP's ``module.``; and how many of
    its ``names`` are there. The first of the most complete wins."""
    best = (f"{key}.", 0)
    for prefix in (f"{key}.", "", f"{key}.module.", "module."):
        found = sum(1 for name in names if prefix + name in saved)
        if found > best[1]:
            best = (prefix, found)
    return best


def _optimizer_form(
    key: str, module: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
) -> str:
    """How the checkpoint keys the optimizer of entry ``key``: ``"flat"`` (torchtitan's
    ``flatten_optimizer_state_dict=True``: no ``param_groups.<i>.params``), else by parameter name
    (``get_optimizer_state_dict``) or by number (``optimizer.state_dict()``), whichever names more of
    the checkpoint's per-parameter keys."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if f"{key}.param_groups.0.params" not in saved:
        return "flat"
    # Initializes an empty optimizer's state. Any: torch types the state dict as a union of values.
    by_name: Any = get_optimizer_state_dict(module, optimizer)
    order = [name for group in by_name["param_groups"] for name in group["params"]]
    per_param = {name: list(values) for name, values in by_name["state"].items()}
    named = sum(f"{key}.state.{name}.{v}" in saved for name, values in per_param.items() for v in values)
    numbered = sum(
        f"{key}.state.{i}.{v}" in saved for i, name in enumerate(order) for v in per_param.get(name, [])
    )
    return "by_index" if numbered > named else "by_name"


def _plan(
    path: str, saved: Mapping[str, Any], state: Mapping[str, Any], strict: bool
) -> tuple[list[_DcpEntry], list[str], set[str]]:
    """The entries of ``state`` found in the checkpoint (checked), the entries it does not have, and
    the checkpoint's keys that these entries take."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    owners = _optimizer_owners(state)
    others = _TORCHTITAN_ENTRIES | frozenset(state)
    entries: list[_DcpEntry] = []
    absent: list[str] = []
    taken: set[str] = set()
    for key, value in state.items():
        if isinstance(value, nn.Module):
            names = list(get_model_state_dict(value))
            prefix, found = _module_prefix(key, names, saved)
            if not found:
                absent.append(key)
                continue
            _check_module(path, key, value, prefix, saved, others, strict)
            entries.append(_DcpEntry(key, prefix))
            taken.update(prefix + name for name in names)
        elif isinstance(value, torch.optim.Optimizer):
            under = {name for name in saved if name.startswith(f"{key}.")}
            if not under:
                absent.append(key)
                continue
            if key not in owners:
                raise DistkitError(
                    f"restoring state[{key!r}] from checkpoint {redact_url(path)} needs the module it "
                    f"trains in the same state, e.g. {{'model': model, {key!r}: optimizer}}: a "
                    f"torch.distributed.checkpoint directory holds optimizer state by parameter name or "
                    f"number, which only the module maps onto this optimizer's parameters."
                )
            form = _optimizer_form(key, state[owners[key]], value, saved)
            entries.append(_DcpEntry(key, f"{key}.", form))
            taken.update(under)
        else:
            absent.append(key)
    modules = [key for key, value in state.items() if isinstance(value, nn.Module)]
    lost = [key for key in modules if key in absent]
    if strict and lost:
        groups = sorted({name.split(".")[0] for name in saved})
        shown = ", ".join(groups[:8]) + (f", ... ({len(groups)} in all)" if len(groups) > 8 else "")
        classes = ", ".join(type(state[k]).__name__ for k in lost)
        raise DistkitError(
            f"checkpoint {redact_url(path)} (a torch.distributed.checkpoint directory without a distkit "
            f"manifest) holds no weights of state{lost} ({classes}): "
            f"none of their parameter names is there, under '<entry>.' or at the top level. It holds "
            f"{shown}. Check the path and the model, or pass strict=False to leave the module as it is."
        )
    return entries, absent, taken


def _load_plain_dcp(
    storage: _Storage, path: str, state: Mapping[str, Any] | None, *, strict: bool, stacklevel: int
) -> dict[str, Any]:
    """:func:`distkit.load_checkpoint` of a DCP directory without a distkit manifest. Local."""
    if not isinstance(storage, _LocalStorage):
        raise ValueError(
            f"{redact_url(path)} is a torch.distributed.checkpoint directory on an object store; distkit "
            f"reads such directories from a local (or shared) filesystem. Copy it there first, e.g. "
            f"with distkit.download(url, local_dir), and load the local copy."
        )
    if state is None:
        return _load_everything(path)
    saved = _reader(path).read_metadata().state_dict_metadata
    entries, absent, taken = _plan(path, saved, state, strict)
    restored = _restore_dcp(path, entries, state, strict, saved_owners={}, saved_keys=saved)
    left = sorted({name.split(".")[0] for name in saved if name not in taken})
    if absent or left:
        loaded = [entry.key for entry in entries]
        what = "a torch.distributed.checkpoint directory without a distkit manifest"
        said = [f"{_rank_label()} {redact_url(path)} is {what}"]
        said.append(f"loaded {loaded}" if loaded else "loaded nothing from it")
        if absent:
            said.append(
                f"it has no {absent}, which start fresh (a Trainer resuming from it counts from step 0, "
                f"with fresh random streams and data order)"
            )
        if left:
            said.append(
                f"it also holds {left}, which distkit does not load from a checkpoint it did not write"
            )
        warnings.warn("; ".join(said) + ".", stacklevel=stacklevel)
    return restored

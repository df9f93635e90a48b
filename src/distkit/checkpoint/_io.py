"""Writing and reading one checkpoint (private): the collective save, the verified load, restoring.

:func:`_save_checkpoint` is :func:`distkit.save_checkpoint` and every save of a
:class:`~distkit.CheckpointManager`: rank 0 writes a full checkpoint, or every rank writes its
shards of a sharded one (:mod:`distkit.checkpoint._sharded`), and the other ranks learn the outcome
(:mod:`distkit.checkpoint._commit`). :func:`_load_verified` checks every file against the manifest
while ``state.pt`` is loaded weights-only, and :func:`_restore_into` puts what was loaded into live
objects, through DCP for a sharded checkpoint's modules and optimizers.
"""

from __future__ import annotations

import functools
import os
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from distkit import runtime
from distkit._utils.secrets import redact_url
from distkit.checkpoint._commit import (
    _check_file_mode,
    _Handshake,
    _metrics_for_manifest,
    _reported_to_the_others,
    _resolve_timeout,
    _step_for_manifest,
)
from distkit.checkpoint._dcp_load import _load_everything, _restore_sharded
from distkit.checkpoint._errors import CheckpointCorruptError
from distkit.checkpoint._files import (
    _check_crc,
    _join,
    _read_manifest,
    _RemoteStorage,
    _Storage,
    _storage_for,
    _verify,
)
from distkit.checkpoint._format import (
    _MANIFEST_FILE,
    _STATE_FILE,
    _STEP_RE,
    _imported_from,
    _is_sharded_manifest,
    _manifest_builder,
    _run_beside,
)
from distkit.checkpoint._resume import ResumeState
from distkit.checkpoint._sharded import _save_sharded, _use_sharded
from distkit.checkpoint._state import _check_loadable, _check_state, _collect, _restore
from distkit.errors import DistkitError

# --------------------------------------------------------------------------------------------------
# Writing: rank 0 writes a full checkpoint, every rank its shards of a sharded one.


def _save_checkpoint(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    step: int | None,
    metrics: Mapping[str, float] | None,
    collective: bool,
    file_mode: int,
    timeout_s: float | None,
    guard: Callable[[], None] | None,
    storage: _Storage | None,
    sharded: bool | str = "auto",
    source: Mapping[str, str] | None = None,
    world_size: int | None = None,
) -> str:
    """:func:`save_checkpoint`, with ``guard`` called by rank 0 before it changes or commits anything
    (a :class:`CheckpointManager`'s writer-lease check), into ``storage`` when it is given (the
    manager's own, so that its scrubber is built once, not at every save). ``source`` (a full
    checkpoint only) records in the manifest which tool wrote what ``distkit checkpoint import``
    converted; ``world_size`` (a full checkpoint only) is the manifest's when the state is another
    job's (a consolidated export)."""
    _check_file_mode(file_mode)
    _check_state(state)
    storage, target = _storage_for(path) if storage is None else (storage, os.fspath(path))
    step = _step_for_manifest(step)
    metrics_json = _metrics_for_manifest(metrics)
    wait_s = _resolve_timeout(timeout_s)
    multi = runtime.get_world_size() > 1
    if multi and not collective and any(isinstance(v, ResumeState) for v in state.values()):
        raise ValueError(
            "a ResumeState gathers every rank's RNG state, so save_checkpoint() must run on every "
            "rank with collective=True when the state holds one."
        )
    if _use_sharded(state, sharded):
        if multi and not collective:
            raise ValueError(
                "a sharded checkpoint is written by every rank, so save_checkpoint() must run on "
                "every rank with collective=True when the state holds sharded modules."
            )
        handshake = _Handshake(f"checkpoint {redact_url(target)}", wait_s) if multi else None
        sharded_save = functools.partial(
            _save_sharded,
            storage,
            target,
            state,
            step=step,
            metrics=metrics_json,
            file_mode=file_mode,
            guard=guard,
            collect=_collect,
            check=_check_loadable,
        )
        if handshake is not None and runtime.get_rank() != 0:
            sharded_save()  # this rank's shards; raises its own failure
            handshake.settle_other()
            return target
        with _reported_to_the_others(handshake):
            sharded_save()
        return target
    handshake = _Handshake(f"checkpoint {redact_url(target)}", wait_s) if multi and collective else None
    if handshake is not None and runtime.get_rank() != 0:
        _collect(state)  # state_dict() may be collective (ResumeState gathers RNG states)
        handshake.settle_other()
        return target
    with _reported_to_the_others(handshake):
        payload = _collect(state)
        _check_loadable(payload)
        storage.write_checkpoint(
            target,
            payload,
            _manifest_builder(step, metrics_json, list(payload), source=source, world_size=world_size),
            file_mode,
            guard,
        )
    return target


# --------------------------------------------------------------------------------------------------
# Reading back: verify, then load with weights_only=True, then restore into live objects.


def _map_location(map_location: Any) -> Any:
    return runtime.get_device() if isinstance(map_location, str) and map_location == "auto" else map_location


def _load_verified(storage: _Storage, path: str, map_location: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    manifest = _verify(storage, path, checksums=False)
    files = manifest["files"]
    source, checksums = storage.open_state(path, files)

    # The weights-only unpickler cannot run code whatever the bytes, so it runs while another thread
    # computes the checksums (loads take about as long as torch.load alone); nothing is returned or
    # restored into the caller's objects unless every checksum matches.
    def load() -> tuple[Any, Exception | None]:
        try:
            return torch.load(source, map_location=_map_location(map_location), weights_only=True), None
        except Exception as err:
            return None, err

    try:
        actual, (loaded, failure) = _run_beside(checksums, load)
    finally:
        source.close()
    for name, info in files.items():
        _check_crc(path, name, info, actual[name])  # a damaged file explains any load failure
    if isinstance(failure, pickle.UnpicklingError):
        lines = str(failure).splitlines()
        detail = next((line.strip() for line in lines if "GLOBAL" in line), lines[0] if lines else "")
        raise DistkitError(
            f"refused to load {redact_url(_join(path, _STATE_FILE))}: it holds objects that torch.load("
            f"weights_only=True) does not allow ({detail}). distkit never unpickles arbitrary "
            f"objects, because unpickling can run code. If you made this file and trust it, allow "
            f"its types with torch.serialization.add_safe_globals([...])."
        ) from failure
    if failure is not None:
        raise failure
    if not isinstance(loaded, dict):
        raise CheckpointCorruptError(path, f"{_STATE_FILE} holds a {type(loaded).__name__}, not a dict")
    return loaded, manifest


def _restore_into(
    path: str,
    loaded: dict[str, Any],
    manifest: Mapping[str, Any],
    state: Mapping[str, Any] | None,
    strict: bool,
    *,
    stacklevel: int,
) -> dict[str, Any]:
    """Restore a verified checkpoint into ``state``; return everything it holds, as loaded.

    A sharded checkpoint's modules and optimizers are read through DCP: into the objects of
    ``state`` (this rank's slices only), or, without them, in full.
    """
    if not _is_sharded_manifest(manifest):
        if state is not None:
            imported = _imported_from(manifest)
            _restore(path, loaded, state, strict, stacklevel=stacklevel + 1, imported_from=imported)
        return loaded
    if state is None:
        return {**loaded, **_load_everything(path)}
    sharded = frozenset(manifest["sharded"]["keys"])
    _restore(path, loaded, state, strict, elsewhere=sharded, stacklevel=stacklevel + 1)
    return {**loaded, **_restore_sharded(path, manifest, state, strict)}


def _consolidate(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, file_mode: int) -> str:
    """:func:`distkit.consolidate_checkpoint`: verify ``src``, read it whole, save it full at ``dst``.

    ``dst`` must be new (or an empty directory): never ``src``, inside it or inside any other
    checkpoint, never an existing checkpoint, never a ``step_<N>`` name of another step (issue 23).
    It is written like every checkpoint: staged and renamed into place (local), manifest last (fsspec).
    """
    storage, source = _storage_for(src)
    _check_consolidate_target(storage, source, os.fspath(dst))
    loaded, manifest = _load_verified(storage, source, "cpu")
    full = _restore_into(source, loaded, manifest, None, True, stacklevel=2)
    metrics = manifest.get("metrics") or None
    return _save_checkpoint(
        dst,
        full,
        step=manifest["step"],
        metrics=metrics,
        collective=False,
        file_mode=file_mode,
        timeout_s=None,
        guard=None,
        storage=None,
        sharded=False,
        # The state is the source job's, a ResumeState's RNG streams of all its ranks included: the
        # manifest says that job's world size, not this one process's, so that `inspect` and the
        # warning of a resume on another world size name the same number.
        world_size=manifest.get("world_size"),
    )


# --------------------------------------------------------------------------------------------------
# Where consolidate may write: a new directory, never over or inside a checkpoint.


def _location(storage: _Storage, path: str) -> tuple[str, str]:
    """``(protocol, absolute path)`` of ``path``, symlinks resolved locally: equal means the same place."""
    if isinstance(storage, _RemoteStorage):
        protocol = storage.fs.protocol
        protocol = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
        return str(protocol), "/" + storage.fs._strip_protocol(path).strip("/")
    return "file", os.path.realpath(path)


def _is_inside(inner: tuple[str, str], outer: tuple[str, str]) -> bool:
    return inner[0] == outer[0] and inner[1].startswith(outer[1].rstrip("/") + "/")


def _parents(path: str) -> list[str]:
    """The directories that hold ``path``, nearest first (local paths resolved, URLs up to the bucket)."""
    if "://" in path:
        scheme, _, rest = path.partition("://")
        parts = rest.strip("/").split("/")
        return [f"{scheme}://{'/'.join(parts[:i])}" for i in range(len(parts) - 1, 0, -1)]
    return [str(parent) for parent in Path(os.path.realpath(path)).parents]


def _check_consolidate_target(src_storage: _Storage, source: str, dst: str) -> None:
    """Refuse a ``dst`` that would replace, nest in or mislabel a checkpoint. Runs before anything is
    written, and before the source's state is read (only its manifest is).

    Raises:
        ValueError: ``dst`` is ``source``, inside it or inside another checkpoint, or is named
            ``step_<N>`` for another step than ``source``'s.
        FileExistsError: ``dst`` holds a checkpoint, is a non-empty directory, or is a file.
        FileNotFoundError: Nothing exists at ``source``.
    """
    source_step = _read_manifest(src_storage, source)["step"]  # a missing source is named first
    _check_new_target(src_storage, source, dst, source_step, command="consolidate")


def _check_new_target(
    src_storage: _Storage, source: str, dst: str, source_step: int | None, *, command: str
) -> None:
    """Refuse a ``dst`` of ``command`` (consolidate, import) that would replace, nest in or mislabel a
    checkpoint: see :func:`_check_consolidate_target`."""
    storage, target = _storage_for(dst)
    shown = redact_url(target)
    made = "full" if command == "consolidate" else "new"
    same_kind = type(storage) is type(src_storage)
    where, src_where = _location(storage, target), _location(src_storage, source)
    if same_kind and where == src_where:
        raise ValueError(
            f"the destination {shown} is the source checkpoint {redact_url(source)}; writing it would "
            f"replace the checkpoint being read. Choose a new directory for the {made} checkpoint."
        )
    if same_kind and _is_inside(where, src_where):
        raise ValueError(
            f"the destination {shown} is inside the source checkpoint {redact_url(source)}; a checkpoint "
            f"nested in another one is deleted with it. Choose a new directory outside "
            f"{redact_url(source)}."
        )
    for parent in _parents(target):
        if storage.kind(_join(parent, _MANIFEST_FILE)) is not None:
            raise ValueError(
                f"the destination {shown} is inside the checkpoint {redact_url(parent)}; a checkpoint "
                f"nested in another one is deleted with it. Choose a new directory outside "
                f"{redact_url(parent)}."
            )
    kind = storage.kind(target)
    if kind == "file":
        raise FileExistsError(
            f"the destination {shown} is a file; {command} writes a checkpoint directory. Choose a "
            f"new directory."
        )
    contents = storage.contents(target) if kind == "dir" else None
    if contents and _MANIFEST_FILE in contents:
        try:
            step = _read_manifest(storage, target)["step"]
            which = "no step" if step is None else f"step {step}"
        except (DistkitError, OSError):
            which = "its manifest is unreadable"
        raise FileExistsError(
            f"the destination {shown} already holds a checkpoint ({which}); {command} never "
            f"replaces a checkpoint. Choose a new directory, or delete {shown} first if it is not needed."
        )
    if contents:
        raise FileExistsError(
            f"the destination {shown} exists and is not empty ({sorted(contents)[:5]}); {command} "
            f"writes only into a new or empty directory. Choose a new directory."
        )
    remote = "://" in target
    named = _STEP_RE.match(target.rstrip("/").rpartition("/")[2] if remote else Path(target).name)
    if named is not None and source_step is not None and int(named.group(1)) != source_step:
        step_named = int(named.group(1))
        parent = target.rstrip("/").rpartition("/")[0] if remote else os.path.dirname(os.path.abspath(target))
        raise ValueError(
            f"the destination {shown} is named like the checkpoint of step {step_named} but the source "
            f"holds step {source_step}: a CheckpointManager of {redact_url(parent)} would take it for "
            f"step {step_named}. Choose a directory that is not named step_<N> (or name it "
            f"step_{source_step:09d})."
        )

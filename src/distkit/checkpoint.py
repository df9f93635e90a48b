"""Checkpoints that are atomic, safe to load, resumable, and never lose the last good one.

One checkpoint is a directory (a local path or an fsspec URL) holding two files:

``state.pt``
    One ``torch.save`` of the state: modules, optimizers, schedulers and anything else with
    ``state_dict()`` are stored as their state dicts (modules unwrapped from DDP, DataParallel and
    ``torch.compile``), tensors and plain data as they are.
``manifest.json``
    Written last: step, world size, torch and distkit versions, creation time, metrics, and the size
    and CRC32 of ``state.pt``. A checkpoint is committed when its manifest exists and verifies.

Local commit: both files are written into a temporary directory beside the target and fsynced, the
directory is renamed into place with ``os.replace`` and its parent fsynced, so a reader never sees
half a checkpoint, even when the writer is killed. fsspec URLs: one put per object, the manifest last.
Loads use ``torch.load(weights_only=True)`` only, and return nothing unless every checksum
matches. See ``docs/checkpoints.md`` for the protocol and for how a resume picks its checkpoint.

This module holds the public API and the policy (who writes, retention, claims, resumes); the parts
below it are private, one concern each, and import only downwards: ``_checkpoint_errors`` (the two
errors, defined low because every part raises them) <- ``_checkpoint_format`` (file names,
serialization, the manifest) <- ``_checkpoint_files`` (local and fsspec storage, safe opening,
verification) <- ``_checkpoint_lock`` (one writer per directory); ``_checkpoint_state`` converts
live objects to a state and back.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import math
import os
import pickle
import random
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch

from distkit import runtime
from distkit._checkpoint_errors import CheckpointConflictError, CheckpointCorruptError, _label
from distkit._checkpoint_files import _check_crc, _join, _read_manifest, _Storage, _storage_for, _verify
from distkit._checkpoint_format import (
    _LEFTOVER_RE,
    _MANIFEST_FILE,
    _OWN_FILES,
    _STATE_FILE,
    _STEP_RE,
    _is_number,
    _manifest_builder,
    _run_beside,
)
from distkit._checkpoint_lock import _LocalWriterLock, _writer_lock_for
from distkit._checkpoint_state import _check_loadable, _check_state, _collect, _restore, _to_cpu
from distkit._secrets import redact_url
from distkit.collectives import all_gather_object, broadcast_object
from distkit.errors import CollectiveTimeoutError, DistkitError, MainProcessError
from distkit.seeding import capture_rng_state, restore_rng_state

__all__ = [
    "DEFAULT_FILE_MODE",
    "DEFAULT_SAVE_TIMEOUT_S",
    "CheckpointConflictError",
    "CheckpointCorruptError",
    "CheckpointManager",
    "ResumeState",
    "load_checkpoint",
    "save_checkpoint",
]

#: Permission bits of checkpoint files: readable and writable by the owner only, because a
#: checkpoint can hold data and weights that are not meant for other users of a shared machine.
#: Directories get the matching execute bits (0o700 for 0o600).
DEFAULT_FILE_MODE = 0o600
#: How long the other ranks wait for rank 0 to commit a checkpoint. Writing is bounded by storage
#: bandwidth, not by the peers: 30 minutes covers about 1 TB at 600 MB/s.
DEFAULT_SAVE_TIMEOUT_S = 1800.0


# --------------------------------------------------------------------------------------------------
# Rank 0 writes; the other ranks learn the outcome through the job's key-value store.


class _Handshake:
    """How rank 0 tells the other ranks that a checkpoint was committed, or why not.

    Every rank creates one per save, in the same order, so they agree on the key. Through the store,
    the waiting ranks have their own deadline and rank 0 never waits for them; without a store
    (a process group adopted from elsewhere) the outcome is broadcast instead.
    """

    def __init__(self, what: str, timeout_s: float, *, action: str = "saving", verb: str = "commit") -> None:
        self.store = runtime._store()
        assert runtime._runtime is not None  # _store() ensured it
        self.key = f"checkpoint/{runtime._runtime.next_id('checkpoint')}"
        self.what = what
        self.timeout_s = timeout_s
        self.action = action  # "saving" checkpoint X failed on the main process
        self.verb = verb  # waited for rank 0 to "commit" checkpoint X
        self._outcome: dict[str, Any] | None = None

    def publish(self, error: BaseException | None) -> None:
        """Rank 0, as soon as the outcome is known (possibly on the writer thread)."""
        self._outcome = (
            {}
            if error is None
            else {
                "type": type(error).__qualname__,
                "message": str(error),
                "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
            }
        )
        if isinstance(error, CheckpointConflictError):
            # The other ranks raise the same error (not MainProcessError): a refusal, not a crash.
            self._outcome["conflict"] = {
                "reason": error.reason,
                "directory": error.directory,
                "holder": error.holder,
                "steps": error.steps,
            }
        if self.store is not None:
            self.store.set(self.key, json.dumps(self._outcome))

    def settle_main(self) -> None:
        """Rank 0, on the training thread, after :meth:`publish`."""
        if self.store is None:
            broadcast_object(self._outcome)

    def settle_other(self) -> None:
        """The other ranks: wait for rank 0's outcome and raise its failure here too."""
        if self.store is None:
            outcome = broadcast_object(None)
        else:
            start = time.monotonic()
            try:
                self.store.wait([self.key], timedelta(seconds=self.timeout_s))
            except RuntimeError as err:
                waited = time.monotonic() - start
                if waited < self.timeout_s * 0.99:
                    raise DistkitError(
                        f"{_label()} lost contact with the job's store while waiting for rank 0 to "
                        f"{self.verb} {self.what}: {err}. Rank 0 has probably died; see its log."
                    ) from err
                raise CollectiveTimeoutError(
                    f"{_label()} waited {self.timeout_s:g} s for rank 0 to {self.verb} {self.what}; it "
                    f"did not report. Rank 0 is stuck or its storage is very slow; raise timeout_s if "
                    f"saves legitimately take this long.",
                    missing_ranks=[0],
                    timeout_s=self.timeout_s,
                ) from err
            outcome = json.loads(self.store.get(self.key))
            self._cleanup()
        if outcome and "conflict" in outcome:
            conflict = outcome["conflict"]
            raise CheckpointConflictError(
                conflict["reason"],
                directory=conflict["directory"],
                holder=conflict["holder"],
                steps=conflict["steps"],
                label=_label(),
            )
        if outcome:
            raise MainProcessError(
                f"{_label()} {self.action} {self.what} failed on the main process (rank 0): "
                f"{outcome['type']}: {outcome['message']}",
                exc_type=outcome["type"],
                exc_message=outcome["message"],
                remote_traceback=outcome["traceback"],
            )

    def _cleanup(self) -> None:
        # The last rank to read the outcome deletes it, so keys do not pile up over a long run.
        assert self.store is not None
        readers = self.store.add(f"{self.key}/read", 1)
        if readers == runtime.get_world_size() - 1:
            self.store.delete_key(self.key)
            self.store.delete_key(f"{self.key}/read")


@contextlib.contextmanager
def _reported_to_the_others(handshake: _Handshake | None) -> Iterator[None]:
    """Rank 0: run the block, then publish and settle its outcome (nothing without a handshake)."""
    error: BaseException | None = None
    try:
        yield
    except BaseException as err:
        error = err
        raise
    finally:
        if handshake is not None:
            handshake.publish(error)
            handshake.settle_main()


def _resolve_timeout(timeout_s: float | None) -> float:
    if timeout_s is None:
        return DEFAULT_SAVE_TIMEOUT_S
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
    return float(timeout_s)


def _check_file_mode(file_mode: int) -> None:
    if not isinstance(file_mode, int) or not 0 <= file_mode <= 0o777 or not file_mode & 0o600 == 0o600:
        raise ValueError(
            f"file_mode must be permission bits that let the owner read and write, e.g. 0o600 or "
            f"0o640, got {file_mode!r}."
        )


def save_checkpoint(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    step: int | None = None,
    metrics: Mapping[str, float] | None = None,
    collective: bool = True,
    file_mode: int = DEFAULT_FILE_MODE,
    timeout_s: float | None = None,
) -> str:
    """Save ``state`` as one committed checkpoint directory at ``path``.

    Collective: call on every rank (``collective=True``, the default); rank 0 writes and every rank
    returns once the checkpoint is committed, or raises if rank 0 failed. With ``collective=False``
    the calling process writes alone and nothing is communicated. Without a process group the one
    process writes.

    Values of ``state`` may be modules (saved unwrapped from DDP, DataParallel and
    ``torch.compile``: no ``module.`` or ``_orig_mod.`` prefix), optimizers, LR schedulers,
    ``GradScaler``\\ s, anything with ``state_dict()``, a :class:`ResumeState`, tensors and plain
    data. A value that ``torch.load(weights_only=True)`` could not read back is refused before
    anything is written. An existing checkpoint at ``path`` is replaced atomically.

    Args:
        path: Checkpoint directory: a local path or an fsspec URL (``s3://bucket/run/step_10``).
        state: Names to objects.
        step: Training step recorded in the manifest.
        metrics: Numbers recorded in the manifest (pass values already reduced across ranks).
        collective: Whether every rank calls and waits for the commit (see above).
        file_mode: Permission bits of local files (default 0o600: the owner only); directories get
            the matching execute bits. Ignored on object stores.
        timeout_s: How long the other ranks wait for rank 0 (default
            :data:`DEFAULT_SAVE_TIMEOUT_S`).

    Returns:
        ``path`` as a string.

    Raises:
        TypeError: A value could not be loaded back with ``weights_only=True`` (names the key).
        FileExistsError: ``path`` exists and holds files that are not a distkit checkpoint.
        OSError: Writing failed (a full disk, a file-size limit, permissions...): the message names
            the errno (``ENOSPC``), the path being written and a fix; nothing was committed and an
            existing checkpoint at ``path`` is untouched. The subclass follows the errno.
        MainProcessError: On ranks other than 0, when rank 0 failed to save.
        CollectiveTimeoutError: Rank 0 did not report within ``timeout_s``.

    Example:
        >>> import torch, distkit
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> _ = distkit.save_checkpoint("/tmp/ckpt_example", {"model": model, "optimizer": opt}, step=0)
    """
    return _save_checkpoint(
        path,
        state,
        step=step,
        metrics=metrics,
        collective=collective,
        file_mode=file_mode,
        timeout_s=timeout_s,
        guard=None,
        storage=None,
    )


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
) -> str:
    """:func:`save_checkpoint`, with ``guard`` called by rank 0 before it changes or commits anything
    (a :class:`CheckpointManager`'s writer-lease check), into ``storage`` when it is given (the
    manager's own, so that its scrubber is built once, not at every save)."""
    _check_file_mode(file_mode)
    _check_state(state)
    storage, target = _storage_for(path) if storage is None else (storage, os.fspath(path))
    metrics_json = _metrics_for_manifest(metrics)
    wait_s = _resolve_timeout(timeout_s)
    multi = runtime.get_world_size() > 1
    if multi and not collective and any(isinstance(v, ResumeState) for v in state.values()):
        raise ValueError(
            "a ResumeState gathers every rank's RNG state, so save_checkpoint() must run on every "
            "rank with collective=True when the state holds one."
        )
    handshake = _Handshake(f"checkpoint {redact_url(target)}", wait_s) if multi and collective else None
    if handshake is not None and runtime.get_rank() != 0:
        _collect(state)  # state_dict() may be collective (ResumeState gathers RNG states)
        handshake.settle_other()
        return target
    with _reported_to_the_others(handshake):
        payload = _collect(state)
        _check_loadable(payload)
        storage.write_checkpoint(
            target, payload, _manifest_builder(step, metrics_json, list(payload)), file_mode, guard
        )
    return target


def _metrics_for_manifest(metrics: Mapping[str, Any] | None) -> dict[str, float] | None:
    if metrics is None:
        return None
    out = {}
    for key, value in metrics.items():
        try:
            out[str(key)] = float(value.item() if isinstance(value, torch.Tensor) else value)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                f"metrics[{key!r}] must be a number or a one-element tensor, got {value!r}."
            ) from err
    return out


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


def load_checkpoint(
    path: str | os.PathLike[str],
    state: Mapping[str, Any] | None = None,
    *,
    map_location: Any = "auto",
    strict: bool = True,
) -> dict[str, Any]:
    """Verify and load a checkpoint, and restore it into the objects of ``state``.

    Local: no communication; call it on every rank that needs the state (each rank reads the files,
    so they must be reachable from every rank: a shared filesystem or an object store). Works the
    same without a process group.

    The checksum of every file is verified before anything is unpickled, and unpickling uses
    ``torch.load(weights_only=True)`` only, so a file carrying code is refused, never run. Modules
    are restored whether they or the saved ones were wrapped in DDP, DataParallel or
    ``torch.compile`` (``module.`` and ``_orig_mod.`` prefixes are matched up); objects with
    ``load_state_dict()`` get their entry; tensors are copied in place; other entries replace the
    values of ``state`` when it is a mutable mapping. A :class:`ResumeState` restores this rank's
    RNG streams (see its notes on a changed world size).

    Args:
        path: Checkpoint directory, local or fsspec URL.
        state: Names to objects to restore into; ``None`` only loads.
        map_location: Where tensors go: ``"auto"`` (this rank's device, :func:`distkit.get_device`)
            or anything ``torch.load`` accepts.
        strict: Require every key of ``state`` in the checkpoint and exact module keys.

    Returns:
        Everything the checkpoint holds, as loaded (modules as state dicts).

    Raises:
        FileNotFoundError: Nothing exists at ``path`` ("checkpoint not found").
        NotADirectoryError: ``path`` is a file, not a checkpoint directory.
        CheckpointCorruptError: The manifest is missing or malformed, a listed file is missing, is
            not a regular file (a FIFO, device or symlink is refused without being opened), or its
            size or checksum does not match the manifest (names the file).
        DistkitError: The manifest has a newer ``format_version`` than this distkit reads (upgrade
            distkit), the file holds objects ``weights_only`` refuses, or an entry does not fit its
            object.

    Example:
        >>> import torch, distkit
        >>> model = torch.nn.Linear(2, 2)
        >>> _ = distkit.save_checkpoint("/tmp/ckpt_example", {"model": model})
        >>> _ = distkit.load_checkpoint("/tmp/ckpt_example", {"model": model})
    """
    storage, target = _storage_for(path)
    loaded, _ = _load_verified(storage, target, map_location)
    if state is not None:
        _restore(target, loaded, state, strict)
    return loaded


# --------------------------------------------------------------------------------------------------
# Resume state: loop position and every rank's RNG streams.


@dataclass
class ResumeState:
    """Where the training loop is, plus every rank's RNG streams, for an exact resume.

    Put it in the state you save, update its fields as the loop runs, and a load puts back the
    position and, on each rank, that rank's own python, numpy, torch CPU and CUDA generators.

    A different world size on load (say 4 ranks saved, 2 resume): the position and everything else
    are restored, but per-rank RNG streams cannot be mapped one to one, so each rank is **reseeded
    deterministically** from the saved states, its rank and the new world size, with a warning.
    The same checkpoint and world size always give the same streams.

    Attributes:
        epoch: Current epoch (0-based).
        global_step: Optimizer steps taken so far.
        batches_in_epoch: Batches already consumed in the current epoch.

    Example:
        >>> import distkit
        >>> from distkit.checkpoint import ResumeState
        >>> progress = ResumeState()
        >>> progress.global_step += 1
        >>> _ = distkit.save_checkpoint("/tmp/ckpt_example", {"progress": progress})
    """

    epoch: int = 0
    global_step: int = 0
    batches_in_epoch: int = 0

    def state_dict(self) -> dict[str, Any]:
        """The position and every rank's RNG states (tensors and lists only).

        Collective: call on every rank (it gathers the RNG states); without a process group it
        captures this process's.

        Example:
            >>> sorted(ResumeState(global_step=3).state_dict())
            ['batches_in_epoch', 'epoch', 'global_step', 'rng', 'world_size']
        """
        return {
            "epoch": int(self.epoch),
            "global_step": int(self.global_step),
            "batches_in_epoch": int(self.batches_in_epoch),
            "world_size": runtime.get_world_size(),
            "rng": all_gather_object(capture_rng_state()),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the position, and this rank's RNG streams (reseeded if the world size changed).

        Local: no communication.

        Example:
            >>> progress = ResumeState()
            >>> progress.load_state_dict(ResumeState(epoch=2).state_dict())
            >>> progress.epoch
            2
        """
        self.epoch = int(state["epoch"])
        self.global_step = int(state["global_step"])
        self.batches_in_epoch = int(state["batches_in_epoch"])
        saved = [_tree_to_cpu(s) for s in state["rng"]]
        rank, world_size = runtime.get_rank(), runtime.get_world_size()
        if int(state["world_size"]) == world_size and len(saved) == world_size:
            restore_rng_state(saved[rank])
            return
        seed = _reseed(saved, rank, world_size)
        warnings.warn(
            f"{_label()} the checkpoint's RNG states were saved by {state['world_size']} rank(s) and "
            f"this job has {world_size}: per-rank streams cannot be restored one to one, so this rank "
            f"was reseeded deterministically from them (seed {seed}). The loop position, model and "
            f"optimizer are restored as saved.",
            stacklevel=2,
        )


def _tree_to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _tree_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tree_to_cpu(v) for v in obj]
    return obj


def _reseed(saved: list[dict[str, Any]], rank: int, world_size: int) -> int:
    # Derived from the saved torch CPU state of rank 0 (so it differs between checkpoints) and from
    # the new rank and world size (so ranks get different streams), never from the clock.
    digest = hashlib.sha256(bytes(saved[0]["torch"].tolist()))
    digest.update(f"{rank}/{world_size}".encode())
    seed = int.from_bytes(digest.digest()[:8], "little") & ((1 << 63) - 1)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        np = None  # type: ignore[assignment]
    if np is not None:
        np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)  # also every CUDA device
    return seed


# --------------------------------------------------------------------------------------------------
# CheckpointManager: a directory of step checkpoints with retention, latest, best and async saves.


@dataclass(frozen=True)
class _Entry:
    step: int
    path: str
    committed: bool  # a manifest exists; it may still fail verification
    leftover: bool  # a temporary name of a killed save or delete: provably distkit's, never committed
    files: frozenset[str]  # the names inside it

    @property
    def holds_only_own_files(self) -> bool:
        return self.files <= _OWN_FILES


@dataclass
class _Pending:
    """The save in flight: its writer thread (rank 0) and the handshake every rank settles."""

    step: int
    path: str
    handshake: _Handshake | None
    main: bool
    thread: threading.Thread | None = None
    error: BaseException | None = None
    # The error was already raised in save() on this rank; wait() only settles the handshake.
    raised: bool = False


_live_managers: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()
_atexit_registered = False


def _finish_at_exit() -> None:
    # Writer threads are not daemons, so the interpreter has already let them finish; what is left
    # is to report a failure nobody will see otherwise. No handshake here: the other ranks may be
    # gone already.
    for manager in list(_live_managers):
        pending = manager._pending
        if pending is None or pending.thread is None:
            continue
        pending.thread.join(manager.timeout_s)
        if pending.error is not None and not pending.raised:
            print(
                f"distkit: {_label()} the background save of step {pending.step} to "
                f"{redact_url(pending.path)} failed: {type(pending.error).__name__}: {pending.error}",
                file=sys.stderr,
                flush=True,
            )


def _shown_steps(steps: list[int]) -> str:
    if len(steps) <= 8:
        return str(steps)
    return f"[{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))}] ({len(steps)} in all)"


class CheckpointManager:
    """A directory of step checkpoints: atomic saves, retention, ``latest()``, ``best()``, resume.

    Each save is a checkpoint directory ``step_<9 digits>`` inside ``directory`` (local or fsspec
    URL), written with :func:`save_checkpoint`'s protocol. Retention runs on rank 0 only after the new
    checkpoint is committed, so the last good one is never lost: it keeps the ``keep_last`` newest
    checkpoints that verify, the ``keep_best`` best by ``monitor``, and the one just saved; it
    removes the others and the leftovers of saves that were killed, and it never deletes what it
    cannot read (a malformed or newer manifest, a damaged file: kept, with one warning).

    **One run, one writer per directory.** The first ``save()`` or ``restore()`` *claims* the
    directory (:meth:`claim`): rank 0 takes its writer lock (a kernel lock beside a local directory,
    released when the holder exits or dies; a lease inside an object-store directory), so a second
    writer is refused with :class:`CheckpointConflictError` naming the first. A fresh run is refused
    the same way when the directory already holds committed checkpoints of another run: resume it
    (``restore()``), write elsewhere, or pass ``overwrite=True`` to delete them. :meth:`close` (or
    leaving a ``with`` block, garbage collection, interpreter exit) releases the lock.

    With ``async_save=True`` the state is copied to CPU memory (the only stall the training loop
    pays) and written by a background thread; one save is in flight at a time (the next ``save()``
    waits for it), ``wait()`` and interpreter exit wait for it, and a background failure is raised at
    the next ``save()`` or ``wait()`` on every rank.

    Args:
        directory: Where the step checkpoints live.
        keep_last: How many of the newest checkpoints to keep (``None``: all).
        keep_best: How many of the best checkpoints by ``monitor`` to keep as well.
        monitor: Metric name (from ``save(..., metrics=...)``) that ranks checkpoints for ``best()``.
        mode: ``"min"`` or ``"max"``: whether a lower or higher ``monitor`` is better.
        async_save: Write in a background thread (see above).
        file_mode: Permission bits of local files (default 0o600: the owner only).
        timeout_s: How long ranks other than 0 wait for rank 0 to commit a save or decide a claim
            (default :data:`DEFAULT_SAVE_TIMEOUT_S`).
        overwrite: **Destructive.** When this manager claims the directory for a fresh run (it did not
            resume), delete the checkpoints already there instead of refusing. A manager that resumes
            (``restore()``, ``claim(resuming=True)``, a ``latest()`` that found one) deletes nothing.

    Example:
        >>> import torch
        >>> from distkit import CheckpointManager
        >>> model = torch.nn.Linear(2, 2)
        >>> with CheckpointManager("/tmp/ckpts_example", keep_last=2) as manager:
        ...     step = manager.restore({"model": model})  # None on a fresh start
        ...     _ = manager.save(100 if step is None else step + 100, {"model": model})
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        keep_best: int | None = None,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        async_save: bool = False,
        file_mode: int = DEFAULT_FILE_MODE,
        timeout_s: float | None = None,
        overwrite: bool = False,
    ) -> None:
        global _atexit_registered
        for name, value in (("keep_last", keep_last), ("keep_best", keep_best)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}.")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}.")
        if keep_best is not None and monitor is None:
            raise ValueError(
                f"keep_best={keep_best} needs monitor=<metric name> to know which checkpoints are best."
            )
        if not isinstance(overwrite, bool):
            raise TypeError(f"overwrite must be True or False, got {overwrite!r}.")
        _check_file_mode(file_mode)
        # Configuration.
        self._storage, self.directory = _storage_for(directory)
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.monitor = monitor
        self.mode = mode
        self.async_save = async_save
        self.file_mode = file_mode
        self.timeout_s = _resolve_timeout(timeout_s)
        self.overwrite = overwrite
        # Ownership of the directory: the writer lock (taken on rank 0 only), whether this manager
        # has claimed the directory, and whether it resumes what is there (restore(), latest()).
        self._lock = _writer_lock_for(self._storage, self.directory, file_mode)
        self._claimed = False
        self._resuming = False
        # The finalizer holds the lock, not the manager: garbage collection and interpreter exit
        # release it.
        self._release_lock = weakref.finalize(self, self._lock.release)
        # Checkpoints retention keeps although it would delete them: warned about once each.
        self._kept_warned: set[str] = set()
        # The save in flight (async mode), until every rank has settled it.
        self._pending: _Pending | None = None
        _live_managers.add(self)
        if not _atexit_registered:
            atexit.register(_finish_at_exit)
            _atexit_registered = True

    def path_for(self, step: int) -> str:
        """The checkpoint directory of ``step`` (whether or not it exists). Local.

        Example:
            >>> CheckpointManager("/tmp/ckpts_example").path_for(7)
            '/tmp/ckpts_example/step_000000007'
        """
        return _join(self.directory, f"step_{step:09d}")

    # ---- owning the directory

    def claim(self, *, resuming: bool = False) -> None:
        """Start writing into the directory: take its writer lock, and refuse to mix two runs.

        Collective: call on every rank; rank 0 decides and the others learn the outcome from it (they
        wait at most ``timeout_s``), so every rank returns or every rank raises the same error.
        Without a process group the one process claims. Idempotent: a claimed manager returns at
        once. ``save()`` claims implicitly on its first call and ``restore()`` claims as resuming, so
        calling this is only needed to fail early (before training starts) or to declare a resume
        done by hand.

        Rank 0 takes the directory's writer lock, then refuses when the directory holds committed
        checkpoints and this manager neither resumes (``resuming=True``, an earlier ``restore()``, or
        an earlier ``latest()`` that returned a checkpoint) nor has ``overwrite=True``. With
        ``overwrite=True`` and no resume, the checkpoints there are deleted (with a warning listing
        them).

        Args:
            resuming: This run continues from a checkpoint of this directory (for example one you
                loaded with :func:`load_checkpoint`), so the checkpoints there are its own.

        Raises:
            CheckpointConflictError: Another writer holds the directory (names its host, pid, start
                time and job id), or the directory holds another run's checkpoints (names the steps
                and the three ways out).

        Example:
            >>> manager = CheckpointManager("/tmp/ckpts_claim_example", overwrite=True)
            >>> manager.claim()  # fails here, before training, rather than at the first save
            >>> manager.close()
        """
        if self._claimed:
            return
        resuming = resuming or self._resuming
        multi = runtime.get_world_size() > 1
        handshake = (
            _Handshake(
                f"checkpoint directory {redact_url(self.directory)}",
                self.timeout_s,
                action="claiming",
                verb="claim",
            )
            if multi
            else None
        )
        if handshake is not None and runtime.get_rank() != 0:
            handshake.settle_other()
            self._claimed = True
            return
        with _reported_to_the_others(handshake):
            self._claim_here(resuming)
        self._claimed = True

    def _claim_here(self, resuming: bool) -> None:
        # A local lock excludes other writers, so it is taken before the directory is looked at.
        # An object-store lease is taken over, not waited for: only once the claim is accepted, so
        # that a refused newcomer never stops the live writer it would have displaced.
        lock_first = isinstance(self._lock, _LocalWriterLock)
        if lock_first:
            self._lock.acquire()
        try:
            entries = [] if resuming else self._entries()
            committed = sorted({entry.step for entry in entries if entry.committed})
            if committed and not self.overwrite:
                raise CheckpointConflictError(
                    f"the checkpoint directory {redact_url(self.directory)} already holds committed "
                    f"checkpoints (steps {_shown_steps(committed)}) that this run did not resume from. A "
                    f"new run writing there would inherit or destroy them (retention deletes by step, and "
                    f"a later resume would continue the old run). Either resume that run "
                    f"(manager.restore(state), Trainer(resume='auto'), or "
                    f"manager.claim(resuming=True) after loading one yourself), write to another "
                    f"directory, or start over with CheckpointManager(..., overwrite=True), which "
                    f"deletes them.",
                    directory=self.directory,
                    steps=committed,
                    label=_label(),
                )
            if not lock_first:
                self._lock.acquire()
            if self.overwrite and not resuming:
                self._delete_for_overwrite(entries)
        except BaseException:
            self._lock.release()
            raise

    def _delete_for_overwrite(self, entries: list[_Entry]) -> None:
        deleted: list[int] = []
        for entry in entries:
            try:
                if not self._delete_unless_foreign(entry, "it holds"):
                    continue
            except OSError as err:
                raise DistkitError(
                    f"{_label()} overwrite=True could not delete {redact_url(entry.path)}: "
                    f"{type(err).__name__}: {err}. Nothing was saved; delete it by hand (or fix its "
                    f"permissions) and start again."
                ) from err
            if entry.committed:
                deleted.append(entry.step)
        if deleted:
            warnings.warn(
                f"{_label()} overwrite=True: deleted the checkpoints of steps "
                f"{_shown_steps(sorted(deleted))} in {redact_url(self.directory)} before this run's first "
                f"save.",
                stacklevel=5,
            )

    def close(self) -> None:
        """Wait for the save in flight, then release the directory's writer lock.

        Collective: call on every rank (it waits like :meth:`wait`). Also done when a ``with`` block
        ends, when the manager is garbage collected and at interpreter exit. The manager stays usable:
        a later ``save()`` claims the directory again, as a resume of its own run.

        Raises:
            DistkitError: The save in flight failed (as for :meth:`wait`); the lock is released anyway.

        Example:
            >>> manager = CheckpointManager("/tmp/ckpts_example")
            >>> manager.close()
        """
        try:
            self.wait()
        finally:
            self._release()

    def _release(self) -> None:
        if self._claimed:
            self._resuming = True  # the checkpoints there are this manager's own from now on
        self._claimed = False
        self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        # Already failing: let the writer thread finish (the lock must outlive it) without raising
        # over the error in flight and without waiting on the other ranks, which may be gone. A
        # background failure is still reported at interpreter exit.
        pending = self._pending
        try:
            if pending is not None and pending.thread is not None:
                pending.thread.join(self.timeout_s)
        finally:
            self._release()

    # ---- saving

    def save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, float] | None = None) -> str:
        """Save ``state`` as the checkpoint of ``step``, then apply retention.

        Collective: call on every rank. Without a process group the one process saves. A save of a
        step that already exists replaces it. The first save claims the directory (:meth:`claim`).
        Once the checkpoint is committed, nothing raises any more: a retention failure is a warning.

        Args:
            step: Training step (integer >= 0); it names the checkpoint and orders ``latest()``.
            state: Names to objects, as for :func:`save_checkpoint`.
            metrics: Numbers for the manifest and for ``best()`` (already reduced across ranks).
                When given with a ``monitor``, they must contain it.

        Returns:
            The checkpoint's path (in async mode: where it will be committed).

        Raises:
            CheckpointConflictError: The claim was refused (see :meth:`claim`), or, on an object
                store, another writer has taken the directory over.
            DistkitError: The previous background save failed (async mode).
            OSError: Writing failed; the message names the errno, the path and a fix.
            ValueError: ``step`` is not an integer >= 0, or ``metrics`` lacks ``monitor``.

        Example:
            >>> manager.save(200, {"model": model}, metrics={"val_loss": 0.5})  # doctest: +SKIP
        """
        self.wait()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}.")
        metrics_json = _metrics_for_manifest(metrics)
        if self.monitor is not None and metrics_json is not None and self.monitor not in metrics_json:
            raise ValueError(
                f"metrics has no {self.monitor!r} (the monitor of this CheckpointManager); it has "
                f"{sorted(metrics_json)}. Pass it, or save without metrics to skip ranking this step."
            )
        self.claim()
        path = self.path_for(step)
        if not self.async_save:
            _save_checkpoint(
                path,
                state,
                step=step,
                metrics=metrics_json,
                collective=True,
                file_mode=self.file_mode,
                timeout_s=self.timeout_s,
                guard=self._lock.check,
                storage=self._storage,
            )
            if runtime.get_rank() == 0:
                self._retain(step)
            return path
        _check_state(state)
        multi = runtime.get_world_size() > 1
        handshake = _Handshake(f"checkpoint {redact_url(path)}", self.timeout_s) if multi else None
        pending = _Pending(step, path, handshake, main=runtime.get_rank() == 0)
        if not pending.main:
            _collect(state)  # state_dict() may be collective (ResumeState gathers RNG states)
            self._pending = pending
            return path
        try:
            payload = _collect(state)
            _check_loadable(payload)
            snapshot = _to_cpu(payload)
        except BaseException as err:
            # The other ranks learn it at their next save() or wait(), like a background failure.
            pending.error, pending.raised = err, True
            if handshake is not None:
                handshake.publish(err)
            self._pending = pending
            raise
        manifest = _manifest_builder(step, metrics_json, list(snapshot))
        pending.thread = threading.Thread(
            target=self._write_in_background,
            args=(pending, snapshot, manifest),
            name=f"distkit-checkpoint-step-{step}",
        )
        self._pending = pending
        pending.thread.start()
        return path

    def _write_in_background(self, pending: _Pending, snapshot: dict[str, Any], manifest: Any) -> None:
        try:
            self._storage.write_checkpoint(pending.path, snapshot, manifest, self.file_mode, self._lock.check)
        except BaseException as err:
            pending.error = err
        else:
            self._retain(pending.step)  # committed: from here on only warnings
        finally:
            if pending.handshake is not None:
                pending.handshake.publish(pending.error)

    def wait(self) -> None:
        """Block until the save in flight (async mode) is committed; raise if it failed.

        Collective: call on every rank (each learns the outcome; rank 0 waits for its writer). Returns
        at once when nothing is in flight.

        Raises:
            DistkitError: On rank 0, the background save failed (chained to the original error).
            MainProcessError: On the other ranks, the background save failed on rank 0.
            CollectiveTimeoutError: Rank 0 did not report within ``timeout_s``.

        Example:
            >>> manager = CheckpointManager("/tmp/ckpts_example", async_save=True, overwrite=True)
            >>> _ = manager.save(1, {"w": torch.ones(1)})
            >>> manager.wait()  # step 1 is committed now
        """
        pending = self._pending
        if pending is None:
            return
        if not pending.main:
            self._pending = None
            if pending.handshake is not None:
                pending.handshake.settle_other()
            return
        if pending.thread is not None:
            pending.thread.join(self.timeout_s)
            if pending.thread.is_alive():
                raise CollectiveTimeoutError(
                    f"{_label()} the background save of step {pending.step} to {redact_url(pending.path)} "
                    f"is still running after {self.timeout_s:g} s; raise timeout_s if saves legitimately "
                    f"take this long.",
                    missing_ranks=None,
                    timeout_s=self.timeout_s,
                )
        self._pending = None
        if pending.handshake is not None:
            pending.handshake.settle_main()
        if isinstance(pending.error, CheckpointConflictError) and not pending.raised:
            raise pending.error  # the same refusal as on the other ranks, not a crash to wrap
        if pending.error is not None and not pending.raised:
            raise DistkitError(
                f"{_label()} the background save of step {pending.step} to {redact_url(pending.path)} "
                f"failed: {type(pending.error).__name__}: {pending.error}"
            ) from pending.error

    # ---- finding checkpoints

    def _entries(self) -> list[_Entry]:
        entries = []
        for name, files in self._storage.listing(self.directory).items():
            if match := _STEP_RE.match(name):
                committed, leftover = _MANIFEST_FILE in files, False
            elif match := _LEFTOVER_RE.match(name):
                committed, leftover = False, True
            else:
                continue
            entries.append(
                _Entry(
                    int(match.group(1)), _join(self.directory, name), committed, leftover, frozenset(files)
                )
            )
        return sorted(entries, key=lambda e: (e.step, e.committed), reverse=True)

    def _first_that_verifies(self, candidates: list[_Entry], entries: list[_Entry]) -> _Entry | None:
        in_flight = self._pending.step if self._pending is not None else None
        for entry in candidates:
            try:
                _verify(self._storage, entry.path, checksums=True)
            except FileNotFoundError:
                continue  # deleted since the listing (retention of the writer): not damage
            except CheckpointCorruptError as err:
                warnings.warn(
                    f"{_label()} skipping corrupt checkpoint {redact_url(entry.path)}: {err.reason}.",
                    stacklevel=3,
                )
                continue
            self._warn_partials(entries, above=entry.step, in_flight=in_flight)
            return entry
        self._warn_partials(entries, above=-1, in_flight=in_flight)
        return None

    def _warn_partials(self, entries: list[_Entry], *, above: int, in_flight: int | None) -> None:
        for entry in entries:
            if not entry.committed and entry.step > above and entry.step != in_flight:
                warnings.warn(
                    f"{_label()} skipping partial checkpoint {redact_url(entry.path)}: it has no "
                    f"{_MANIFEST_FILE} (a save that did not finish).",
                    stacklevel=4,
                )

    def latest(self) -> str | None:
        """The newest committed checkpoint that verifies, or ``None``.

        Local: no communication; every rank reads the directory. Checks sizes and checksums (which
        reads the files), newest step first; partial and corrupt checkpoints are skipped with a
        warning naming them. Does not wait for a save in flight. A checkpoint with a newer
        ``format_version`` than this distkit reads raises instead of being skipped (upgrade distkit).

        A ``latest()`` that returns a checkpoint counts as resuming (see :meth:`claim`): the pattern
        ``path = manager.latest(); load_checkpoint(path, state)`` followed by ``save()`` continues
        that run, and a requeued job written that way keeps working.

        Example:
            >>> manager.latest()  # doctest: +SKIP
            '/tmp/ckpts_example/step_000000100'
        """
        entries = self._entries()
        found = self._first_that_verifies([e for e in entries if e.committed], entries)
        if found is None:
            return None
        self._resuming = True
        return found.path

    def best(self) -> str | None:
        """The committed checkpoint with the best ``monitor`` value that verifies, or ``None``.

        Local: no communication. Ties go to the later step; checkpoints saved without the metric
        (or whose manifest cannot be read) do not compete. Corrupt ones are skipped with a warning.
        Unlike ``latest()``, it does not count as resuming.

        Raises:
            ValueError: The manager has no ``monitor``.

        Example:
            >>> manager.best()  # doctest: +SKIP
        """
        if self.monitor is None:
            raise ValueError(
                "best() needs a monitor: create the CheckpointManager with monitor=<metric name>."
            )
        entries = self._entries()
        ranked = self._ranked_by_metric([e for e in entries if e.committed])
        found = self._first_that_verifies(ranked, [])
        return None if found is None else found.path

    def _ranked_by_metric(self, committed: list[_Entry]) -> list[_Entry]:
        scored = []
        for entry in committed:
            try:
                value = _read_manifest(self._storage, entry.path).get("metrics", {}).get(self.monitor)
            except (DistkitError, OSError):  # unreadable, newer format, or gone: not ranked
                continue
            if _is_number(value) and not math.isnan(value):
                scored.append((value if self.mode == "min" else -value, -entry.step, entry))
        return [entry for *_, entry in sorted(scored, key=lambda s: s[:2])]

    # ---- resuming

    def restore(self, state: Mapping[str, Any], *, strict: bool = True) -> int | None:
        """Load the newest checkpoint that verifies into ``state``; return its step, or ``None``.

        Collective: call on every rank; they load the same step (checked) onto their own devices.
        Without a process group the one process loads. Corrupt and partial checkpoints are skipped
        with a warning, falling back to the next older one. Waits for a save in flight first, and
        claims the directory as resuming (:meth:`claim`), so a requeued job restores and saves on.

        Args:
            state: Names to objects, as for :func:`load_checkpoint`.
            strict: As for :func:`load_checkpoint`.

        Returns:
            The restored step, or ``None`` when there is no usable checkpoint (a fresh start).

        Raises:
            CheckpointConflictError: Another writer holds the directory.
            DistkitError: Restoring failed on another rank (this rank re-raises its own error),
                ranks restored different steps (the directory changed while they read it), or the
                newest checkpoint has a newer ``format_version`` (upgrade distkit).

        Example:
            >>> step = manager.restore({"model": model})  # doctest: +SKIP
            >>> start = 0 if step is None else step + 1  # doctest: +SKIP
        """
        self.wait()
        self.claim(resuming=True)
        restored: int | None = None
        failure: Exception | None = None
        try:
            restored = self._restore_newest(state, strict)
        except Exception as err:
            failure = err
        # Every rank reaches this gather, failed or not, so a failure on one rank cannot leave the
        # others waiting in a later collective.
        outcomes = all_gather_object(
            (restored, None if failure is None else f"{type(failure).__name__}: {failure}")
        )
        if failure is not None:
            raise failure
        failed = {rank: error for rank, (_, error) in enumerate(outcomes) if error is not None}
        if failed:
            raise DistkitError(
                f"{_label()} restoring from {redact_url(self.directory)} failed on rank(s) {sorted(failed)}: "
                + "; ".join(f"rank {rank}: {error}" for rank, error in failed.items())
            )
        chosen = [step for step, _ in outcomes]
        if len(set(chosen)) > 1:
            raise DistkitError(
                f"{_label()} ranks restored different checkpoints from {redact_url(self.directory)}: "
                f"{dict(enumerate(chosen))} (rank: step). The directory changed while they read it; "
                f"make sure no other job writes to it and restore again."
            )
        return restored

    def _restore_newest(self, state: Mapping[str, Any], strict: bool) -> int | None:
        entries = self._entries()
        for entry in (e for e in entries if e.committed):
            try:
                loaded, manifest = _load_verified(self._storage, entry.path, "auto")
            except FileNotFoundError:
                continue  # deleted since the listing
            except CheckpointCorruptError as err:
                warnings.warn(
                    f"{_label()} skipping corrupt checkpoint {redact_url(entry.path)}: {err.reason}.",
                    stacklevel=3,
                )
                continue
            self._warn_partials(entries, above=entry.step, in_flight=None)
            _restore(entry.path, loaded, state, strict)
            return manifest["step"] if manifest["step"] is not None else entry.step
        self._warn_partials(entries, above=-1, in_flight=None)
        return None

    # ---- retention (rank 0, after a commit)

    def _retain(self, just_saved: int) -> None:
        """Retention after the commit of ``just_saved``. Never raises: that checkpoint is committed."""
        try:
            self._apply_retention(just_saved)
        except Exception as err:
            warnings.warn(
                f"{_label()} retention after saving step {just_saved} in {redact_url(self.directory)} "
                f"failed: {type(err).__name__}: {err}. The new checkpoint is committed; older ones were "
                f"not deleted this time.",
                stacklevel=3,
            )

    def _apply_retention(self, just_saved: int) -> None:
        valid: list[_Entry] = []
        debris: list[_Entry] = []  # provably distkit's and incomplete: leftovers of killed saves and deletes
        for entry in self._entries():
            if entry.leftover:
                debris.append(entry)
            elif not entry.committed:
                # A step directory without a manifest: what a writer killed between its two puts
                # leaves on an object store. Removed when it holds nothing distkit did not write.
                if entry.holds_only_own_files:
                    debris.append(entry)
                else:
                    self._warn_kept(
                        entry,
                        f"it has no {_MANIFEST_FILE} and holds files distkit did not write "
                        f"({self._foreign(entry)})",
                    )
            elif entry.step == just_saved:
                valid.append(entry)  # committed a moment ago by this process
            else:
                try:
                    _verify(self._storage, entry.path, checksums=False)
                except FileNotFoundError:
                    continue
                except (DistkitError, OSError) as err:
                    # Never delete what cannot be read: a malformed or newer manifest, a damaged,
                    # missing or special file. It may be the only copy of something.
                    reason = err.reason if isinstance(err, CheckpointCorruptError) else str(err)
                    self._warn_kept(entry, f"it cannot be read ({reason})")
                    continue
                valid.append(entry)
        keep = {just_saved}
        keep.update(e.step for e in (valid if self.keep_last is None else valid[: self.keep_last]))
        if self.keep_best is not None:
            keep.update(e.step for e in self._ranked_by_metric(valid)[: self.keep_best])
        # Surplus checkpoints first (the space retention is for), then the debris.
        for entry in [e for e in valid if e.step not in keep] + debris:
            try:
                self._delete_unless_foreign(entry, "it also holds")
            except OSError as err:
                warnings.warn(
                    f"{_label()} retention could not delete {redact_url(entry.path)}: {err}. The new "
                    f"checkpoint is committed; delete the old one by hand to free the space.",
                    stacklevel=4,
                )

    def _delete_unless_foreign(self, entry: _Entry, kept_because: str) -> bool:
        """Delete ``entry``; one that holds files distkit did not write is kept, with a warning.

        Args:
            entry: A checkpoint or leftover of this directory.
            kept_because: How the warning's reason starts: ``"it holds"`` or ``"it also holds"``.

        Returns:
            Whether this call deleted it (``False``: kept, or gone already).

        Raises:
            OSError: The deletion failed.
        """
        if not entry.leftover and not entry.holds_only_own_files:
            why = f"{kept_because} files distkit did not write ({self._foreign(entry)})"
            self._warn_kept(entry, why, stacklevel=6)  # one frame deeper than the callers' own
            return False
        try:
            self._storage.remove(entry.path)
        except FileNotFoundError:
            return False
        return True

    @staticmethod
    def _foreign(entry: _Entry) -> str:
        return ", ".join(sorted(entry.files - _OWN_FILES)[:5])

    def _warn_kept(self, entry: _Entry, why: str, *, stacklevel: int = 5) -> None:
        # Once per checkpoint and manager: the same reason at every save would bury the log.
        if entry.path in self._kept_warned:
            return
        self._kept_warned.add(entry.path)
        warnings.warn(
            f"{_label()} retention keeps {redact_url(entry.path)}: {why}. distkit never deletes what it "
            f"cannot read or did not write; look at it, and delete it by hand if it is not needed.",
            stacklevel=stacklevel,
        )

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

A state whose modules hold DTensor parameters (FSDP2's ``fully_shard``) is saved as a *sharded*
checkpoint: every rank writes its own shards through ``torch.distributed.checkpoint`` beside
``state.pt``, under the same manifest and commit, and it loads on any world size, into FSDP, DDP or
a plain module; :func:`consolidate_checkpoint` turns one into a full checkpoint.

Checkpoints of other tools (docs/checkpoints.md, "Checkpoints from other tools"): a
``torch.distributed.checkpoint`` directory without a manifest (torchtitan's ``step-N``) loads as it
is; :func:`import_checkpoint` (``distkit checkpoint import``) converts a Lightning ``.ckpt`` or an
Accelerate ``save_state`` directory; any other path is named for what it is
(:class:`ForeignCheckpointError`), and only a distkit save that did not finish is called one.

This package's ``__init__`` is the public API; the modules below it are private, one concern each,
and import only downwards: ``_errors`` (the three errors, defined low because every part raises
them) <- ``_format`` (file names, serialization, the manifest) <- ``_foreign`` (other tools'
layouts, recognized by their files) <- ``_files`` (local and fsspec storage, safe opening,
verification) <- ``_lock`` (one writer per directory); ``_state`` converts live objects to a state
and back, ``_resume`` holds :class:`ResumeState`, ``_commit`` how the ranks agree on a save,
``_sharded`` the sharded writes through DCP and ``_dcp_load`` every read of a DCP directory,
``_plain_dcp`` the DCP directories distkit did not write, ``_io`` one checkpoint's save and load,
``_import`` the conversion of Lightning and Accelerate checkpoints, ``_retention`` a directory's
step checkpoints, ``_async`` the save in flight of an asynchronous manager, and ``_manager`` the
:class:`CheckpointManager` (who writes, when, retention, resumes). ``_command`` is the ``distkit
checkpoint`` command.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import torch

from distkit._utils.checks import check_bool
from distkit._utils.slips import names_slips
from distkit.checkpoint._commit import DEFAULT_FILE_MODE, DEFAULT_SAVE_TIMEOUT_S
from distkit.checkpoint._errors import CheckpointConflictError, CheckpointCorruptError, ForeignCheckpointError
from distkit.checkpoint._files import _storage_for
from distkit.checkpoint._import import ImportReport, _import_checkpoint
from distkit.checkpoint._io import _consolidate, _load_verified, _restore_into, _save_checkpoint
from distkit.checkpoint._manager import CheckpointManager
from distkit.checkpoint._plain_dcp import _load_plain_dcp
from distkit.checkpoint._resume import ResumeState
from distkit.checkpoint._state import _check_state

__all__ = [
    "DEFAULT_FILE_MODE",
    "DEFAULT_SAVE_TIMEOUT_S",
    "CheckpointConflictError",
    "CheckpointCorruptError",
    "CheckpointManager",
    "ForeignCheckpointError",
    "ImportReport",
    "ResumeState",
    "consolidate_checkpoint",
    "import_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]


@names_slips()
def save_checkpoint(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    step: int | None = None,
    metrics: Mapping[str, float] | None = None,
    collective: bool = True,
    file_mode: int = DEFAULT_FILE_MODE,
    timeout_s: float | None = None,
    sharded: bool | Literal["auto"] = "auto",
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

    A state whose modules hold DTensor parameters (FSDP2's ``fully_shard``) is saved as a sharded
    checkpoint: every rank writes its own shards of the modules and of their optimizers (each
    optimizer saved by parameter name, through the module in ``state`` that holds its parameters)
    with ``torch.distributed.checkpoint``; everything else goes into ``state.pt`` from rank 0. It is
    committed as a whole, and loads on any world size (see ``docs/checkpoints.md``).

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
        sharded: ``"auto"`` (default): sharded when a module or optimizer of ``state`` has DTensor
            parameters; ``True``: always sharded; ``False``: always full (a state with DTensor
            parameters is refused). Sharded checkpoints go to local directories (or ``file://``).

    Returns:
        ``path`` as a string.

    Raises:
        TypeError: A value could not be loaded back with ``weights_only=True`` (names the key).
        ValueError: A sharded state and an fsspec URL, ``collective=False`` on several ranks, or
            ``sharded=False`` with DTensor parameters (the message says what to do instead).
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
        sharded=sharded,
    )


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

    A sharded checkpoint's modules and optimizers are read through ``torch.distributed.checkpoint``
    into the objects of ``state``, resharded to them: each rank reads the pieces of its own shards
    (an FSDP2 module) or whole tensors (a DDP or plain module), whatever world size saved it. An
    optimizer needs the module it trains in ``state``. A full state goes into a sharded module or
    optimizer the same way, each rank keeping its own slices. Without ``state``, a sharded
    checkpoint's modules and optimizers come back whole, as CPU tensors keyed by parameter name.

    **Checkpoints of other tools.** A ``torch.distributed.checkpoint`` directory without a distkit
    manifest (``.metadata`` and ``*.distcp`` files: torchtitan's ``step-N``, anything ``dcp.save``
    wrote) loads as it is, resharded the same way: a module is found under ``"<key>."`` (``dcp.save(
    {"model": model.state_dict(), ...})``) or at the top level (torchtitan), an optimizer keyed by
    parameter name, flattened (torchtitan) or by number (``optimizer.state_dict()``). It has no
    checksums to verify. An Accelerate ``save_state`` directory or a Lightning ``.ckpt`` is refused
    with :class:`ForeignCheckpointError` naming :func:`import_checkpoint`, which converts it; the
    checkpoint that makes loads here.

    Args:
        path: Checkpoint directory, local or fsspec URL.
        state: Names to objects to restore into; ``None`` only loads.
        map_location: Where tensors go: ``"auto"`` (this rank's device, :func:`distkit.get_device`)
            or anything ``torch.load`` accepts.
        strict: Require every key of ``state`` in the checkpoint and exact module keys. For a
            checkpoint distkit did not write (a DCP directory) or imported (:func:`import_checkpoint`),
            which hold no distkit bookkeeping: every module of ``state`` must be in it and match
            exactly (no parameter missing, extra or reshaped), and an optimizer it holds must match
            its module; the entries it lacks (a :class:`ResumeState`, counters, callbacks, a loader's
            position, an optimizer it has none of) start fresh, listed in one warning. ``False`` also
            loads a module in part and leaves a module it lacks as it is.

    Returns:
        Everything the checkpoint holds, as loaded (modules as state dicts).

    Raises:
        FileNotFoundError: Nothing exists at ``path`` ("checkpoint not found").
        NotADirectoryError: ``path`` is a file, not a checkpoint directory (and no Lightning one).
        ForeignCheckpointError: ``path`` is another tool's checkpoint that must be imported first
            (Accelerate, Lightning) or a directory of other files: the message says which, and the
            command.
        CheckpointCorruptError: A save that did not finish (only distkit's files, no manifest), an
            empty directory, a malformed manifest, a listed file that is missing, is
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
    if state is not None:
        _check_state(state)  # load_checkpoint(path, model): before reading anything
    check_bool("strict", strict)
    _check_map_location(map_location)
    storage, target = _storage_for(path)
    try:
        verified = _load_verified(storage, target, map_location)
    except ForeignCheckpointError as err:
        if err.kind != "dcp":
            raise
        # Told apart only once there is no manifest: a distkit checkpoint costs no extra listing.
        verified = None
    if verified is None:
        return _load_plain_dcp(storage, target, state, strict=strict, stacklevel=3)
    loaded, manifest = verified
    return _restore_into(target, loaded, manifest, state, strict, stacklevel=3)


def consolidate_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    file_mode: int = DEFAULT_FILE_MODE,
) -> str:
    """Write the checkpoint at ``src`` as one full checkpoint at ``dst``, for inference or export.

    Local: no communication; run it in one process (it holds the whole state in CPU memory). ``src``
    is verified first (sizes and checksums); a sharded checkpoint's modules and optimizers are read
    whole through ``torch.distributed.checkpoint``, whatever world size saved them. ``dst`` becomes
    a committed full checkpoint directory (written atomically, as by :func:`save_checkpoint`) whose
    ``state.pt`` loads without distkit: ``torch.load(dst + "/state.pt", weights_only=True)`` gives
    ``{"model": {name: tensor}, ...}``. Modules are keyed by parameter name; optimizers are saved by
    parameter name too (``{"state": {name: ...}, "param_groups": [{"params": [name, ...]}]}``),
    which :func:`load_checkpoint` restores into any optimizer given its module. The step, metrics
    and the world size that saved the state are kept (a :class:`ResumeState` in it holds that many
    ranks' RNG streams). The command ``distkit checkpoint consolidate SRC DST`` does the same.

    Args:
        src: A checkpoint directory (sharded or full), local or fsspec URL.
        dst: Where to write the full checkpoint: a local directory or fsspec URL.
        file_mode: Permission bits of local files (default 0o600).

    Returns:
        ``dst`` as a string.

    Raises:
        FileNotFoundError: Nothing exists at ``src``.
        CheckpointCorruptError: ``src`` is incomplete or damaged (names the file).
        FileExistsError: ``dst`` exists and holds files that are not a distkit checkpoint.

    Example:
        >>> import torch, distkit
        >>> _ = distkit.save_checkpoint("/tmp/ckpt_example", {"model": torch.nn.Linear(2, 2)})
        >>> distkit.consolidate_checkpoint("/tmp/ckpt_example", "/tmp/ckpt_example_full")
        '/tmp/ckpt_example_full'
    """
    return _consolidate(src, dst, file_mode=file_mode)


def import_checkpoint(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    strip_prefix: str | None = None,
    step: int | None = None,
    file_mode: int = DEFAULT_FILE_MODE,
) -> ImportReport:
    """Convert a Lightning ``.ckpt`` file or an Accelerate ``save_state`` directory into a committed
    distkit checkpoint at ``dest``.

    Local: no communication; run it in one process. ``src`` is read with
    ``torch.load(weights_only=True)`` (and ``safetensors`` for ``model.safetensors``, when that
    package is installed), never unpickling arbitrary objects. ``dest`` is written by distkit's own
    save (a new or empty directory, as for :func:`consolidate_checkpoint`), so it verifies and loads
    like any checkpoint: ``load_checkpoint(dest, {"model": model, "optimizer": optimizer})`` or
    ``Trainer(resume=dest)``, which starts its own progress, counters and random streams fresh.
    The command ``distkit checkpoint import SRC DEST`` does the same and prints the report.

    Carried over: the model's state dict as ``"model"`` (Lightning's ``state_dict``; Accelerate's
    first model, without DDP's ``module.``), the first optimizer's state dict as ``"optimizer"``
    (Lightning's ``optimizer_states[0]``, Accelerate's ``optimizer.bin``: parameters numbered in the
    order the optimizer was given them), and the step in the manifest (Lightning's ``global_step``;
    for Accelerate, ``step`` of a registered custom object, or a directory named ``step_<N>``).
    Everything else (Lightning's loops, callbacks, LR schedulers, hyper-parameters; Accelerate's
    schedulers, scaler, RNG states, samplers, custom objects, other models) is listed in the report
    with the reason.

    Args:
        src: A Lightning ``.ckpt`` file or an Accelerate ``save_state`` directory (local).
        dest: The distkit checkpoint directory to write (local or fsspec URL).
        strip_prefix: Model keys. ``None`` (default): a Lightning checkpoint's prefix common to every
            key (the LightningModule's attribute holding the model, such as ``"model."``) is stripped,
            so the weights load into that module; Accelerate's keys are kept. ``""``: keep every key
            as saved. A prefix: strip it, leaving out the keys without it. The report says which.
        step: The step to record, instead of the one found (or where none is).
        file_mode: Permission bits of local files (default 0o600).

    Returns:
        What was carried over, what was not and why (``str()`` of it is the command's output).

    Raises:
        FileNotFoundError: Nothing exists at ``src``.
        ForeignCheckpointError: ``src`` is another layout (a DCP directory, which loads as it is,
            sharded Hugging Face weights...): the message says what to do instead.
        DistkitError: ``src`` holds objects ``weights_only`` refuses, is not a Lightning checkpoint,
            holds no model weights, or needs the safetensors package (the message says how).
        FileExistsError: ``dest`` holds a checkpoint or other files.
        ValueError: ``strip_prefix`` matches no key, ``dest`` is inside a checkpoint or named
            ``step_<N>`` for another step, or ``src`` is a URL.

    Example:
        >>> report = distkit.import_checkpoint("lightning_logs/version_0/checkpoints/last.ckpt",
        ...                                    "imported")  # doctest: +SKIP
        >>> print(report)  # doctest: +SKIP
        >>> distkit.Trainer(resume="imported").fit(model, data, optimizer=opt)  # doctest: +SKIP
    """
    return _import_checkpoint(src, dest, strip_prefix=strip_prefix, step=step, file_mode=file_mode)


def _check_map_location(map_location: Any) -> None:
    """A device string torch cannot parse ("gpu") is named before any file is read, not by
    torch's unpickler once the tensors come."""
    if not isinstance(map_location, str) or map_location == "auto":
        return
    try:
        torch.device(map_location)
    except RuntimeError:
        meant = "'cuda'" if map_location.lower().startswith("gpu") else "'cpu', 'cuda' or 'cuda:0'"
        raise ValueError(
            f"map_location={map_location!r} is no device torch knows; did you mean {meant}? "
            f"('auto', the default, puts tensors on this rank's device.)"
        ) from None

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
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import errno
import gc
import hashlib
import io
import json
import math
import mmap
import os
import pickle
import random
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
import weakref
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from distkit import runtime
from distkit._fs import TEMP_MARKER, fsync_dir, temp_name
from distkit.collectives import all_gather_object, broadcast_object
from distkit.errors import CollectiveTimeoutError, DistkitError, MainProcessError
from distkit.seeding import capture_rng_state, restore_rng_state

try:  # POSIX; elsewhere the writer lock is off (with a warning), see _LocalWriterLock
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

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

_STATE_FILE = "state.pt"
_MANIFEST_FILE = "manifest.json"
_OWN_FILES = frozenset({_STATE_FILE, _MANIFEST_FILE})
_FORMAT = "distkit-checkpoint"
_FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
# Leftovers of a local save or delete that was killed: temporary names made by distkit._fs.temp_name.
_LEFTOVER_RE = re.compile(r"^\.step_(\d+)" + re.escape(TEMP_MARKER) + "-")
# Chunks smaller than this (zip headers, alignment padding, small tensors) are gathered into writes
# of about _COALESCE_BYTES; larger ones go straight through.
_PARALLEL_BYTES = 1 << 16
_COALESCE_BYTES = 1 << 20
_READ_CHUNK = 8 << 20
# A manifest is about 1 KB (a few thousand metrics or keys stay far below this); a bigger file is not
# one, and reading it whole would only cost memory.
_MAX_MANIFEST_BYTES = 16 << 20
# The writer lock of a local directory sits beside it: `<directory>.distkit-lock`.
_LOCK_SUFFIX = ".distkit-lock"
# The writer lease of an object-store directory sits inside it (a bucket root has no "beside").
_LEASE_FILE = ".distkit-writer.json"

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

_T = TypeVar("_T")
_U = TypeVar("_U")


class CheckpointCorruptError(DistkitError):
    """A checkpoint is incomplete or its files do not match their manifest.

    Attributes:
        path: The checkpoint directory.
        reason: What is wrong, e.g. ``"state.pt is 10 bytes, the manifest says 2048"``.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(
            f"checkpoint {path} is not usable: {reason}. Load an earlier checkpoint "
            f"(CheckpointManager.latest() skips such ones) or save this one again."
        )
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.reason)


class CheckpointConflictError(DistkitError):
    """Writing into a checkpoint directory was refused, so that no run destroys another.

    Raised on every rank by :meth:`CheckpointManager.claim` (and so by the first ``save()`` or
    ``restore()``) when another writer holds the directory's lock, or when the directory already
    holds committed checkpoints that this manager neither resumed from nor was told to overwrite;
    on object stores also by a ``save()`` after another writer took the directory over.

    Attributes:
        directory: The checkpoint directory.
        reason: What conflicts, without the ``[rank R/W]`` prefix.
        holder: The other writer (``host``, ``pid``, ``since``, ``job``) when one was named, else
            ``None``.
        steps: The committed steps found in the directory (for a fresh run's refusal), else ``[]``.

    Example:
        >>> try:  # doctest: +SKIP
        ...     manager.save(0, state)
        ... except distkit.CheckpointConflictError as err:
        ...     print(err.directory, err.steps, err.holder)
    """

    def __init__(
        self,
        reason: str,
        *,
        directory: str,
        holder: Mapping[str, Any] | None = None,
        steps: list[int] | None = None,
        label: str = "",
    ) -> None:
        super().__init__(f"{label} {reason}" if label else reason)
        self.reason = reason
        self.directory = directory
        self.holder = None if holder is None else dict(holder)
        self.steps = list(steps or [])
        self._label = label

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_conflict, (self.reason, self.directory, self.holder, self.steps, self._label)


def _rebuild_conflict(
    reason: str, directory: str, holder: dict[str, Any] | None, steps: list[int], label: str
) -> CheckpointConflictError:
    return CheckpointConflictError(reason, directory=directory, holder=holder, steps=steps, label=label)


# --------------------------------------------------------------------------------------------------
# Where checkpoints live: a local directory or an fsspec URL.


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if "://" in base else os.path.join(base, name)


def _dir_mode(file_mode: int) -> int:
    # Directories need the execute bit wherever their files are readable.
    return file_mode | ((file_mode & 0o444) >> 2)


# Opening the files a checkpoint lists: never follow a symlink, never block on a FIFO.


def _kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(checkpoint: str, file: str, mode: int) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        checkpoint,
        f"{file} is {_kind_of(mode)}, not a regular file; distkit refused to open it (a checkpoint "
        f"holds regular files only, and opening a FIFO or a device can block forever or have side "
        f"effects)",
    )


_SAFE_OPEN_FLAGS = (
    os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
)


def _open_regular(checkpoint: str, file: str) -> int:
    """A read-only descriptor of ``file``; anything but a regular file is refused without being opened.

    ``lstat`` first refuses a FIFO, device, socket or symlink unopened; ``O_NOFOLLOW`` and
    ``O_NONBLOCK`` cover a name swapped after the ``lstat`` (opening a FIFO without ``O_NONBLOCK``
    waits for a writer forever); ``fstat`` then checks what was actually opened.
    """
    mode = os.lstat(file).st_mode
    if not stat.S_ISREG(mode):
        raise _not_regular(checkpoint, file, mode)
    try:
        fd = os.open(file, _SAFE_OPEN_FLAGS)
    except OSError as err:
        if err.errno == errno.ELOOP:  # replaced by a symlink since the lstat
            raise _not_regular(checkpoint, file, stat.S_IFLNK) from err
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(checkpoint, file, mode)
        if fcntl is not None and _SAFE_OPEN_FLAGS & getattr(os, "O_NONBLOCK", 0):
            # Linux ignores O_NONBLOCK on regular files, a network or FUSE filesystem may not.
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


# Why a write failed, said so that the reader knows what to do (keyed by errno name).
_WRITE_HINTS = {
    "ENOSPC": "free space on that filesystem or save to another directory",
    "EDQUOT": "your disk quota there is used up: free space or save to another directory",
    "EFBIG": (
        "the file outgrew a file-size limit (`ulimit -f`, or the filesystem's largest file): raise "
        "the limit or save to another filesystem"
    ),
    "EROFS": "the filesystem is read-only: save to a writable directory",
    "EACCES": "this user may not write there: fix the directory's permissions or save elsewhere",
    "EPERM": "this user may not write there: fix the directory's permissions or save elsewhere",
    "EIO": "the storage reported an I/O error (a failing disk or network filesystem): check it",
    "ENOTDIR": "a component of the path is a file, not a directory: choose another directory",
    "EEXIST": "a file stands where a directory is needed: choose another directory",
    "ENAMETOOLONG": "the path is too long: choose a shorter directory",
    "EMFILE": "this process has too many open files: raise `ulimit -n`",
}


def _write_error(err: OSError, checkpoint: str, where: str, *, untouched: str) -> OSError:
    """``err`` restated with its errno name, the checkpoint, the path being written and a fix.

    The result has the same errno, hence the same ``OSError`` subclass (``FileExistsError``, ...).
    Errors without an errno (some object-store clients) are returned as they are.
    """
    code = err.errno
    name = errno.errorcode.get(code) if isinstance(code, int) else None
    if name is None:
        return err
    hint = _WRITE_HINTS.get(name, "check the storage that holds it")
    return OSError(
        code,
        f"{name} ({err.strerror or os.strerror(code)}) while writing checkpoint {checkpoint}, at "
        f"{where}; nothing was committed and {untouched}. Fix: {hint}.",
    )


class _LocalStorage:
    """Local directories: the commit is an ``os.replace`` of a fully written, fsynced directory."""

    def listing(self, directory: str) -> dict[str, set[str]]:
        # name of each entry of `directory` -> the names of the files it holds
        try:
            names = os.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out: dict[str, set[str]] = {}
        for name in names:
            try:
                out[name] = set(os.listdir(os.path.join(directory, name)))
            except (NotADirectoryError, FileNotFoundError):
                continue
        return out

    def contents(self, path: str) -> set[str] | None:
        try:
            return set(os.listdir(path))
        except FileNotFoundError:
            return None

    def kind(self, path: str) -> str | None:
        """``"dir"``, ``"file"`` or ``None`` (nothing there); follows a symlinked checkpoint directory."""
        try:
            mode = os.stat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None
        return "dir" if stat.S_ISDIR(mode) else "file"

    def read_manifest(self, path: str) -> bytes | None:
        file = os.path.join(path, _MANIFEST_FILE)
        try:
            fd = _open_regular(path, file)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            data = os.read(fd, _MAX_MANIFEST_BYTES + 1)
            while len(data) <= _MAX_MANIFEST_BYTES and (
                more := os.read(fd, _MAX_MANIFEST_BYTES + 1 - len(data))
            ):
                data += more
        finally:
            os.close(fd)
        if len(data) > _MAX_MANIFEST_BYTES:
            raise CheckpointCorruptError(
                path, f"{file} is over {_MAX_MANIFEST_BYTES} bytes, too big for a manifest"
            )
        return data

    def size(self, checkpoint: str, file: str) -> int | None:
        try:
            info = os.lstat(file)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(checkpoint, file, info.st_mode)
        return info.st_size

    def crc32(self, checkpoint: str, file: str) -> int:
        fd = _open_regular(checkpoint, file)
        try:
            return _crc32_of_fd(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def open_state(self, path: str, files: Mapping[str, Any]) -> tuple[Any, Callable[[], dict[str, int]]]:
        # torch.load reads through a descriptor opened like every other checkpoint file (no symlink,
        # no FIFO); torch.load(path) would open the name itself, which can block on a FIFO. The
        # checksums read the files again, from the page cache: only a rewrite in place could make
        # them see different bytes, and distkit never rewrites a checkpoint in place (a new save
        # replaces the whole directory).
        handle = os.fdopen(_open_regular(path, os.path.join(path, _STATE_FILE)), "rb")
        return handle, lambda: {n: self.crc32(path, os.path.join(path, n)) for n in files}

    def write_checkpoint(
        self,
        target: str,
        payload: Mapping[str, Any],
        manifest: Callable[[dict[str, Any]], bytes],
        mode: int,
        guard: Callable[[], None] | None = None,
    ) -> None:
        del guard  # the local writer lock is held by the kernel for as long as its owner lives
        target = os.path.abspath(target)
        if os.path.lexists(target) and not os.path.isdir(target):
            raise FileExistsError(
                f"{target} exists and is a file, not a checkpoint directory; choose another path."
            )
        _check_replaceable(target, self.contents(target))
        parent = os.path.dirname(target)
        untouched = "the checkpoints saved before are untouched"
        try:
            os.makedirs(parent, exist_ok=True)
            staging = tempfile.mkdtemp(prefix=temp_name(Path(target)), dir=parent)
        except OSError as err:
            raise _write_error(err, target, parent, untouched=untouched) from err
        try:
            where = os.path.join(staging, _STATE_FILE)
            info = self._write_state(where, mode, payload)
            where = os.path.join(staging, _MANIFEST_FILE)
            self._write_manifest(where, mode, manifest(info))
            where = staging
            os.chmod(staging, _dir_mode(mode))
            fsync_dir(staging)
            where = target
            self._move_into_place(staging, target)
        except BaseException as err:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(err, OSError):
                explained = _write_error(err, target, where, untouched=untouched)
                if explained is not err:
                    raise explained from err
            raise

    @staticmethod
    def _write_state(path: str, mode: int, payload: Mapping[str, Any]) -> dict[str, Any]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            size = _serialize(payload, lambda data: _write_all(fd, data), checksum=False)["size"]
            # fsync waits for the disk and leaves this process's CPU idle: the checksum is computed
            # meanwhile, from the page cache through a memory map, instead of slowing every write
            # down (measured here: 0.86 of a plain write's throughput, against 0.57 for a CRC
            # beside each write on a loaded machine).
            crc, _ = _run_beside(lambda: _crc32_of_fd(fd, size), lambda: os.fsync(fd))
            os.fchmod(fd, mode)  # after the data: a read-only mode must not stop our own writes
        finally:
            os.close(fd)
        return {"size": size, "crc32": f"{crc:08x}"}

    @staticmethod
    def _write_manifest(path: str, mode: int, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            _write_all(fd, data)
            os.fsync(fd)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)

    @staticmethod
    def _move_into_place(staging: str, target: str) -> None:
        parent = os.path.dirname(target)
        if not os.path.lexists(target):
            os.replace(staging, target)
            fsync_dir(parent)
            return
        # A directory cannot replace a non-empty one in one rename: move the old one aside first. A
        # crash between the two renames leaves the old checkpoint under a temporary name, never a
        # half-written one under the real name; a failed second rename puts the old one back.
        retired = os.path.join(parent, temp_name(Path(target)) + "old-" + uuid.uuid4().hex[:8])
        os.replace(target, retired)
        try:
            os.replace(staging, target)
        except BaseException:
            os.replace(retired, target)
            raise
        fsync_dir(parent)
        shutil.rmtree(retired, ignore_errors=True)

    def remove(self, path: str) -> None:
        # Renaming first un-commits the checkpoint atomically; a kill during the deletion that
        # follows leaves a leftover that the next retention pass removes.
        name = os.path.basename(path)
        if _STEP_RE.match(name):
            retired = os.path.join(
                os.path.dirname(path), temp_name(Path(path)) + "del-" + uuid.uuid4().hex[:8]
            )
            os.replace(path, retired)
            fsync_dir(os.path.dirname(path))
            path = retired
        _purge(path)


def _purge(path: str) -> None:
    """Delete what is left of a checkpoint that is no longer committed."""
    shutil.rmtree(path)


class _RemoteStorage:
    """fsspec filesystems (object stores): one put per object, the manifest put last."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def listing(self, directory: str) -> dict[str, set[str]]:
        root = self.fs._strip_protocol(directory).rstrip("/")
        out: dict[str, set[str]] = {}
        try:
            # withdirs: a sub-directory of a step directory shows up as a name too, so retention
            # sees everything that a recursive delete would remove.
            found = self.fs.find(directory, maxdepth=2, withdirs=True)
        except FileNotFoundError:
            return {}
        for item in found:
            relative = self.fs._strip_protocol(item)[len(root) :].strip("/")
            parts = relative.split("/")
            if len(parts) == 2:
                out.setdefault(parts[0], set()).add(parts[1])
        return out

    def contents(self, path: str) -> set[str] | None:
        try:
            return {name.rstrip("/").rpartition("/")[2] for name in self.fs.ls(path, detail=False)}
        except FileNotFoundError:
            return None

    def kind(self, path: str) -> str | None:
        try:
            if self.fs.isdir(path):
                return "dir"
            return "file" if self.fs.exists(path) else None
        except FileNotFoundError:
            return None

    def read_manifest(self, path: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(_join(path, _MANIFEST_FILE)))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def size(self, checkpoint: str, file: str) -> int | None:
        del checkpoint  # object stores hold objects only: no FIFO, device or symlink to refuse
        try:
            return int(self.fs.size(file))
        except FileNotFoundError:
            return None

    def crc32(self, checkpoint: str, file: str) -> int:
        del checkpoint
        crc = 0
        with self.fs.open(file, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                crc = zlib.crc32(chunk, crc)
        return crc

    def open_state(self, path: str, files: Mapping[str, Any]) -> tuple[Any, Callable[[], dict[str, int]]]:
        # One download: the bytes that are checked are the bytes that are loaded.
        contents = {name: bytes(self.fs.cat_file(_join(path, name))) for name in files}
        return io.BytesIO(contents[_STATE_FILE]), lambda: {
            n: zlib.crc32(data) for n, data in contents.items()
        }

    def write_checkpoint(
        self,
        target: str,
        payload: Mapping[str, Any],
        manifest: Callable[[dict[str, Any]], bytes],
        mode: int,
        guard: Callable[[], None] | None = None,
    ) -> None:
        del mode  # object stores have no POSIX permission bits; access is the bucket's policy
        _check_replaceable(target, self.contents(target))
        manifest_path = _join(target, _MANIFEST_FILE)
        where = manifest_path
        try:
            if guard is not None:
                guard()  # before un-committing anything: is this directory still ours?
            if self.fs.exists(manifest_path):
                self.fs.rm_file(manifest_path)  # un-commit before overwriting the state
            where = _join(target, _STATE_FILE)
            with self.fs.open(where, "wb") as f:
                info = _serialize(payload, f.write, checksum=True)
            where = manifest_path
            if guard is not None:
                guard()  # and again right before the commit, which a writer taken over must not make
            self.fs.pipe_file(manifest_path, manifest(info))
        except OSError as err:
            explained = _write_error(err, target, where, untouched="the other checkpoints are untouched")
            if explained is not err:
                raise explained from err
            raise

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(_join(path, _MANIFEST_FILE))  # un-commit first
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)


_Storage = _LocalStorage | _RemoteStorage


def _storage_for(path: str | os.PathLike[str]) -> tuple[_Storage, str]:
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if "://" not in text:
        return _LocalStorage(), text
    import fsspec

    fs, _ = fsspec.core.url_to_fs(text)
    return _RemoteStorage(fs), text.rstrip("/")


def _check_replaceable(target: str, contents: set[str] | None) -> None:
    # Saving over an existing path must never delete someone's unrelated files.
    if contents is None:
        return
    foreign = sorted(contents - _OWN_FILES)
    if foreign:
        raise FileExistsError(
            f"{target} already exists and holds files that are not part of a distkit checkpoint "
            f"({foreign[:5]}); refusing to replace it. Choose a new path for the checkpoint."
        )


def _crc32_of_fd(fd: int, size: int) -> int:
    if size == 0:
        return zlib.crc32(b"")
    try:
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as view:
            return zlib.crc32(view)
    except (OSError, ValueError, OverflowError):  # no mmap here (or no address space): read it
        crc = 0
        for offset in range(0, size, _READ_CHUNK):
            crc = zlib.crc32(os.pread(fd, min(_READ_CHUNK, size - offset), offset), crc)
        return crc


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


# --------------------------------------------------------------------------------------------------
# Serialization: torch.save into a sink that checksums on the way.


def _run_beside(background: Callable[[], _T], foreground: Callable[[], _U]) -> tuple[_T, _U]:
    """Run ``background`` on a helper thread while ``foreground`` runs here; return both results.

    Both callables release the GIL for their heavy part (zlib, file I/O), so on a machine with a free
    core they overlap. A plain thread rather than an executor: executors refuse new work once the
    interpreter starts to exit, which is exactly when an async save may still be writing. Where no
    thread can be started at all, the two simply run one after the other.
    """
    box: list[Any] = []

    def target() -> None:
        try:
            box.append((True, background()))
        except BaseException as err:
            box.append((False, err))

    helper = threading.Thread(target=target, name="distkit-checkpoint-helper", daemon=True)
    try:
        helper.start()
        started = True
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        target()
        started = False
    try:
        result = foreground()
    finally:
        if started:
            helper.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value, result


class _ChecksumWriter:
    """The file object ``torch.save`` writes into: passes bytes on to ``write``.

    Small chunks (zip headers, alignment padding, small tensors) are gathered first to save system
    calls. With ``checksum=True`` (object stores, where there is no fsync to hide it behind) it
    keeps a CRC32, computing it for large chunks on a helper thread while they are written.

    A failed write is kept in ``error``: torch.save's C++ writer swallows the exception of a Python
    sink and reports only "unexpected pos ..." (a full disk would read as a torch bug), so
    :func:`_serialize` raises this one instead.
    """

    def __init__(self, write: Callable[[Any], Any], *, checksum: bool) -> None:
        self._write = write
        self._checksum = checksum
        self._pending = bytearray()
        self.crc = 0
        self.size = 0
        self.error: BaseException | None = None

    def _send(self, data: Any) -> None:
        try:
            self._write(data)
        except BaseException as err:
            self.error = err
            raise

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        self.size += n
        if n < _PARALLEL_BYTES:
            self._pending += view
            if len(self._pending) >= _COALESCE_BYTES:
                self.flush()
            return n
        self.flush()
        if not self._checksum:
            self._send(view)
            return n
        # The view points into the tensor's memory, valid until this call returns: both finish here.
        crc = self.crc
        self.crc, _ = _run_beside(lambda: zlib.crc32(view, crc), lambda: self._send(view))
        return n

    def flush(self) -> None:
        if self._pending:
            if self._checksum:
                self.crc = zlib.crc32(self._pending, self.crc)
            self._send(self._pending)
            self._pending = bytearray()

    def close(self) -> None:
        self.flush()


# torch.save computes a CRC32 of every zip record for the zip headers, which torch.load never checks;
# the manifest's checksum covers the whole file, so that pass (120 ms of CPU for a 200 MB state
# here) is turned off while distkit writes. The setting is process-wide and read when a writer is
# created, so a torch.save that another thread starts meanwhile also writes zero CRCs (harmless to
# torch.load); a reference count keeps overlapping distkit saves from restoring it too early.
_crc_lock = threading.Lock()
_crc_users = 0
_crc_saved = True


@contextlib.contextmanager
def _without_torch_crc() -> Iterator[None]:
    global _crc_users, _crc_saved
    from torch.utils.serialization import config

    with _crc_lock:
        if _crc_users == 0:
            _crc_saved = config.save.compute_crc32
            config.save.compute_crc32 = False
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                config.save.compute_crc32 = _crc_saved


def _serialize(payload: Mapping[str, Any], write: Callable[[Any], Any], *, checksum: bool) -> dict[str, Any]:
    sink = _ChecksumWriter(write, checksum=checksum)
    try:
        with _without_torch_crc():
            torch.save(dict(payload), sink)
        sink.close()
    except Exception:
        if sink.error is not None:
            # The real cause (ENOSPC, EFBIG, ...), not torch's "unexpected pos" that followed it.
            raise sink.error from None
        raise
    return {"size": sink.size, "crc32": f"{sink.crc:08x}"}


def _manifest_builder(
    step: int | None, metrics: Mapping[str, float] | None, keys: list[str]
) -> Callable[[dict[str, Any]], bytes]:
    from distkit import __version__

    def build(info: dict[str, Any]) -> bytes:
        manifest = {
            "format": _FORMAT,
            "format_version": _FORMAT_VERSION,
            "step": step,
            "world_size": runtime.get_world_size(),
            "torch_version": torch.__version__,
            "distkit_version": __version__,
            "created_unix": time.time(),
            "keys": keys,
            "metrics": dict(metrics or {}),
            "files": {_STATE_FILE: info},
        }
        return json.dumps(manifest, indent=1).encode()

    return build


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
    if storage.device.type == "cpu":
        return storage.clone()
    if storage.device.type != "cuda":
        return storage.cpu()
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
# Rank 0 writes; the other ranks learn the outcome through the job's key-value store.


def _label() -> str:
    return f"[rank {runtime.get_rank()}/{runtime.get_world_size()}]"


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
) -> str:
    """:func:`save_checkpoint`, with ``guard`` called by rank 0 before it changes or commits anything
    (a :class:`CheckpointManager`'s writer-lease check)."""
    _check_file_mode(file_mode)
    _check_state(state)
    storage, target = _storage_for(path)
    metrics_json = _metrics_for_manifest(metrics)
    wait_s = _resolve_timeout(timeout_s)
    multi = runtime.get_world_size() > 1
    if multi and not collective and any(isinstance(v, ResumeState) for v in state.values()):
        raise ValueError(
            "a ResumeState gathers every rank's RNG state, so save_checkpoint() must run on every "
            "rank with collective=True when the state holds one."
        )
    handshake = _Handshake(f"checkpoint {target}", wait_s) if multi and collective else None
    if handshake is not None and runtime.get_rank() != 0:
        _collect(state)  # state_dict() may be collective (ResumeState gathers RNG states)
        handshake.settle_other()
        return target
    error: BaseException | None = None
    try:
        payload = _collect(state)
        _check_loadable(payload)
        storage.write_checkpoint(
            target, payload, _manifest_builder(step, metrics_json, list(payload)), file_mode, guard
        )
    except BaseException as err:
        error = err
        raise
    finally:
        if handshake is not None:
            handshake.publish(error)
            handshake.settle_main()
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_plain_name(name: Any) -> bool:
    # A file listed in a manifest sits in the checkpoint directory itself: no path, no "..".
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def _is_file_entry(info: Any) -> bool:
    return (
        isinstance(info, dict)
        and _is_int(info.get("size"))
        and info["size"] >= 0
        and isinstance(info.get("crc32"), str)
        and re.fullmatch(r"[0-9a-f]{8}", info["crc32"]) is not None
    )


# Every field of a format-1 manifest: (name, required, check, what is expected). distkit reads the
# required ones; the others describe the checkpoint and are checked when present, since a value of
# the wrong type means the file is not what distkit wrote.
_MANIFEST_FIELDS: tuple[tuple[str, bool, Callable[[Any], bool], str], ...] = (
    ("step", True, lambda v: v is None or (_is_int(v) and v >= 0), "an integer >= 0 or null"),
    (
        "files",
        True,
        lambda v: (
            isinstance(v, dict)
            and _STATE_FILE in v
            and all(_is_plain_name(k) and _is_file_entry(i) for k, i in v.items())
        ),
        f'an object naming {_STATE_FILE} and other plain file names, each {{"size": <int >= 0>, '
        f'"crc32": <8 hex digits>}}',
    ),
    (
        "metrics",
        False,
        lambda v: isinstance(v, dict) and all(_is_number(x) for x in v.values()),
        "an object of numbers",
    ),
    (
        "keys",
        False,
        lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v),
        "a list of strings",
    ),
    ("world_size", False, lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    ("torch_version", False, lambda v: isinstance(v, str), "a string"),
    ("distkit_version", False, lambda v: isinstance(v, str), "a string"),
    ("created_unix", False, _is_number, "a number"),
)


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _parse_manifest(path: str, raw: bytes) -> dict[str, Any]:
    """The manifest in ``raw``, checked field by field; anything malformed is a CheckpointCorruptError."""

    def malformed(why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(path, f"its {_MANIFEST_FILE} {why}")

    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise malformed(f"is not valid JSON ({err})") from err
    if not isinstance(manifest, dict):
        raise malformed(f"holds a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != _FORMAT:
        raise malformed(
            f"has format {_shown(manifest.get('format'))}, not {_FORMAT!r}: it is not a distkit manifest"
        )
    version = manifest.get("format_version")
    if not _is_int(version) or version < 1:
        raise malformed(f"has format_version {_shown(version)}; expected an integer >= 1")
    if version > _FORMAT_VERSION:
        from distkit import __version__

        raise DistkitError(
            f"checkpoint {path} has format_version {version} (its {_MANIFEST_FILE} says so), but this "
            f"distkit ({__version__}) reads format_version {_FORMAT_VERSION} only: it was written by a "
            f"newer distkit. Upgrade distkit (pip install -U distkit) to load it."
        )
    for name, required, check, expected in _MANIFEST_FIELDS:
        if name not in manifest:
            if required:
                raise malformed(f"has no {name!r} field")
            continue
        if not check(manifest[name]):
            raise malformed(f"has {name} {_shown(manifest[name])}; expected {expected}")
    return manifest


def _read_manifest(storage: _Storage, path: str) -> dict[str, Any]:
    raw = storage.read_manifest(path)
    if raw is not None:
        return _parse_manifest(path, raw)
    kind = storage.kind(path)
    if kind is None:
        raise FileNotFoundError(
            errno.ENOENT,
            f"checkpoint not found: {path} does not exist. Check the path; "
            f"CheckpointManager(directory).latest() gives the newest checkpoint of a directory",
        )
    if kind == "file":
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"{path} is a file, not a checkpoint directory: a distkit checkpoint is a directory "
            f"holding {_STATE_FILE} and {_MANIFEST_FILE}. Pass that directory (a file written by "
            f"torch.save loads with torch.load(path, weights_only=True))",
        )
    raise CheckpointCorruptError(path, f"it has no {_MANIFEST_FILE} (a save that did not finish)")


def _verify(storage: _Storage, path: str, *, checksums: bool) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` once its files match it; sizes only if not ``checksums``.

    Raises:
        CheckpointCorruptError: The manifest is malformed, or a file is missing, not a regular file,
            or does not match it.
        DistkitError: The manifest has a newer format version.
        FileNotFoundError: Nothing is at ``path``.
    """
    manifest = _read_manifest(storage, path)
    for name, info in manifest["files"].items():
        file = _join(path, name)
        size = storage.size(path, file)
        if size is None:
            raise CheckpointCorruptError(path, f"{name} is missing")
        if size != info["size"]:
            raise CheckpointCorruptError(
                path, f"{file} is {size} bytes, the manifest says {info['size']} (truncated or overwritten)"
            )
        if checksums:
            _check_crc(path, name, info, storage.crc32(path, file))
    return manifest


def _check_crc(path: str, name: str, info: Mapping[str, Any], crc: int) -> None:
    if f"{crc:08x}" != info["crc32"]:
        raise CheckpointCorruptError(
            path,
            f"{_join(path, name)} has CRC32 {crc:08x}, the manifest says {info['crc32']} "
            f"(the file is damaged)",
        )


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
            f"refused to load {_join(path, _STATE_FILE)}: it holds objects that torch.load("
            f"weights_only=True) does not allow ({detail}). distkit never unpickles arbitrary "
            f"objects, because unpickling can run code. If you made this file and trust it, allow "
            f"its types with torch.serialization.add_safe_globals([...])."
        ) from failure
    if failure is not None:
        raise failure
    if not isinstance(loaded, dict):
        raise CheckpointCorruptError(path, f"{_STATE_FILE} holds a {type(loaded).__name__}, not a dict")
    return loaded, manifest


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
        inner.load_state_dict(saved, strict=strict)
    except RuntimeError as err:
        raise DistkitError(f"could not restore state[{name!r}] into {type(inner).__name__}: {err}") from err


def _restore(path: str, loaded: Mapping[str, Any], state: Mapping[str, Any], strict: bool) -> None:
    missing = [key for key in state if key not in loaded]
    if missing and strict:
        raise DistkitError(
            f"checkpoint {path} has no entries {missing}; it holds {sorted(loaded)}. Rename the keys "
            f"of state to match, or pass strict=False to skip the missing ones."
        )
    if missing:
        warnings.warn(
            f"{_label()} checkpoint {path} has no entries {missing}; they were left as they are.",
            stacklevel=3,
        )
    for key, target in list(state.items()):
        if key not in loaded:
            continue
        value = loaded[key]
        if isinstance(target, nn.Module):
            _load_module(key, target, value, strict)
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
# One writer per checkpoint directory: a kernel lock beside a local directory, a lease inside a remote one.


def _job_of_this_process() -> str | None:
    jobs = []
    if slurm := os.environ.get("SLURM_JOB_ID"):
        jobs.append(f"SLURM job {slurm}")
    if run := os.environ.get("TORCHELASTIC_RUN_ID"):
        jobs.append(f"torchelastic run {run}")
    return ", ".join(jobs) or None


def _holder_of_this_process(directory: str, owner: str | None = None) -> dict[str, Any]:
    now = time.time()
    holder: dict[str, Any] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now)),
        "since_unix": now,
        "directory": directory,
    }
    if job := _job_of_this_process():
        holder["job"] = job
    if owner is not None:
        holder["owner"] = owner
    return holder


def _describe_holder(holder: Mapping[str, Any] | None) -> str:
    if not holder:
        return "a process that has not written its name yet (it took the lock a moment ago)"
    text = (
        f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
        f"writing since {holder.get('since', '?')}"
    )
    if holder.get("job"):
        text += f" ({holder['job']})"
    return text


def _parse_holder(raw: bytes | None) -> dict[str, Any] | None:
    try:
        holder = json.loads(raw) if raw else None
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


_unlocked_warned: set[str] = set()


class _LocalWriterLock:
    """An exclusive ``flock`` on ``<directory>.distkit-lock``, held while the manager writes there.

    The kernel releases a ``flock`` when its holder dies, however it dies, so a SIGKILLed job never
    leaves a stale lock. Each lock opens the file itself: ``flock`` locks belong to an open file
    description, so two managers in one process conflict like two processes do. The holder writes
    its host, pid, start time and job id into the file, for the error that refuses the next writer.
    The file stays when released (deleting a lock file races with a process that just opened it).
    """

    def __init__(self, directory: str, file_mode: int) -> None:
        self.directory = directory
        self.path = os.path.normpath(os.path.abspath(directory)) + _LOCK_SUFFIX
        self.file_mode = file_mode
        self.fd: int | None = None
        self.pid = os.getpid()  # the holder; a forked child inherits the descriptor, not the lock

    def acquire(self) -> None:
        """Take the lock, or raise :class:`CheckpointConflictError` naming its holder. Idempotent."""
        if self.fd is not None:
            return
        for attempt in range(2):
            fd = self._open()
            if fd is None:
                return  # no lock possible here; warned
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                # EWOULDBLOCK is the usual answer to a held lock; some filesystems say EACCES.
                held = err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
                holder = self._holder(fd) if held else None
                os.close(fd)
                if not held:
                    self._warn_unlocked(f"flock failed: {err}")
                    return
                if attempt == 0 and holder and holder.get("pid") == os.getpid():
                    # An unreachable manager of this process that the cycle collector has not freed
                    # yet: collecting it releases its lock. A live one keeps holding it.
                    gc.collect()
                    continue
                raise CheckpointConflictError(
                    f"another writer holds the checkpoint directory {self.directory}: "
                    f"{_describe_holder(holder)} (lock {self.path}). Two writers in one directory "
                    f"delete each other's checkpoints. Stop that job, or write to another directory; "
                    f"in one process, close() the other CheckpointManager first (or share one). The "
                    f"lock is released when its holder exits or dies, even when killed (on NFS, once "
                    f"the server notices a crashed client).",
                    directory=self.directory,
                    holder=holder,
                    label=_label(),
                ) from err
            info = json.dumps(_holder_of_this_process(self.directory)).encode()
            with contextlib.suppress(OSError):  # the name is for error messages only
                os.ftruncate(fd, 0)
                os.pwrite(fd, info, 0)
            self.fd, self.pid = fd, os.getpid()
            return

    def _open(self) -> int | None:
        if fcntl is None:  # pragma: no cover - Windows
            self._warn_unlocked("this platform has no flock")
            return None
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
            return os.open(self.path, flags, self.file_mode)
        except OSError as err:
            self._warn_unlocked(f"cannot open {self.path}: {err}")
            return None

    def _holder(self, fd: int) -> dict[str, Any] | None:
        # A holder writes its name right after taking the lock: wait a moment for it (at most 0.5 s).
        for _ in range(25):
            try:
                holder = _parse_holder(os.pread(fd, 1 << 16, 0))
            except OSError:
                return None
            if holder is not None:
                return holder
            time.sleep(0.02)
        return None

    def _warn_unlocked(self, why: str) -> None:
        # Never a refusal: a filesystem without locks must not stop a job. Warned once per directory.
        if self.path in _unlocked_warned:
            return
        _unlocked_warned.add(self.path)
        warnings.warn(
            f"{_label()} cannot lock the checkpoint directory {self.directory} ({why}); saving "
            f"without the writer lock, so a second job writing there would not be detected.",
            stacklevel=5,
        )

    def check(self) -> None:
        """Nothing to check: the kernel holds the lock for as long as this process lives."""

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        if os.getpid() != self.pid:
            # A forked child (a DataLoader worker) dropping its copy of the manager: the lock is
            # the parent's, since the two share the open file description. Close the copy only.
            os.close(fd)
            return
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        # LOCK_UN releases the lock even if a forked child still shares the open file description.
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class _RemoteWriterLease:
    """A lease object ``<directory>/.distkit-writer.json`` naming the manager that writes there.

    Object stores offer no lock that dies with its holder, and a writer cannot tell a live holder
    from a dead one (a requeued job must never be refused because its killed predecessor left a
    lease). So the newest writer takes the lease over, with a warning naming the previous one, and a
    writer checks that the lease still names it before it un-commits anything and again before each
    commit: a writer that was taken over stops with :class:`CheckpointConflictError` naming the new
    one, instead of committing or deleting checkpoints in a directory that is no longer its own.
    This detects two writers; it does not exclude them (a check and the put after it are not atomic).
    """

    def __init__(self, storage: _RemoteStorage, directory: str) -> None:
        self.fs = storage.fs
        self.directory = directory
        self.path = _join(directory, _LEASE_FILE)
        self.owner = uuid.uuid4().hex
        self.held = False
        self.pid = os.getpid()

    def _read(self) -> dict[str, Any] | None:
        try:
            return _parse_holder(bytes(self.fs.cat_file(self.path)))
        except FileNotFoundError:
            return None

    def acquire(self) -> None:
        if self.held:
            return
        previous = self._read()
        if previous is not None:
            warnings.warn(
                f"{_label()} the checkpoint directory {self.directory} has a writer lease of "
                f"{_describe_holder(previous)}; taking it over. An object store cannot tell a live "
                f"writer from a dead one, so the newest writer wins: if that job still runs, its next "
                f"save stops with CheckpointConflictError.",
                stacklevel=5,
            )
        self.fs.pipe_file(self.path, json.dumps(_holder_of_this_process(self.directory, self.owner)).encode())
        self.held, self.pid = True, os.getpid()

    def check(self) -> None:
        """Raise :class:`CheckpointConflictError` if another writer took the lease over."""
        if not self.held:
            return
        current = self._read()
        if current is None:
            # Deleted by hand, not taken over (a new writer always writes one): hold it again.
            self.fs.pipe_file(
                self.path, json.dumps(_holder_of_this_process(self.directory, self.owner)).encode()
            )
            return
        if current.get("owner") != self.owner:
            raise CheckpointConflictError(
                f"another writer took over the checkpoint directory {self.directory}: "
                f"{_describe_holder(current)} (lease {self.path}). This manager stopped before "
                f"committing, so it changes nothing there any more. Two writers in one directory "
                f"delete each other's checkpoints: stop one job, or give each its own directory.",
                directory=self.directory,
                holder=current,
                label=_label(),
            )

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if os.getpid() != self.pid:
            return  # a forked child's copy: the lease is the parent's
        with contextlib.suppress(Exception):  # best effort: also runs at interpreter exit
            current = self._read()
            if current is not None and current.get("owner") == self.owner:
                self.fs.rm_file(self.path)


def _writer_lock_for(
    storage: _Storage, directory: str, file_mode: int
) -> _LocalWriterLock | _RemoteWriterLease:
    if isinstance(storage, _RemoteStorage):
        return _RemoteWriterLease(storage, directory)
    return _LocalWriterLock(directory, file_mode)


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
                f"distkit: {_label()} the background save of step {pending.step} to {pending.path} "
                f"failed: {type(pending.error).__name__}: {pending.error}",
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
                f"checkpoint directory {self.directory}", self.timeout_s, action="claiming", verb="claim"
            )
            if multi
            else None
        )
        if handshake is not None and runtime.get_rank() != 0:
            handshake.settle_other()
            self._claimed = True
            return
        error: BaseException | None = None
        try:
            self._claim_here(resuming)
        except BaseException as err:
            error = err
            raise
        finally:
            if handshake is not None:
                handshake.publish(error)
                handshake.settle_main()
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
                    f"the checkpoint directory {self.directory} already holds committed checkpoints "
                    f"(steps {_shown_steps(committed)}) that this run did not resume from. A new run "
                    f"writing there would inherit or destroy them (retention deletes by step, and a "
                    f"later resume would continue the old run). Either resume that run "
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
            if not entry.leftover and not entry.holds_only_own_files:
                self._warn_kept(entry, f"it holds files distkit did not write ({self._foreign(entry)})")
                continue
            try:
                self._storage.remove(entry.path)
            except FileNotFoundError:
                continue
            except OSError as err:
                raise DistkitError(
                    f"{_label()} overwrite=True could not delete {entry.path}: {type(err).__name__}: "
                    f"{err}. Nothing was saved; delete it by hand (or fix its permissions) and start "
                    f"again."
                ) from err
            if entry.committed:
                deleted.append(entry.step)
        if deleted:
            warnings.warn(
                f"{_label()} overwrite=True: deleted the checkpoints of steps "
                f"{_shown_steps(sorted(deleted))} in {self.directory} before this run's first save.",
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
            )
            if runtime.get_rank() == 0:
                self._retain(step)
            return path
        _check_state(state)
        multi = runtime.get_world_size() > 1
        handshake = _Handshake(f"checkpoint {path}", self.timeout_s) if multi else None
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
                    f"{_label()} the background save of step {pending.step} to {pending.path} is still "
                    f"running after {self.timeout_s:g} s; raise timeout_s if saves legitimately take "
                    f"this long.",
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
                f"{_label()} the background save of step {pending.step} to {pending.path} failed: "
                f"{type(pending.error).__name__}: {pending.error}"
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
                    f"{_label()} skipping corrupt checkpoint {entry.path}: {err.reason}.", stacklevel=3
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
                    f"{_label()} skipping partial checkpoint {entry.path}: it has no {_MANIFEST_FILE} "
                    f"(a save that did not finish).",
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
                f"{_label()} restoring from {self.directory} failed on rank(s) {sorted(failed)}: "
                + "; ".join(f"rank {rank}: {error}" for rank, error in failed.items())
            )
        chosen = [step for step, _ in outcomes]
        if len(set(chosen)) > 1:
            raise DistkitError(
                f"{_label()} ranks restored different checkpoints from {self.directory}: "
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
                    f"{_label()} skipping corrupt checkpoint {entry.path}: {err.reason}.", stacklevel=3
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
                f"{_label()} retention after saving step {just_saved} in {self.directory} failed: "
                f"{type(err).__name__}: {err}. The new checkpoint is committed; older ones were not "
                f"deleted this time.",
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
            if not entry.leftover and not entry.holds_only_own_files:
                self._warn_kept(entry, f"it also holds files distkit did not write ({self._foreign(entry)})")
                continue
            try:
                self._storage.remove(entry.path)
            except FileNotFoundError:
                continue
            except OSError as err:
                warnings.warn(
                    f"{_label()} retention could not delete {entry.path}: {err}. The new checkpoint "
                    f"is committed; delete the old one by hand to free the space.",
                    stacklevel=4,
                )

    @staticmethod
    def _foreign(entry: _Entry) -> str:
        return ", ".join(sorted(entry.files - _OWN_FILES)[:5])

    def _warn_kept(self, entry: _Entry, why: str) -> None:
        # Once per checkpoint and manager: the same reason at every save would bury the log.
        if entry.path in self._kept_warned:
            return
        self._kept_warned.add(entry.path)
        warnings.warn(
            f"{_label()} retention keeps {entry.path}: {why}. distkit never deletes what it cannot "
            f"read or did not write; look at it, and delete it by hand if it is not needed.",
            stacklevel=5,
        )

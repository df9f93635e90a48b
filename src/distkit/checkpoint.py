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

__all__ = [
    "DEFAULT_FILE_MODE",
    "DEFAULT_SAVE_TIMEOUT_S",
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


# --------------------------------------------------------------------------------------------------
# Where checkpoints live: a local directory or an fsspec URL.


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if "://" in base else os.path.join(base, name)


def _dir_mode(file_mode: int) -> int:
    # Directories need the execute bit wherever their files are readable.
    return file_mode | ((file_mode & 0o444) >> 2)


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

    def read_manifest(self, path: str) -> bytes | None:
        try:
            with open(os.path.join(path, _MANIFEST_FILE), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def size(self, path: str) -> int | None:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None

    def crc32(self, path: str) -> int:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            return _crc32_of_fd(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def open_state(self, path: str, files: Mapping[str, Any]) -> tuple[Any, Callable[[], dict[str, int]]]:
        # torch.load and the checksums each read the file: from the page cache for the second one.
        # Only a rewrite in place could make them see different bytes, and distkit never rewrites a
        # checkpoint in place (a new save replaces the whole directory).
        return os.path.join(path, _STATE_FILE), lambda: {n: self.crc32(os.path.join(path, n)) for n in files}

    def write_checkpoint(
        self, target: str, payload: Mapping[str, Any], manifest: Callable[[dict[str, Any]], bytes], mode: int
    ) -> None:
        target = os.path.abspath(target)
        if os.path.lexists(target) and not os.path.isdir(target):
            raise FileExistsError(
                f"{target} exists and is a file, not a checkpoint directory; choose another path."
            )
        _check_replaceable(target, self.contents(target))
        parent = os.path.dirname(target)
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=temp_name(Path(target)), dir=parent)
        try:
            info = self._write_state(os.path.join(staging, _STATE_FILE), mode, payload)
            self._write_manifest(os.path.join(staging, _MANIFEST_FILE), mode, manifest(info))
            os.chmod(staging, _dir_mode(mode))
            fsync_dir(staging)
            self._move_into_place(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
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
        # half-written one under the real name.
        retired = os.path.join(parent, temp_name(Path(target)) + "old-" + uuid.uuid4().hex[:8])
        os.replace(target, retired)
        os.replace(staging, target)
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
            files = self.fs.find(directory, maxdepth=2, withdirs=False)
        except FileNotFoundError:
            return {}
        for file in files:
            relative = self.fs._strip_protocol(file)[len(root) :].strip("/")
            parts = relative.split("/")
            if len(parts) == 2:
                out.setdefault(parts[0], set()).add(parts[1])
        return out

    def contents(self, path: str) -> set[str] | None:
        try:
            return {name.rstrip("/").rpartition("/")[2] for name in self.fs.ls(path, detail=False)}
        except FileNotFoundError:
            return None

    def read_manifest(self, path: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(_join(path, _MANIFEST_FILE)))
        except FileNotFoundError:
            return None

    def size(self, path: str) -> int | None:
        try:
            return int(self.fs.size(path))
        except FileNotFoundError:
            return None

    def crc32(self, path: str) -> int:
        crc = 0
        with self.fs.open(path, "rb") as f:
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
        self, target: str, payload: Mapping[str, Any], manifest: Callable[[dict[str, Any]], bytes], mode: int
    ) -> None:
        del mode  # object stores have no POSIX permission bits; access is the bucket's policy
        _check_replaceable(target, self.contents(target))
        manifest_path = _join(target, _MANIFEST_FILE)
        if self.fs.exists(manifest_path):
            self.fs.rm_file(manifest_path)  # un-commit before overwriting the state
        with self.fs.open(_join(target, _STATE_FILE), "wb") as f:
            info = _serialize(payload, f.write, checksum=True)
        self.fs.pipe_file(manifest_path, manifest(info))

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
    """

    def __init__(self, write: Callable[[Any], Any], *, checksum: bool) -> None:
        self._write = write
        self._checksum = checksum
        self._pending = bytearray()
        self.crc = 0
        self.size = 0

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
            self._write(view)
            return n
        # The view points into the tensor's memory, valid until this call returns: both finish here.
        crc = self.crc
        self.crc, _ = _run_beside(lambda: zlib.crc32(view, crc), lambda: self._write(view))
        return n

    def flush(self) -> None:
        if self._pending:
            if self._checksum:
                self.crc = zlib.crc32(self._pending, self.crc)
            self._write(self._pending)
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
    finally:
        sink.close()
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

    def __init__(self, what: str, timeout_s: float) -> None:
        self.store = runtime._store()
        assert runtime._runtime is not None  # _store() ensured it
        self.key = f"checkpoint/{runtime._runtime.next_id('checkpoint')}"
        self.what = what
        self.timeout_s = timeout_s
        self._outcome: dict[str, str] | None = None

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
                        f"commit {self.what}: {err}. Rank 0 has probably died; see its log."
                    ) from err
                raise CollectiveTimeoutError(
                    f"{_label()} waited {self.timeout_s:g} s for rank 0 to commit {self.what}; it did "
                    f"not report. Rank 0 is stuck or its storage is very slow; raise timeout_s if "
                    f"saves legitimately take this long.",
                    missing_ranks=[0],
                    timeout_s=self.timeout_s,
                ) from err
            outcome = json.loads(self.store.get(self.key))
            self._cleanup()
        if outcome:
            raise MainProcessError(
                f"{_label()} saving {self.what} failed on the main process (rank 0): "
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
        MainProcessError: On ranks other than 0, when rank 0 failed to save.
        CollectiveTimeoutError: Rank 0 did not report within ``timeout_s``.

    Example:
        >>> import torch, distkit
        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> _ = distkit.save_checkpoint("/tmp/ckpt_example", {"model": model, "optimizer": opt}, step=0)
    """
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
            target, payload, _manifest_builder(step, metrics_json, list(payload)), file_mode
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


def _read_manifest(storage: _Storage, path: str) -> dict[str, Any]:
    raw = storage.read_manifest(path)
    if raw is None:
        raise CheckpointCorruptError(path, f"it has no {_MANIFEST_FILE} (a save that did not finish)")
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        if manifest.get("format") != _FORMAT or not isinstance(files, dict):
            raise ValueError("not a distkit manifest")
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointCorruptError(path, f"{_MANIFEST_FILE} is unreadable ({err})") from err
    return manifest


def _verify(storage: _Storage, path: str, *, checksums: bool) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` once its files match it; sizes only if not ``checksums``."""
    manifest = _read_manifest(storage, path)
    for name, info in manifest["files"].items():
        file = _join(path, name)
        size = storage.size(file)
        if size is None:
            raise CheckpointCorruptError(path, f"{name} is missing")
        if size != info["size"]:
            raise CheckpointCorruptError(
                path, f"{file} is {size} bytes, the manifest says {info['size']} (truncated or overwritten)"
            )
        if checksums:
            _check_crc(path, name, info, storage.crc32(file))
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
    if _STATE_FILE not in files:
        raise CheckpointCorruptError(path, f"its manifest lists no {_STATE_FILE}")
    source, checksums = storage.open_state(path, files)

    # The weights-only unpickler cannot run code whatever the bytes, so it runs while another thread
    # computes the checksums (loads take about as long as torch.load alone); nothing is returned or
    # restored into the caller's objects unless every checksum matches.
    def load() -> tuple[Any, Exception | None]:
        try:
            return torch.load(source, map_location=_map_location(map_location), weights_only=True), None
        except Exception as err:
            return None, err

    actual, (loaded, failure) = _run_beside(checksums, load)
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
        CheckpointCorruptError: The manifest is missing, or a file's size or checksum does not match
            it (names the file).
        DistkitError: The file holds objects ``weights_only`` refuses, or an entry does not fit its
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


class CheckpointManager:
    """A directory of step checkpoints: atomic saves, retention, ``latest()``, ``best()``, resume.

    Each save is a checkpoint directory ``step_<9 digits>`` inside ``directory`` (local or fsspec
    URL), written with :func:`save_checkpoint`'s protocol. Retention runs on rank 0 only after the new
    checkpoint is committed, so the last good one is never lost: it keeps the ``keep_last`` newest
    checkpoints that verify, the ``keep_best`` best by ``monitor``, and the one just saved; it
    removes the others and the leftovers of saves that were killed. One process writes to a
    directory at a time.

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
        timeout_s: How long ranks other than 0 wait for rank 0 to commit a save
            (default :data:`DEFAULT_SAVE_TIMEOUT_S`).

    Example:
        >>> import torch
        >>> from distkit import CheckpointManager
        >>> model = torch.nn.Linear(2, 2)
        >>> manager = CheckpointManager("/tmp/ckpts_example", keep_last=2)
        >>> _ = manager.save(100, {"model": model})
        >>> manager.restore({"model": model})
        100
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

    # ---- saving

    def save(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, float] | None = None) -> str:
        """Save ``state`` as the checkpoint of ``step``, then apply retention.

        Collective: call on every rank. Without a process group the one process saves. A save of a
        step that already exists replaces it.

        Args:
            step: Training step (integer >= 0); it names the checkpoint and orders ``latest()``.
            state: Names to objects, as for :func:`save_checkpoint`.
            metrics: Numbers for the manifest and for ``best()`` (already reduced across ranks).
                When given with a ``monitor``, they must contain it.

        Returns:
            The checkpoint's path (in async mode: where it will be committed).

        Raises:
            DistkitError: The previous background save failed (async mode).
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
        path = self.path_for(step)
        if not self.async_save:
            save_checkpoint(
                path,
                state,
                step=step,
                metrics=metrics_json,
                file_mode=self.file_mode,
                timeout_s=self.timeout_s,
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
            self._storage.write_checkpoint(pending.path, snapshot, manifest, self.file_mode)
            self._retain(pending.step)
        except BaseException as err:
            pending.error = err
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
            >>> manager = CheckpointManager("/tmp/ckpts_example", async_save=True)
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
                committed = _MANIFEST_FILE in files
            elif match := _LEFTOVER_RE.match(name):
                committed = False
            else:
                continue
            entries.append(_Entry(int(match.group(1)), _join(self.directory, name), committed))
        return sorted(entries, key=lambda e: (e.step, e.committed), reverse=True)

    def _first_that_verifies(self, candidates: list[_Entry], entries: list[_Entry]) -> _Entry | None:
        in_flight = self._pending.step if self._pending is not None else None
        for entry in candidates:
            try:
                _verify(self._storage, entry.path, checksums=True)
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
        warning naming them. Does not wait for a save in flight.

        Example:
            >>> manager.latest()  # doctest: +SKIP
            '/tmp/ckpts_example/step_000000100'
        """
        entries = self._entries()
        found = self._first_that_verifies([e for e in entries if e.committed], entries)
        return None if found is None else found.path

    def best(self) -> str | None:
        """The committed checkpoint with the best ``monitor`` value that verifies, or ``None``.

        Local: no communication. Ties go to the later step; checkpoints saved without the metric
        do not compete. Corrupt ones are skipped with a warning.

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
                value = _read_manifest(self._storage, entry.path)["metrics"].get(self.monitor)
            except (CheckpointCorruptError, AttributeError):
                continue
            if isinstance(value, (int, float)) and not math.isnan(value):
                scored.append((value if self.mode == "min" else -value, -entry.step, entry))
        return [entry for *_, entry in sorted(scored, key=lambda s: s[:2])]

    # ---- resuming

    def restore(self, state: Mapping[str, Any], *, strict: bool = True) -> int | None:
        """Load the newest checkpoint that verifies into ``state``; return its step, or ``None``.

        Collective: call on every rank; they load the same step (checked) onto their own devices.
        Without a process group the one process loads. Corrupt and partial checkpoints are skipped
        with a warning, falling back to the next older one. Waits for a save in flight first.

        Args:
            state: Names to objects, as for :func:`load_checkpoint`.
            strict: As for :func:`load_checkpoint`.

        Returns:
            The restored step, or ``None`` when there is no usable checkpoint (a fresh start).

        Raises:
            DistkitError: Restoring failed on another rank (this rank re-raises its own error), or
                ranks restored different steps (the directory changed while they read it).

        Example:
            >>> step = manager.restore({"model": model})  # doctest: +SKIP
            >>> start = 0 if step is None else step + 1  # doctest: +SKIP
        """
        self.wait()
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
            except CheckpointCorruptError as err:
                warnings.warn(
                    f"{_label()} skipping corrupt checkpoint {entry.path}: {err.reason}.", stacklevel=3
                )
                continue
            self._warn_partials(entries, above=entry.step, in_flight=None)
            _restore(entry.path, loaded, state, strict)
            return int(manifest["step"]) if manifest.get("step") is not None else entry.step
        self._warn_partials(entries, above=-1, in_flight=None)
        return None

    # ---- retention (rank 0, after a commit)

    def _retain(self, just_saved: int) -> None:
        valid: list[_Entry] = []
        debris: list[_Entry] = []  # leftovers of killed saves and deletes, and corrupt checkpoints
        for entry in self._entries():
            if entry.committed and entry.step == just_saved:
                valid.append(entry)  # committed a moment ago by this process
                continue
            try:
                if not entry.committed:
                    raise CheckpointCorruptError(entry.path, "partial")
                _verify(self._storage, entry.path, checksums=False)
            except CheckpointCorruptError:
                debris.append(entry)
                continue
            valid.append(entry)
        keep = {just_saved}
        keep.update(e.step for e in (valid if self.keep_last is None else valid[: self.keep_last]))
        if self.keep_best is not None:
            keep.update(e.step for e in self._ranked_by_metric(valid)[: self.keep_best])
        # Surplus checkpoints first (the space retention is for), then the debris.
        for entry in [e for e in valid if e.step not in keep] + debris:
            try:
                self._storage.remove(entry.path)
            except OSError as err:
                warnings.warn(
                    f"{_label()} retention could not delete {entry.path}: {err}. The new checkpoint "
                    f"is committed; delete the old one by hand to free the space.",
                    stacklevel=2,
                )

"""Where checkpoints live and how their files are read and written (private).

A checkpoint directory is local (:class:`_LocalStorage`: staged, fsynced, renamed into place) or an
fsspec URL (:class:`_RemoteStorage`: one put per object, the manifest last, every fsspec call under
a :class:`distkit._utils.secrets.Scrubber` of the URL). Reading opens regular files only, and
:func:`_verify` checks them against their manifest; a failed write is restated with a fix.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import io
import mmap
import os
import shutil
import stat
import tempfile
import uuid
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from distkit._utils.fs import fsync_dir, temp_name
from distkit._utils.secrets import Scrubber, redact_url
from distkit.checkpoint._errors import CheckpointCorruptError
from distkit.checkpoint._foreign import _identify_file, _without_manifest
from distkit.checkpoint._format import (
    _MANIFEST_FILE,
    _MAX_MANIFEST_BYTES,
    _STATE_FILE,
    _STEP_RE,
    _foreign_files,
    _parse_manifest,
    _run_beside,
    _serialize,
)

try:  # POSIX; see _open_regular
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

_READ_CHUNK = 8 << 20

_R = TypeVar("_R")


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
    # A file or directory that vanished while it was written: most often another process saving
    # to the same path at the same time (a second job, or save_checkpoint on two ranks with
    # collective=False); a CheckpointManager takes a lock against that.
    "ENOENT": (
        "a file or directory vanished while it was written; most often another process saves to "
        "the same path at the same time: give each job its own path, or use a CheckpointManager, "
        "whose lock refuses a second writer"
    ),
}


def _write_error(err: OSError, checkpoint: str, where: str, *, untouched: str) -> OSError:
    """``err`` restated with its errno name, the checkpoint, the path being written and a fix.

    The result has the same errno, hence the same ``OSError`` subclass (``FileExistsError``, ...).
    Errors without an errno (some object-store clients) are returned as they are.
    """
    code = err.errno
    if not isinstance(code, int):
        return err
    name = errno.errorcode.get(code)
    if name is None:
        return err
    hint = _WRITE_HINTS.get(name, "check the storage that holds it")
    return OSError(
        code,
        f"{name} ({err.strerror or os.strerror(code)}) while writing checkpoint {redact_url(checkpoint)}, "
        f"at {redact_url(where)}; nothing was committed and {untouched}. Fix: {hint}.",
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
        self.commit_staged(target, self.new_staging(target), payload, manifest, mode)

    def new_staging(self, target: str) -> str:
        """A new, empty staging directory beside ``target`` (the same filesystem, so a rename commits)."""
        target = os.path.abspath(target)
        if os.path.lexists(target) and not os.path.isdir(target):
            raise FileExistsError(
                f"{target} exists and is a file, not a checkpoint directory; choose another path."
            )
        _check_replaceable(target, self.contents(target))
        parent = os.path.dirname(target)
        try:
            os.makedirs(parent, exist_ok=True)
            return tempfile.mkdtemp(prefix=temp_name(Path(target)), dir=parent)
        except OSError as err:
            raise _write_error(
                err, target, parent, untouched="the checkpoints saved before are untouched"
            ) from err

    def commit_staged(
        self,
        target: str,
        staging: str,
        payload: Mapping[str, Any],
        manifest: Callable[[dict[str, Any]], bytes],
        mode: int,
    ) -> None:
        """Write ``state.pt`` and the manifest into ``staging`` (which may hold other files already,
        fsynced), then rename it onto ``target``; on any failure the staging directory is removed."""
        target = os.path.abspath(target)
        where = staging
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
                untouched = "the checkpoints saved before are untouched"
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


def _scrubbed(method: Callable[..., _R]) -> Callable[..., _R]:
    """A :class:`_RemoteStorage` method that runs under the storage's :class:`Scrubber`."""

    @functools.wraps(method)
    def scrubbed(self: _RemoteStorage, *args: Any) -> _R:
        return self.scrub.call(method, self, *args)

    return scrubbed


class _RemoteStorage:
    """fsspec filesystems (object stores): one put per object, the manifest put last.

    Every fsspec call runs under ``scrub`` (:meth:`Scrubber.call`), so the credentials of the
    directory's URL reach neither what fsspec raises nor what it logs meanwhile.
    """

    def __init__(self, fs: Any, scrub: Scrubber) -> None:
        self.fs = fs
        self.scrub = scrub

    @_scrubbed
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

    @_scrubbed
    def contents(self, path: str) -> set[str] | None:
        try:
            return {name.rstrip("/").rpartition("/")[2] for name in self.fs.ls(path, detail=False)}
        except FileNotFoundError:
            return None

    @_scrubbed
    def kind(self, path: str) -> str | None:
        try:
            if self.fs.isdir(path):
                return "dir"
            return "file" if self.fs.exists(path) else None
        except FileNotFoundError:
            return None

    @_scrubbed
    def read_manifest(self, path: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(_join(path, _MANIFEST_FILE)))
        except (FileNotFoundError, NotADirectoryError):
            return None

    @_scrubbed
    def size(self, checkpoint: str, file: str) -> int | None:
        del checkpoint  # object stores hold objects only: no FIFO, device or symlink to refuse
        try:
            return int(self.fs.size(file))
        except FileNotFoundError:
            return None

    @_scrubbed
    def crc32(self, checkpoint: str, file: str) -> int:
        del checkpoint
        crc = 0
        with self.fs.open(file, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                crc = zlib.crc32(chunk, crc)
        return crc

    @_scrubbed
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
        # Each fsspec call scrubbed on its own: the guard's CheckpointConflictError passes as raised.
        call = self.scrub.call
        try:
            if guard is not None:
                guard()  # before un-committing anything: is this directory still ours?
            if call(self.fs.exists, manifest_path):
                call(self.fs.rm_file, manifest_path)  # un-commit before overwriting the state
            where = _join(target, _STATE_FILE)
            info = call(self._put_state, where, payload)
            where = manifest_path
            if guard is not None:
                guard()  # and again right before the commit, which a writer taken over must not make
            call(self.fs.pipe_file, manifest_path, manifest(info))
        except OSError as err:
            explained = _write_error(err, target, where, untouched="the other checkpoints are untouched")
            if explained is not err:
                raise explained from err
            raise

    def _put_state(self, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        with self.fs.open(path, "wb") as f:
            return _serialize(payload, f.write, checksum=True)

    @_scrubbed
    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(_join(path, _MANIFEST_FILE))  # un-commit first
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)


_Storage = _LocalStorage | _RemoteStorage


def _missing_hint(path: str) -> str:
    """What to add when ``path`` does not exist and its kind of storage explains why."""
    if path.startswith("memory://"):
        return (
            " memory:// lives inside one process: what another process saved there (a training job, "
            "a `distkit checkpoint` command) ended with it."
        )
    return ""


def _storage_for(path: str | os.PathLike[str]) -> tuple[_Storage, str]:
    text = os.fsdecode(os.fspath(path))  # bytes too
    if text.startswith("file://"):
        text = text[len("file://") :]
        if not text.startswith(("/", "./", "../", "~")):
            # file://tmp/ckpt reads as the relative path tmp/ckpt (or a host named tmp): a slash short.
            raise ValueError(
                f"{redact_url(os.fsdecode(os.fspath(path)))}: a file:// URL of an absolute path has three "
                f"slashes (file:///{text}); without the third, {text.split('/', 1)[0]!r} reads as a host "
                f"or a relative directory. Pass file:///{text}, or the path itself ({'/' + text})."
            )
    if "://" not in text:
        # "~/runs" as a shell would read it: not a directory named "~" in the working directory.
        return _LocalStorage(), os.path.expanduser(text)
    import fsspec

    protocol = text.split("://", 1)[0]
    # The protocols fsspec ships, and those a program registered (fsspec.register_implementation).
    known = sorted(set(fsspec.available_protocols()) | set(fsspec.registry))
    if protocol not in known:
        # A slip keeps the first letter (s4, s3a, gcs): those are looked at first.
        same = [name for name in known if name[:1] == protocol[:1]]
        close = difflib.get_close_matches(protocol, same, n=1, cutoff=0.5) or difflib.get_close_matches(
            protocol, known, n=1
        )
        hint = f"Did you mean {close[0]}://? " if close else ""
        raise ValueError(
            f"{redact_url(text)}: fsspec knows no protocol {protocol!r}. {hint}A local path needs no "
            f"prefix (or file://); an object store needs its fsspec package (s3fs for s3://, gcsfs "
            f"for gs://)."
        )
    # One per storage, since it compiles a regex: a manager reuses it for every save.
    scrub = Scrubber(None, text)
    fs, _ = scrub.call(fsspec.core.url_to_fs, text)
    return _RemoteStorage(fs, scrub), text.rstrip("/")


def _check_replaceable(target: str, contents: set[str] | None) -> None:
    # Saving over an existing path must never delete someone's unrelated files.
    if contents is None:
        return
    foreign = _foreign_files(contents)
    if foreign:
        raise FileExistsError(
            f"{redact_url(target)} already exists and holds files that are not part of a distkit checkpoint "
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
# Reading back: the manifest, then every file it lists checked against it.


def _read_manifest(storage: _Storage, path: str) -> dict[str, Any]:
    raw = storage.read_manifest(path)
    if raw is not None:
        return _parse_manifest(path, raw)
    kind = storage.kind(path)
    if kind is None:
        raise FileNotFoundError(
            errno.ENOENT,
            f"checkpoint not found: {redact_url(path)} does not exist. Check the path: `distkit "
            f"checkpoint list <directory>` lists a directory's checkpoints, and "
            f"CheckpointManager(directory).latest() gives the newest.{_missing_hint(path)}",
        )
    if kind == "file":
        layout = _identify_file(path) if isinstance(storage, _LocalStorage) else None
        if layout is not None:
            raise layout.error(path)
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"{redact_url(path)} is a file, not a checkpoint directory: a distkit checkpoint is a directory "
            f"holding {_STATE_FILE} and {_MANIFEST_FILE}. Pass that directory (a file written by "
            f"torch.save loads with torch.load(path, weights_only=True))",
        )
    names = storage.contents(path) or set()
    # A Trainer run's default_root_dir: its checkpoints are a CheckpointManager directory inside.
    inner = _join(path, "checkpoints")
    run_checkpoints = (
        (inner, storage.contents(inner) or set())
        if "checkpoints" in names and storage.kind(inner) == "dir"
        else None
    )

    def complete(directory: str, name: str) -> bool:
        return _MANIFEST_FILE in (storage.contents(_join(directory, name)) or set())

    raise _without_manifest(path, names, complete=complete, run_checkpoints=run_checkpoints)


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
                path,
                f"{redact_url(file)} is {size} bytes, the manifest says {info['size']} "
                f"(truncated or overwritten)",
            )
        if checksums:
            _check_crc(path, name, info, storage.crc32(path, file))
    return manifest


def _check_crc(path: str, name: str, info: Mapping[str, Any], crc: int) -> None:
    if f"{crc:08x}" != info["crc32"]:
        raise CheckpointCorruptError(
            path,
            f"{redact_url(_join(path, name))} has CRC32 {crc:08x}, the manifest says {info['crc32']} "
            f"(the file is damaged)",
        )

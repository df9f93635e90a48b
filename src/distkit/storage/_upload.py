"""How :func:`distkit.storage.upload` writes (private); the contract is in :mod:`distkit.storage`.

:func:`_plan_upload` checks the whole source tree before anything is written and returns an
:class:`_Upload`: which local files go to which remote paths. :meth:`_Upload.run` writes them,
opening each without following links, framed by the markers of :mod:`distkit.storage._transfer`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import errno
import functools
import hashlib
import json
import mimetypes
import os
import platform
import posixpath
import stat
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import fsspec

from distkit import coordination, runtime
from distkit._utils.fs import TEMP_MARKER, atomic_open, fd_path, fsync_dir, umask_mode
from distkit._utils.secrets import Scrubber, redact_url
from distkit.errors import DistkitError
from distkit.runtime import _rank_label
from distkit.storage._transfer import (
    _CHUNK,
    _MANIFEST_FORMAT,
    _MANIFEST_VERSION,
    _MARKERS,
    INCOMPLETE_NAME,
    MANIFEST_NAME,
    _check_http_credentials,
    _is_transient,
    _log,
    _problem_lines,
    _protocols,
    _with_retries,
)

__all__ = ["UploadHandle", "upload"]

# Object stores write an object in one atomic put (and a rename there is a copy), so they get a
# direct put; other remote filesystems get a temporary name and a move.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss"})
# At most this many threads hash uploaded files beside the transfer: enough that hashing (OpenSSL's
# SHA-256: roughly 1.5-2 GB/s per core with SHA extensions, published figures) rarely limits an
# upload, few enough not to take the cores of a training job that uploads in the background.
_HASH_THREADS = 2


class UploadHandle:
    """The state of an :func:`upload`: ``done()`` and ``wait(timeout_s)``.

    Every rank gets one; on ranks other than 0, and after a foreground upload, it is already done.

    Attributes:
        source: The local file or directory.
        dest_url: The destination, with passwords and query strings replaced by ``***``.

    Example:
        >>> import distkit
        >>> handle = distkit.upload("results", "s3://bucket/run-1", background=True)  # doctest: +SKIP
        >>> handle.wait(timeout_s=600)  # doctest: +SKIP
    """

    def __init__(self, source: Path, dest_url: str) -> None:
        self.source = source
        self.dest_url = dest_url
        self._finished = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the upload has finished, successfully or not. Local.

        Example:
            >>> handle = distkit.upload("results", "memory://run-1", background=True)  # doctest: +SKIP
            >>> handle.done()  # doctest: +SKIP
            False
        """
        return self._finished.is_set()

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the upload to finish; raise its error if it failed.

        Local: no communication. The upload itself is bounded by the filesystem's own timeouts,
        so ``None`` (no deadline of its own) still ends.

        Args:
            timeout_s: Seconds to wait; ``None`` waits until the upload ends.

        Raises:
            TimeoutError: The upload is still running after ``timeout_s``.
            Exception: What the upload raised, with secrets replaced by ``***``.

        Example:
            >>> handle = distkit.upload("results", "memory://run-1", background=True)  # doctest: +SKIP
            >>> handle.wait(timeout_s=600)  # doctest: +SKIP
        """
        if timeout_s is not None:
            timeout_s = coordination._check_timeout(timeout_s)
        if not self._finished.wait(timeout_s):
            raise TimeoutError(
                f"{_rank_label()} the upload of {self.source} to {self.dest_url} is still running after "
                f"{timeout_s:g} s; call wait() again, or with a larger timeout_s."
            )
        if self._error is not None:
            raise self._error

    def _finish(self, error: BaseException | None = None) -> UploadHandle:
        self._error = error
        self._finished.set()
        return self

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._error is not None else "done"
        return f"UploadHandle(source={str(self.source)!r}, dest_url={self.dest_url!r}, state={state!r})"


# Open an upload's files without following a symlink in the last component; a FIFO swapped in
# must not block the open (it is then refused as not a regular file).
_OPEN_FLAGS = (
    os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
)


@dataclass(frozen=True)
class _UploadFile:
    """One file of an upload, as the tree check saw it."""

    path: Path  # what is opened: the file itself, or the (resolved, in-tree) target of a symlink
    rel: str  # its name inside the upload, with "/": the manifest's key
    remote: str  # where it goes on the destination filesystem
    identity: tuple[int, int]  # (st_dev, st_ino) at the check; what is opened must be this file


@dataclass
class _Upload:
    """A checked upload: which local files go to which remote paths, and how to write them."""

    fs: Any
    source: Path
    files: list[_UploadFile]
    remote_root: str
    remote_dirs: list[str]
    tree: bool  # a directory: framed by the markers, each file hashed for the manifest
    shown: str
    scrub: Scrubber
    kind: str = field(init=False)  # "local", "object" (one atomic put) or "renamed" (put, then move)

    def __post_init__(self) -> None:
        protocols = set(_protocols(self.fs))
        if protocols & {"file", "local"}:
            self.kind = "local"
        elif protocols & _OBJECT_STORES:
            self.kind = "object"
        else:
            self.kind = "renamed"

    def run(self) -> None:
        started = time.monotonic()
        mode = umask_mode(0o666)  # what open() would give: the process umask decides
        self._make_dirs()
        if self.tree:
            # Marked partial before any file changes, and the manifest of an earlier upload to the
            # same place removed: from here until the new manifest, a reader sees a partial tree.
            self._write_marker(INCOMPLETE_NAME, _marker_json(started=_now()), mode)
            self._remove_marker(MANIFEST_NAME)
        # Only a tree's files are hashed (for its manifest), on threads beside the transfer.
        hasher = (
            concurrent.futures.ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="distkit-upload-hash")
            if self.tree
            else None
        )
        try:
            if self.kind == "local":
                entries = self._write_local(hasher, mode)
            elif self.kind == "object" and getattr(self.fs, "async_impl", False):
                entries = self._put_concurrently(hasher)
            else:
                entries = self._put_each(hasher)
        finally:
            if hasher is not None:
                hasher.shutdown(wait=True)
        if self.tree:
            files = {rel: {"size": size, "sha256": sha256} for rel, (size, sha256) in sorted(entries.items())}
            self._write_marker(MANIFEST_NAME, _marker_json(created=_now(), files=files), mode)
            self._remove_marker(INCOMPLETE_NAME)
        size = sum(size for size, _ in entries.values())
        _log().info(
            "uploaded %d file%s (%d bytes) to %s in %.2f s",
            len(self.files),
            "" if len(self.files) == 1 else "s",
            size,
            self.shown,
            time.monotonic() - started,
        )

    # -- reading the source safely

    def _open(self, item: _UploadFile) -> tuple[int, os.stat_result]:
        """Open ``item`` and check it is the regular file the tree check saw; never follow a link."""
        try:
            fd = os.open(item.path, _OPEN_FLAGS)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EMLINK):  # EMLINK: FreeBSD's O_NOFOLLOW answer
                reason = "it was replaced by a symbolic link"
            elif err.errno == errno.ENOENT:
                reason = "it was removed"
            else:
                reason = f"it can no longer be opened ({err.strerror})"
            raise self._changed(item, reason) from err
        before = os.fstat(fd)
        if stat.S_ISREG(before.st_mode) and (before.st_dev, before.st_ino) == item.identity:
            return fd, before
        os.close(fd)
        what = "another file" if stat.S_ISREG(before.st_mode) else "something that is not a regular file"
        raise self._changed(item, f"it was replaced by {what}")

    def _check_unchanged(self, item: _UploadFile, fd: int, before: os.stat_result, read: int | None) -> None:
        """Raise if ``item`` was written to since it was opened (``read``: the bytes read of it)."""
        after = os.fstat(fd)
        read_other = read is not None and read != before.st_size
        if read_other or (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise self._changed(item, "it was written to while it was being uploaded")

    def _changed(self, item: _UploadFile, reason: str) -> DistkitError:
        partial = (
            f" The destination is marked partial by {INCOMPLETE_NAME} and has no {MANIFEST_NAME}."
            if self.tree
            else ""
        )
        return DistkitError(
            f"{_rank_label()} upload of {self.source} to {self.shown} stopped at {item.rel}: {reason} after "
            f"the tree was checked; nothing is read through a changed entry.{partial} Upload again "
            f"once nothing writes to the source any more."
        )

    # -- writing

    def _write_local(
        self, hasher: concurrent.futures.Executor | None, mode: int
    ) -> dict[str, tuple[int, str | None]]:
        entries: dict[str, tuple[int, str | None]] = {}
        for item in self.files:
            os.makedirs(os.path.dirname(item.remote) or ".", exist_ok=True)
            fd, before = self._open(item)
            try:
                with atomic_open(item.remote, mode=mode) as out:
                    size, sha256 = _copy_fd(fd, out, hasher)
                    self._check_unchanged(item, fd, before, size)  # inside: a change commits nothing
            finally:
                os.close(fd)
            entries[item.rel] = (size, sha256)
        return entries

    def _put_options(self, item: _UploadFile) -> dict[str, Any]:
        # s3fs names an object's Content-Type after the local file's name, which is /proc/self/fd/N
        # here: name it after the real one, as s3fs would have.
        if {"s3", "s3a"} & set(_protocols(self.fs)):
            content_type, _ = mimetypes.guess_type(item.rel)
            if content_type is not None:
                return {"ContentType": content_type}
        return {}

    def _put_concurrently(
        self, hasher: concurrent.futures.Executor | None
    ) -> dict[str, tuple[int, str | None]]:
        """Async object stores: the puts run concurrently, as ``fs.put`` would run them."""
        fs = self.fs
        entries: dict[str, tuple[int, str | None]] = {}
        remaining = list(self.files)

        async def put_one(item: _UploadFile, gate: asyncio.Semaphore) -> tuple[int, str | None]:
            async with gate:
                fd, before = self._open(item)
                try:
                    loop = asyncio.get_running_loop()
                    hashing = loop.run_in_executor(hasher, _sha256_fd, fd) if hasher is not None else None
                    try:
                        await fs._put_file(fd_path(fd), item.remote, **self._put_options(item))
                    finally:
                        hashed = await hashing if hashing is not None else None  # before fd closes
                    self._check_unchanged(item, fd, before, hashed[0] if hashed else None)
                    return hashed if hashed is not None else (before.st_size, None)
                finally:
                    os.close(fd)

        async def put_all(items: list[_UploadFile]) -> list[Any]:
            gate = asyncio.Semaphore(_concurrency(fs, len(items)))
            return await asyncio.gather(*(put_one(item, gate) for item in items), return_exceptions=True)

        def attempt() -> None:
            # A retry sends only the files that failed.
            results = fsspec.asyn.sync(fs.loop, put_all, list(remaining))
            failures = []
            for item, result in zip(list(remaining), results, strict=True):
                if isinstance(result, BaseException):
                    failures.append((item, result))
                else:
                    entries[item.rel] = result
            remaining[:] = [item for item, _ in failures]
            if failures:
                errors = [error for _, error in failures]
                # Retried only when every failure is worth retrying; a changed file ends the upload.
                raise next((error for error in errors if not _is_transient(error)), errors[0])

        if remaining:
            _with_retries(attempt, what=f"uploading to {self.shown}", scrub=self.scrub)
        return entries

    def _put_each(self, hasher: concurrent.futures.Executor | None) -> dict[str, tuple[int, str | None]]:
        """One file at a time: other filesystems (through a temporary name, then a move) and
        object stores without an async API (a direct put)."""
        entries: dict[str, tuple[int, str | None]] = {}
        for item in self.files:
            target = item.remote
            if self.kind == "renamed":
                # A reader of the final name sees nothing or the whole file.
                parent, name = posixpath.split(item.remote)
                self.fs.makedirs(parent, exist_ok=True)
                target = posixpath.join(parent, f".{name}{TEMP_MARKER}-{uuid.uuid4().hex}")
            fd, before = self._open(item)
            try:
                hashing = hasher.submit(_sha256_fd, fd) if hasher is not None else None
                try:
                    _with_retries(
                        functools.partial(self._put_fd, fd, target, item),
                        what=f"uploading to {self.scrub.url(item.remote)}",
                        scrub=self.scrub,
                    )
                finally:
                    hashed = hashing.result() if hashing is not None else None  # before fd closes
                self._check_unchanged(item, fd, before, hashed[0] if hashed else None)
                if target != item.remote:
                    self._move(target, item.remote)
            except BaseException:
                if target != item.remote:
                    with contextlib.suppress(Exception):
                        self.fs.rm_file(target)
                raise
            finally:
                os.close(fd)
            entries[item.rel] = hashed if hashed is not None else (before.st_size, None)
        return entries

    def _put_fd(self, fd: int, target: str, item: _UploadFile) -> None:
        os.lseek(fd, 0, os.SEEK_SET)  # where /dev/fd/N shares fd's offset (macOS), start over
        self.fs.put_file(fd_path(fd), target, **self._put_options(item))

    def _move(self, tmp: str, final: str) -> None:
        if type(self.fs).mv is fsspec.AbstractFileSystem.mv:
            # fsspec's generic mv expands glob characters in the name ("what?.txt", "[ab].txt"),
            # so it moves the wrong file or none; copying one file and deleting it expands nothing.
            self.fs.cp_file(tmp, final)
            self.fs.rm_file(tmp)
        else:
            self.fs.mv(tmp, final)  # the filesystem's own rename (sftp, ftp, smb, ...)

    # -- the markers

    def _make_dirs(self) -> None:
        if self.kind == "local":
            for rdir in self.remote_dirs:
                os.makedirs(rdir, exist_ok=True)
        elif self.kind == "renamed":
            for rdir in self.remote_dirs:
                self.fs.makedirs(rdir, exist_ok=True)

    def _write_marker(self, name: str, data: bytes, mode: int) -> None:
        path = posixpath.join(self.remote_root, name)
        if self.kind == "local":
            with atomic_open(path, mode=mode) as out:
                out.write(data)
            return
        target = path
        if self.kind == "renamed":
            target = posixpath.join(self.remote_root, f".{name}{TEMP_MARKER}-{uuid.uuid4().hex}")
        _with_retries(
            lambda: self.fs.pipe_file(target, data),
            what=f"writing {self.scrub.url(path)}",
            scrub=self.scrub,
        )
        if target != path:
            self._move(target, path)

    def _remove_marker(self, name: str) -> None:
        path = posixpath.join(self.remote_root, name)
        if self.kind == "local":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                fsync_dir(self.remote_root)
            return
        with contextlib.suppress(FileNotFoundError):
            _with_retries(
                lambda: self.fs.rm_file(path), what=f"removing {self.scrub.url(path)}", scrub=self.scrub
            )


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _marker_json(**fields: Any) -> bytes:
    if "files" not in fields:  # the partial-upload marker: who is writing, to tell a live upload
        fields.update(host=platform.node(), pid=os.getpid())
    document = {"format": _MANIFEST_FORMAT, "version": _MANIFEST_VERSION, **fields}
    return (json.dumps(document, indent=1) + "\n").encode()


def _copy_fd(fd: int, out: Any, hasher: concurrent.futures.Executor | None) -> tuple[int, str | None]:
    """Copy the open file ``fd`` to ``out``; return the size and, with a ``hasher``, the SHA-256.

    The hash of a chunk runs on ``hasher`` while the chunk is written (hashlib releases the GIL),
    one chunk behind at most: the copy takes about as long as without hashing.
    """
    digest = hashlib.sha256() if hasher is not None else None
    pending: concurrent.futures.Future[None] | None = None
    size = 0
    while chunk := os.read(fd, _CHUNK):
        if digest is not None:
            if pending is not None:
                pending.result()
            pending = hasher.submit(digest.update, chunk)  # type: ignore[union-attr]
        out.write(chunk)
        size += len(chunk)
    if pending is not None:
        pending.result()
    return size, digest.hexdigest() if digest is not None else None


def _sha256_fd(fd: int) -> tuple[int, str]:
    """Size and SHA-256 of the open file ``fd``, read with ``pread`` so its offset is untouched."""
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, _CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return offset, digest.hexdigest()


def _concurrency(fs: Any, count: int) -> int:
    # As many puts at once as fsspec's own fs.put would run: the filesystem's batch_size, the
    # "gather_batch_size" setting, or an eighth of the open-file limit (each put here holds two
    # descriptors, the checked one and the library's).
    limit = getattr(fs, "batch_size", None) or fsspec.config.conf.get("gather_batch_size")
    if not limit:
        try:
            import resource

            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            limit = 128 if soft == resource.RLIM_INFINITY else soft // 8
        except (ImportError, ValueError, OSError):
            limit = 128
    return max(1, count if limit < 0 else min(limit, count))


def _local_source(source: str | os.PathLike[str]) -> Path:
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be a local path, got {type(source).__name__}.")
    text = os.fspath(source)
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        raise ValueError(
            f"upload() reads a local file or directory, got the URL {redact_url(text)!r}; pass a path."
        )
    return Path(os.path.expanduser(text))


def _plan_upload(source: Path, dest_url: str, options: dict[str, Any], scrub: Scrubber) -> _Upload:
    shown = scrub.url(dest_url)
    path_part = urlsplit(dest_url).path if "://" in dest_url else dest_url
    if ".." in path_part.replace("\\", "/").split("/"):
        raise ValueError(
            f"dest_url {shown!r} has a '..' component, which filesystems resolve differently; "
            f"spell the destination without it."
        )
    if not os.path.lexists(source):
        raise FileNotFoundError(f"upload source {source} does not exist.")
    root = source.resolve(strict=True)
    fs, remote_root = fsspec.core.url_to_fs(dest_url, **options)
    remote_root = remote_root.rstrip("/") or remote_root
    if root.is_file():
        # A trailing slash means "into this directory", as with cp.
        target = posixpath.join(remote_root, source.name) if dest_url.endswith("/") else remote_root
        item = _UploadFile(root, source.name, target, _identity(os.stat(root)))
        problems = _misplaced_names(fs, [item])
        if problems:
            raise DistkitError(f"{_rank_label()} upload of {source} refused: {problems[0]}")
        return _Upload(fs, source, [item], posixpath.dirname(target), [], False, shown, scrub)
    if not root.is_dir():
        raise DistkitError(f"upload source {source} is not a regular file or a directory.")

    files: list[_UploadFile] = []
    remote_dirs = [remote_root]
    problems = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        for name in sorted(dirnames):
            entry = here / name
            rel = entry.relative_to(root).as_posix()
            if entry.is_symlink():
                dirnames.remove(name)
                problems.append(_symlink_problem(entry, rel, root, directory=True))
            else:
                remote_dirs.append(posixpath.join(remote_root, rel))
        dirnames.sort()
        for name in sorted(filenames):
            entry = here / name
            rel = entry.relative_to(root).as_posix()
            if rel in _MARKERS:
                # The upload writes its own; one copied from another upload would mislead.
                _log().info("not uploading %s: the upload writes its own %s", entry, rel)
                continue
            remote = posixpath.join(remote_root, rel)
            if entry.is_symlink():
                target = _symlink_target(entry)
                if target is None or not target.is_relative_to(root) or not target.is_file():
                    problems.append(_symlink_problem(entry, rel, root, directory=False))
                    continue
                files.append(_UploadFile(target, rel, remote, _identity(os.stat(target))))
                continue
            info = os.lstat(entry)
            if stat.S_ISREG(info.st_mode):
                files.append(_UploadFile(entry, rel, remote, _identity(info)))
            else:
                problems.append(f"{rel}: not a regular file (a FIFO, socket or device)")
    problems += _misplaced_names(fs, files)
    if problems:
        raise DistkitError(
            f"{_rank_label()} upload of {source} refused before writing anything: {len(problems)} "
            f"entr{'y' if len(problems) == 1 else 'ies'} would read outside the source tree, cannot "
            f"be read safely, or would land elsewhere:{_problem_lines(problems)}\nRemove or rename "
            f"them, or copy what they point to into the tree."
        )
    return _Upload(fs, source, files, remote_root, remote_dirs, True, shown, scrub)


def _identity(info: os.stat_result) -> tuple[int, int]:
    return (info.st_dev, info.st_ino)


def _misplaced_names(fs: Any, files: list[_UploadFile]) -> list[str]:
    # Object stores parse some names: s3fs reads "?versionId=" as a version (and adlfs alike), so
    # "a?versionId=1" would be written to the key "a". Such names are refused, not misplaced.
    split = getattr(fs, "split_path", None)
    if split is None:
        return []
    problems = []
    for item in files:
        try:
            parts = split(item.remote)
        except Exception:  # the filesystem's own error comes when the file is written
            continue
        stored = "/".join(part for part in parts[:2] if part)
        if stored != item.remote.strip("/"):
            problems.append(f"{item.rel}: {_protocols(fs)[0]}:// would store it as {stored!r}")
    return problems


def _symlink_target(entry: Path) -> Path | None:
    try:
        return entry.resolve(strict=True)
    except (OSError, RuntimeError):  # dangling, or a loop
        return None


def _symlink_problem(entry: Path, rel: str, root: Path, *, directory: bool) -> str:
    target = _symlink_target(entry)
    if target is None:
        return f"{rel}: symlink to {os.readlink(entry)!r}, which does not resolve"
    if not target.is_relative_to(root):
        return f"{rel}: symlink to {target}, outside {root}"
    if directory:
        return f"{rel}: symlink to the directory {target}; directory links are not followed"
    return f"{rel}: symlink to {target}, which is not a regular file"


def upload(
    source: str | os.PathLike[str],
    dest_url: str,
    *,
    background: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> UploadHandle:
    """Copy a local file or directory tree to ``dest_url``, from rank 0 only.

    Local: no communication. Rank 0 uploads; every other rank returns an already finished handle at
    once (no barrier, and ``source`` need not exist there). Without a process group this process
    uploads.

    Before anything is written, the whole tree is checked: entries that resolve outside ``source``
    (a symlink to ``/etc``, a relative link through ``..``), directory symlinks, special files,
    names an object store would store under another key, and a ``..`` in ``dest_url`` are refused,
    all of them named in one error. Each file is then opened without following links and must be
    the very file the check saw (a swapped-in symlink stops the upload). Each remote object appears
    whole or not at all; local destinations get the permission bits of the process umask. A
    directory becomes ``dest_url`` itself; a file goes to ``dest_url``, or into it when
    ``dest_url`` ends with ``/``.

    A directory upload writes ``_DISTKIT_INCOMPLETE`` at the top of the destination first and the
    manifest ``_DISTKIT_MANIFEST.json`` (each file's size and SHA-256) last, then removes the
    first: the manifest exists exactly when the tree is complete, and :func:`download` refuses a
    tree marked partial (see ``docs/coordination.md``). Files of those names at the top of
    ``source`` are not uploaded.

    Args:
        source: Local file or directory (a ``file://`` URL is accepted).
        dest_url: Destination URL or local path.
        background: Upload in a thread and return at once; errors surface at
            :meth:`UploadHandle.wait`. The interpreter waits for a running upload at exit.
        storage_options: Options for the destination's filesystem (credentials, endpoint); never
            shown in messages, logs or reprs.

    Returns:
        An :class:`UploadHandle`; already done unless ``background`` is true on rank 0.

    Raises:
        DistkitError: The tree holds entries that are refused (raised at the call, even with
            ``background=True``), a file changed after the check, or the upload failed after
            retries.
        FileNotFoundError: ``source`` does not exist.
        ValueError: ``dest_url`` has a ``..`` component, ``source`` is a remote URL, or an HTTP
            ``dest_url`` gets credentials twice (as :func:`download` refuses them).

    Example:
        >>> import distkit
        >>> handle = distkit.upload("checkpoints", "s3://bucket/run-1", background=True,
        ...                         storage_options={"profile": "training"})  # doctest: +SKIP
        >>> handle.wait(timeout_s=3600)  # doctest: +SKIP
    """
    local_source = _local_source(source)
    if not isinstance(dest_url, (str, os.PathLike)):
        raise TypeError(f"dest_url must be a URL or a path, got {type(dest_url).__name__}.")
    dest_text = os.fspath(dest_url)
    options = dict(storage_options or {})
    scrub = Scrubber(options, dest_text)
    _check_http_credentials(dest_text, options, shown=scrub.url(dest_text))
    handle = UploadHandle(local_source, scrub.url(dest_text))
    if not runtime.is_main_process():
        return handle._finish()
    plan = scrub.call(_plan_upload, local_source, dest_text, options, scrub)
    if not background:
        scrub.call(plan.run)
        return handle._finish()

    def work() -> None:
        try:
            scrub.call(plan.run)
        except BaseException as err:
            _log().error("background upload of %s to %s failed: %s", local_source, plan.shown, err)
            handle._finish(err)
        else:
            handle._finish()

    # Not a daemon: a job that ends right after starting its upload still delivers the results.
    threading.Thread(target=work, name="distkit-upload", daemon=False).start()
    return handle


# Errors and reprs name the public home of these objects, not the private module that defines them.
for _public in (UploadHandle, upload):
    _public.__module__ = "distkit.storage"
del _public

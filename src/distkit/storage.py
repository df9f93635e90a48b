"""Downloads fetched once per node and never half-written; uploads from rank 0 that stay in the tree.

Both speak fsspec, so a source or destination is any URL it knows (``https://``, ``s3://``,
``gs://``, ``memory://``, ``file://``) or a local path; ``storage_options`` go to the filesystem.

:func:`download` is coordinated twice: within the job by a main-first section (one rank per node
fetches while the others wait on the store, and a failure reaches all of them), and across jobs by
an ``flock`` lock beside the destination (two jobs on one node never fetch at once; the kernel
releases the lock of a holder that dies). The data goes to a temporary name in the destination's
directory, is fsynced and checked, and only then renamed into place.

:func:`upload` runs on rank 0 only. Nothing outside the source tree is ever read (each file is
opened without following links and checked to be the file the tree check saw), and each remote
object appears whole: local targets through a temporary file and a rename, object stores because a
put is atomic there, other filesystems through a temporary name and a move. A directory upload is
framed by two markers: ``_DISTKIT_INCOMPLETE`` is written first, and the manifest
``_DISTKIT_MANIFEST.json`` (every file's size and SHA-256) last, so a reader can tell a complete tree
from a partial one; :func:`download` refuses a partial one and checks a complete one against it.

Credentials in ``storage_options``, in URLs and in HTTP headers are replaced by ``***`` in every
message, exception chain, ``repr`` and log line (distkit's, and fsspec's, aiohttp's and botocore's
during a call); see :class:`distkit._secrets.Scrubber`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import errno
import hashlib
import json
import mimetypes
import os
import platform
import posixpath
import shutil
import stat
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import filelock
import fsspec

from distkit import coordination, runtime
from distkit._fs import TEMP_MARKER, atomic_open, fd_path, fsync_dir, temp_name, umask_mode
from distkit._secrets import Scrubber, redact_url
from distkit.errors import DistkitError

__all__ = ["ChecksumMismatchError", "LockTimeoutError", "UploadHandle", "download", "upload"]

T = TypeVar("T")

_DEFAULT_TIMEOUT_S = coordination._DEFAULT_TIMEOUT_S
# Ranks that wait for the fetching rank allow it this much beyond timeout_s, so that its own,
# more precise error (a lock it could not get within timeout_s) reaches them before their deadline.
_FOLLOWER_GRACE_S = 30.0
# Transient network errors: 4 attempts, 1 + 2 + 4 = 7 s of back-off in all, enough to ride out a
# load balancer's restart without hiding an outage for long.
_ATTEMPTS = 4
_RETRY_BASE_S = 1.0
# Copy in 4 MiB pieces: large enough that per-call overhead vanishes, small enough to stream.
_CHUNK = 4 * 2**20
# aiohttp's default caps a whole HTTP request at 5 minutes, which fails any large download; cap
# the silence instead: connecting (30 s) and each read (60 s).
_HTTP_CONNECT_S = 30.0
_HTTP_READ_S = 60.0
# Object stores write an object in one atomic put (and a rename there is a copy), so they get a
# direct put; other remote filesystems get a temporary name and a move.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss"})
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EIO,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EAGAIN,
    }
)
# The markers of a directory upload, at the top of the destination. The leading underscore makes
# dataset readers skip them (pyarrow, Spark and Hive ignore names starting with "_" or ".").
# The manifest exists only once every file is in place, as Hadoop's _SUCCESS does, so a sensor
# that waits for it needs no parsing; _DISTKIT_INCOMPLETE is what tells a partial tree written by
# distkit (failed, killed or still running) from a tree someone else wrote.
MANIFEST_NAME = "_DISTKIT_MANIFEST.json"
INCOMPLETE_NAME = "_DISTKIT_INCOMPLETE"
_MARKERS = frozenset({MANIFEST_NAME, INCOMPLETE_NAME})
_MANIFEST_FORMAT = "distkit-upload"
_MANIFEST_VERSION = 1
# At most this many threads hash uploaded files beside the transfer: enough that hashing (OpenSSL's
# SHA-256: roughly 1.5-2 GB/s per core with SHA extensions, published figures) rarely limits an
# upload, few enough not to take the cores of a training job that uploads in the background.
_HASH_THREADS = 2


def _log() -> runtime.RankLoggerAdapter:
    return runtime.get_logger("distkit.storage")


def _label() -> str:
    return f"[rank {runtime.get_rank()}/{runtime.get_world_size()}]"


class ChecksumMismatchError(DistkitError):
    """A download's SHA-256 differs from the expected one; nothing was written to ``dest``.

    Attributes:
        expected: The SHA-256 the caller passed (lower-case hex).
        actual: The SHA-256 of what the source delivered.
    """

    def __init__(self, message: str, *, expected: str, actual: str) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_checksum_error, (str(self), self.expected, self.actual)


def _rebuild_checksum_error(message: str, expected: str, actual: str) -> ChecksumMismatchError:
    return ChecksumMismatchError(message, expected=expected, actual=actual)


class LockTimeoutError(DistkitError, filelock.Timeout):
    """The download lock beside ``dest`` could not be taken in time.

    Also a :class:`filelock.Timeout`; ``lock_file`` is the lock's path.
    """

    def __init__(self, message: str, lock_file: str) -> None:
        DistkitError.__init__(self, message)
        self._message = message
        self._lock_file = lock_file
        self._holder = None

    def __str__(self) -> str:
        return self._message

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self._message, self._lock_file)


# -- retries --------------------------------------------------------------------------------------


def _is_transient(err: BaseException) -> bool:
    """Worth retrying: a dropped connection, a timeout, a 5xx answer; not a missing file."""
    if isinstance(err, DistkitError):
        return False
    if isinstance(err, FileNotFoundError):
        # fsspec's HTTP filesystem reports any failed HEAD and GET as FileNotFoundError, chaining
        # the real cause (a 503, a refused connection).
        return err.__cause__ is not None and _is_transient(err.__cause__)
    if isinstance(err, (PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return False
    if isinstance(err, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    # Only a loaded aiohttp can have raised its errors; looking it up never imports it.
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(err, aiohttp.ClientError):
        if isinstance(err, aiohttp.ClientResponseError):
            return err.status >= 500 or err.status in (408, 429)
        return True  # connection refused or reset, payload cut short, server disconnected
    if isinstance(err, OSError):
        return err.errno in _TRANSIENT_ERRNOS
    return False


def _with_retries(fn: Callable[[], T], *, what: str, scrub: Scrubber) -> T:
    attempt = 1
    while True:
        try:
            return fn()
        except Exception as err:
            if not _is_transient(err):
                raise
            if attempt >= _ATTEMPTS:
                raise DistkitError(
                    scrub.text(
                        f"{_label()} {what} failed after {_ATTEMPTS} attempts: "
                        f"{coordination._type_name(err)}: {err}. Check that the source is reachable "
                        f"from this machine, then run again."
                    )
                ) from err
            delay = _RETRY_BASE_S * 2 ** (attempt - 1)
            _log().warning(
                "%s",
                scrub.text(
                    f"{what} failed ({coordination._type_name(err)}: {err}); retrying in {delay:g} s "
                    f"(attempt {attempt + 1} of {_ATTEMPTS})"
                ),
            )
            time.sleep(delay)
            attempt += 1


# -- download -------------------------------------------------------------------------------------


def _check_sha256(sha256: str | None) -> str | None:
    if sha256 is None:
        return None
    value = sha256.strip().lower() if isinstance(sha256, str) else sha256
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(
            f"sha256 must be 64 hexadecimal digits (as printed by `sha256sum FILE`), got {sha256!r}."
        )
    return value


def _fingerprint(path: Path) -> tuple[int, int, int] | None:
    # What the fetching rank saw; a rank that sees the same inode, size and mtime is looking at the
    # same file. st_dev is left out: one file on a shared filesystem can show a different device
    # number on each node.
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _relative(root: str, name: str) -> str:
    """``name`` relative to ``root`` in a listing; refuses names that would leave the destination."""
    name = name.rstrip("/")
    if name == root:
        return ""
    if not name.startswith(root + "/"):
        raise DistkitError(f"the listing of {root!r} returned {name!r}, which is not inside it.")
    rel = name[len(root) + 1 :]
    if any(part in ("", ".", "..") for part in rel.split("/")):
        raise DistkitError(f"refusing to download {name!r}: its name has an empty, '.' or '..' component.")
    return rel


def _remove_leftovers(dest: Path) -> None:
    # Temporary files or directories of a fetch that was killed. Called with the lock held, so no
    # live writer owns them.
    prefix = temp_name(dest)
    with os.scandir(dest.parent) as entries:
        for entry in entries:
            if entry.name.startswith(prefix):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


@dataclass
class _Download:
    """One download as every rank describes it; :meth:`fetch` runs under the lock."""

    source: str
    dest: Path
    sha256: str | None
    options: dict[str, Any]
    timeout_s: float
    scrub: Scrubber

    @property
    def shown(self) -> str:
        return self.scrub.url(self.source)

    def fetch(self) -> tuple[int, int, int] | None:
        """Make ``dest`` hold a verified copy (fetching only when needed); return its fingerprint."""
        return self.scrub.call(self._fetch)

    def _fetch(self) -> tuple[int, int, int] | None:
        dest = self.dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        lock_path = str(dest.with_name(dest.name + ".lock"))
        lock = filelock.FileLock(lock_path, timeout=self.timeout_s)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise LockTimeoutError(
                f"{_label()} could not take the download lock {lock_path} within {self.timeout_s:g} s: "
                f"another process is fetching to {dest} (another job on this node?). The kernel "
                f"releases the lock of a process that dies, so a live one holds it: find it with "
                f"`fuser {lock_path}`, or pass a larger timeout_s.",
                lock_path,
            ) from None
        try:
            _remove_leftovers(dest)
            if self._usable():
                return _fingerprint(dest)
            started = time.monotonic()
            fs, path = self._filesystem()
            info = _with_retries(lambda: fs.info(path), what=f"looking up {self.shown}", scrub=self.scrub)
            if info.get("type") == "directory":
                if self.sha256 is not None:
                    raise ValueError(
                        f"sha256 checks a single file, but {self.shown} is a directory; leave sha256 out."
                    )
                count = self._fetch_tree(fs, path)
            else:
                count = 1
                _with_retries(
                    lambda: self._fetch_file(fs, path),
                    what=f"downloading {self.shown}",
                    scrub=self.scrub,
                )
            _log().info(
                "downloaded %s to %s (%d file%s) in %.2f s",
                self.shown,
                dest,
                count,
                "" if count == 1 else "s",
                time.monotonic() - started,
            )
            return _fingerprint(dest)
        finally:
            lock.release()

    def _usable(self) -> bool:
        # What was renamed into place was complete when renamed, so existing is enough unless a
        # checksum is asked for.
        dest = self.dest
        if not dest.exists():
            return False
        if self.sha256 is None:
            return True
        if not dest.is_file():
            raise ValueError(f"sha256 checks a single file, but {dest} is a directory; leave sha256 out.")
        actual = _sha256_of(dest)
        if actual == self.sha256:
            return True
        _log().warning(
            "%s has sha256 %s, expected %s; fetching %s again", dest, actual, self.sha256, self.shown
        )
        return False

    def _filesystem(self) -> tuple[Any, str]:
        options = dict(self.options)
        if fsspec.utils.get_protocol(self.source) in ("http", "https"):
            client_kwargs = dict(options.get("client_kwargs") or {})
            if "timeout" not in client_kwargs:
                import aiohttp

                client_kwargs["timeout"] = aiohttp.ClientTimeout(
                    total=None, sock_connect=_HTTP_CONNECT_S, sock_read=_HTTP_READ_S
                )
            options["client_kwargs"] = client_kwargs
        return fsspec.core.url_to_fs(self.source, **options)  # type: ignore[no-any-return]

    def _copy(self, fs: Any, path: str, out: Any) -> tuple[int, str]:
        """Copy ``path`` to ``out``; return the size and SHA-256 of what was copied."""
        digest = hashlib.sha256()
        size = 0
        # block_size=0: one streaming GET over HTTP instead of a ranged request per block.
        extra = {"block_size": 0} if "http" in _protocols(fs) else {}
        with fs.open(path, "rb", **extra) as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
        return size, digest.hexdigest()

    def _fetch_file(self, fs: Any, path: str) -> None:
        # atomic_open: temporary name beside dest, fsync, rename; an exception removes the file.
        # The file gets the bits open() would give it under the process umask.
        with atomic_open(self.dest, mode=umask_mode(0o666)) as out:
            _, actual = self._copy(fs, path, out)
            if self.sha256 is not None and actual != self.sha256:
                raise ChecksumMismatchError(
                    f"{_label()} the sha256 of {self.shown} is {actual}, expected {self.sha256}; "
                    f"nothing was written to {self.dest}. Check the expected checksum, or whether "
                    f"the source changed.",
                    expected=self.sha256,
                    actual=actual,
                )

    def _fetch_tree(self, fs: Any, path: str) -> int:
        root = fs._strip_protocol(path).rstrip("/")
        entries = _with_retries(
            lambda: fs.find(path, withdirs=True, detail=True),
            what=f"listing {self.shown}",
            scrub=self.scrub,
        )
        members: dict[str, tuple[str, dict[str, Any]]] = {}
        for name, info in entries.items():
            rel = _relative(root, name)
            if rel:
                members[rel] = (name, info)
        # Refuses a partial upload before anything is fetched.
        promised = self._upload_manifests(fs, members)
        work = Path(tempfile.mkdtemp(prefix=temp_name(self.dest), dir=self.dest.parent))
        count = 0
        try:
            for rel, (name, info) in sorted(members.items()):
                if posixpath.basename(rel) in _MARKERS:
                    continue  # checked above; not part of the data
                target = work.joinpath(*rel.split("/"))
                if info.get("type") == "directory":
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                got = _with_retries(
                    lambda name=name, target=target: self._fetch_member(fs, name, target),
                    what=f"downloading {self.scrub.url(name)}",
                    scrub=self.scrub,
                )
                expected = promised.get(rel)
                if expected is not None and got != expected:
                    raise ChecksumMismatchError(
                        f"{_label()} {self.scrub.url(name)} has {got[0]} bytes and sha256 {got[1]}, but "
                        f"the upload manifest of {self.shown} promises {expected[0]} bytes and sha256 "
                        f"{expected[1]}: the tree changed after it was uploaded (is another upload to it "
                        f"running?). Nothing was written to {self.dest}; download again once the tree "
                        f"is complete.",
                        expected=expected[1],
                        actual=got[1],
                    )
                count += 1
            _fsync_tree(work)
            os.chmod(work, umask_mode(0o777))  # mkdtemp made it private to this user
            os.rename(work, self.dest)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        fsync_dir(self.dest.parent)
        return count

    def _upload_manifests(self, fs: Any, members: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
        """What the upload manifests in the tree promise, by relative name: ``(size, sha256)``.

        Raises when a directory holds the mark of a partial upload and no manifest, or when the
        listing already shows a promised file missing or of another size.
        """
        promised: dict[str, tuple[int, str]] = {}
        problems: list[str] = []
        for rel, (name, _) in sorted(members.items()):
            folder, base = posixpath.split(rel)
            prefix = f"{folder}/" if folder else ""
            if base == INCOMPLETE_NAME and prefix + MANIFEST_NAME not in members:
                raise DistkitError(
                    f"{_label()} {self.shown} holds a partial upload: {self.scrub.url(name)} marks "
                    f"{folder or 'the tree'} as written by distkit.upload() without its manifest "
                    f"{MANIFEST_NAME}, so that upload failed, was killed, or is still running"
                    f"{self._describe_incomplete(fs, name)}. Nothing was written to {self.dest}. Wait for "
                    f"the upload to finish or run it again, then download again."
                )
            if base != MANIFEST_NAME:
                continue
            data = _with_retries(
                lambda name=name: fs.cat_file(name), what=f"reading {self.scrub.url(name)}", scrub=self.scrub
            )
            for file_rel, (size, sha256) in _parse_manifest(data, self.scrub.url(name)).items():
                key = prefix + file_rel
                member = members.get(key)
                if member is None or member[1].get("type") == "directory":
                    problems.append(f"{key}: missing")
                elif member[1].get("size") is not None and member[1]["size"] != size:
                    problems.append(f"{key}: {member[1]['size']} bytes, the manifest says {size}")
                promised[key] = (size, sha256)
        if problems:
            listed = "\n  ".join(problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise DistkitError(
                f"{_label()} {self.shown} does not match its upload manifest {MANIFEST_NAME}:\n  "
                f"{listed}{more}\nThe tree changed after it was uploaded (is another upload to it "
                f"running?). Nothing was written to {self.dest}; download again once it is complete."
            )
        return promised

    def _describe_incomplete(self, fs: Any, name: str) -> str:
        # Who wrote the marker and when, to tell a running upload from a dead one; best effort.
        try:
            info = json.loads(fs.cat_file(name))
            return f" (started {info['started']} by process {int(info['pid'])} on {info['host']})"
        except Exception:
            return ""

    def _fetch_member(self, fs: Any, name: str, target: Path) -> tuple[int, str]:
        # Inside the private work directory: nobody sees it until the whole tree is renamed.
        with open(target, "wb") as out:
            return self._copy(fs, name, out)


def _parse_manifest(data: bytes, shown: str) -> dict[str, tuple[int, str]]:
    """The ``{relative name: (size, sha256)}`` of an upload manifest."""
    try:
        document = json.loads(data)
        if not isinstance(document, dict) or document.get("format") != _MANIFEST_FORMAT:
            raise ValueError(f"its format is not {_MANIFEST_FORMAT!r}")
        if document.get("version") != _MANIFEST_VERSION:
            raise ValueError(
                f"it has version {document.get('version')!r}, this distkit reads {_MANIFEST_VERSION} "
                f"(upgrade distkit to read newer manifests)"
            )
        files: dict[str, tuple[int, str]] = {}
        for rel, entry in document["files"].items():
            size, sha256 = entry["size"], entry["sha256"]
            if not isinstance(size, int) or not isinstance(sha256, str) or _check_sha256(sha256) is None:
                raise ValueError(f"the entry of {rel!r} is {entry!r}")
            files[rel] = (size, sha256.lower())
        return files
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise DistkitError(
            f"{shown} is not a readable distkit upload manifest: {err}. Remove it if the tree was not "
            f"written by distkit.upload(), or upload the tree again."
        ) from None


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def download(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    sha256: str | None = None,
    local: bool = True,
    timeout_s: float = _DEFAULT_TIMEOUT_S,
    storage_options: Mapping[str, Any] | None = None,
) -> Path:
    """Fetch a file or a directory tree to ``dest`` once per node, atomically, and return ``dest``.

    Collective: call on every rank with the same arguments. Without a process group it fetches in
    this process (still under the file lock).

    One rank per node (``local=True``) or one in the job (``local=False``, for a filesystem all
    nodes share) fetches while the others wait; a file lock ``<dest>.lock`` beside ``dest`` keeps
    other jobs on the node from fetching at the same time (they find the finished copy instead). The
    data is written under a temporary name in ``dest``'s directory, fsynced, checked against
    ``sha256`` and renamed into place, so ``dest`` never holds a partial copy, even when the
    process is killed; leftovers of a killed fetch are removed by the next call. An existing
    ``dest`` is used as it is (and checked first when ``sha256`` is given; one that does not match
    is fetched again). Transient network errors are retried with back-off (4 attempts); any error
    is raised on the fetching rank and, as :class:`~distkit.MainProcessError`, on the ranks that
    waited for it.

    Args:
        source: An fsspec URL (``https://``, ``s3://``, ``file://``, ``memory://``, ...) or a local
            path, of a file or a directory.
        dest: Local path of the result (the file itself, or the directory the tree becomes).
        sha256: Expected SHA-256 of a file, in hex; a mismatch raises and leaves nothing at ``dest``.
        local: Fetch once per node (the default: safe with node-local disks); ``False`` fetches once
            in the job, for a ``dest`` on a filesystem every node shares.
        timeout_s: How long to wait for the lock, and how long the other ranks wait for the
            fetching one (default 7200 s).
        storage_options: Options for the source's filesystem (credentials, endpoint); never shown
            in messages or logs. For HTTP, a per-read timeout of 60 s replaces aiohttp's 5-minute
            cap on a whole request unless ``client_kwargs`` sets ``timeout``.

    Returns:
        ``dest`` as a :class:`~pathlib.Path`.

    Raises:
        ChecksumMismatchError: The fetched file's SHA-256 differs from ``sha256``.
        LockTimeoutError: Another process held the lock for ``timeout_s`` (also a
            :class:`filelock.Timeout`; the message names the lock file).
        FileNotFoundError: The source does not exist.
        DistkitError: The source stayed unreachable after the retries.
        MainProcessError: On the ranks that waited, when the fetching rank failed.
        ValueError: ``sha256`` is malformed, or given for a directory.

    Example:
        >>> import distkit
        >>> digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
        >>> path = distkit.download("https://host/x.bin", "cache/x.bin", sha256=digest)  # doctest: +SKIP
    """
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be a URL or a path, got {type(source).__name__}.")
    if not isinstance(dest, (str, os.PathLike)):
        raise TypeError(f"dest must be a local path, got {type(dest).__name__}.")
    source_text = os.fspath(source)
    dest_path = Path(os.path.expanduser(os.fspath(dest)))
    options = dict(storage_options or {})
    job = _Download(
        source=source_text,
        dest=dest_path,
        sha256=_check_sha256(sha256),
        options=options,
        timeout_s=coordination._check_timeout(timeout_s),
        scrub=Scrubber(options, source_text),
    )

    def coordinated() -> Path:
        seen = coordination._run_leader_first(
            job.fetch,
            (),
            {},
            local=local,
            timeout_s=job.timeout_s + _FOLLOWER_GRACE_S,
            what=f"download({job.shown})",
        )
        # Same file as the fetching rank saw: done. Otherwise this rank is on another node than the
        # fetching one (local=False without a shared filesystem): fetch here, under the lock.
        if _fingerprint(dest_path) != seen:
            job.fetch()
        return dest_path

    return job.scrub.call(coordinated)


# -- upload ---------------------------------------------------------------------------------------


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
                f"{_label()} the upload of {self.source} to {self.dest_url} is still running after "
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
            f"{_label()} upload of {self.source} to {self.shown} stopped at {item.rel}: {reason} after "
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
                        lambda fd=fd, target=target, item=item: self._put_fd(fd, target, item),
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
            raise DistkitError(f"{_label()} upload of {source} refused: {problems[0]}")
        return _Upload(fs, source, [item], posixpath.dirname(target), [], False, shown, scrub)
    if not root.is_dir():
        raise DistkitError(f"upload source {source} is not a regular file or a directory.")

    files: list[_UploadFile] = []
    remote_dirs = [remote_root]
    problems: list[str] = []
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
        listed = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise DistkitError(
            f"{_label()} upload of {source} refused before writing anything: {len(problems)} "
            f"entr{'y' if len(problems) == 1 else 'ies'} would read outside the source tree, cannot "
            f"be read safely, or would land elsewhere:\n  {listed}{more}\nRemove or rename them, or "
            f"copy what they point to into the tree."
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
        ValueError: ``dest_url`` has a ``..`` component, or ``source`` is a remote URL.

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

"""Downloads fetched once per node and never half-written; uploads from rank 0 that stay in the tree.

Both speak fsspec, so a source or destination is any URL it knows (``https://``, ``s3://``,
``gs://``, ``memory://``, ``file://``) or a local path; ``storage_options`` go to the filesystem.

:func:`download` is coordinated twice: within the job by a main-first section (one rank per node
fetches while the others wait on the store, and a failure reaches all of them), and across jobs by
an ``flock`` lock beside the destination (two jobs on one node never fetch at once; the kernel
releases the lock of a holder that dies). The data goes to a temporary name in the destination's
directory, is fsynced and checked, and only then renamed into place.

:func:`upload` runs on rank 0 only. Nothing outside the source tree is ever read, and each remote
object appears whole: local targets through a temporary file and a rename, object stores because a
put is atomic there, other filesystems through a temporary name and a move.

Secrets in ``storage_options`` (and passwords or query strings in URLs) are replaced by ``***`` in
every message, log line and ``repr`` distkit produces.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import posixpath
import shutil
import stat
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import filelock
import fsspec

from distkit import coordination, runtime
from distkit._fs import TEMP_MARKER, atomic_open, fsync_dir, temp_name
from distkit.errors import DistkitError, MainProcessError

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
# Option names whose values are secrets, matched as substrings of the lower-cased name: key,
# secret, token, password (s3fs, gcsfs, adlfs), Authorization headers, session tokens, SAS strings.
_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "auth", "signature", "sas")
# Shorter values would blank out ordinary words in messages; real secrets are long.
_MIN_SECRET_LEN = 4


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


# -- secrets --------------------------------------------------------------------------------------


def _redact_url(url: str) -> str:
    """``url`` without the password of its user part and without its query string."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", parts.fragment))


def _string_leaves(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, bytes):
        yield value.decode(errors="replace")
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _string_leaves(item)
    elif isinstance(value, (list, tuple, set, frozenset)):  # namedtuples too, e.g. aiohttp.BasicAuth
        for item in value:
            yield from _string_leaves(item)


def _secret_values(options: Any, urls: Iterable[str]) -> tuple[str, ...]:
    found: set[str] = set()

    def visit(obj: Any) -> None:
        if isinstance(obj, Mapping):
            for name, value in obj.items():
                if isinstance(name, str) and any(word in name.lower() for word in _SECRET_WORDS):
                    found.update(_string_leaves(value))
                else:
                    visit(value)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item)

    visit(options)
    for url in urls:
        if "://" in url:
            parts = urlsplit(url)
            found.update(s for s in (parts.password, parts.query) if s)
    # Longest first, so that a secret containing another is replaced whole.
    return tuple(sorted((s for s in found if len(s) >= _MIN_SECRET_LEN), key=len, reverse=True))


class _Scrubber:
    """Replaces the secrets of one call's options and URLs in text and exceptions."""

    def __init__(self, options: Any, *urls: str) -> None:
        self.secrets = _secret_values(options, urls)

    def text(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    def url(self, url: str) -> str:
        return self.text(_redact_url(url))

    def clean(self, err: BaseException) -> BaseException:
        """``err`` itself when no secret shows in it or its chain, else a scrubbed copy."""
        if not self.secrets:
            return err
        shown = "".join(traceback.format_exception(type(err), err, err.__traceback__)) + repr(err.args)
        if not any(secret in shown for secret in self.secrets):
            return err
        if isinstance(err, MainProcessError):
            return MainProcessError(
                self.text(str(err)),
                exc_type=err.exc_type,
                exc_message=self.text(err.exc_message),
                remote_traceback=self.text(err.remote_traceback),
            )
        # A new exception without the original attached (its traceback and chain hold the
        # secret), whose message keeps the chain's messages: the cause is often the useful part.
        described = f"{coordination._type_name(err)}: {err}"
        seen = {id(err)}
        link = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
        while link is not None and id(link) not in seen:
            seen.add(id(link))
            described += f" (caused by {coordination._type_name(link)}: {link})"
            link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
        return DistkitError(self.text(described))


def _scrubbed_call(scrub: _Scrubber, fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except Exception as err:
        failure = scrub.clean(err)
        if failure is err:
            raise
    # Raised outside the except block, so the scrubbed error carries no context with the secret.
    raise failure


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


def _with_retries(fn: Callable[[], T], *, what: str, scrub: _Scrubber) -> T:
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
    scrub: _Scrubber

    @property
    def shown(self) -> str:
        return self.scrub.url(self.source)

    def fetch(self) -> tuple[int, int, int] | None:
        """Make ``dest`` hold a verified copy (fetching only when needed); return its fingerprint."""
        return _scrubbed_call(self.scrub, self._fetch)

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

    def _copy(self, fs: Any, path: str, out: Any) -> str:
        digest = hashlib.sha256()
        # block_size=0: one streaming GET over HTTP instead of a ranged request per block.
        extra = {"block_size": 0} if "http" in _protocols(fs) else {}
        with fs.open(path, "rb", **extra) as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
        return digest.hexdigest()

    def _fetch_file(self, fs: Any, path: str) -> None:
        # atomic_open: temporary name beside dest, fsync, rename; an exception removes the file.
        with atomic_open(self.dest, mode=0o644) as out:
            actual = self._copy(fs, path, out)
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
        work = Path(tempfile.mkdtemp(prefix=temp_name(self.dest), dir=self.dest.parent))
        count = 0
        try:
            for name, info in sorted(entries.items()):
                rel = _relative(root, name)
                if not rel:
                    continue
                target = work.joinpath(*rel.split("/"))
                if info.get("type") == "directory":
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                _with_retries(
                    lambda name=name, target=target: self._fetch_member(fs, name, target),
                    what=f"downloading {self.scrub.url(name)}",
                    scrub=self.scrub,
                )
                count += 1
            _fsync_tree(work)
            os.chmod(work, 0o755)  # mkdtemp made it private to this user
            os.rename(work, self.dest)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        fsync_dir(self.dest.parent)
        return count

    def _fetch_member(self, fs: Any, name: str, target: Path) -> None:
        # Inside the private work directory: nobody sees it until the whole tree is renamed.
        with open(target, "wb") as out:
            self._copy(fs, name, out)


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
        scrub=_Scrubber(options, source_text),
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

    return _scrubbed_call(job.scrub, coordinated)


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


@dataclass
class _Upload:
    """A checked upload: which local files go to which remote paths, and how to write them."""

    fs: Any
    files: list[tuple[Path, str]]
    remote_dirs: list[str]
    shown: str
    scrub: _Scrubber

    def run(self) -> None:
        started = time.monotonic()
        protocols = set(_protocols(self.fs))
        if "file" in protocols or "local" in protocols:
            self._write_local()
        elif protocols & _OBJECT_STORES:
            if self.files:
                # One batch: async filesystems (s3fs, gcsfs, adlfs) send the files concurrently.
                local_paths = [str(lpath) for lpath, _ in self.files]
                remote_paths = [rpath for _, rpath in self.files]
                _with_retries(
                    lambda: self.fs.put(local_paths, remote_paths),
                    what=f"uploading to {self.shown}",
                    scrub=self.scrub,
                )
        else:
            self._write_renamed()
        size = sum(lpath.stat().st_size for lpath, _ in self.files)
        _log().info(
            "uploaded %d file%s (%d bytes) to %s in %.2f s",
            len(self.files),
            "" if len(self.files) == 1 else "s",
            size,
            self.shown,
            time.monotonic() - started,
        )

    def _write_local(self) -> None:
        for rdir in self.remote_dirs:
            os.makedirs(rdir, exist_ok=True)
        for lpath, rpath in self.files:
            os.makedirs(os.path.dirname(rpath) or ".", exist_ok=True)
            with atomic_open(rpath, mode=0o644) as out, open(lpath, "rb") as src:
                shutil.copyfileobj(src, out, _CHUNK)

    def _write_renamed(self) -> None:
        # A reader of the final name sees nothing or the whole file: write a temporary name in the
        # same directory, then move it (a rename on these filesystems, a dict move for memory://).
        for rdir in self.remote_dirs:
            self.fs.makedirs(rdir, exist_ok=True)
        for lpath, rpath in self.files:
            parent, name = posixpath.split(rpath)
            self.fs.makedirs(parent, exist_ok=True)
            tmp = posixpath.join(parent, f".{name}{TEMP_MARKER}-{uuid.uuid4().hex}")
            try:
                _with_retries(
                    lambda lpath=lpath, tmp=tmp: self.fs.put_file(str(lpath), tmp),
                    what=f"uploading to {self.scrub.url(rpath)}",
                    scrub=self.scrub,
                )
                self.fs.mv(tmp, rpath)
            except BaseException:
                with contextlib.suppress(Exception):
                    if self.fs.exists(tmp):
                        self.fs.rm(tmp)
                raise


def _local_source(source: str | os.PathLike[str]) -> Path:
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be a local path, got {type(source).__name__}.")
    text = os.fspath(source)
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        raise ValueError(
            f"upload() reads a local file or directory, got the URL {_redact_url(text)!r}; pass a path."
        )
    return Path(os.path.expanduser(text))


def _plan_upload(source: Path, dest_url: str, options: dict[str, Any], scrub: _Scrubber) -> _Upload:
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
        return _Upload(fs, [(root, target)], [], shown, scrub)
    if not root.is_dir():
        raise DistkitError(f"upload source {source} is not a regular file or a directory.")

    files: list[tuple[Path, str]] = []
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
            if entry.is_symlink():
                target = _symlink_target(entry)
                if target is None or not target.is_relative_to(root) or not target.is_file():
                    problems.append(_symlink_problem(entry, rel, root, directory=False))
                    continue
                files.append((target, posixpath.join(remote_root, rel)))
            elif stat.S_ISREG(os.lstat(entry).st_mode):
                files.append((entry, posixpath.join(remote_root, rel)))
            else:
                problems.append(f"{rel}: not a regular file (a FIFO, socket or device)")
    if problems:
        listed = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise DistkitError(
            f"{_label()} upload of {source} refused before writing anything: {len(problems)} "
            f"entr{'y' if len(problems) == 1 else 'ies'} would read outside the source tree or cannot "
            f"be read safely:\n  {listed}{more}\nRemove them, or copy what they point to into the tree."
        )
    return _Upload(fs, files, remote_dirs, shown, scrub)


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
    (a symlink to ``/etc``, a relative link through ``..``), directory symlinks, special files and a
    ``..`` in ``dest_url`` are refused, all of them named in one error. Each remote object appears
    whole or not at all. A directory becomes ``dest_url`` itself; a file goes to ``dest_url``, or
    into it when ``dest_url`` ends with ``/``.

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
            ``background=True``), or the upload failed after retries.
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
    scrub = _Scrubber(options, dest_text)
    handle = UploadHandle(local_source, scrub.url(dest_text))
    if not runtime.is_main_process():
        return handle._finish()
    plan = _scrubbed_call(scrub, _plan_upload, local_source, dest_text, options, scrub)
    if not background:
        _scrubbed_call(scrub, plan.run)
        return handle._finish()

    def work() -> None:
        try:
            _scrubbed_call(scrub, plan.run)
        except BaseException as err:
            _log().error("background upload of %s to %s failed: %s", local_source, plan.shown, err)
            handle._finish(err)
        else:
            handle._finish()

    # Not a daemon: a job that ends right after starting its upload still delivers the results.
    threading.Thread(target=work, name="distkit-upload", daemon=False).start()
    return handle

"""How :func:`distkit.storage.download` fetches (private); the contract is in :mod:`distkit.storage`.

Every rank describes the download as a :class:`_Download`; the fetching rank (one per node, or one
in the job) runs :meth:`_Download.fetch` under an ``flock`` lock beside the destination, into a
temporary name that is fsynced, checked (against ``sha256``, or a tree against its upload
manifest) and renamed into place. The other ranks wait for it in a main-first section.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import posixpath
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock
import fsspec

from distkit import coordination
from distkit._utils.fs import atomic_open, fsync_dir, temp_name, umask_mode
from distkit._utils.secrets import Scrubber
from distkit._utils.slips import names_slips
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
    _log,
    _problem_lines,
    _protocols,
    _with_retries,
)

__all__ = ["ChecksumMismatchError", "LockTimeoutError", "download"]

_DEFAULT_TIMEOUT_S = coordination._DEFAULT_TIMEOUT_S
# Ranks that wait for the fetching rank allow it this much beyond timeout_s, so that its own,
# more precise error (a lock it could not get within timeout_s) reaches them before their deadline.
_FOLLOWER_GRACE_S = 30.0
# aiohttp's default caps a whole HTTP request at 5 minutes, which fails any large download; cap
# the silence instead: connecting (30 s) and each read (60 s).
_HTTP_CONNECT_S = 30.0
_HTTP_READ_S = 60.0


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
                f"{_rank_label()} could not take the download lock {lock_path} within {self.timeout_s:g} s: "
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
                    f"{_rank_label()} the sha256 of {self.shown} is {actual}, expected {self.sha256}; "
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
                    functools.partial(self._fetch_member, fs, name, target),
                    what=f"downloading {self.scrub.url(name)}",
                    scrub=self.scrub,
                )
                expected = promised.get(rel)
                if expected is not None and got != expected:
                    raise ChecksumMismatchError(
                        f"{_rank_label()} {self.scrub.url(name)} has {got[0]} bytes and sha256 {got[1]}, but "
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
                    f"{_rank_label()} {self.shown} holds a partial upload: {self.scrub.url(name)} marks "
                    f"{folder or 'the tree'} as written by distkit.upload() without its manifest "
                    f"{MANIFEST_NAME}, so that upload failed, was killed, or is still running"
                    f"{self._describe_incomplete(fs, name)}. Nothing was written to {self.dest}. Wait for "
                    f"the upload to finish or run it again, then download again."
                )
            if base != MANIFEST_NAME:
                continue
            data = _with_retries(
                functools.partial(fs.cat_file, name), what=f"reading {self.scrub.url(name)}", scrub=self.scrub
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
            raise DistkitError(
                f"{_rank_label()} {self.shown} does not match its upload manifest {MANIFEST_NAME}:"
                f"{_problem_lines(problems)}\nThe tree changed after it was uploaded (is another upload "
                f"to it running?). Nothing was written to {self.dest}; download again once it is complete."
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


@names_slips()
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
        FileNotFoundError: The source does not exist (over HTTP: a 404 or 410 answer, named in a
            note of the error).
        PermissionError: An HTTP server refused the credentials (401 or 403, named in the message).
        DistkitError: The source stayed unreachable after the retries (the message names the HTTP
            status of a 5xx, 408 or 429 answer), or an HTTP server gave another 4xx answer.
        MainProcessError: On the ranks that waited, when the fetching rank failed.
        ValueError: ``sha256`` is malformed, or given for a directory; or an HTTP source gets
            credentials twice (an ``Authorization`` header beside a URL's ``user:password@`` or an
            ``auth``), which aiohttp refuses to send.

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
    _check_http_credentials(source_text, options, shown=job.shown)

    def coordinated() -> Path:
        seen = coordination._run_leader_first(
            job.fetch,
            (),
            {},
            local=local,
            timeout_s=job.timeout_s + _FOLLOWER_GRACE_S,
            what=f"download({job.shown})",
            site=f"download({job.shown})",
        )
        # Same file as the fetching rank saw: done. Otherwise this rank is on another node than the
        # fetching one (local=False without a shared filesystem): fetch here, under the lock.
        if _fingerprint(dest_path) != seen:
            job.fetch()
        return dest_path

    return job.scrub.call(coordinated)


# Errors and reprs name the public home of these objects, not the private module that defines them.
for _public in (ChecksumMismatchError, LockTimeoutError, download):
    _public.__module__ = "distkit.storage"
del _public

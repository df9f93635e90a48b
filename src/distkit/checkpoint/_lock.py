"""One writer per checkpoint directory (private): a kernel lock beside a local directory, a lease
inside a remote one, and the description of their holder that refusals show."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import socket
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from distkit._utils.secrets import redact_url
from distkit.checkpoint._errors import CheckpointConflictError
from distkit.checkpoint._files import _join, _RemoteStorage, _Storage
from distkit.runtime import _rank_label

try:  # POSIX; elsewhere the writer lock is off (with a warning), see _LocalWriterLock
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

# The writer lock of a local directory sits beside it: `<directory>.distkit-lock`.
_LOCK_SUFFIX = ".distkit-lock"
# The writer lease of an object-store directory sits inside it (a bucket root has no "beside").
_LEASE_FILE = ".distkit-writer.json"


# --------------------------------------------------------------------------------------------------
# One writer per checkpoint directory: a kernel lock beside a local directory, a lease inside a remote one.


def _job_of_this_process() -> str | None:
    jobs = []
    if slurm := os.environ.get("SLURM_JOB_ID"):
        jobs.append(f"SLURM job {slurm}")
    # torchrun's own --rdzv-id when none is given is "none": no name to show.
    if (run := os.environ.get("TORCHELASTIC_RUN_ID")) and run != "none":
        jobs.append(f"torchelastic run {run}")
    return ", ".join(jobs) or None


def _holder_of_this_process(directory: str, owner: str | None = None) -> dict[str, Any]:
    now = time.time()
    holder: dict[str, Any] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now)),
        "since_unix": now,
        "directory": redact_url(directory),  # a lease is an object others can read
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


# The local locks this process holds. A forked child (a DataLoader worker) closes its copies of
# their descriptors at once: a flock belongs to the open file description, which a fork shares, so a
# worker outliving its SIGKILLed parent (DataLoader's watchdog notices within 5 s) would otherwise
# keep the lock, and the restarted job be refused naming a dead pid.
_HELD: weakref.WeakSet[_LocalWriterLock] = weakref.WeakSet()


def _close_in_child() -> None:
    for lock in list(_HELD):
        fd, lock.fd = lock.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_close_in_child)


class _LocalWriterLock:
    """An exclusive ``flock`` on ``<directory>.distkit-lock``, held while the manager writes there.

    The kernel releases a ``flock`` when its holder dies, however it dies, so a SIGKILLed job never
    leaves a stale lock. Each lock opens the file itself: ``flock`` locks belong to an open file
    description, so two managers in one process conflict like two processes do. The holder writes
    its host, pid, start time and job id into the file, for the error that refuses the next writer.
    The file stays when released (deleting a lock file races with a process that just opened it).
    """

    def __init__(
        self,
        directory: str,
        file_mode: int,
        *,
        what: str = "the checkpoint directory",
        conflict: Callable[[str, str], Exception] | None = None,
    ) -> None:
        self.directory = directory
        self.path = os.path.normpath(os.path.abspath(directory)) + _LOCK_SUFFIX
        self.file_mode = file_mode
        # What is locked, for the warning of a filesystem without locks; and the error refusing a
        # second writer, from the holder's description and the lock's path (a checkpoint
        # directory's CheckpointConflictError when None).
        self.what = what
        self.conflict = conflict
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
                if self.conflict is not None:
                    raise self.conflict(_describe_holder(holder), self.path) from None
                raise CheckpointConflictError(
                    f"another writer holds the checkpoint directory {self.directory}: "
                    f"{_describe_holder(holder)} (lock {self.path}). Two writers in one directory "
                    f"delete each other's checkpoints. Stop that job, or write to another directory; "
                    f"in one process, close() the other CheckpointManager first (or share one). The "
                    f"lock is released when its holder exits or dies, even when killed (on NFS, once "
                    f"the server notices a crashed client).",
                    directory=self.directory,
                    holder=holder,
                    label=_rank_label(),
                ) from err
            info = json.dumps(_holder_of_this_process(self.directory)).encode()
            with contextlib.suppress(OSError):  # the name is for error messages only
                os.ftruncate(fd, 0)
                os.pwrite(fd, info, 0)
            self.fd, self.pid = fd, os.getpid()
            _HELD.add(self)
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
            f"{_rank_label()} cannot lock {self.what} {self.directory} ({why}); writing without the "
            f"writer lock, so a second job writing there would not be detected.",
            stacklevel=5,
        )

    def check(self) -> None:
        """Nothing to check: the kernel holds the lock for as long as this process lives."""

    def release(self) -> None:
        fd, self.fd = self.fd, None
        _HELD.discard(self)
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
        self.scrub = storage.scrub
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

    def _write(self) -> None:
        holder = json.dumps(_holder_of_this_process(self.directory, self.owner)).encode()
        self.scrub.call(self.fs.pipe_file, self.path, holder)

    def acquire(self) -> None:
        if self.held:
            return
        previous = self.scrub.call(self._read)
        if previous is not None:
            warnings.warn(
                f"{_rank_label()} the checkpoint directory {redact_url(self.directory)} has a writer "
                f"lease of "
                f"{_describe_holder(previous)}; taking it over. An object store cannot tell a live "
                f"writer from a dead one, so the newest writer wins: if that job still runs, its next "
                f"save stops with CheckpointConflictError.",
                stacklevel=5,
            )
        self._write()
        self.held, self.pid = True, os.getpid()

    def check(self) -> None:
        """Raise :class:`CheckpointConflictError` if another writer took the lease over."""
        if not self.held:
            return
        current = self.scrub.call(self._read)
        if current is None:
            # Deleted by hand, not taken over (a new writer always writes one): hold it again.
            self._write()
            return
        if current.get("owner") != self.owner:
            raise CheckpointConflictError(
                f"another writer took over the checkpoint directory {redact_url(self.directory)}: "
                f"{_describe_holder(current)} (lease {redact_url(self.path)}). This manager stopped before "
                f"committing, so it changes nothing there any more. Two writers in one directory "
                f"delete each other's checkpoints: stop one job, or give each its own directory.",
                directory=self.directory,
                holder=current,
                label=_rank_label(),
            )

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if os.getpid() != self.pid:
            return  # a forked child's copy: the lease is the parent's
        # No Scrubber here: this also runs as a garbage-collection finalizer, at any allocation of any
        # thread, where its lock could deadlock and its traceback formatting (ast.parse) breaks a
        # parse in progress (CPython 3.11: "AST constructor recursion depth mismatch"). Nothing of
        # these calls is shown: their errors are dropped, and only fsspec's debug lines could show
        # the URL.
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

"""Private filesystem helpers shared by storage, checkpoints, loggers and bench.

**Atomic local writes.** A reader sees either the old file or the complete new one, never a
partial file, even when the writer is killed: write a temporary file in the same directory, fsync
it, ``os.replace`` it over the target (atomic within one filesystem), then fsync the directory so
the rename itself survives a power loss.

**Permissions.** :func:`umask_mode` gives the bits a file or directory would get from ``open`` or
``mkdir`` under the process umask, for files written through a temporary name (``mkstemp`` makes
them private).

Credentials in URLs, errors and logs are :mod:`distkit._utils.secrets`' concern.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_open", "fd_path", "fsync_dir", "get_umask", "temp_name", "umask_mode"]

#: Marker in every temporary name, so crash leftovers can be recognised and cleaned.
TEMP_MARKER = ".distkit-tmp"


def temp_name(target: Path) -> str:
    """A prefix for temporary files beside ``target``, recognisable as distkit's leftovers."""
    return f".{target.name}{TEMP_MARKER}-"


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Flush a directory entry (a rename or a new file) to stable storage; best effort on platforms
    without directory file descriptors."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: int = 0o600) -> Iterator[IO[bytes]]:
    """Open a binary file that appears at ``path`` only when the block exits without error.

    Args:
        path: Final location; its directory must exist.
        mode: Permission bits of the committed file (default: owner read/write only; pass
            ``umask_mode()`` for what ``open`` would give).

    Example:
        >>> with atomic_open("/tmp/example.bin") as f:
        ...     _ = f.write(b"data")
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_name(target), dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


# -- permissions ----------------------------------------------------------------------------------


def get_umask() -> int:
    """The process umask, read without changing it where the platform allows (Linux >= 4.7)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    # Elsewhere the only way is to set it and put it back. For that instant the mask is the
    # strictest one, so a file another thread creates meanwhile is more private, never less.
    previous = os.umask(0o077)
    os.umask(previous)
    return previous


def umask_mode(mode: int = 0o666) -> int:
    """``mode`` less the bits the process umask removes: what ``open`` (0o666) or ``mkdir``
    (0o777) would give a new file or directory.

    Example:
        >>> oct(umask_mode(0o666))  # under the usual umask 0o022  # doctest: +SKIP
        '0o644'
    """
    return mode & ~get_umask()


def fd_path(fd: int) -> str:
    """A path that opens the very file ``fd`` refers to, whatever happens to its name meanwhile.

    For handing an opened and checked file to a library that only takes paths. On Linux
    (``/proc/self/fd/N``) each open gets its own offset; on macOS (``/dev/fd/N``) an open shares
    ``fd``'s offset, so seek ``fd`` to 0 before each use and read it only with ``os.pread``.

    Raises:
        OSError: The platform has neither ``/proc/self/fd`` nor ``/dev/fd``.
    """
    for template in ("/proc/self/fd/{}", "/dev/fd/{}"):
        path = template.format(fd)
        if os.path.exists(path):
            return path
    raise OSError(f"cannot name the open file {fd}: this platform has neither /proc/self/fd nor /dev/fd.")

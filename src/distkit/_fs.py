"""Atomic local file writes shared by storage and checkpoints (private).

A reader sees either the old file or the complete new one, never a partial file, even when the
writer is killed: write a temporary file in the same directory, fsync it, ``os.replace`` it over
the target (atomic within one filesystem), then fsync the directory so the rename itself survives
a power loss.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_open", "fsync_dir", "temp_name"]

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
        mode: Permission bits of the committed file (default: owner read/write only).

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

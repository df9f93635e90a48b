"""Exception types raised by distkit.

Every distkit error derives from :class:`DistkitError`, so ``except distkit.DistkitError`` catches
them all. Messages that concern one rank start with ``[rank R/W]``.
"""

from __future__ import annotations

__all__ = ["CollectiveTimeoutError", "DistkitError", "MainProcessError"]


class DistkitError(RuntimeError):
    """Base class of every error distkit raises on purpose."""


class CollectiveTimeoutError(DistkitError, TimeoutError):
    """A wait on other ranks passed its deadline.

    Attributes:
        missing_ranks: The ranks that did not arrive, when the backend could tell; else ``None``.
        timeout_s: The deadline that passed, in seconds.
    """

    def __init__(self, message: str, *, missing_ranks: list[int] | None, timeout_s: float) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks
        self.timeout_s = timeout_s


class MainProcessError(DistkitError):
    """The main process failed inside a section the other ranks were waiting on.

    Raised on every rank that was waiting; the main process re-raises its own exception instead.

    Attributes:
        exc_type: Qualified name of the original exception type, e.g. ``"FileNotFoundError"``.
        exc_message: ``str()`` of the original exception.
        remote_traceback: The main process's formatted traceback.
    """

    def __init__(self, message: str, *, exc_type: str, exc_message: str, remote_traceback: str) -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback

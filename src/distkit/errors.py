"""Exception types raised by distkit.

Every distkit error derives from :class:`DistkitError`, so ``except distkit.DistkitError`` catches
them all. Messages that concern one rank start with ``[rank R/W]``.
"""

from __future__ import annotations

__all__ = ["CollectiveMismatchError", "CollectiveTimeoutError", "DistkitError", "MainProcessError"]


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


class CollectiveMismatchError(DistkitError):
    """Some ranks wait in a collective that the others can never reach.

    Raised at once, on the ranks that arrived, when a distkit collective (``barrier``,
    ``reduce_metrics``, the gathers, a checkpoint save's gather) was started by some ranks only:
    the ranks that did not arrive wait in another collective, or have left the job. See
    ``docs/debugging.md``. Also raised on a waiting rank whose ``main_process_first`` or
    ``run_on_main`` section was paired with one the main process made at another line (the ranks
    made sections in another order or number).

    Attributes:
        missing_ranks: The ranks that can never arrive.
        where: One line per missing rank saying where it is (its operation, file and line).

    Example:
        >>> err = CollectiveMismatchError("rank 1 is elsewhere", missing_ranks=[1], where=["..."])
        >>> err.missing_ranks
        [1]
    """

    def __init__(
        self, message: str, *, missing_ranks: list[int] | None = None, where: list[str] | None = None
    ) -> None:
        # Optional so that pickle (which calls cls(message) and then restores __dict__) works.
        super().__init__(message)
        self.missing_ranks = missing_ranks or []
        self.where = where or []


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

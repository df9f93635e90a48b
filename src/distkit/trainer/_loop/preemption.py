"""SIGTERM during ``fit``: the signal becomes a flag that the next backward pass tells every rank
(see :mod:`distkit.trainer._loop.nonfinite`); ``fit`` then saves a checkpoint and exits with code 0."""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING, Any

from distkit import runtime

if TYPE_CHECKING:
    from distkit.trainer._run import Run

__all__: list[str] = []


class _Preempted(SystemExit):
    """Raised by ``fit`` after a preemption signal was handled: checkpoint saved, exit code 0."""

    def __init__(self) -> None:
        super().__init__(0)


_log = runtime.get_logger("distkit.trainer", main_process_only=True)


def install_handler(run: Run) -> Any:
    """Route SIGTERM to a flag; returns what to restore (``None``: nothing was installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None  # Python sets signal handlers from the main thread only
    previous: Any = signal.getsignal(signal.SIGTERM)
    if previous is None:  # installed from C: restore the default action
        previous = signal.SIG_DFL

    def on_sigterm(signum: int, frame: Any) -> None:
        if run.preempt_requested:
            # A second SIGTERM: the first was not acted on (this rank is stuck outside the step
            # loop, or the others are). Terminate as if fit() had not been running.
            signal.signal(signal.SIGTERM, previous)
            signal.raise_signal(signal.SIGTERM)
            return
        # Only flags: the next backward pass tells every rank (see the module docs).
        run.preempt_requested = True
        run.request_stop = True

    signal.signal(signal.SIGTERM, on_sigterm)
    return previous


def restore_handler(run: Run, previous: Any) -> None:
    """Put back the SIGTERM handler :func:`install_handler` replaced; deliver a late SIGTERM."""
    if previous is None:
        return
    signal.signal(signal.SIGTERM, previous)
    if run.preempt_requested and not run.preempted:
        # The signal came after the last step; deliver it as if fit() had not been running.
        signal.raise_signal(signal.SIGTERM)


def preempt(run: Run) -> None:
    """Every rank agreed that some rank got SIGTERM: save a checkpoint and leave ``fit``."""
    _log.warning(
        "SIGTERM received: saving a checkpoint at step %d, then exiting with code 0", run.global_step
    )
    checkpoint = run.checkpoint
    if checkpoint is not None:
        checkpoint.save(run.trainer, None)
        checkpoint.manager.wait()
    else:
        _log.warning("no ModelCheckpoint callback: nothing was saved before exiting")
    run.preempted = True

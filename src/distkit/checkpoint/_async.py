"""The save in flight of an asynchronous :class:`~distkit.checkpoint.CheckpointManager` (private).

With ``async_save=True`` the training thread only copies the state to CPU memory; a writer thread
(rank 0's, or every rank's in a sharded save) writes and commits it, then runs retention and tells
the other ranks through the save's handshake. :class:`_Pending` is that save until every rank has
settled it (at the next ``save()`` or ``wait()``), and interpreter exit waits for its thread, prints
a failure nobody saw and makes the exit status 1 (issue 22). When to start a save and when to wait
stays the manager's concern.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from distkit import runtime
from distkit._utils.secrets import redact_url
from distkit.checkpoint._commit import _Handshake
from distkit.checkpoint._files import _Storage
from distkit.checkpoint._format import _manifest_builder
from distkit.checkpoint._sharded import _start_async_sharded
from distkit.checkpoint._state import _check_loadable, _collect, _to_cpu
from distkit.runtime import _rank_label


@dataclass(eq=False)  # compared by identity: the exit registry removes this very save
class _Pending:
    """The save in flight: its writer thread (rank 0; every rank in a sharded save) and the handshake
    every rank settles."""

    step: int
    path: str
    handshake: _Handshake | None
    main: bool
    thread: threading.Thread | None = None
    error: BaseException | None = None
    # The error was already raised in save() on this rank; wait() only settles the handshake.
    raised: bool = False
    # "[rank R/W]" when the save started: at interpreter exit the process group may be gone.
    label: str = field(default_factory=_rank_label)


# --------------------------------------------------------------------------------------------------
# Starting the writer threads.


def _snapshot_on_main(pending: _Pending, state: Mapping[str, Any]) -> dict[str, Any]:
    """Rank 0 of a full async save: ``state`` copied to CPU memory (the only stall the training loop
    pays). A failure is recorded in ``pending`` and published before it is raised: the other ranks
    learn it at their next ``save()`` or ``wait()``, like a background failure."""
    try:
        payload = _collect(state)
        _check_loadable(payload)
        on_cpu: dict[str, Any] = _to_cpu(payload)  # the same structure, its tensors copied to CPU
        return on_cpu
    except BaseException as err:
        pending.error, pending.raised = err, True
        if pending.handshake is not None:
            pending.handshake.publish(err)
        raise


def _full_writer(
    storage: _Storage,
    pending: _Pending,
    snapshot: dict[str, Any],
    metrics: dict[str, float] | None,
    *,
    file_mode: int,
    guard: Callable[[], None],
    on_committed: Callable[[int], None],
) -> threading.Thread:
    """Rank 0's writer thread (not started) of a full async save of ``snapshot``; once the checkpoint
    is committed it calls ``on_committed(step)`` (retention), then publishes the outcome."""
    manifest = _manifest_builder(pending.step, metrics, list(snapshot))

    def write() -> None:
        try:
            storage.write_checkpoint(pending.path, snapshot, manifest, file_mode, guard)
        except BaseException as err:
            pending.error = err
        else:
            on_committed(pending.step)  # committed: from here on only warnings
        finally:
            if pending.handshake is not None:
                pending.handshake.publish(pending.error)

    return threading.Thread(target=write, name=f"distkit-checkpoint-step-{pending.step}")


def _async_group(timeout_s: float) -> Any:
    """The gloo group of the threads that finish async sharded saves: their collectives must not
    interleave with the training thread's. Collective: made once per manager, on every rank."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _start_sharded_writer(
    storage: _Storage,
    pending: _Pending,
    state: Mapping[str, Any],
    metrics: dict[str, float] | None,
    *,
    file_mode: int,
    guard: Callable[[], None],
    group: Any,
    on_committed: Callable[[int], None],
) -> threading.Thread:
    """Every rank's writer thread (started) of a sharded async save: DCP writes the shards, then rank
    0 commits, calls ``on_committed(step)`` (retention) and publishes the outcome. A failure before
    the threads start raises on every rank at once, so nothing is left pending."""

    def done(error: BaseException | None) -> None:
        pending.error = error
        if pending.main:
            if error is None:
                on_committed(pending.step)  # committed: from here on only warnings
            if pending.handshake is not None:
                pending.handshake.publish(error)

    return _start_async_sharded(
        storage,
        pending.path,
        state,
        step=pending.step,
        metrics=metrics,
        file_mode=file_mode,
        guard=guard,
        collect=_collect,
        check=_check_loadable,
        snapshot=_to_cpu,
        group=group,
        on_done=done,
        name=f"distkit-checkpoint-step-{pending.step}",
    )


# --------------------------------------------------------------------------------------------------
# Interpreter exit waits for every manager's save in flight.


_live_managers: weakref.WeakSet[Any] = weakref.WeakSet()  # CheckpointManagers
# Saves in flight that no wait() has settled, with their manager's directory and timeout. Strong
# references: a manager garbage collected while its save ran (a local of a function that returned)
# must still have that save's failure reported at exit.
_unsettled: list[tuple[_Pending, str, float]] = []
_atexit_registered = False

# The exit status of a process whose background save failed unseen: 1, what Python itself returns
# for an uncaught exception, so torchrun, schedulers and shells treat the run as failed the same way.
_EXIT_STATUS_SAVE_FAILED = 1


def _watch_at_exit(manager: Any) -> None:
    """At interpreter exit, report ``manager``'s save in flight if it failed, and release its lock."""
    global _atexit_registered
    _live_managers.add(manager)
    if not _atexit_registered:
        atexit.register(_finish_at_exit)
        _atexit_registered = True


def _track(pending: _Pending, *, directory: str, timeout_s: float) -> None:
    """``pending`` is in flight until :func:`_settle`; interpreter exit reports it if it failed."""
    _unsettled.append((pending, directory, timeout_s))


def _settle(pending: _Pending) -> None:
    """Every rank has learned ``pending``'s outcome (``wait()``): nothing is left to report at exit."""
    _unsettled[:] = [entry for entry in _unsettled if entry[0] is not pending]


def _failed_unseen_message(pending: _Pending, error: BaseException, directory: str) -> str:
    return (
        f"distkit: {pending.label} the background save of step {pending.step} to "
        f"{redact_url(pending.path)} failed and nothing waited for it before the process ended: "
        f"{type(error).__name__}: {error}\n"
        f"  Step {pending.step} was not saved; the checkpoints committed before it in "
        f"{redact_url(directory)} are untouched (CheckpointManager.latest() picks the newest to resume "
        f"from). Fix the cause above, and call manager.wait() (or close()) before the script ends to get "
        f"this error where it happens; this process exits with status {_EXIT_STATUS_SAVE_FAILED}."
    )


def _finish_at_exit() -> None:
    # Writer threads are not daemons, so the interpreter has already let them finish; what is left
    # is to report a failure nobody will see otherwise. No handshake here: the other ranks may be
    # gone already (a failure on rank 0 makes rank 0's exit status 1, which torchrun reports).
    failed = False
    for pending, directory, timeout_s in list(_unsettled):
        if pending.thread is None:  # a rank that does not write: rank 0 reports
            continue
        pending.thread.join(timeout_s)
        if pending.error is not None and not pending.raised:
            failed = True
            print(_failed_unseen_message(pending, pending.error, directory), file=sys.stderr, flush=True)
    if not failed:
        return
    if getattr(sys, "last_value", None) is not None:
        # The script ended with an uncaught exception (its traceback is above): the exit status is
        # 1 already, so the rest of the shutdown runs as usual.
        return
    # An atexit handler cannot change the exit status (a SystemExit raised here is ignored): only
    # os._exit can. It skips what would still run (the atexit handlers registered before this one,
    # such as distkit.shutdown() registered by init(); finalizers; buffered streams), so first do
    # what matters of that: release every manager's writer lock (an object-store lease would
    # otherwise outlive this process), shut distkit's runtime down (the hang doctor stops and the
    # other ranks learn that this one left), flush the logging handlers and the standard streams.
    # A script that ended with sys.exit(N) exits 1 instead of N.
    for manager in list(_live_managers):
        with contextlib.suppress(Exception):
            manager._release_lock()
    with contextlib.suppress(Exception):
        runtime.shutdown()
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    os._exit(_EXIT_STATUS_SAVE_FAILED)

"""Daemon threads that block in torch's C++ (connections to the job's store), and a process exit
that waits for them.

distkit connects to the store on a daemon thread whenever a connection may hang (a port held by
a silent program, a store whose host died): the caller waits with a deadline, and the thread is
left behind if the deadline passes. Python before 3.14 ends a daemon thread that takes the GIL
back after the interpreter began finalizing by unwinding its stack. When that thread is
returning from a torch call that released the GIL, the unwinding passes through pybind11's GIL
guard, whose destructor may not throw, and the whole process aborts: "terminate called without
an active exception", SIGABRT and a core file, instead of the exit code the script chose. It
happened to a rank that raised early in ``fit`` while the hang doctor's second store connection
was still being made on a busy machine (3 of 22 runs of tests/test_failure_exit.py's jobs, their
ranks forked with torch._dynamo imported).

So :func:`start` keeps its threads, and at exit (an ``atexit`` hook, which runs before the
finalization) the process waits for each one whose caller still waits for it, up to that
caller's deadline: a connection to a live store answers within milliseconds, one whose peer
ends while it waits fails as fast, and one that keeps retrying is waited for no longer than its
caller would. A caller that stops waiting (it has its answer, its deadline passed, or an
exception interrupted it) :func:`abandon`-s the thread, which is then not waited for: it is
stuck retrying a dead or silent peer and does not come back during the finalization.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["abandon", "clone", "start"]

_running: dict[threading.Thread, float] = {}  # thread -> its caller's deadline (time.monotonic)
_lock = threading.Lock()
_hooked = False


def start(target: Callable[[], None], name: str, deadline_s: float) -> threading.Thread:
    """Run ``target`` on a new daemon thread that the process's exit waits for, up to
    ``deadline_s`` from now: how long the caller waits for it (see the module docs). The caller
    calls :func:`abandon` when it stops waiting.

    Example:
        >>> thread = start(lambda: None, "distkit-example", deadline_s=1.0)
        >>> thread.join(1.0)
        >>> abandon(thread)
    """
    global _hooked

    def run() -> None:
        try:
            target()
        finally:
            abandon(thread)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _lock:
        if not _hooked:
            atexit.register(_wait_at_exit)
            _hooked = True
        _running[thread] = time.monotonic() + deadline_s
    try:
        thread.start()
    except BaseException:
        abandon(thread)  # never started: nothing to wait for (the exit would fail to join it)
        raise
    return thread


def abandon(thread: threading.Thread) -> None:
    """Stop waiting for ``thread`` at exit: it ended, or its caller stopped waiting for it."""
    with _lock:
        _running.pop(thread, None)


def _wait_at_exit() -> None:
    with _lock:
        waited = list(_running.items())
    for thread, deadline in waited:
        thread.join(max(0.0, deadline - time.monotonic()))


def clone(
    store: Any, deadline_s: float, answers: Callable[[], bool] | None = None, longer_s: float = 0.0
) -> Any:
    """``store.clone()`` (a second connection to the job's store) on a thread of :func:`start`:
    the new connection, the error it raised, or :class:`TimeoutError` after ``deadline_s``; with
    ``answers`` (whether the store still answers a connection the caller has), for as long as it
    does, up to ``longer_s`` more. A thread still connecting then is left behind (:func:`abandon`).

    Example:
        >>> import datetime, torch.distributed as dist
        >>> store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))
        >>> second = clone(store, deadline_s=5.0)
    """
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = store.clone()
        except BaseException as err:  # handed to the caller
            box["error"] = err

    longest = deadline_s + (longer_s if answers is not None else 0.0)
    thread = start(connect, "distkit-store-clone", longest)
    started = time.monotonic()
    try:
        thread.join(deadline_s)
        # A live store answers at once; one whose host died fails the question at once too.
        while (
            thread.is_alive() and answers is not None and time.monotonic() - started < longest and answers()
        ):
            thread.join(1.0)
    finally:
        abandon(thread)  # one still retrying a store that does not answer is left behind
    if "error" in box:
        raise box["error"]
    if "store" not in box:
        raise TimeoutError(
            f"no second connection to the job's store within {time.monotonic() - started:.0f} s"
        )
    return box["store"]

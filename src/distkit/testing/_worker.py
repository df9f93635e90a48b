"""The child side of :mod:`distkit.testing`: one rank that joins a group and runs tasks on request.

A rank is started by the parent (``_runner``) through :mod:`multiprocessing` (forkserver where the
platform has it) and talks to it over a pipe with pickled tuples:

parent -> rank: ``("task", sys_path, payload)`` with ``payload = pickle.dumps((fn, args, kwargs))``,
or ``("stop",)``.

rank -> parent: ``("ready", pid)`` once joined, then for each task one of ``("ok", result_bytes)``,
``("error", exc_line, traceback_text)``, ``("skip", reason)``, ``("xfail", reason)``.

This module never imports pytest: a rank only meets pytest through the user's own test module.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import os
import pickle
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TextIO

from distkit.env import _local_job_environ

__all__: list[str] = []

# Launcher variables of an outer job (pytest itself run under torchrun) must not leak into the
# ranks' own job description; distkit.env reads TORCHELASTIC_RUN_ID to name the launcher.


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to start; pickled by the parent into the child."""

    rank: int
    world_size: int
    backend: str
    init: bool
    environ: dict[str, str]
    log_path: str
    stack_path: str


# Kept open for the life of the process: faulthandler writes into it from a signal handler.
_stack_file: TextIO | None = None


def job_environ(
    base: dict[str, str], *, rank: int, world_size: int, port: int, extra: dict[str, str] | None
) -> dict[str, str]:
    """The environment of one rank: ``base`` with the torchrun-style variables of this job set."""
    environ = _local_job_environ(base, rank=rank, world_size=world_size, port=port)
    # torchrun's own default with several processes per node: N ranks that each use every core
    # for intra-op threads oversubscribe the CPU and make tests slow and timing-dependent.
    environ.setdefault("OMP_NUM_THREADS", "1")
    environ.update(extra or {})
    return environ


def _send(conn: Connection, message: tuple[Any, ...]) -> None:
    conn.send_bytes(pickle.dumps(message))


def _watch_parent(lifeline: Connection) -> None:
    # The parent never writes to the lifeline; it becomes readable (EOF) only when the parent has
    # closed it or died. Without this, a rank stuck in a collective would outlive a killed pytest.
    with contextlib.suppress(Exception):
        lifeline.poll(None)
    os._exit(70)


def _redirect_output(log_path: str) -> None:
    # Both streams go to a per-rank file the parent forwards after each call: a forkserver child
    # would otherwise write to whatever fd 1/2 the server inherited (possibly pytest's capture file
    # of an unrelated test).
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            # Line buffering so that output printed before a hang or a kill is not lost.
            stream.reconfigure(line_buffering=True)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


def _describe(exc: BaseException, *, skip_frames: int) -> tuple[str, str, str]:
    tb = exc.__traceback__
    for _ in range(skip_frames):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    line = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return "error", line, text


def _outcome(exc: BaseException) -> tuple[str, str] | None:
    # pytest.skip/xfail raise classes from _pytest.outcomes; the user's module imported pytest if
    # it can raise them, so looking in sys.modules is enough and never imports pytest here.
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is not None:
        if isinstance(exc, outcomes.Skipped):
            return "skip", str(exc.msg or "")
        if isinstance(exc, outcomes.XFailed):
            return "xfail", str(exc.msg or "")
    unittest = sys.modules.get("unittest")
    if unittest is not None and isinstance(exc, unittest.SkipTest):
        return "skip", str(exc)
    return None


def _run_task(sys_path: list[str], payload: bytes) -> tuple[Any, ...]:
    if sys.path != sys_path:
        # The parent's sys.path holds pytest's rootdir entries; without them the test module that
        # defines fn cannot be imported here. New directories need fresh finder caches.
        sys.path[:] = sys_path
        importlib.invalidate_caches()
    try:
        fn, args, kwargs = pickle.loads(payload)
    except BaseException as exc:
        kind, line, text = _describe(exc, skip_frames=1)
        return (
            kind,
            f"could not load the task in the rank: {line} (fn must be importable by name here: "
            f"define it at module level in a module on sys.path)",
            text,
        )
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        outcome = _outcome(exc)
        if outcome is not None:
            return outcome
        # Skip this module's own frame: the traceback starts in the user's function.
        return _describe(exc, skip_frames=1)
    finally:
        _flush()
    try:
        return ("ok", pickle.dumps(result))
    except BaseException as exc:
        kind, line, text = _describe(exc, skip_frames=0)
        return (
            kind,
            f"{getattr(fn, '__qualname__', fn)!s} returned a {type(result).__name__} that cannot be "
            f"pickled ({line}); return plain data (numbers, strings, lists, dicts, CPU tensors)",
            text,
        )


def _join(spec: WorkerSpec) -> None:
    if spec.init:
        import distkit

        distkit.init(spec.backend, timeout_s=distkit.DEFAULT_TIMEOUT_S)
    # torch was imported before OMP_NUM_THREADS was set (forkserver preload), so apply it here.
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def _leave() -> None:
    import torch.distributed as dist

    import distkit

    distkit.shutdown()
    # A function run with init=False may have created the group by hand; the process is exiting.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(spec: WorkerSpec, conn: Connection, lifeline: Connection) -> None:
    """Run one rank until the parent says stop or goes away. The parent's ``Process`` target."""
    global _stack_file
    threading.Thread(target=_watch_parent, args=(lifeline,), name="distkit-parent-watch", daemon=True).start()
    # Ctrl-C reaches every process of the terminal's group; the parent handles it and kills us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _redirect_output(spec.log_path)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    _stack_file = open(spec.stack_path, "a")  # noqa: SIM115 - must outlive this function
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True, chain=False)
    os.environ.clear()
    os.environ.update(spec.environ)

    try:
        _join(spec)
    except BaseException as exc:
        _flush()
        _send(conn, _describe(exc, skip_frames=1))
        return
    _send(conn, ("ready", os.getpid()))

    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent is gone
        if message[0] == "stop":
            break
        _send(conn, _run_task(message[1], message[2]))

    try:
        _leave()
    finally:
        _flush()

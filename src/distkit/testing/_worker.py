"""The child side of :mod:`distkit.testing`: one rank that joins a group and runs tasks on request.

A rank is started by the parent (``_runner``) through :mod:`multiprocessing` (forkserver where the
platform has it) and talks to it over a pipe with pickled tuples:

parent -> rank: ``("task", sys_path, payload)`` with ``payload = pickle.dumps((fn, args, kwargs))``,
``("check", check_id, group_names, timeout_s)``, or ``("stop",)``.

rank -> parent: ``("ready", pid, state)`` once joined, then for each task one of
``("ok", result_bytes, state)``, ``("error", exc_line, traceback_text)``, ``("skip", reason, state)``,
``("xfail", reason, state)``; for a check, ``("ok", pickle.dumps(None), state)`` or an error.

``state`` (see :func:`step_state`) tells the parent how many operations this rank has issued on each
process group, so that it can see a task that left a collective unmatched.

This module never imports pytest: a rank only meets pytest through the user's own test module.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from distkit import runtime
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


#: What a forkserver imports before it forks anything: the parent's (which starts the ranks) and each
#: rank's own (which starts that rank's DataLoader workers). Importing torch is most of a start.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "distkit")

# Kept open for the life of the process: faulthandler writes into it from a signal handler.
_stack_file: TextIO | None = None
# Group name -> how messages name it; a group's name and ranks never change.
_group_labels: dict[str, str] = {}

# Whether this rank joined its group for its pool (spec.init): a task that ends the group (a
# training main()'s last line, distkit.shutdown()) then leaves a pool that cannot be reused.
_pooled = False

#: One rank's progress: ``("group", name, label)`` -> operations issued on that process group,
#: ``("distkit", kind)`` -> calls of distkit's store-based collectives of that kind, and
#: :data:`LEFT` -> 1 once a task ended the group the rank was started in.
StepState = dict[tuple[str, ...], int]
LEFT = ("pool", "left")


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


def _groups() -> dict[Any, str]:
    # Every process group this rank belongs to, with its name (torch's own registry; the default
    # group included). Groups a rank is not a member of are not listed on that rank.
    if not dist.is_initialized():
        return {}
    return dict(distributed_c10d._world.pg_names)


def _label(group: Any, name: str) -> str:
    label = _group_labels.get(name)
    if label is None:
        if group is distributed_c10d._get_default_group():
            label = "the default process group"
        else:
            label = f"process group {name!r} of ranks {dist.get_process_group_ranks(group)}"
        _group_labels[name] = label
    return label


def step_state() -> StepState:
    """How far this rank has got, to compare with the other ranks after each task.

    torch's per-group sequence number counts every operation issued on the group (collectives
    and point-to-point), when it is issued, so an ``async_op=True`` collective that only some
    ranks started, or one whose wait timed out, shows as a difference between ranks. distkit's
    store-based collectives (``barrier()``, ``main_process_first()``, checkpoint hand-shakes) number
    their keys with per-process counters, which must also agree.
    """
    state: StepState = {}
    for group, name in _groups().items():
        try:
            count = group._get_sequence_number_for_group()
        except RuntimeError:  # a backend that does not count operations: this group is not checked
            continue
        state[("group", name, _label(group, name))] = count
    current = runtime._current()
    if current is not None:
        for kind, count in current.counters.items():
            state[("distkit", kind)] = count
    if _pooled and not dist.is_initialized():
        state[LEFT] = 1
    return state


def _check_in_step(check_id: int, names: list[str], timeout_s: float) -> tuple[Any, ...]:
    """Run one all-reduce on each named group this rank is in and check its value.

    The parent asks for this when the ranks issued different numbers of operations in a task,
    which asymmetric point-to-point traffic also causes. An all-reduce of ``check_id`` is matched
    by tag with the next collective of every other rank: if one rank left a collective pending,
    that is the one it meets, so the check returns another value, fails, or times out.
    """
    by_name = {name: group for group, name in _groups().items()}
    started = []
    try:
        # Started together and then waited, so ranks in different subsets of groups cannot wait
        # for each other in a cycle.
        for name in names:
            group = by_name.get(name)
            if group is None:
                continue  # this rank is not a member
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if dist.get_backend(group) == "nccl"
                else torch.device("cpu")
            )
            probe = torch.tensor([float(check_id)], dtype=torch.float64, device=device)
            work = dist.all_reduce(probe, group=group, async_op=True)
            started.append((_label(group, name), dist.get_world_size(group), probe, work))
        for label, size, probe, work in started:
            try:
                work.wait(timeout=timedelta(seconds=timeout_s))
            except Exception as exc:
                kind, line, text = _describe(exc, skip_frames=0)
                return kind, f"the check all-reduce on {label} failed: {line}", text
            got, expected = probe.item(), float(check_id * size)
            if got != expected:
                return (
                    "error",
                    f"the check all-reduce on {label} returned {got:.17g} instead of "
                    f"{expected:.17g}: another rank's pending operation took part in it",
                    "",
                )
    except Exception as exc:
        return _describe(exc, skip_frames=0)
    return ("ok", pickle.dumps(None), step_state())


def _with_state(message: tuple[Any, ...]) -> tuple[Any, ...]:
    try:
        return (*message, step_state())
    except Exception as exc:  # e.g. a task that tore down torch's group registry
        kind, line, text = _describe(exc, skip_frames=0)
        return kind, f"the task returned, but its process groups could not be inspected: {line}", text


def _run_task(sys_path: list[str], payload: bytes) -> tuple[Any, ...]:
    doctor = runtime._doctor()
    if doctor is not None:
        # An earlier task may have caught what a fit raised on this rank: the rank went on.
        doctor.carry_on()
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
            return _with_state(outcome)
        # Skip this module's own frame: the traceback starts in the user's function.
        return _describe(exc, skip_frames=1)
    finally:
        _flush()
    try:
        return _with_state(("ok", pickle.dumps(result)))
    except BaseException as exc:
        kind, line, text = _describe(exc, skip_frames=0)
        return (
            kind,
            f"{getattr(fn, '__qualname__', fn)!s} returned a {type(result).__name__} that cannot be "
            f"pickled ({line}); return plain data (numbers, strings, lists, dicts, CPU tensors)",
            text,
        )


def _preload_own_forkserver() -> None:
    """Make the forkserver this rank starts its processes from (DataLoader workers) a quick one.

    Forking the rank itself is not safe: its other threads can hold a lock at that moment that the
    child then waits for forever. Before CPython 3.10.15 and 3.11.10, a gloo thread that frees a
    tensor a collective held creates a Python thread state under the interpreter's head lock, and a
    child forked meanwhile hangs in ``PyOS_AfterFork_Child`` (python/cpython#112275; see
    docs/testing.md). A rank's default start method is forkserver (inherited from the server that
    started it): a single-threaded server of the rank's own, started on first use. It imports torch
    once, so that it forks each worker in milliseconds; without, every worker would import it.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    # distkit's loader unpickles its dataset wrapper from distkit.data in each worker, and a test
    # module's dataset comes with pytest. (The test module itself cannot be preloaded: before
    # Python 3.12.8 the server ignores this process's sys.path, python/cpython#117378.)
    extra = ["distkit.data", *(["pytest"] if "pytest" in sys.modules else [])]
    multiprocessing.set_forkserver_preload(["__main__", *FORKSERVER_PRELOAD, *extra])


def _join(spec: WorkerSpec) -> None:
    global _pooled
    if spec.init:
        runtime.init(spec.backend, timeout_s=runtime.DEFAULT_TIMEOUT_S)
        _pooled = True
    # torch was imported before OMP_NUM_THREADS was set (forkserver preload), so apply it here.
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _leave() -> None:
    runtime.shutdown()
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
    _preload_own_forkserver()

    try:
        _join(spec)
    except BaseException as exc:
        _flush()
        _send(conn, _describe(exc, skip_frames=1))
        return
    _send(conn, ("ready", os.getpid(), step_state()))

    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent is gone
        if message[0] == "stop":
            break
        if message[0] == "check":
            _send(conn, _check_in_step(*message[1:]))
            continue
        _send(conn, _run_task(message[1], message[2]))

    try:
        _leave()
    finally:
        _flush()

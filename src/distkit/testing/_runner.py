"""The parent side of :mod:`distkit.testing`: start ranks, send them work, collect what comes back.

One ``_Group`` is a set of ``world_size`` live ranks around one TCP store that this process hosts.
A :class:`RankPools` keeps one healthy group per ``(world_size, backend)`` for reuse and replaces
it after any failure; ``fresh=True`` calls get a group of their own that lives for that call only.
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import inspect
import multiprocessing as mp
import os
import pickle
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import unittest
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait as wait_ready
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, Literal, NoReturn, TypeVar

import torch
import torch.distributed as dist

from distkit._doctor import doctor as _hang
from distkit.errors import DistkitError
from distkit.testing import _worker

__all__ = ["DEFAULT_TIMEOUT_S", "RankFailedError", "RankFailure", "RankPools", "Ranks", "run_ranks"]

T = TypeVar("T")

# A unit test that takes longer than two minutes is either hung or belongs in a benchmark.
DEFAULT_TIMEOUT_S = 120.0
# After the first failure, how long the other ranks get to report their own outcome before they
# are killed. gloo peers of a dead rank fail within about 0.3 s (FACTS.md); 3 s leaves room to
# format and send a traceback on a loaded 2-core machine.
DEFAULT_GRACE_S = 3.0
# Starting N ranks from a warm forkserver and joining the group takes about 0.03 s; the first start
# in a process imports torch in the forkserver (about 2 s here). A minute covers a loaded CI
# machine without letting a broken rendezvous hang the session.
DEFAULT_START_TIMEOUT_S = 60.0
# distkit.shutdown() is local (no collective), so a stopping rank exits at once; this bounds it.
_STOP_TIMEOUT_S = 10.0
# faulthandler writes from a signal handler within milliseconds; this bounds a wedged rank.
_STACK_WAIT_S = 2.0
# How long to wait for the kernel to reap a SIGKILLed rank.
_KILL_WAIT_S = 5.0
# Lines of a dead rank's own output quoted in the failure (its last words: a segfault trace, an
# abort message from C++).
_TAIL_LINES = 30
# Deadline of the check all-reduce a pool runs when ranks issued different numbers of operations in
# a task. Healthy, it is one scalar all-reduce on idle ranks (under a millisecond), so this leaves
# four orders of magnitude for a loaded machine. It only runs out when an operation the task left
# pending blocks every rank's check (a broadcast started on one rank only does); other leftovers
# make the check fail at once.
_CHECK_TIMEOUT_S = 10.0

# Frames of this file end the interesting part of a rank's stack.
_WORKER_FRAME = f'File "{_worker.__file__}"'
# The hang doctor's threads (docs/debugging.md) wait in this file; a hang's dump leaves them out.
_DOCTOR_FRAME = f'File "{_hang.__file__}"'

_FailureKind = Literal["exception", "exit", "timeout", "killed", "unmatched"]


@dataclass(frozen=True)
class RankFailure:
    """How one rank failed in a :func:`run_ranks` call.

    Attributes:
        rank: The failing rank.
        world_size: Number of ranks in the call.
        kind: ``"exception"`` (the function raised), ``"exit"`` (the process died),
            ``"timeout"`` (still running at the deadline), ``"killed"`` (still running when
            another rank had failed and the grace period ran out) or ``"unmatched"`` (the
            function returned on a pool rank, but issued more operations on a process group than
            another rank did: a collective it left unmatched).
        summary: One line, e.g. ``"ValueError: bad shape"`` or ``"exited with code -9 (SIGKILL)"``.
        details: The rank's full traceback (exceptions), its Python stack (timeouts), or the last
            lines of its output (exits); empty when there is nothing to show.
        pid: The rank's process id, when it got far enough to report it.
        exitcode: The exit code of a rank that died (negative: killed by that signal).

    Example:
        >>> failure = RankFailure(1, 2, "exception", "ValueError: boom", "Traceback ...", 42, None)
        >>> failure.label
        '[rank 1/2]'
    """

    rank: int
    world_size: int
    kind: _FailureKind
    summary: str
    details: str
    pid: int | None
    exitcode: int | None

    @property
    def label(self) -> str:
        """``[rank R/W]``, the prefix of every rank-specific message."""
        return f"[rank {self.rank}/{self.world_size}]"


class RankFailedError(DistkitError):
    """One or more ranks of a :func:`run_ranks` call failed, hung or died.

    The message has the first failure in full (its traceback, or every rank's stack for a hang),
    then one line per other failing rank, in the manner of torch.distributed.elastic's
    ``ChildFailedError``.

    Attributes:
        failures: Every failing rank, the first observed failure first, then by rank.

    Example:
        >>> err = RankFailedError("boom", failures=[])
        >>> isinstance(err, DistkitError)
        True
    """

    def __init__(self, message: str, *, failures: list[RankFailure] | None = None) -> None:
        # Optional so that pickle (which calls cls(message) and then restores __dict__) works.
        super().__init__(message)
        self.failures = failures or []


@dataclass
class _Outcome:
    # What one rank reported (or what became of it) in one phase of a group's life.
    kind: Literal["ready", "ok", "error", "skip", "xfail", "exit", "timeout", "killed"]
    value: Any = None
    line: str = ""
    text: str = ""
    exitcode: int | None = None
    # Position in the order the parent observed outcomes; unobserved ones sort last, by rank.
    order: float = float("inf")
    # How far the rank had got when it reported (ready, ok, skip): see _worker.step_state.
    state: _worker.StepState | None = None


def _exit_line(exitcode: int | None) -> str:
    if exitcode is None:
        return "closed its pipe without reporting a result"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"exited with code {exitcode} ({name})"
    return f"exited with code {exitcode} before reporting a result"


def _tidy_stack(dump: str) -> str:
    """Keep what a reader needs from a faulthandler dump: the user's frames, thread by thread."""
    blocks: list[str] = []
    for block in dump.strip().split("\n\n"):
        if "in _watch_parent" in block or _DOCTOR_FRAME in block:
            continue  # the rank's own parent-watch thread, and the hang doctor's threads: always idle
        kept: list[str] = []
        for line in block.splitlines():
            # Frames below the task (the rank's loop, multiprocessing, the forkserver) are the
            # same in every dump.
            if line.lstrip().startswith(_WORKER_FRAME):
                break
            kept.append(line)
        if len(kept) == 1:
            kept.append("  (idle: waiting for the next task)")
        blocks.append("\n".join(kept))
    return "\n\n".join(blocks)


def _context() -> BaseContext:
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")  # Windows: no fork at all
    # A forkserver that imported torch once forks each rank in milliseconds (spawn: 1.5-3 s per
    # start on 2 cores, mostly `import torch`). It is safe: the server is single-threaded and never touches
    # CUDA, unlike forking the parent. pytest is preloaded when present because every rank imports
    # the user's test module, which imports pytest. The preload only applies to a server that is
    # not running yet; modules already asked for by someone else are kept.
    from multiprocessing import forkserver

    # torch._dynamo too: DistributedDataParallel's constructor imports it on its first use, about
    # 0.9 s of CPU in every rank that wraps a model (not in a rank's own forkserver: DataLoader
    # workers never build one).
    wanted = [*_worker.FORKSERVER_PRELOAD, "torch._dynamo", "distkit.testing._worker"]
    if "pytest" in sys.modules:
        wanted.append("pytest")
    current = list(getattr(forkserver._forkserver, "_preload_modules", None) or [])
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(current + [name for name in wanted if name not in current])
    return ctx


def _descendants(pid: int | None) -> list[int]:
    """The processes below ``pid`` (Linux; elsewhere none are found).

    A rank's DataLoader workers come from the rank's own forkserver (see
    ``_worker._preload_own_forkserver``), and neither that server nor its children notice when the
    rank is killed: each keeps the other alive (a worker holds the pipe whose end tells the server
    to exit, and torch's worker only exits once its parent, the server, is gone). Forked workers would
    exit on their own within 5 s (torch's watchdog), unless they hang.
    """
    found: list[int] = []
    todo = [] if pid is None else [pid]
    while todo:
        parent = todo.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for thread in threads:
            try:
                with open(f"/proc/{parent}/task/{thread}/children") as children:
                    pids = [int(child) for child in children.read().split()]
            except (OSError, ValueError):
                continue
            found += pids
            todo += pids
    return found


def _skip(kind: str, reason: str) -> NoReturn:
    __tracebackhide__ = True  # pytest: show the test, not this plumbing
    try:
        import pytest
    except ImportError:  # run_ranks outside any pytest installation
        raise unittest.SkipTest(reason) from None
    if kind == "xfail":
        pytest.xfail(reason)
    pytest.skip(reason)


def _describe_fn(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


def _pickle_task(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}: {fn!r}.")
    qualname = getattr(fn, "__qualname__", "")
    fix = (
        "Define it with `def` at module level (the test module itself is fine) and pass "
        "per-call values as arguments: ranks.run(my_fn, value, world_size=2)."
    )
    if inspect.isfunction(fn) and ("<lambda>" in qualname or "<locals>" in qualname):
        what = "a lambda" if "<lambda>" in qualname else "a nested function or closure"
        raise ValueError(
            f"fn must be a top-level function the ranks can import by name, got {what}: "
            f"{_describe_fn(fn)}. {fix}"
        )
    try:
        pickle.dumps(fn)
    except Exception as err:
        raise ValueError(f"fn {_describe_fn(fn)} cannot be pickled by reference ({err}). {fix}") from err
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as err:
        raise ValueError(
            f"the arguments for {_describe_fn(fn)} cannot be pickled ({err}); pass plain data "
            f"(numbers, strings, lists, dicts, CPU tensors) or objects of module-level classes."
        ) from err


def _check_options(
    world_size: int, backend: str, timeout_s: float, fresh: bool, init: bool, env: Any
) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a name such as 'gloo' or 'nccl', got {backend!r}.")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}.")
    if not fresh and not init:
        raise ValueError(
            "init=False needs fresh=True: pool ranks have already joined their group. "
            "Pass fresh=True to get ranks that only have the launcher variables set."
        )
    if env is not None:
        if not fresh:
            raise ValueError(
                "env= needs fresh=True: pool ranks are shared by many tests and keep the "
                "environment they started with. Pass fresh=True."
            )
        if not isinstance(env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ValueError(f"env must map str to str, got {env!r}.")


_RUN_OPTIONS = ("world_size", "backend", "timeout_s", "fresh", "init", "env")


def _check_option_slips(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """Refuse a keyword that is a slip of one of run()'s own options (``world_sise=2``) and that
    ``fn`` does not name: it would go to ``fn`` (silently, into a ``**kwargs``) and the option
    would keep its default."""
    try:
        named = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to compare
        named = set()
    for key in kwargs:
        close = difflib.get_close_matches(key, _RUN_OPTIONS, n=1, cutoff=0.75)
        if close and key not in named:
            raise TypeError(
                f"run() got {key}=, which {_describe_fn(fn)} does not name: did you mean {close[0]}=? "
                f"run()'s own options are {', '.join(_RUN_OPTIONS)}; other keyword arguments go to fn."
            )


def _skip_without_gpus(backend: str, world_size: int) -> None:
    if backend != "nccl":
        return
    # device_count() does not create a CUDA context, and the ranks come from the forkserver, not
    # from a fork of this process, so asking here is safe.
    count = torch.cuda.device_count()
    if count < world_size:
        _skip(
            "skip",
            f"backend='nccl' with world_size={world_size} needs {world_size} CUDA devices; "
            f"this machine has {count}.",
        )


class _Group:
    """``world_size`` live ranks joined around a store hosted here; used by one thread at a time."""

    def __init__(
        self,
        world_size: int,
        backend: str,
        *,
        init: bool,
        env: Mapping[str, str] | None,
        grace_s: float,
        start_timeout_s: float,
        check_in_step: bool = False,
    ) -> None:
        # What the ranks are.
        self.world_size = world_size
        self.backend = backend
        self.init = init
        self.env = dict(env or {})
        self.grace_s = grace_s
        self.start_timeout_s = start_timeout_s
        # False until every rank reported ready, and again after any failure: the group's
        # collectives may then be broken, so it is never reused.
        self.healthy = False
        # False once a call ended the ranks' process group (they are healthy, but not joined).
        self.reusable = True
        # Pools check after each task that no rank left an operation unmatched; the state of each
        # rank at the last point where they were known to be in step is the baseline.
        self.check_in_step = check_in_step
        self._baseline: list[_worker.StepState] = [{} for _ in range(world_size)]
        # Per-rank handles, indexed by rank.
        self.procs: list[BaseProcess] = []
        self.pids: list[int | None] = [None] * world_size
        self._conns: list[Connection] = []
        # The parent never writes to these; closing them (or dying) tells the ranks to exit.
        self._lifelines: list[Connection] = []
        # The rendezvous store every rank connects to; its port is chosen by the OS.
        self._store: dist.TCPStore | None = None
        self.port: int | None = None
        # Per-rank output and stack files, and how much output was already forwarded.
        self._dir: str | None = None
        self._log_offsets = [0] * world_size

    # -- life cycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the ranks and wait until each has joined (or failed to)."""
        __tracebackhide__ = True  # pytest: show the test, not this plumbing
        ctx = _context()
        # Forkserver children inherit the server's environment, not ours; send ours as it is now.
        base = dict(os.environ)
        ok = False
        try:
            self._dir = tempfile.mkdtemp(prefix="distkit-ranks-")
            # Port 0: the OS picks a free port atomically, so concurrent runs never collide.
            self._store = dist.TCPStore(
                host_name="127.0.0.1",
                port=0,
                world_size=None,
                is_master=True,
                wait_for_workers=False,
                use_libuv=True,
            )
            port = self.port = self._store.port
            for rank in range(self.world_size):
                parent_end, child_end = ctx.Pipe()
                life_read, life_write = ctx.Pipe(duplex=False)
                spec = _worker.WorkerSpec(
                    rank=rank,
                    world_size=self.world_size,
                    backend=self.backend,
                    init=self.init,
                    environ=_worker.job_environ(
                        base,
                        rank=rank,
                        world_size=self.world_size,
                        port=port,
                        extra=self.env,
                    ),
                    log_path=self._log_path(rank),
                    stack_path=self._stack_path(rank),
                )
                proc = ctx.Process(  # type: ignore[attr-defined]
                    target=_worker.main,
                    args=(spec, child_end, life_read),
                    name=f"distkit-rank-{rank}",
                    # Not daemonic: a rank may start processes of its own (DataLoader workers).
                    daemon=False,
                )
                self._conns.append(parent_end)
                self._lifelines.append(life_write)
                try:
                    proc.start()
                finally:
                    # The child has its own copies now (or never will); ours would keep the
                    # pipes open after the child's death.
                    child_end.close()
                    life_read.close()
                self.procs.append(proc)
            outcomes, stacks = self._collect(time.monotonic() + self.start_timeout_s)
            failures = self._failures(outcomes)
            if failures:
                raise RankFailedError(
                    self._failure_message(
                        f"starting {self.world_size} ranks ({self._describe_start()})",
                        outcomes,
                        failures,
                        stacks,
                        self.start_timeout_s,
                        "start_timeout_s",
                    ),
                    failures=failures,
                )
            for rank, outcome in enumerate(outcomes):
                self.pids[rank] = outcome.value
                self._baseline[rank] = outcome.state or {}
            self.healthy = True
            ok = True
        finally:
            self._forward_output()
            if not ok:
                self.kill()

    def run(self, payload: bytes, name: str, timeout_s: float) -> tuple[list[Any], _Outcome | None]:
        """Run one task on every rank.

        Returns:
            The values in rank order, and the first skip/xfail outcome if every rank finished but
            some skipped (the caller re-raises it outside this object's cleanup).
        """
        __tracebackhide__ = True  # pytest: show the test, not this plumbing
        message = pickle.dumps(("task", list(sys.path), payload))
        ok = False
        try:
            for conn in self._conns:
                # A dead rank shows up through its sentinel in _collect, with its exit code.
                with contextlib.suppress(OSError):
                    conn.send_bytes(message)
            outcomes, stacks = self._collect(time.monotonic() + timeout_s)
            failures = self._failures(outcomes)
            if failures:
                raise RankFailedError(
                    self._failure_message(
                        f"{name}() on {self.world_size} ranks",
                        outcomes,
                        failures,
                        stacks,
                        timeout_s,
                        "timeout_s",
                    ),
                    failures=failures,
                )
            if self.check_in_step:
                self._check_in_step(name, outcomes)
                # Every rank ended its group (distkit.shutdown() at the end of a training main):
                # the call is fine, but the next one needs new ranks.
                self.reusable = not any(_worker.LEFT in (o.state or {}) for o in outcomes)
            skipped = [o for o in outcomes if o.kind in ("skip", "xfail")]
            ok = True
            first_skip = min(skipped, key=lambda o: o.order) if skipped else None
            return [o.value for o in outcomes], first_skip
        finally:
            self._forward_output()
            if not ok:
                # Any failure, and also an interruption here (Ctrl-C, pytest-timeout): the group
                # may be mid-collective, so it is never reused.
                self.kill()

    def _check_in_step(self, name: str, outcomes: list[_Outcome]) -> None:
        """Raise if the task left the ranks out of step; else make their state the new baseline.

        Each rank reported, with its result, how many operations it has issued on each process
        group (and how often it entered distkit's store-based collectives). When every rank issued
        as many in this task as the others, the group is in step: no collective or message is
        needed to know it. Otherwise either point-to-point traffic was uneven (rank 0 sent to
        two ranks, each of which received once), which is fine, or a collective was left
        unmatched, which is not; a check all-reduce on the uneven groups tells the two apart.
        distkit's counters are only ever advanced by collectives, so a difference there is final.
        """
        __tracebackhide__ = True  # pytest: show the test, not this plumbing
        states = [o.state or {} for o in outcomes]
        uneven = self._uneven(states)
        if not uneven:
            self._baseline = states
            return
        if _worker.LEFT in uneven:
            left = sorted(rank for rank, count in uneven[_worker.LEFT].items() if count)
            raise RankFailedError(
                f"{name}() on {self.world_size} ranks returned, but ended the process group on "
                f"rank(s) {left} only (distkit.shutdown() or torch.distributed.destroy_process_group() "
                f"ran there): the other ranks' next collective would wait for them forever. End the "
                f"group on every rank, or on none.\nThe ranks were killed; the next call starts new ones."
            )
        check_failures: list[RankFailure] = []
        if all(key[0] == "group" for key in uneven):
            check_id = secrets.randbelow(2**40) + 1  # W * id stays exact in float64
            groups = sorted({key[1] for key in uneven})
            message = pickle.dumps(("check", check_id, groups, _CHECK_TIMEOUT_S))
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(message)
            checked, _ = self._collect(time.monotonic() + _CHECK_TIMEOUT_S + self.grace_s)
            check_failures = self._failures(checked)
            if not check_failures:
                self._baseline = [o.state or {} for o in checked]
                return
        failures = self._unmatched(uneven, check_failures)
        lines = [
            f"{name}() on {self.world_size} ranks returned, but left an unmatched collective "
            f"behind: the ranks are out of step, and the next call on them would hang or compute "
            f"wrong values."
        ]
        lines.extend(f"{f.label} {f.summary}" for f in failures)
        if check_failures:
            lines.append("----- the check all-reduce run after the call -----")
            lines.extend(f"{f.label} {f.summary}" for f in check_failures)
        lines.append(
            "Call every collective on every rank of its group, wait for each async_op=True "
            "collective before returning (work.wait()), and do not swallow a collective's timeout: "
            "the collective stays pending and meets the next one of the other ranks."
        )
        lines.append("The ranks were killed; the next call starts new ones.")
        raise RankFailedError("\n".join(lines), failures=failures)

    def _uneven(self, states: list[_worker.StepState]) -> dict[tuple[str, ...], dict[int, int]]:
        """Per counter that advanced differently on different ranks: each rank's advance."""
        uneven: dict[tuple[str, ...], dict[int, int]] = {}
        if states == self._baseline:  # nothing issued anywhere: most small tasks, at no cost
            return uneven
        for key in sorted(set().union(*states)):
            # A group is compared among its members; distkit's counters among all ranks.
            ranks: Sequence[int] = range(self.world_size)
            if key[0] == "group":
                ranks = [rank for rank in ranks if key in states[rank]]
            advance = {rank: states[rank].get(key, 0) - self._baseline[rank].get(key, 0) for rank in ranks}
            if len(set(advance.values())) > 1:
                uneven[key] = advance
        return uneven

    def _unmatched(
        self, uneven: dict[tuple[str, ...], dict[int, int]], check_failures: list[RankFailure]
    ) -> list[RankFailure]:
        """One failure per rank that issued more operations than the rank that issued fewest."""
        summaries: dict[int, list[str]] = {}
        for key, advance in uneven.items():
            low_rank = min(advance, key=lambda rank: (advance[rank], rank))
            low = advance[low_rank]
            for rank, count in advance.items():
                if count == low:
                    continue
                if key[0] == "group":
                    what = f"issued {count - low} more operation(s) on {key[2]}"
                else:
                    what = f"made {count - low} more call(s) of distkit's {key[1]} (a store-based collective)"
                summaries.setdefault(rank, []).append(
                    f"{what} than rank {low_rank} in this call ({count} against {low})"
                )
        details = {f.rank: f"{f.summary}\n{f.details}".rstrip() for f in check_failures}
        return [
            RankFailure(
                rank=rank,
                world_size=self.world_size,
                kind="unmatched",
                summary="; ".join(summaries[rank]),
                details=details.get(rank, ""),
                pid=self._pid(rank),
                exitcode=None,
            )
            for rank in sorted(summaries)
        ]

    def stop(self) -> None:
        """Ask healthy ranks to leave their group and exit; kill whatever is left."""
        if self.healthy:
            stop = pickle.dumps(("stop",))
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(stop)
            deadline = time.monotonic() + _STOP_TIMEOUT_S
            for proc in self.procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
            self._forward_output()
        self.kill()

    def kill(self) -> None:
        """Kill every rank still alive (with the processes it started), reap them all, and release
        files, pipes and the store."""
        self.healthy = False
        started: list[int] = []
        for proc in self.procs:
            if proc.exitcode is None:
                with contextlib.suppress(OSError, ValueError):
                    # Read before the kill, while the rank still links them to itself.
                    started += _descendants(proc.pid)
                    proc.kill()
        for pid in started:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + _KILL_WAIT_S
        for proc in self.procs:
            with contextlib.suppress(ValueError):  # already closed
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for handle in [*self._conns, *self._lifelines]:
            handle.close()
        for proc in self.procs:
            with contextlib.suppress(ValueError):  # still running after SIGKILL: leave it be
                proc.close()
        self._conns, self._lifelines, self.procs = [], [], []
        self._store = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -- collecting outcomes ----------------------------------------------------------------------

    def _collect(self, deadline: float) -> tuple[list[_Outcome], dict[int, str]]:
        """Wait for one message (or death) per rank until ``deadline``.

        After the first outcome that is not a success, the others get ``grace_s`` more. Ranks
        still running at the deadline get their stacks dumped (a hang); ranks still running
        after a failure's grace period are marked killed.
        """
        n = self.world_size
        outcomes: list[_Outcome | None] = [None] * n
        pending = set(range(n))
        first_bad: int | None = None
        limit = deadline
        seen = 0
        while pending:
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            waitables: dict[Any, int] = {}
            for rank in pending:
                waitables[self._conns[rank]] = rank
                waitables[self.procs[rank].sentinel] = rank
            ready_now = wait_ready(list(waitables), timeout=remaining)
            # Deaths first: when a rank dies, its peers' "connection closed" errors follow; if
            # both arrived while this process was not looking, the death is the cause.
            ready_now.sort(key=lambda obj: not isinstance(obj, int))
            for ready in ready_now:
                rank = waitables[ready]
                if rank not in pending:
                    continue
                outcome = self._receive(rank)
                outcome.order = seen
                seen += 1
                outcomes[rank] = outcome
                pending.discard(rank)
                if outcome.kind not in ("ready", "ok") and first_bad is None:
                    first_bad = rank
                    limit = min(deadline, time.monotonic() + self.grace_s)
        stacks: dict[int, str] = {}
        if pending and first_bad is None:
            # A hang: every live rank's stack, finished ones included (they show where they wait).
            stacks = self._dump_stacks()
            for rank in pending:
                outcomes[rank] = _Outcome(
                    "timeout", line="still running at the deadline", text=stacks.get(rank, "")
                )
        elif pending:
            assert first_bad is not None
            cause = outcomes[first_bad]
            assert cause is not None
            verb = "skipped" if cause.kind in ("skip", "xfail") else "failed"
            for rank in pending:
                outcomes[rank] = _Outcome(
                    "killed",
                    line=f"killed after rank {first_bad} {verb}: no outcome within the "
                    f"{self.grace_s:g} s grace period",
                )
        return [o for o in outcomes if o is not None], stacks

    def _receive(self, rank: int) -> _Outcome:
        conn, proc = self._conns[rank], self.procs[rank]
        message: tuple[Any, ...] | None = None
        try:
            if conn.poll():
                message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            message = None
        if message is None:
            # The process ended (or closed its pipe) without a word: report how it ended.
            proc.join(timeout=_KILL_WAIT_S)
            text = self._output_tail(rank)
            if not text and not self.healthy:
                why = (
                    "multiprocessing re-imports the main script in every child, and this one was read "
                    "from stdin (`python - < script.py`), which a child cannot read again: save it as "
                    "a file and run `python script.py`."
                    if _main_from_stdin()
                    else "multiprocessing re-imports the main script in every child: keep its "
                    "top-level code under `if __name__ == '__main__':`."
                )
                text = (
                    "The rank wrote nothing: it ended before redirecting its output, so its traceback "
                    f"(if any) is on this process's stderr. {why}"
                )
            return _Outcome("exit", line=_exit_line(proc.exitcode), text=text, exitcode=proc.exitcode)
        kind = message[0]
        if kind == "ready":
            return _Outcome("ready", value=message[1], state=message[2])
        if kind == "ok":
            try:
                return _Outcome("ok", value=pickle.loads(message[1]), state=message[2])
            except Exception as err:
                return _Outcome(
                    "error",
                    line=f"its result could not be unpickled in the parent: "
                    f"{type(err).__name__}: {err} (return types the parent can import)",
                )
        if kind in ("skip", "xfail"):
            return _Outcome(kind, line=message[1], state=message[2])
        return _Outcome("error", line=message[1], text=message[2])

    def _failures(self, outcomes: list[_Outcome]) -> list[RankFailure]:
        kinds: dict[str, _FailureKind] = {
            "error": "exception",
            "exit": "exit",
            "timeout": "timeout",
            "killed": "killed",
        }
        failing = [
            (outcome.order, rank, outcome) for rank, outcome in enumerate(outcomes) if outcome.kind in kinds
        ]
        failing.sort(key=lambda item: (item[0], item[1]))
        return [
            RankFailure(
                rank=rank,
                world_size=self.world_size,
                kind=kinds[outcome.kind],
                summary=outcome.line or f"did not finish (pid {self.pids[rank]})",
                details=outcome.text,
                pid=self._pid(rank),
                exitcode=outcome.exitcode,
            )
            for _, rank, outcome in failing
        ]

    def _failure_message(
        self,
        what: str,
        outcomes: list[_Outcome],
        failures: list[RankFailure],
        stacks: dict[int, str],
        timeout_s: float,
        timeout_name: str,
    ) -> str:
        w = self.world_size
        hung = [f.rank for f in failures if f.kind == "timeout"]
        lines: list[str] = []
        if hung:
            lines.append(
                f"{what}: rank(s) {hung} did not finish within {timeout_s:g} s ({timeout_name}). "
                f"Python stacks of every rank follow; then the ranks were killed. Look for a rank "
                f"that skipped a collective the others wait in, or raise {timeout_name} if the "
                f"work is legitimately slow."
            )
            for rank in range(w):
                state = "still running" if rank in hung else f"finished ({outcomes[rank].kind})"
                lines.append(f"----- [rank {rank}/{w}] {state}, pid {self._pid(rank)} -----")
                lines.append(stacks.get(rank, "(no stack: the rank was not alive)").rstrip())
        else:
            first = failures[0]
            skip_first = [
                (o.order, rank, o) for rank, o in enumerate(outcomes) if o.kind in ("skip", "xfail")
            ]
            if first.kind == "killed" and skip_first:
                _, rank, o = min(skip_first)
                lines.append(
                    f"{what}: rank {rank} called pytest.{o.kind}({o.line!r}) but rank(s) "
                    f"{[f.rank for f in failures]} did not finish after it; skip on every rank "
                    f"alike (the others may be waiting in a collective for rank {rank})."
                )
            else:
                lines.append(f"{what}: {first.label} failed first.")
                lines.append(f"----- {first.label} {first.summary} (pid {first.pid}) -----")
                if first.details:
                    lines.append(first.details.rstrip())
                failures = failures[1:]
            if failures:
                lines.append("----- other ranks -----" if first.kind != "killed" else "----- ranks -----")
                lines.extend(f"{f.label} {f.summary}" for f in failures)
        lines.append("The ranks were killed; the next call starts new ones.")
        return "\n".join(lines)

    def _describe_start(self) -> str:
        init = f"distkit.init({self.backend!r})" if self.init else "no init"
        return f"backend={self.backend!r}, {init}, store port {self.port}"

    def _pid(self, rank: int) -> int | None:
        if self.pids[rank] is not None:
            return self.pids[rank]
        return self.procs[rank].pid if rank < len(self.procs) else None

    # -- per-rank files ---------------------------------------------------------------------------

    def _log_path(self, rank: int) -> str:
        assert self._dir is not None
        return os.path.join(self._dir, f"rank{rank}.log")

    def _stack_path(self, rank: int) -> str:
        assert self._dir is not None
        return os.path.join(self._dir, f"rank{rank}.stacks")

    def _dump_stacks(self) -> dict[int, str]:
        # Each rank registered faulthandler for SIGUSR1; it writes every thread's Python stack
        # from the signal handler, so it works even while the rank is blocked inside C++ (gloo).
        offsets: dict[int, int] = {}
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is None and proc.pid is not None:
                path = self._stack_path(rank)
                offsets[rank] = os.path.getsize(path) if os.path.exists(path) else 0
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGUSR1)
        sizes: dict[int, int] = {}
        deadline = time.monotonic() + _STACK_WAIT_S
        while offsets and time.monotonic() < deadline:
            time.sleep(0.05)
            previous, sizes = sizes, {r: self._size(self._stack_path(r)) for r in offsets}
            # Done when every file has grown and stayed the same size for one poll.
            if all(sizes[r] > offsets[r] and previous.get(r) == sizes[r] for r in offsets):
                break
        stacks: dict[int, str] = {}
        for rank, offset in offsets.items():
            with contextlib.suppress(OSError), open(self._stack_path(rank), "rb") as file:
                file.seek(offset)
                stacks[rank] = _tidy_stack(file.read().decode(errors="replace"))
        return stacks

    @staticmethod
    def _size(path: str) -> int:
        try:
            return os.path.getsize(path)
        except OSError:
            return 0

    def _read_new_output(self, rank: int) -> bytes:
        if self._dir is None:
            return b""
        try:
            # A stat is cheaper than an open; most calls print nothing.
            if os.stat(self._log_path(rank)).st_size <= self._log_offsets[rank]:
                return b""
            with open(self._log_path(rank), "rb") as file:
                file.seek(self._log_offsets[rank])
                return file.read()
        except OSError:
            return b""

    def _output_tail(self, rank: int) -> str:
        text = self._read_new_output(rank).decode(errors="replace")
        tail = text.splitlines()[-_TAIL_LINES:]
        return ("last output of the rank:\n" + "\n".join(tail)) if tail else ""

    def _forward_output(self) -> None:
        # Ranks write to files; after each call their output is copied to this process's
        # sys.stderr, line by line with a [rank R/W] prefix. Under pytest that is the test's own
        # captured stderr, shown with its failure report.
        stream = sys.stderr
        for rank in range(self.world_size):
            data = self._read_new_output(rank)
            self._log_offsets[rank] += len(data)
            if data and stream is not None:
                prefix = f"[rank {rank}/{self.world_size}] "
                text = data.decode(errors="replace")
                stream.write("".join(prefix + line for line in text.splitlines(keepends=True)))
                if not text.endswith("\n"):
                    stream.write("\n")
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


# Every live RankPools, so that one exit hook can stop them all. The hook is registered after
# multiprocessing's own (imported above); exit hooks run last-in first-out, so ours stops the
# ranks before multiprocessing joins its non-daemonic children, which would otherwise wait forever.
_live_pools: weakref.WeakSet[RankPools] = weakref.WeakSet()


def _close_all_at_exit() -> None:
    for pools in list(_live_pools):
        pools.close()


atexit.register(_close_all_at_exit)


class RankPools:
    """Reusable groups of initialised ranks, one per ``(world_size, backend)``.

    Local: runs in the parent process; the ranks are child processes. The ``ranks`` pytest fixture
    wraps one session-wide instance and :func:`run_ranks` uses a process-wide one; make your own
    to control the lifetime (e.g. in a benchmark). Safe to call from several threads: calls on one
    instance are serialised.

    Args:
        grace_s: After the first rank fails, how long the other ranks get to report before they
            are killed.
        start_timeout_s: Deadline for starting the ranks and joining their group.

    Example:
        >>> with RankPools() as pools:  # doctest: +SKIP
        ...     pools.run(my_module.all_reduce_one, world_size=2)
        [2.0, 2.0]
    """

    def __init__(
        self,
        *,
        grace_s: float = DEFAULT_GRACE_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        if not grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s!r}.")
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be > 0, got {start_timeout_s!r}.")
        self.grace_s = grace_s
        self.start_timeout_s = start_timeout_s
        # One group per (world_size, backend); a failed group is replaced at its next use.
        self._pools: dict[tuple[int, str], _Group] = {}
        self._lock = threading.Lock()
        self._closed = False
        _live_pools.add(self)

    def run(
        self,
        fn: Callable[..., T],
        /,
        *args: Any,
        world_size: int = 2,
        backend: str = "gloo",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        fresh: bool = False,
        init: bool = True,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> list[T]:
        """Call ``fn(*args, **kwargs)`` on every rank; see :func:`run_ranks`.

        Example:
            >>> RankPools().run(my_module.get_rank, world_size=2)  # doctest: +SKIP
            [0, 1]
        """
        __tracebackhide__ = True  # pytest: show the test, not this plumbing
        _check_options(world_size, backend, timeout_s, fresh, init, env)
        _check_option_slips(fn, kwargs)
        _skip_without_gpus(backend, world_size)
        payload = _pickle_task(fn, args, kwargs)
        name = getattr(fn, "__qualname__", None) or repr(fn)
        if fresh:
            group = self._new_group(world_size, backend, init=init, env=env)
            try:
                group.start()
                values, skipped = group.run(payload, name, timeout_s)
            finally:
                group.stop()
        else:
            # A concurrent call on the same instance runs after this one; bound that wait too.
            wait_s = timeout_s + self.start_timeout_s + self.grace_s + _STOP_TIMEOUT_S
            if not self._lock.acquire(timeout=wait_s):
                raise DistkitError(
                    f"another thread kept these RankPools busy for over {wait_s:g} s; use one "
                    f"RankPools per thread."
                )
            try:
                if self._closed:
                    raise DistkitError("this RankPools was closed; create a new one.")
                group = self._pool(world_size, backend)
                values, skipped = group.run(payload, name, timeout_s)
            finally:
                self._lock.release()
        if skipped is not None:
            _skip(skipped.kind, skipped.line)
        return values

    def pids(self, world_size: int = 2, backend: str = "gloo") -> list[int] | None:
        """Process ids of the healthy pool for ``(world_size, backend)``, or ``None`` if none.

        Example:
            >>> RankPools().pids(2)
        """
        group = self._pools.get((world_size, backend))
        if group is None or not group.healthy:
            return None
        return [pid for pid in group.pids if pid is not None]

    def close(self) -> None:
        """Stop every pool's ranks and wait for them to exit. Idempotent.

        Example:
            >>> RankPools().close()
        """
        with self._lock:
            self._closed = True
            groups, self._pools = list(self._pools.values()), {}
        for group in groups:
            group.stop()

    def __enter__(self) -> RankPools:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _new_group(
        self,
        world_size: int,
        backend: str,
        *,
        init: bool,
        env: Mapping[str, str] | None,
        check_in_step: bool = False,
    ) -> _Group:
        return _Group(
            world_size,
            backend,
            init=init,
            env=env,
            grace_s=self.grace_s,
            start_timeout_s=self.start_timeout_s,
            check_in_step=check_in_step,
        )

    def _pool(self, world_size: int, backend: str) -> _Group:
        __tracebackhide__ = True  # pytest: show the test, not this plumbing
        key = (world_size, backend)
        group = self._pools.get(key)
        # A rank may also have died while idle (the OOM killer, a stray signal); that is no
        # failure of the coming call, so such a pool is replaced quietly.
        if group is not None and group.healthy and group.reusable and all(p.is_alive() for p in group.procs):
            return group
        if group is not None:
            group.stop()
        # Fresh groups exit after their one call, so only pools check that a call left no
        # operation unmatched: the next call would meet it.
        group = self._new_group(world_size, backend, init=True, env=None, check_in_step=True)
        self._pools[key] = group
        group.start()
        return group


class Ranks:
    """What the ``ranks`` fixture gives a test: :meth:`run` on the session's pools.

    Example:
        >>> def test_all_reduce(ranks):  # doctest: +SKIP
        ...     assert ranks.run(all_reduce_one, world_size=2) == [2.0, 2.0]
    """

    def __init__(self, pools: RankPools) -> None:
        self.pools = pools

    def run(
        self,
        fn: Callable[..., T],
        /,
        *args: Any,
        world_size: int = 2,
        backend: str = "gloo",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        fresh: bool = False,
        init: bool = True,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> list[T]:
        """Call ``fn(*args, **kwargs)`` on every rank; see :func:`run_ranks`.

        Example:
            >>> ranks.run(all_reduce_one, world_size=2)  # doctest: +SKIP
            [2.0, 2.0]
        """
        __tracebackhide__ = True  # pytest: show the test, not this plumbing
        return self.pools.run(
            fn,
            *args,
            world_size=world_size,
            backend=backend,
            timeout_s=timeout_s,
            fresh=fresh,
            init=init,
            env=env,
            **kwargs,
        )


_default_pools: RankPools | None = None
_default_lock = threading.Lock()


def run_ranks(
    fn: Callable[..., T],
    /,
    *args: Any,
    world_size: int = 2,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    fresh: bool = False,
    init: bool = True,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> list[T]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks and return each rank's result.

    Local: runs in this process; the ranks are child processes. By default the call goes to a
    pool of ranks that already joined a ``backend`` group with :func:`distkit.init` (about 1 ms
    when warm); the pool is replaced after any failure and stopped at exit. Without pytest this
    uses a process-wide :class:`RankPools`; the ``ranks`` fixture uses one per test session.

    Args:
        fn: A module-level function (the ranks import it by name); not a lambda or closure.
        *args: Positional arguments for ``fn``; must be picklable.
        world_size: Number of ranks.
        backend: ``"gloo"`` or ``"nccl"``. NCCL skips the test when there are fewer CUDA devices
            than ranks.
        timeout_s: Deadline for ``fn`` on every rank. A rank still running then fails the call
            with every rank's Python stack in the message.
        fresh: Run on newly started ranks that exit afterwards, for tests that kill ranks, change
            the environment, or test initialisation itself.
        init: With ``fresh=True``, ``False`` only sets the launcher variables (``RANK``,
            ``WORLD_SIZE``, ``MASTER_ADDR``, ...) so that ``fn`` can call :func:`distkit.init`.
        env: With ``fresh=True``, environment variables to add or override in the ranks.
        **kwargs: Keyword arguments for ``fn``; must be picklable.

    Returns:
        The return values of ``fn``, in rank order.

    Raises:
        RankFailedError: A rank raised, died, or did not finish in time; the message has the
            first failing rank's traceback and one line per other failing rank.
        ValueError: ``fn`` or its arguments cannot be sent to the ranks, or the options conflict.
        pytest.skip.Exception: Every rank called ``pytest.skip`` (or NCCL lacks devices);
            ``unittest.SkipTest`` when pytest is not installed.

    Example:
        >>> # my_module.py:  def world() -> int: return distkit.get_world_size()
        >>> run_ranks(my_module.world, world_size=2)  # doctest: +SKIP
        [2, 2]
    """
    __tracebackhide__ = True  # pytest: show the test, not this plumbing
    global _default_pools
    with _default_lock:
        if _default_pools is None or _default_pools._closed:
            _default_pools = RankPools()
        pools = _default_pools
    return pools.run(
        fn,
        *args,
        world_size=world_size,
        backend=backend,
        timeout_s=timeout_s,
        fresh=fresh,
        init=init,
        env=env,
        **kwargs,
    )


# Errors and reprs name the public home of these objects, not the private module that defines them.
for _public in (RankFailedError, RankFailure, RankPools, Ranks, run_ranks):
    _public.__module__ = "distkit.testing"
del _public


def _main_from_stdin() -> bool:
    """Whether the main script has a file name that is no file (``<stdin>``): multiprocessing's
    children, which run it again by that name, then fail to open it."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return isinstance(path, str) and not os.path.exists(path)

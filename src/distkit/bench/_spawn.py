"""Groups of local ranks that stay up between tasks: start once, run many measurements, close.

Ranks are fresh interpreters started with :mod:`subprocess` rather than ``multiprocessing``'s
spawn, which re-imports the caller's ``__main__``: that fails in scripts without an
``if __name__ == "__main__"`` guard and in notebooks. The parent hosts the rendezvous store on a
port the OS picks (as torchrun's agent does), so concurrent benchmarks never collide on a port;
each rank joins with :func:`distkit.init`, then waits for tasks on its own socket pair. A group
kept between tasks lets the benchmark interleave repetitions of every configuration without
paying a start-up (about 3 s, FACTS.md) per repetition; a rank waiting for its next task sleeps
in ``recv`` and takes no CPU.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait as wait_ready
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distkit import runtime
from distkit.env import _local_job_environ
from distkit.errors import CollectiveTimeoutError, DistkitError

# After the first rank failed, how long the others get to report their own outcome before they
# are killed: gloo peers of a dead rank fail within about 0.3 s (FACTS.md).
_GRACE_S = 3.0
_KILL_WAIT_S = 5.0
# Lines of a dead rank's own output quoted in the error (a segfault trace, a C++ abort message).
_TAIL_LINES = 20


def _child_main() -> None:
    """Entry point of a rank: read the spec from stdin, join the group, run tasks until told to stop."""
    spec = pickle.loads(sys.stdin.buffer.read())
    sys.path[:] = spec["sys_path"]
    conn = Connection(spec["fd"])
    try:
        # torch reads OMP_NUM_THREADS at import, but a site hook may have imported it earlier.
        torch.set_num_threads(spec["threads"])
        runtime.init(spec["backend"], timeout_s=spec["timeout_s"])
        conn.send(("ok", None))  # ready: the parent may start measuring
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return  # the parent is gone
            if message[0] == "stop":
                return
            fn, args = pickle.loads(message[1])
            conn.send(("ok", fn(*args)))
    except BaseException as err:
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(err).__name__}: {err}", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        runtime.shutdown()


def _rank_environ(rank: int, world_size: int, port: int, threads: int) -> dict[str, str]:
    environ = _local_job_environ(os.environ, rank=rank, world_size=world_size, port=port)
    environ["OMP_NUM_THREADS"] = str(threads)
    return environ


class RankGroup:
    """``world_size`` fresh local ranks in one process group, running the tasks they are sent.

    Local: call from one process. The ranks start in the background; :meth:`wait_ready` (or the
    first :meth:`run`) waits until every one joined the group, so that several groups can start
    at once and none is measured while another still starts. Use as a context manager;
    :meth:`close` stops the ranks. After a failed or timed-out task the group is closed and cannot
    run another.
    """

    def __init__(
        self, world_size: int, *, backend: str = "gloo", threads: int = 1, timeout_s: float = 600.0
    ) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.closed = False
        self.ready = False
        # Port 0: the OS picks a free port atomically.
        self._store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
        self._logdir = Path(tempfile.mkdtemp(prefix="distkit-bench-"))
        self._logs = [self._logdir / f"rank{rank}.log" for rank in range(world_size)]
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        self._stop_sent = False
        try:
            for rank in range(world_size):
                parent_sock, child_sock = socket.socketpair()
                self._conns.append(Connection(parent_sock.detach()))
                with open(self._logs[rank], "wb") as log:
                    proc = subprocess.Popen(
                        [sys.executable, "-c", "from distkit.bench._spawn import _child_main; _child_main()"],
                        stdin=subprocess.PIPE,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=_rank_environ(rank, world_size, self._store.port, threads),
                        pass_fds=[child_sock.fileno()],
                    )
                spec = {
                    "sys_path": list(sys.path),
                    "fd": child_sock.fileno(),
                    "threads": threads,
                    "backend": backend,
                    "timeout_s": timeout_s,
                }
                child_sock.close()
                self._procs.append(proc)
                assert proc.stdin is not None  # stdin=PIPE above
                proc.stdin.write(pickle.dumps(spec))
                proc.stdin.close()
        except BaseException:
            self.close(graceful=False)
            raise

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, in rank order."""
        return [proc.pid for proc in self._procs]

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self) -> None:
        """Wait until every rank has joined the group (at most the group's ``timeout_s``).

        Raises:
            DistkitError: A rank failed to start or to join (its traceback is in the message).
            CollectiveTimeoutError: Some rank did not join in time.
        """
        if self.ready:
            return
        if self.closed:
            raise DistkitError("this benchmark group was closed after an earlier failure; start a new one.")
        try:
            self._collect(self.timeout_s)
        except BaseException:
            self.close(graceful=False)
            raise
        self.ready = True

    def run(
        self, fn: Callable[..., Any], args: tuple[Any, ...], *, timeout_s: float | None = None
    ) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return their results in rank order.

        ``fn`` must be importable by name (a module-level function): it travels by pickle.

        Raises:
            DistkitError: A rank raised or died (the first failure's traceback is in the message),
                or the group was closed.
            CollectiveTimeoutError: The ranks did not all finish within ``timeout_s`` (default:
                the group's).
        """
        self.wait_ready()
        payload = pickle.dumps((fn, args))
        try:
            for conn in self._conns:
                with contextlib.suppress(OSError):  # a rank that died already: reported below
                    conn.send(("task", payload))
            return self._collect(self.timeout_s if timeout_s is None else timeout_s)
        except BaseException:
            self.close(graceful=False)  # ranks still busy (or stuck) would not read a stop message
            raise

    def _tail(self, rank: int) -> str:
        try:
            lines = self._logs[rank].read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-_TAIL_LINES:])

    def _collect(self, timeout_s: float) -> list[Any]:
        world_size = self.world_size
        results: dict[int, Any] = {}
        failures: list[tuple[int, str, str]] = []
        waiting = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            ready = wait_ready(list(waiting.values()), timeout=max(0.0, deadline - time.monotonic()))
            for ready_conn in ready:
                rank = next(r for r, c in waiting.items() if c is ready_conn)
                conn = waiting.pop(rank)  # the Connection itself: wait() returns a wider type
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    # The rank's end closed without a result: it exited.
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self._procs[rank].wait(_KILL_WAIT_S)
                    code = self._procs[rank].returncode
                    failures.append((rank, f"exited with code {code}", self._tail(rank)))
                    continue
                if message[0] == "ok":
                    results[rank] = message[1]
                else:
                    failures.append((rank, message[1], message[2]))
            if failures:
                # Give the others a moment to report their own failure, then stop.
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        if failures:
            rank, summary, details = failures[0]
            others = "".join(f"\n  [rank {r}/{world_size}] {s}" for r, s, _ in failures[1:])
            raise DistkitError(
                f"[rank {rank}/{world_size}] failed in a benchmark group of {world_size} processes: "
                f"{summary}{others}\n{details}".rstrip()
            )
        if len(results) < world_size:
            missing = [r for r in range(world_size) if r not in results]
            raise CollectiveTimeoutError(
                f"a benchmark group of {world_size} processes did not finish within {timeout_s:g} s: "
                f"rank(s) {missing} still running. Raise the timeout, or lower the steps or the batch size.",
                missing_ranks=missing,
                timeout_s=timeout_s,
            )
        return [results[r] for r in range(world_size)]

    def request_stop(self) -> None:
        """Ask every rank to stop, without waiting: several groups then exit at the same time."""
        if self.closed or self._stop_sent:
            return
        self._stop_sent = True
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))

    def close(self, *, graceful: bool = True) -> None:
        """Stop the ranks; idempotent.

        ``graceful``: ask them to stop and kill those still running after a few seconds; otherwise
        (after a failure, when they may be stuck in a collective) kill them at once.
        """
        if self.closed:
            return
        if graceful:
            self.request_stop()
        self.closed = True
        deadline = time.monotonic() + (_KILL_WAIT_S if graceful else 0.0)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(_KILL_WAIT_S)
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._logdir, ignore_errors=True)
        del self._store


def run_group(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    world_size: int,
    backend: str = "gloo",
    threads: int = 1,
    timeout_s: float = 600.0,
) -> list[Any]:
    """Run ``fn(*args)`` once on ``world_size`` fresh local ranks; return their results in rank order.

    Raises:
        DistkitError: A rank raised or died (the first failure's traceback is in the message).
        CollectiveTimeoutError: The ranks did not all finish within ``timeout_s``.
    """
    with RankGroup(world_size, backend=backend, threads=threads, timeout_s=timeout_s) as group:
        return group.run(fn, args)

"""Start a short-lived group of local ranks, run one function on each, and collect the results.

Ranks are fresh interpreters started with :mod:`subprocess` rather than ``multiprocessing``'s
spawn, which re-imports the caller's ``__main__``: that fails in scripts without an
``if __name__ == "__main__"`` guard and in notebooks. The parent hosts the rendezvous store on a
port the OS picks (as torchrun's agent does), so concurrent benchmarks never collide on a port;
each rank joins with :func:`distkit.init` and talks back through its own socket pair.
"""

from __future__ import annotations

import contextlib
import os
import pickle
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

# Variables of an outer job (this command may itself run under torchrun or SLURM) that would make
# a rank believe it belongs to that job instead of ours.
# After the first rank failed, how long the others get to report their own outcome before they
# are killed: gloo peers of a dead rank fail within about 0.3 s (FACTS.md).
_GRACE_S = 3.0
_KILL_WAIT_S = 5.0
# Lines of a dead rank's own output quoted in the error (a segfault trace, a C++ abort message).
_TAIL_LINES = 20

# The connection to the parent, in a rank process; progress() sends through it.
_parent_conn: Connection | None = None


def progress(message: Any) -> None:
    """Send a progress message to the parent (rank 0 only; a no-op outside a spawned rank)."""
    if _parent_conn is not None and runtime.get_rank() == 0:
        _parent_conn.send(("progress", message))


def _child_main() -> None:
    """Entry point of a rank: read the task from stdin, join the group, run it, send the result."""
    global _parent_conn
    spec = pickle.loads(sys.stdin.buffer.read())
    sys.path[:] = spec["sys_path"]
    _parent_conn = conn = Connection(spec["fd"])
    try:
        # torch reads OMP_NUM_THREADS at import, but a site hook may have imported it earlier.
        torch.set_num_threads(spec["threads"])
        fn, args = pickle.loads(spec["payload"])
        runtime.init(spec["backend"], timeout_s=spec["timeout_s"])
        result = fn(*args)
        conn.send(("ok", result))
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


def run_group(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    world_size: int,
    backend: str = "gloo",
    threads: int = 1,
    timeout_s: float = 600.0,
    on_progress: Callable[[Any], None] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh local ranks; return their results in rank order.

    ``fn`` must be importable by name (a module-level function): it travels by pickle.

    Raises:
        DistkitError: A rank raised or died (the first failure's traceback is in the message).
        CollectiveTimeoutError: The ranks did not all finish within ``timeout_s``.
    """
    # Port 0: the OS picks a free port atomically.
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    payload = pickle.dumps((fn, args))
    procs: list[subprocess.Popen[bytes]] = []
    conns: list[Connection] = []
    with tempfile.TemporaryDirectory(prefix="distkit-bench-") as logdir:
        logs = [Path(logdir, f"rank{rank}.log") for rank in range(world_size)]
        try:
            for rank in range(world_size):
                parent_sock, child_sock = socket.socketpair()
                conns.append(Connection(parent_sock.detach()))
                with open(logs[rank], "wb") as log:
                    proc = subprocess.Popen(
                        [sys.executable, "-c", "from distkit.bench._spawn import _child_main; _child_main()"],
                        stdin=subprocess.PIPE,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=_rank_environ(rank, world_size, store.port, threads),
                        pass_fds=[child_sock.fileno()],
                    )
                spec = {
                    "sys_path": list(sys.path),
                    "fd": child_sock.fileno(),
                    "threads": threads,
                    "backend": backend,
                    "timeout_s": timeout_s,
                    "payload": payload,
                }
                child_sock.close()
                procs.append(proc)
                assert proc.stdin is not None  # stdin=PIPE above
                proc.stdin.write(pickle.dumps(spec))
                proc.stdin.close()
            return _collect(procs, conns, logs, timeout_s, on_progress)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(_KILL_WAIT_S)
            for conn in conns:
                conn.close()
            del store


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-_TAIL_LINES:])


def _collect(
    procs: list[subprocess.Popen[bytes]],
    conns: list[Connection],
    logs: list[Path],
    timeout_s: float,
    on_progress: Callable[[Any], None] | None,
) -> list[Any]:
    world_size = len(procs)
    results: dict[int, Any] = {}
    failures: list[tuple[int, str, str]] = []
    open_conns = dict(enumerate(conns))
    deadline = time.monotonic() + timeout_s
    while open_conns and time.monotonic() < deadline:
        ready = wait_ready(list(open_conns.values()), timeout=max(0.0, deadline - time.monotonic()))
        for conn in ready:
            rank = next(r for r, c in open_conns.items() if c is conn)
            try:
                message = conn.recv()
            except (EOFError, OSError):
                # The rank's end closed: it exited, after its result or without one.
                del open_conns[rank]
                if rank not in results and all(f[0] != rank for f in failures):
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        procs[rank].wait(_KILL_WAIT_S)
                    failures.append((rank, f"exited with code {procs[rank].returncode}", _tail(logs[rank])))
                continue
            if message[0] == "progress":
                if on_progress is not None:
                    on_progress(message[1])
            elif message[0] == "ok":
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

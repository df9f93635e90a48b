"""Run many two-process jobs of ``scenarios.py`` at once, each rank a forked copy of this process.

    python tests/failure_scripts/forked_jobs.py RUN_DIR DEADLINE_S CASE:WHAT[:ENV=VALUE,...] ...

Importing torch costs about 2 s of CPU per process (FACTS.md); forking a process that has it
imported costs milliseconds, so the tests can start one job per collective without paying that
twenty times. Each rank is a plain process launched "by hand" (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``; rank 0 hosts the store): after the fork it leaves the loop below
and runs the job as this script's own top level, so an uncaught exception goes through
``sys.excepthook``, ``atexit`` and the interpreter's finalization exactly as in a script. No
thread exists in this process when it forks.

Prints one JSON line: per job, each rank's exit status (``None`` when it outlived the deadline and
was killed), its output, and the seconds from its failing call (the ``bad-step`` marker) to the
last exit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

# torch is imported once, before the forks; torch._dynamo with it, which the constructor of
# DistributedDataParallel imports on its first use: about 0.9 s of CPU per rank, half of
# test_failure_exit's wall time for its thirty ranks here.
import torch._dynamo  # noqa: F401

import distkit  # noqa: F401

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import scenarios  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _parse(spec: str) -> tuple[str, str, dict[str, str]]:
    case, what, *rest = spec.split(":")
    env = dict(item.split("=", 1) for item in rest[0].split(",")) if rest and rest[0] else {}
    return case, what, env


run_root, deadline_s, specs = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
child: tuple[str, str, str, dict[str, str]] | None = None
ranks: dict[int, tuple[int, int, str]] = {}  # pid -> (job, rank, output path)
for job, spec in enumerate(specs):
    case, what, env = _parse(spec)
    run_dir = os.path.join(run_root, f"job{job}")
    os.makedirs(run_dir, exist_ok=True)
    port = str(_free_port())
    for rank in range(2):
        output = os.path.join(run_dir, f"output-{rank}.txt")
        pid = os.fork()
        if pid == 0:
            fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(env)
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                DISTKIT_RUN_DIR=run_dir,
            )
            child = (case, what, run_dir, env)
            break
        ranks[pid] = (job, rank, output)
    if child is not None:
        break

if child is not None:
    # A rank: the job is this script's top level from here on (see the module docs).
    scenarios._job(child[0], child[1], child[2])
else:
    ended: dict[int, tuple[int | None, float]] = {}
    start = time.monotonic()
    while len(ended) < len(ranks) and time.monotonic() - start < deadline_s:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.02)
            continue
        ended[pid] = (os.waitstatus_to_exitcode(status), time.time())
    for pid in ranks:
        if pid not in ended:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    results = []
    for job, spec in enumerate(specs):
        pids = sorted((rank, pid) for pid, (j, rank, _) in ranks.items() if j == job)
        codes = [ended[pid][0] if pid in ended else None for _, pid in pids]
        outputs = []
        for _, pid in pids:
            with open(ranks[pid][2], encoding="utf-8", errors="replace") as handle:
                outputs.append(handle.read())
        run_dir = os.path.join(run_root, f"job{job}")
        markers = [float(path.read_text()) for path in Path(run_dir).glob("bad-step-*.txt")]
        elapsed = (
            max(ended[pid][1] for _, pid in pids) - min(markers)
            if markers and all(pid in ended for _, pid in pids)
            else None
        )
        results.append({"spec": spec, "codes": codes, "outputs": outputs, "error_to_exit_s": elapsed})
    print(json.dumps(results))

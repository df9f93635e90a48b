"""What the tests that start jobs of their own share: the launcher variables a job must not inherit,
the environment without them (and a job's whole environment), the torchrun command line and a free
port.

A test session may itself run under a launcher (torchrun, SLURM, mpirun). A job the tests start with that
environment would join the session's job instead of forming its own, and a call made in the pytest
process would see a world that is not there; so every launched job gets :func:`launcher_free_env`,
and the fixture ``world_of_one`` (``conftest.py``) removes the same variables from the pytest
process for one test.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "LAUNCHER_PREFIXES",
    "LAUNCHER_VARS",
    "free_port",
    "is_launcher_var",
    "job_env",
    "launcher_free_env",
    "torchrun",
]

REPO = Path(__file__).resolve().parent.parent

# What torchrun sets for each worker (torch/distributed/elastic/agent/server/api.py), besides the
# TORCHELASTIC_* family below.
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)
# Families a launcher sets: torchrun's own (run id, restart count, agent store), and those of the
# launchers distkit.env derives a job from as well: SLURM, Open MPI, MPICH and Intel MPI (the same
# prefixes as distkit.env's _OUTER_JOB_PREFIXES).
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "MPI_LOCAL")


def is_launcher_var(name: str) -> bool:
    """Whether ``name`` is a variable a launcher sets for its workers."""
    return name in LAUNCHER_VARS or name.startswith(LAUNCHER_PREFIXES)


def launcher_free_env(**overrides: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, then ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not is_launcher_var(k)}
    env.update(overrides)
    return env


def job_env(*python_path: str | os.PathLike[str]) -> dict[str, str]:
    """The environment of a job a test starts: :func:`launcher_free_env`, one thread per process (as
    the ranks of the ``ranks`` pool have, so results compare bitwise), and this checkout's ``src``
    first on ``PYTHONPATH``, then ``python_path``."""
    env = launcher_free_env(OMP_NUM_THREADS="1")
    paths = [str(REPO / "src"), *map(str, python_path), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def torchrun(*args: str, options: Sequence[str] = ("--standalone", "--nproc_per_node=2")) -> list[str]:
    """``python -m torch.distributed.run OPTIONS ARGS``: by default a standalone job of 2 processes
    (``--standalone``: a rendezvous on a free port of its own, so tests side by side never collide)."""
    return [sys.executable, "-m", "torch.distributed.run", *options, *args]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous or a store)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

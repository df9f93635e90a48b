"""Read the launcher's environment variables into one frozen :class:`LaunchEnv`.

Local: no communication, no device probing, no environment changes. Supported launchers, in the
order they are recognised (the first match wins, so ``srun torchrun ...`` reads as torchrun):

========== ==========================================================================
torchrun   ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
           ``MASTER_ADDR``, ``MASTER_PORT`` (also what ``torch.multiprocessing.spawn`` users set)
Open MPI   ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/``_LOCAL_SIZE``/``_NODE_RANK``
MPICH      ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS`` (Intel MPI too)
SLURM      ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURM_NODEID``,
           ``SLURM_NTASKS_PER_NODE``, ``SLURM_JOB_NODELIST``, ``SLURM_JOB_ID``
========== ==========================================================================

Anything else is a single process: a world of one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LaunchEnv", "detect_env", "expand_slurm_nodelist"]

# SLURM gives no rendezvous port; every job derives the same one from its id. The range keeps clear
# of the ephemeral ports (32768+ on Linux) and of the well-known ones, as Lightning's choice does.
_SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 10000


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it.

    Attributes:
        launcher: ``"torchrun"``, ``"env"`` (RANK/WORLD_SIZE set by hand, e.g. under
            ``torch.multiprocessing.spawn``), ``"openmpi"``, ``"mpich"``, ``"slurm"`` or ``"none"``.
        rank: Global rank, ``0 <= rank < world_size``.
        world_size: Number of processes in the job.
        local_rank: Rank among the processes of this node.
        local_world_size: Number of processes on this node.
        node_rank: Index of this node.
        master_addr: Host of the rendezvous store; ``None`` in a world of one.
        master_port: Port of the rendezvous store; ``None`` in a world of one.
        agent_store: True when a launcher agent (torchrun) already hosts the store at
            ``master_addr:master_port``, so every rank connects as a client.

    Example:
        >>> env = detect_env({})
        >>> env.world_size, env.is_distributed
        (1, False)
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    agent_store: bool = False

    @property
    def is_distributed(self) -> bool:
        """True when the job has more than one process."""
        return self.world_size > 1

    @property
    def num_nodes(self) -> int:
        """Number of nodes, assuming the same number of processes on every node."""
        return max(1, -(-self.world_size // self.local_world_size))


# Variables of an outer job (torchrun agent, SLURM step, MPI) that must not leak into the ranks of a
# job distkit starts itself: detect_env would read the outer job instead of the new one.
_OUTER_JOB_PREFIXES = ("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "MPI_LOCAL")


def _local_job_environ(base: Mapping[str, str], *, rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment of one rank of a one-node job whose parent hosts the store on 127.0.0.1:port.

    Used by distkit.testing and distkit.bench, which start their own ranks (private).
    """
    environ = {k: v for k, v in base.items() if not k.startswith(_OUTER_JOB_PREFIXES)}
    environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # The parent hosts the store, as torchrun's agent does; every rank connects as a client.
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    return environ


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise ValueError(f"environment variable {name} is not set; the launcher must set it.")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name} must be an integer, got {raw!r}; "
            f"unset it or fix the launcher command."
        ) from None


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM node list such as ``"gpu[01-03,07],login1"`` into host names.

    Local: no communication.

    Args:
        nodelist: The value of ``SLURM_JOB_NODELIST``.

    Returns:
        The host names in order.

    Raises:
        ValueError: The list is malformed.

    Example:
        >>> expand_slurm_nodelist("node[1-3],gpu07")
        ['node1', 'node2', 'node3', 'gpu07']
    """
    hosts: list[str] = []
    # Split on commas that are outside brackets.
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", part)
        if match is None:
            if "[" in part or "]" in part:
                raise ValueError(f"malformed SLURM_JOB_NODELIST entry {part!r} in {nodelist!r}.")
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        if "[" in suffix:
            # Nested brackets ("a[1-2]b[3-4]") are expanded recursively.
            for head in expand_slurm_nodelist(f"{prefix}[{ranges}]"):
                hosts.extend(expand_slurm_nodelist(head + suffix))
            continue
        for item in ranges.split(","):
            lo, sep, hi = item.partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                raise ValueError(f"malformed range {item!r} in SLURM_JOB_NODELIST {nodelist!r}.")
            width = len(lo)
            for number in range(int(lo), int(hi if sep else lo) + 1):
                hosts.append(f"{prefix}{number:0{width}d}{suffix}")
    if not hosts:
        raise ValueError(f"SLURM_JOB_NODELIST {nodelist!r} names no host.")
    return hosts


def _slurm_tasks_per_node(value: str, node_id: int, name: str) -> int:
    # "4(x2),2" means 4 tasks on each of the first two nodes, then 2 on the third.
    counts: list[int] = []
    for item in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ValueError(f"malformed {name} {value!r}.")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts[min(node_id, len(counts) - 1)]


def _master(environ: Mapping[str, str], launcher: str, world_size: int) -> tuple[str | None, int | None]:
    if world_size == 1 and "MASTER_ADDR" not in environ:
        return None, None
    addr = environ.get("MASTER_ADDR")
    if not addr:
        fixes = {
            "openmpi": "mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500",
            "mpich": "mpiexec -genv MASTER_ADDR <host of rank 0> -genv MASTER_PORT 29500",
        }
        hint = (
            f"pass it to every rank: {fixes[launcher]}"
            if launcher in fixes
            else "export MASTER_ADDR=<host of rank 0>, or launch with torchrun --standalone"
        )
        raise ValueError(
            f"MASTER_ADDR is not set for a {world_size}-process job launched by {launcher}; {hint}."
        )
    port = _int(environ, "MASTER_PORT", 29500)
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT must be in 1..65535, got {port}.")
    return addr, port


def _check(env: LaunchEnv, names: tuple[str, str, str, str]) -> LaunchEnv:
    rank_var, size_var, local_var, local_size_var = names
    if env.world_size < 1:
        raise ValueError(f"{size_var} must be >= 1, got {env.world_size}.")
    if not 0 <= env.rank < env.world_size:
        raise ValueError(
            f"{rank_var}={env.rank} is outside 0..{env.world_size - 1} ({size_var}={env.world_size}); "
            f"every process needs a distinct rank below the world size — check the launcher command."
        )
    if env.local_world_size < 1 or env.local_world_size > env.world_size:
        raise ValueError(
            f"{local_size_var}={env.local_world_size} must be in 1..{size_var}={env.world_size}."
        )
    if not 0 <= env.local_rank < env.local_world_size:
        raise ValueError(
            f"{local_var}={env.local_rank} is outside 0..{env.local_world_size - 1} "
            f"({local_size_var}={env.local_world_size}); check the launcher command."
        )
    if env.node_rank < 0:
        raise ValueError(f"node rank must be >= 0, got {env.node_rank}.")
    return env


def detect_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Describe this process's place in the job from the launcher's environment variables.

    Local: no communication. Without any launcher variables it returns a world of one.

    Args:
        environ: The variables to read; ``os.environ`` when ``None``.

    Returns:
        The frozen :class:`LaunchEnv`.

    Raises:
        ValueError: A variable is malformed or inconsistent (e.g. ``RANK >= WORLD_SIZE``, or no
            ``MASTER_ADDR`` for a multi-process job); the message names the variable and the fix.

    Example:
        >>> detect_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}).rank
        1
    """
    environ = os.environ if environ is None else environ

    if "RANK" in environ or "WORLD_SIZE" in environ:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in environ else "env"
        world_size = _int(environ, "WORLD_SIZE")
        rank = _int(environ, "RANK")
        # Without LOCAL_WORLD_SIZE (hand-set variables, mp.spawn) the job is taken as one node.
        local_world_size = _int(environ, "LOCAL_WORLD_SIZE", world_size)
        local_rank = _int(environ, "LOCAL_RANK", rank)
        node_rank = _int(environ, "GROUP_RANK", rank // max(local_world_size, 1))
        addr, port = _master(environ, launcher, world_size)
        env = LaunchEnv(
            launcher,
            rank,
            world_size,
            local_rank,
            local_world_size,
            node_rank,
            addr,
            port,
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )
        return _check(env, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))

    if "OMPI_COMM_WORLD_RANK" in environ:
        rank = _int(environ, "OMPI_COMM_WORLD_RANK")
        world_size = _int(environ, "OMPI_COMM_WORLD_SIZE")
        local_world_size = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
        local_rank = _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
        node_rank = _int(environ, "OMPI_COMM_WORLD_NODE_RANK", rank // local_world_size)
        addr, port = _master(environ, "openmpi", world_size)
        env = LaunchEnv("openmpi", rank, world_size, local_rank, local_world_size, node_rank, addr, port)
        return _check(
            env,
            (
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ),
        )

    if "PMI_RANK" in environ:
        rank = _int(environ, "PMI_RANK")
        world_size = _int(environ, "PMI_SIZE")
        local_world_size = _int(environ, "MPI_LOCALNRANKS", 1)
        local_rank = _int(environ, "MPI_LOCALRANKID", 0)
        addr, port = _master(environ, "mpich", world_size)
        env = LaunchEnv(
            "mpich",
            rank,
            world_size,
            local_rank,
            local_world_size,
            rank // local_world_size,
            addr,
            port,
        )
        return _check(env, ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))

    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        rank = _int(environ, "SLURM_PROCID")
        # Inside a job step srun sets SLURM_STEP_NUM_TASKS; a batch script run without srun still
        # sees SLURM_NTASKS of the whole allocation but is one process.
        world_size = _int(environ, "SLURM_STEP_NUM_TASKS", _int(environ, "SLURM_NTASKS"))
        node_rank = _int(environ, "SLURM_NODEID", 0)
        local_rank = _int(environ, "SLURM_LOCALID", 0)
        # Errors name the variable the value came from: a job step's own, or the allocation's.
        size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
        per_node_var = "SLURM_STEP_TASKS_PER_NODE"
        if not environ.get(per_node_var):
            per_node_var = "SLURM_NTASKS_PER_NODE"
        per_node = environ.get(per_node_var)
        local_world_size = world_size
        if per_node:
            local_world_size = _slurm_tasks_per_node(per_node, node_rank, per_node_var)
        addr = environ.get("MASTER_ADDR")
        port = _int(environ, "MASTER_PORT", 0) or None
        if world_size > 1:
            if not addr:
                nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                if not nodelist:
                    raise ValueError(
                        "SLURM_JOB_NODELIST is not set, so the master host is unknown; "
                        "export MASTER_ADDR=<first node of the job> in the sbatch script."
                    )
                addr = expand_slurm_nodelist(nodelist)[0]
            if port is None:
                job_id = _int(environ, "SLURM_JOB_ID", 0)
                port = _SLURM_PORT_BASE + job_id % _SLURM_PORT_SPAN
        env = LaunchEnv(
            "slurm",
            rank,
            world_size,
            local_rank,
            local_world_size,
            node_rank,
            addr if world_size > 1 else None,
            port if world_size > 1 else None,
        )
        return _check(env, ("SLURM_PROCID", size_var, "SLURM_LOCALID", per_node_var))

    return LaunchEnv("none", 0, 1, 0, 1, 0, None, None)

"""Process-group setup and teardown, rank queries, a barrier with a deadline, rank-aware output.

Every query works in three situations with one code path for the caller: before :func:`init`
(read from the launcher's environment), after it, and in a world of one (no launcher at all).
"""

from __future__ import annotations

import atexit
import builtins
import functools
import gc
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar, overload

import torch
import torch.distributed as dist

from distkit._doctor import doctor as _hang
from distkit.env import LaunchEnv, detect_env
from distkit.errors import CollectiveTimeoutError, DistkitError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HANG_EXIT_CODE",
    "PEER_FAILED_EXIT_CODE",
    "RankLoggerAdapter",
    "barrier",
    "get_device",
    "get_env",
    "get_local_rank",
    "get_local_world_size",
    "get_logger",
    "get_node_rank",
    "get_rank",
    "get_world_size",
    "init",
    "is_distributed",
    "is_initialized",
    "is_local_main_process",
    "is_main_process",
    "local_main_process_only",
    "main_process_only",
    "rank_zero_print",
    "shutdown",
]

# NCCL's own default in torch (10 minutes). gloo's is 30 minutes, which is how long a job hangs
# today when one rank stops arriving; a shorter default surfaces such bugs sooner. Long rank-0-only
# work (downloads) belongs in main_process_first(), which has its own, longer deadline.
DEFAULT_TIMEOUT_S = 600.0

#: Exit code of every rank after the hang doctor's report: ``timeout(1)``'s code for "timed out".
HANG_EXIT_CODE = _hang.HANG_EXIT_CODE
#: Exit code of a rank that only waited for another rank that failed (raised, or died).
PEER_FAILED_EXIT_CODE = _hang.PEER_FAILED_EXIT_CODE

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class _Runtime:
    # What the launcher said and what init() chose.
    env: LaunchEnv
    backend: str | None
    device: torch.device
    timeout_s: float
    # Communication handles: the key-value store (prefixed for distkit's own keys) and a gloo group
    # for CPU-side work (objects, flags) even when the default group is NCCL.
    store: dist.Store | None = None
    cpu_group: Any = None
    # Whether distkit created the process group (and so may destroy it).
    owns_group: bool = False
    # Per-process counters; every rank calls the same sequence of collectives, so they agree.
    counters: dict[str, int] = field(default_factory=dict)
    # Barriers of groups the caller made, per group name: only their members count them, so they
    # are kept apart from the counters every rank shares.
    group_barriers: dict[str, int] = field(default_factory=dict)
    # The hang doctor (docs/debugging.md): its watchdog timeout as init() resolved it (None: off;
    # seconds; "auto"), and the doctor itself in a job of several processes with a store.
    hang_timeout_s: float | str | None = None
    doctor: _hang.Doctor | None = None

    def next_id(self, kind: str) -> int:
        self.counters[kind] = self.counters.get(kind, 0) + 1
        return self.counters[kind]


# The process group is process-wide state in torch itself; this mirrors it and holds nothing else.
_runtime: _Runtime | None = None
_atexit_registered = False


def _abandon(group: Any) -> None:
    """Let this process exit although ``group`` has a collective that will never complete.

    Called when an error ends distkit's wait for one of its own collectives while the collective
    is still pending (a :class:`~distkit.CollectiveMismatchError`, a timeout, a signal). Freeing a
    gloo group joins its threads, and the one inside that collective waits for the group's whole
    timeout (ten minutes by default) for peers that will never come: the process could not exit,
    so its launcher never ended the job (measured on torch 2.13; the group's ``abort()`` and
    ``shutdown()`` return at once but do not release that thread). So such a group is never
    freed: one reference to it is leaked on purpose (``destroy_process_group`` still unregisters
    it, so a later :func:`init` starts afresh). The process then exits at once with its own exit
    code (a traceback's 1, or what the script passed to ``sys.exit``), and the peers'
    collectives fail within a second ("Connection closed by peer"), which ends them too. Ending
    the process from an ``atexit`` hook with ``os._exit`` would also work, but it loses the exit
    code that the script chose, and runs before other ``atexit`` hooks (an async checkpoint's).
    """
    import ctypes  # here: rarely needed, and `import distkit` stays light

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def _default_device(env: LaunchEnv) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if env.local_rank < count:
        return torch.device("cuda", env.local_rank)
    if count == 1:
        # One visible GPU per process: the launcher bound it (srun --gpus-per-task=1, or
        # CUDA_VISIBLE_DEVICES set per rank).
        return torch.device("cuda", 0)
    raise DistkitError(
        f"[rank {env.rank}/{env.world_size}] local rank {env.local_rank} has no GPU: this node "
        f"runs {env.local_world_size} processes but sees {count} GPUs. Start at most {count} "
        f"processes per node (torchrun --nproc_per_node={count}), or pass device='cpu'."
    )


def _check_one_gpu_per_process(env: LaunchEnv, backend: str, device: object) -> None:
    # Several processes of a node on its one GPU: NCCL refuses them with a bare "invalid usage"
    # (measured: NCCL 2.28, "Duplicate GPU detected"). One visible GPU per process is fine when the
    # launcher bound it (srun --gpus-per-task=1 sets CUDA_VISIBLE_DEVICES per rank).
    if (
        backend != "nccl"
        or device is not None
        or env.local_world_size < 2
        or torch.cuda.device_count() != 1
        or os.environ.get("CUDA_VISIBLE_DEVICES")
    ):
        return
    raise DistkitError(
        f"[rank {env.rank}/{env.world_size}] this node runs {env.local_world_size} processes but sees "
        f"1 GPU, and NCCL needs a GPU of its own for every process. Start one process per GPU "
        f"(torchrun --nproc_per_node=1), bind one GPU to each process (CUDA_VISIBLE_DEVICES), or "
        f"run the processes on the CPU: distkit.init(device='cpu'), or CUDA_VISIBLE_DEVICES='' for "
        f"the whole job."
    )


def _resolve_device(env: LaunchEnv, device: str | torch.device | None) -> torch.device:
    if device is None:
        return _default_device(env)
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DistkitError(
                f"device={str(device)!r} was requested but CUDA is not available on this machine; "
                f"pass device='cpu' or install a CUDA build of torch."
            )
        if dev.index is None:
            dev = _default_device(env)
    return dev


def _resolve_backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise DistkitError(
            f"backend='nccl' needs a CUDA device, but this rank's device is {device}; "
            f"use backend='gloo' on CPU, or leave backend=None to choose automatically."
        )
    if not dist.is_backend_available(backend):
        raise DistkitError(f"backend {backend!r} is not available in this torch build.")
    return backend


# The key under which the rank that hosts the store says whose it is (outside any job's namespace).
_OWNER_KEY = "distkit-store-owner"


def _job_id() -> str:
    """What every process of this job, and no other job, has in its environment."""
    for name in ("DISTKIT_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = os.environ.get(name)
        if value:
            return value.replace("/", "_")
    slurm = os.environ.get("SLURM_JOB_ID")
    if slurm:
        return f"slurm-{slurm}.{os.environ.get('SLURM_STEP_ID', '0')}"
    return "local"


def _port_fix() -> str:
    return (
        "Set MASTER_PORT to a free port (the same on every rank), or launch with `torchrun --standalone`, "
        "which picks a free one."
    )


def _connect_store(env: LaunchEnv, timeout_s: float) -> dist.Store:
    assert env.master_addr is not None and env.master_port is not None  # detect_env guarantees it
    # Under torchrun (or the distkit.testing parent) the launcher already hosts the store, as
    # torch's own env:// rendezvous assumes; otherwise rank 0 hosts it.
    is_master = env.rank == 0 and not env.agent_store
    where = f"MASTER_PORT={env.master_port} on {env.master_addr}"
    label = f"[rank {env.rank}/{env.world_size}]"
    try:
        if is_master:
            store = dist.TCPStore(
                env.master_addr,
                env.master_port,
                env.world_size,
                is_master=True,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        else:
            store = _connect_client(env, timeout_s)
    except DistkitError:
        raise
    except RuntimeError as err:
        text = str(err)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise DistkitError(
                f"{label} {where} is already in use (another job, or a previous run that is still "
                f"exiting). {_port_fix()}"
            ) from err
        raise DistkitError(
            f"{label} could not reach the rendezvous store at "
            f"MASTER_ADDR={env.master_addr} MASTER_PORT={env.master_port} within {timeout_s:g} s: "
            f"{text.splitlines()[0] if text else type(err).__name__}. Check that rank 0 is running "
            f"and that every rank was given the same MASTER_ADDR and MASTER_PORT."
        ) from err
    owner = {"job": _job_id(), "world_size": env.world_size, "host": socket.gethostname(), "pid": os.getpid()}
    if is_master:
        store.set(_OWNER_KEY, json.dumps(owner))
    elif not env.agent_store:
        _check_owner(store, env, owner, timeout_s, where)
    return store


# How long a port that accepts connections may stay silent before it is judged not to be this job's
# store (or a store without distkit's rank 0): a real store answers within milliseconds, and a rank
# of a job whose MASTER_PORT another program holds then fails within this, not timeout_s.
_SILENT_STORE_S = 15.0


def _connect_client(env: LaunchEnv, timeout_s: float) -> dist.TCPStore:
    """A client of the store at MASTER_ADDR:MASTER_PORT, or an error within ``timeout_s``.

    torch's client retries a refused connection until its timeout, but when the port belongs to a
    program that accepts the connection and never answers as a store, it waits forever (measured:
    torch 2.13). So it connects on a thread, and the wait for it has the deadline.
    """
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(
                env.master_addr,  # type: ignore[arg-type]
                env.master_port,  # type: ignore[arg-type]
                env.world_size,
                is_master=False,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=connect, name="distkit-store-connect", daemon=True)
    thread.start()
    start = time.monotonic()
    while thread.is_alive() and (waited := time.monotonic() - start) < timeout_s:
        thread.join(min(0.5, timeout_s - waited))
        # A refused connection is rank 0 not up yet: wait up to timeout_s. A port that accepts and
        # stays silent this long is not a store (a real one answers within milliseconds).
        if thread.is_alive() and time.monotonic() - start >= _SILENT_STORE_S and _accepts(env):
            break
    if "store" in box:
        return box["store"]  # type: ignore[no-any-return]
    if "error" in box:
        raise box["error"]
    raise DistkitError(
        f"[rank {env.rank}/{env.world_size}] MASTER_PORT={env.master_port} on {env.master_addr} "
        f"accepted the connection but did not answer as a torch.distributed store within "
        f"{time.monotonic() - start:.0f} s: another program holds the port (rank 0 of this job most "
        f"likely failed to start its store there). {_port_fix()}"
    )


def _accepts(env: LaunchEnv) -> bool:
    """Whether something listens on MASTER_ADDR:MASTER_PORT (a plain TCP connection, closed)."""
    try:
        with socket.create_connection((env.master_addr, env.master_port), timeout=1.0):  # type: ignore[arg-type]
            return True
    except OSError:
        return False


def _check_owner(
    store: dist.Store, env: LaunchEnv, mine: dict[str, Any], timeout_s: float, where: str
) -> None:
    """Refuse a store that another job's rank 0 hosts (that job's MASTER_PORT is this job's too)."""
    label = f"[rank {env.rank}/{env.world_size}]"
    # distkit's rank 0 registers right after its store starts, so the key is there at once.
    wait_s = min(timeout_s, _SILENT_STORE_S)
    try:
        store.wait([_OWNER_KEY], timedelta(seconds=wait_s))
        owner = json.loads(store.get(_OWNER_KEY))
    except (RuntimeError, ValueError) as err:
        raise DistkitError(
            f"{label} {where} answers as a torch.distributed store, but no distkit rank 0 registered "
            f"there within {wait_s:g} s: the store belongs to another program or job. {_port_fix()}"
        ) from err
    job = mine["job"]
    if owner.get("world_size") != env.world_size or (job != "local" and owner.get("job") != job):
        raise DistkitError(
            f"{label} {where} belongs to another job: a {owner.get('world_size')}-process job (job id "
            f"{owner.get('job')!r}) whose rank 0 is pid {owner.get('pid')} on {owner.get('host')}; this "
            f"job ({env.world_size} processes, job id {job!r}) must not join it. {_port_fix()}"
        )


def _claim_rank(store: dist.Store, env: LaunchEnv) -> None:
    """Take this rank's place in the job's namespace, or raise if another process holds it."""
    if int(store.add(f"claim/{env.rank}", 1)) == 1:
        store.set(f"claimer/{env.rank}", f"pid {os.getpid()} on {socket.gethostname()}")
        return
    try:
        holder = store.get(f"claimer/{env.rank}").decode(errors="replace")
    except RuntimeError:
        holder = "another process"
    raise DistkitError(
        f"[rank {env.rank}/{env.world_size}] rank {env.rank} of this job is already taken (by {holder}) "
        f"at MASTER_PORT={env.master_port} on {env.master_addr}: two processes were given RANK="
        f"{env.rank}, or another job with the same world size uses the same MASTER_PORT. Give each "
        f"process its own RANK. {_port_fix()}"
    )


# How long init() waits for the other ranks silently: past this it says once which ranks have not
# joined (a rank that never calls init, e.g. a collective under `if is_main_process():`, would
# otherwise leave this one waiting without a word until the timeout; ten minutes by default).
_JOIN_QUIET_S = 30.0


def _await_ranks(store: dist.Store, env: LaunchEnv, timeout_s: float) -> None:
    """Wait until every rank of the job has claimed its place; say which have not after
    ``_JOIN_QUIET_S``, and raise naming them at ``timeout_s``."""
    keys = [f"claim/{rank}" for rank in range(env.world_size)]
    start = time.monotonic()
    warned = False
    pause = 0.005
    while not store.check(keys):
        waited = time.monotonic() - start
        if (waited >= _JOIN_QUIET_S and not warned) or waited >= timeout_s:
            missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
            if not missing:
                break
            text = (
                f"[rank {env.rank}/{env.world_size}] rank(s) {missing} of this job have not joined after "
                f"{waited:.0f} s. They may still be starting (importing torch and building data take "
                f"much longer on a busy machine), or never get there: every rank must reach "
                f"distkit.init() (and the Trainer's fit, validate, test and predict, which call it), "
                f"and a call under `if is_main_process():` or a rank whose script ended early leaves "
                f"the others waiting."
            )
            if waited >= timeout_s:
                message = f"{text} Gave up after timeout_s={timeout_s:g}."
                raise CollectiveTimeoutError(message, missing_ranks=missing, timeout_s=timeout_s)
            print(f"{text} Waiting up to timeout_s={timeout_s:g} s.", file=sys.stderr, flush=True)
            warned = True
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def _adopt_existing_group(timeout_s: float) -> _Runtime:
    # The user (or another library) called init_process_group; describe it without changing it.
    env = detect_env()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if (env.rank, env.world_size) != (rank, world_size):
        env = LaunchEnv(
            env.launcher,
            rank,
            world_size,
            env.local_rank if env.world_size == world_size else rank,
            env.local_world_size if env.world_size == world_size else world_size,
            env.node_rank,
            env.master_addr,
            env.master_port,
            env.agent_store,
        )
    backend = str(dist.get_backend())
    device = _default_device(env) if "nccl" in backend else torch.device("cpu")
    store = None
    try:
        store = dist.PrefixStore("distkit/", dist.distributed_c10d._get_default_store())
    except (RuntimeError, AttributeError, ValueError):  # private API; fall back to collectives
        store = None
    cpu_group = None if backend == "gloo" else dist.new_group(backend="gloo")
    return _Runtime(env, backend, device, timeout_s, store, cpu_group, owns_group=False)


def init(
    backend: str | None = None,
    *,
    timeout_s: float | None = None,
    device: str | torch.device | None = None,
    hang_timeout_s: float | str | None = None,
) -> LaunchEnv:
    """Join the job this process was launched into, or set up a world of one.

    Collective: call on every rank. Idempotent: a second call returns the same :class:`LaunchEnv`
    when its settings agree with the first (``None`` agrees with anything) and raises otherwise.
    Without a launcher it creates no process group; every helper then acts on a world of one.
    Under torchrun, or with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set by hand, it creates one even
    for a single process, so that ``torch.distributed`` calls and DDP work as they would on more.

    Picks ``nccl`` when this rank has a CUDA device, else ``gloo``; selects the CUDA device of the
    local rank; initialises NCCL eagerly so that the first collective already obeys the timeout.
    distkit's own collectives (metrics, objects, flags) run on a gloo group of their own, so they
    never touch the GPU and never pair up with another collective of the default group.

    Every rank of a job of several processes can say where it is when asked through the job's store
    (a thread that blocks on the store and costs nothing while idle): distkit's collectives use it
    to raise at once when some ranks can never arrive (:class:`~distkit.CollectiveMismatchError`).
    With ``hang_timeout_s`` the hang doctor also watches this process: when a rank has waited in a
    collective for longer than that, one rank prints where every rank is (and writes it to a file
    in ``DISTKIT_RUN_DIR``, else the working directory) and every rank exits with code 124. See
    ``docs/debugging.md``.

    Args:
        backend: ``"gloo"``, ``"nccl"``, or ``None`` to choose from the device.
        timeout_s: Deadline of every collective and of the rendezvous, in seconds
            (default :data:`DEFAULT_TIMEOUT_S`, 600).
        device: This rank's device; ``None`` picks ``cuda:<local_rank>`` when CUDA is available,
            else the CPU.
        hang_timeout_s: Turn the hang doctor's watchdog on with this many seconds; ``"auto"`` for
            five minutes; 0 to turn it off. ``None`` (the default) leaves it to the environment
            variable ``DISTKIT_HANG_TIMEOUT_S`` (a number, ``auto`` or ``off``), off when unset.
            Ignored in a world of one, where no collective can wait for another process.

    Returns:
        The launch environment this process joined.

    Raises:
        ValueError: The launcher's variables are inconsistent (names the variable), or
            ``hang_timeout_s``/``DISTKIT_HANG_TIMEOUT_S`` is not a number of seconds.
        DistkitError: The settings conflict with an earlier ``init()``, ``MASTER_PORT`` is already
            in use or belongs to another job (every rank says so within ``timeout_s``), or the
            rendezvous store cannot be reached.

    Example:
        >>> import distkit
        >>> env = distkit.init()  # python, torchrun, srun or mpirun alike
        >>> distkit.get_world_size() == env.world_size
        True
    """
    global _runtime, _atexit_registered
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
    hang = _hang.timeout_for_init(hang_timeout_s)
    if _runtime is not None:
        wanted_device = None if device is None else _resolve_device(_runtime.env, device)
        conflicts = [
            f"{name}: first init() used {old!r}, now {new!r}"
            for name, old, new, given in (
                ("backend", _runtime.backend, backend, backend is not None),
                ("timeout_s", _runtime.timeout_s, timeout_s, timeout_s is not None),
                ("device", _runtime.device, wanted_device, device is not None),
                ("hang_timeout_s", _runtime.hang_timeout_s, hang, hang_timeout_s is not None),
            )
            if given and new != old
        ]
        if conflicts:
            raise DistkitError(
                "distkit.init() was already called with other settings ("
                + "; ".join(conflicts)
                + "). Call distkit.shutdown() first to start over with new settings."
            )
        return _runtime.env

    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    if dist.is_available() and dist.is_initialized():
        _runtime = _adopt_existing_group(timeout)
        _start_doctor(_runtime, hang)
        return _runtime.env

    env = detect_env()
    dev = _resolve_device(env, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # torchrun --nproc_per_node=1 (or RANK/WORLD_SIZE/MASTER_* set by hand) still gets a process
    # group: its users call torch.distributed and wrap DDP themselves. A plain `python` run, or one
    # task of SLURM or MPI with no rendezvous address of its own, is a world of one with no group.
    if not env.is_distributed and (env.launcher not in ("torchrun", "env") or env.master_addr is None):
        _runtime = _Runtime(env, backend, dev, timeout, hang_timeout_s=hang)
        return env

    chosen = _resolve_backend(backend, dev)
    _check_one_gpu_per_process(env, chosen, device)
    # Every key of this job lives under its own namespace: torchrun keeps one store across restarts
    # of the workers (keys of an earlier attempt, gloo's addresses, barrier arrivals, must not be
    # read by this one, as torch's own rendezvous does), and a job whose MASTER_PORT another job's
    # store holds must never mix its keys with that job's.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    job_store = dist.PrefixStore(f"distkit-job-{_job_id()}-attempt-{attempt}/", _connect_store(env, timeout))
    _claim_rank(job_store, env)
    _await_ranks(job_store, env, timeout)
    try:
        dist.init_process_group(
            chosen,
            store=dist.PrefixStore("pg/", job_store),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout),
            # Passing the device makes NCCL create its communicator now (eager init), so a rank
            # that never arrives is reported within the timeout instead of at the first collective.
            device_id=dev if chosen == "nccl" else None,
        )
        # distkit's collectives get a gloo group of their own: CPU-side under NCCL, and never
        # matched with a collective of the default group (a reduce_metrics that only some ranks
        # reach would otherwise pair with another rank's DDP all-reduce, and gloo aborts the
        # process on the size mismatch; measured: torch 2.13).
        cpu_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    except Exception as err:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise DistkitError(
            f"[rank {env.rank}/{env.world_size}] init_process_group({chosen!r}) failed: {err}. "
            f"Check that all {env.world_size} ranks started and share MASTER_ADDR={env.master_addr} "
            f"and MASTER_PORT={env.master_port}."
        ) from err
    _runtime = _Runtime(
        env,
        chosen,
        dev,
        timeout,
        dist.PrefixStore("distkit/", job_store),
        cpu_group,
        owns_group=True,
        hang_timeout_s=hang,
    )
    _start_doctor(_runtime, hang)
    if not _atexit_registered:
        # torch warns at exit when a group was never destroyed; users should not have to care.
        atexit.register(shutdown)
        _atexit_registered = True
    return env


def _start_doctor(runtime: _Runtime, hang: float | str | None) -> None:
    """Start the hang doctor of a job of several processes (see docs/debugging.md)."""
    runtime.hang_timeout_s = hang
    if runtime.store is None or runtime.env.world_size < 2:
        return
    group = runtime.cpu_group if runtime.cpu_group is not None else dist.distributed_c10d._get_default_group()
    doctor = _hang.Doctor(
        store=runtime.store,
        rank=runtime.env.rank,
        world_size=runtime.env.world_size,
        counters=runtime.counters,
        helper_group=group,
        helper_group_name=dist.distributed_c10d._world.pg_names.get(group),
        hosts_store=runtime.owns_group and runtime.env.rank == 0 and not runtime.env.agent_store,
    )
    doctor.start()
    runtime.doctor = doctor
    if not runtime.owns_group:
        # shutdown() is registered at exit only for groups distkit made; the doctor's threads must
        # stop (and this rank say it left) for an adopted group too.
        atexit.register(doctor.stop)
    if hang is not None:
        doctor.configure(hang)


def shutdown() -> None:
    """Tear down what :func:`init` set up.

    Local: no communication (so it cannot hang on a dead peer); one store write tells the other
    ranks that this one has left, so that a barrier waiting for it says so at once. Idempotent; a
    group created by someone else than distkit is left as it was. Registered to run at exit by
    :func:`init`.

    Example:
        >>> import distkit
        >>> distkit.shutdown()
        >>> distkit.shutdown()  # a second call does nothing
    """
    global _runtime
    runtime, _runtime = _runtime, None
    if runtime is not None and runtime.doctor is not None:
        runtime.doctor.stop()
    if runtime is not None and runtime.owns_group and dist.is_initialized():
        dist.destroy_process_group()
        # A DDP reducer or pending gloo work in a reference cycle keeps the C++ group alive until
        # interpreter finalization, where freeing it aborts the process ("terminate called without
        # an active exception", pytorch/pytorch#190489). Free such cycles now, while Python is whole.
        gc.collect()
    if runtime is not None and runtime.doctor is not None:
        # A rank that raised and hosts the store: the others, whose collectives now fail, report
        # through it that this rank is the cause.
        runtime.doctor.linger()


def is_initialized() -> bool:
    """True once :func:`init` has run in this process (also for a world of one). Local."""
    return _runtime is not None


def get_env() -> LaunchEnv:
    """This process's :class:`LaunchEnv`: the one :func:`init` joined, or read from the environment.

    Local: no communication.

    Example:
        >>> import distkit
        >>> distkit.get_env().launcher in {"none", "torchrun", "env", "slurm", "openmpi", "mpich"}
        True
    """
    if _runtime is not None:
        return _runtime.env
    if dist.is_available() and dist.is_initialized():
        return _adopt_env_view()
    return detect_env()


def _adopt_env_view() -> LaunchEnv:
    env = detect_env()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if (env.rank, env.world_size) == (rank, world_size):
        return env
    return LaunchEnv(env.launcher, rank, world_size, rank, world_size, 0, None, None)


def get_rank() -> int:
    """Global rank of this process; 0 in a world of one. Local.

    Example:
        >>> import distkit
        >>> distkit.get_rank()
        0
    """
    return get_env().rank


def get_world_size() -> int:
    """Number of processes in the job; 1 in a world of one. Local.

    Example:
        >>> import distkit
        >>> distkit.get_world_size()
        1
    """
    return get_env().world_size


def get_local_rank() -> int:
    """Rank of this process among those on its node. Local.

    Example:
        >>> import distkit
        >>> distkit.get_local_rank()
        0
    """
    return get_env().local_rank


def get_local_world_size() -> int:
    """Number of processes on this node. Local.

    Example:
        >>> import distkit
        >>> distkit.get_local_world_size()
        1
    """
    return get_env().local_world_size


def get_node_rank() -> int:
    """Index of this process's node. Local.

    Example:
        >>> import distkit
        >>> distkit.get_node_rank()
        0
    """
    return get_env().node_rank


def is_distributed() -> bool:
    """True when the job has more than one process (before or after :func:`init`). Local.

    Example:
        >>> import distkit
        >>> distkit.is_distributed()
        False
    """
    return get_world_size() > 1


def is_main_process() -> bool:
    """True on global rank 0, the process that does the job's one-off work. Local.

    Example:
        >>> import distkit
        >>> distkit.is_main_process()
        True
    """
    return get_rank() == 0


def is_local_main_process() -> bool:
    """True on local rank 0 of each node (per-node work such as filling a local cache). Local.

    Example:
        >>> import distkit
        >>> distkit.is_local_main_process()
        True
    """
    return get_local_rank() == 0


def get_device() -> torch.device:
    """This rank's device: the one :func:`init` chose, or the one it would choose. Local.

    Example:
        >>> import distkit
        >>> distkit.get_device().type in {"cpu", "cuda"}
        True
    """
    if _runtime is not None:
        return _runtime.device
    return _default_device(get_env())


def _check_decorator_rank(rank: int, what: str) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{what} rank must be an int >= 0, got {rank!r}.")
    return rank


def _only_on(fn: Callable[P, R], rank: int, *, local: bool, name: str) -> Callable[P, R | None]:
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
        env = get_env()
        mine, size = (env.local_rank, env.local_world_size) if local else (env.rank, env.world_size)
        if rank >= size:
            # Checked at the call, not at decoration: the job's size is known only then. A rank
            # that does not exist would otherwise make the function silently never run.
            where = (
                f"this node runs {size} process(es), local ranks"
                if local
                else f"this job has {size} process(es), ranks"
            )
            raise ValueError(
                f"[rank {env.rank}/{env.world_size}] {name}(rank={rank}) on "
                f"{getattr(fn, '__qualname__', fn)!s}: {where} 0..{size - 1}, so no process would run "
                f"it. Pass a rank below {size}."
            )
        return fn(*args, **kwargs) if mine == rank else None

    return wrapper


@overload
def main_process_only(fn: Callable[P, R], /) -> Callable[P, R | None]: ...
@overload
def main_process_only(*, rank: int = 0) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...
def main_process_only(
    fn: Callable[P, R] | None = None, /, *, rank: int = 0
) -> Callable[P, R | None] | Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorate ``fn`` to run on the main process only; other ranks return ``None`` at once.

    Local: no communication, so the other ranks do not wait for it. Without a process group the
    one process is rank 0 and runs ``fn``.

    Args:
        fn: The function, when used bare as ``@main_process_only``.
        rank: The global rank that runs ``fn`` (``@main_process_only(rank=1)``); 0 by default.

    Raises:
        ValueError: At decoration, ``rank`` is not an int >= 0; at the call, ``rank`` is not a
            rank of this job (no process would run ``fn``).

    Example:
        >>> import distkit
        >>> @distkit.main_process_only
        ... def save_plot(path: str) -> str:
        ...     return path
        >>> save_plot("loss.png")
        'loss.png'
    """
    _check_decorator_rank(rank, "main_process_only()")

    def decorate(f: Callable[P, R]) -> Callable[P, R | None]:
        return _only_on(f, rank, local=False, name="main_process_only")

    return decorate if fn is None else decorate(fn)


@overload
def local_main_process_only(fn: Callable[P, R], /) -> Callable[P, R | None]: ...
@overload
def local_main_process_only(*, rank: int = 0) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...
def local_main_process_only(
    fn: Callable[P, R] | None = None, /, *, rank: int = 0
) -> Callable[P, R | None] | Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorate ``fn`` to run on local rank 0 of every node only; other ranks return ``None`` at once.

    Local: no communication, so the other ranks do not wait for it. Use it for per-node work
    (clearing a node-local cache, logging a node's GPUs). Without a process group the one process
    runs ``fn``.

    Args:
        fn: The function, when used bare as ``@local_main_process_only``.
        rank: The local rank that runs ``fn`` on each node; 0 by default.

    Raises:
        ValueError: At decoration, ``rank`` is not an int >= 0; at the call, ``rank`` is not a
            local rank of this node (no process of the node would run ``fn``).

    Example:
        >>> import distkit
        >>> @distkit.local_main_process_only
        ... def node_cache() -> str:
        ...     return "/tmp/cache"
        >>> node_cache()
        '/tmp/cache'
    """
    _check_decorator_rank(rank, "local_main_process_only()")

    def decorate(f: Callable[P, R]) -> Callable[P, R | None]:
        return _only_on(f, rank, local=True, name="local_main_process_only")

    return decorate if fn is None else decorate(fn)


def rank_zero_print(*args: Any, **kwargs: Any) -> None:
    """``print`` on the main process only. Local.

    Example:
        >>> import distkit
        >>> distkit.rank_zero_print("epoch", 1)
        epoch 1
    """
    if is_main_process():
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


class RankLoggerAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger whose records start with ``[rank R/W]`` and carry ``rank``/``world_size`` fields."""

    def __init__(self, logger: logging.Logger, *, main_process_only: bool) -> None:
        super().__init__(logger, {})
        self.main_process_only = main_process_only

    def isEnabledFor(self, level: int) -> bool:
        if self.main_process_only and not is_main_process():
            return False
        # bool(): self.logger is Any, the adapter being unparameterised (not subscriptable on 3.10).
        return bool(self.logger.isEnabledFor(level))

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        env = get_env()
        extra = dict(kwargs.get("extra") or {})
        extra.setdefault("rank", env.rank)
        extra.setdefault("world_size", env.world_size)
        kwargs["extra"] = extra
        return f"[rank {env.rank}/{env.world_size}] {msg}", kwargs


def get_logger(name: str = "distkit", *, main_process_only: bool = False) -> RankLoggerAdapter:
    """A :mod:`logging` logger whose messages are prefixed with ``[rank R/W]``.

    Local. Adds no handler: configure output with :func:`logging.basicConfig` as usual.

    Args:
        name: Logger name.
        main_process_only: Drop records on every rank but the main process.

    Example:
        >>> import distkit
        >>> log = distkit.get_logger("train")
        >>> log.info("step %d", 10)  # "[rank 0/1] step 10" once logging is configured
    """
    return RankLoggerAdapter(logging.getLogger(name), main_process_only=main_process_only)


def _require_runtime(what: str) -> _Runtime:
    if _runtime is None:
        if dist.is_available() and dist.is_initialized():
            init()  # adopt the group someone else created
            assert _runtime is not None
            return _runtime
        raise DistkitError(
            f"{what} needs a process group in this {get_world_size()}-process job; "
            f"call distkit.init() on every rank first."
        )
    return _runtime


def barrier(timeout_s: float | None = None, *, group: Any = None) -> None:
    """Wait until every rank arrives, or raise naming the ranks that did not.

    Collective: call on every rank (of ``group``, when given). Without a process group, and on a
    rank outside ``group``, it returns at once.

    The barrier runs through the job's key-value store, so every waiting rank (not only rank 0, as
    with gloo's monitored barrier) learns which ranks are missing, on every backend. A barrier still
    waiting after a second asks where the missing ranks are: one that waits in another collective,
    or has already left the job (its script ended), can never arrive, and the barrier raises
    :class:`~distkit.CollectiveMismatchError` at once instead of waiting for its deadline.

    With ``group`` only its members wait for each other, through the store as well; the early
    "can never arrive" verdict covers barriers of every rank only, so a group's barrier waits for
    its deadline.

    Args:
        timeout_s: Deadline in seconds; the process group's timeout when ``None``.
        group: A group made with ``torch.distributed.new_group``: wait for its ranks only.
            ``None``: every rank.

    Raises:
        CollectiveTimeoutError: Some rank did not arrive in time; ``missing_ranks`` lists them
            (global ranks, also with ``group``).
        CollectiveMismatchError: Some rank can never arrive (it waits elsewhere, or has left);
            ``missing_ranks`` lists them and the message says where they are.
        TypeError: ``group`` is not a process group.

    Example:
        >>> import distkit
        >>> distkit.barrier(timeout_s=60)
    """
    if group is not None and group is not dist.GroupMember.WORLD:
        _group_barrier(group, timeout_s)
        return
    if get_world_size() == 1:
        return
    runtime = _require_runtime("barrier()")
    timeout = runtime.timeout_s if timeout_s is None else float(timeout_s)
    if timeout <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
    if runtime.device.type == "cuda":
        torch.cuda.synchronize(runtime.device)
    if runtime.store is None:
        _monitored_barrier(runtime, timeout)
        return
    generation = runtime.next_id("barrier")
    env, store = runtime.env, runtime.store
    # Each rank counts itself in; the last one releases everyone through one key per rank, which only
    # it and the rank's own hang check (to abort the wait) ever write. Two store round trips for a
    # rank that waits, as many as waiting on every rank's arrival key.
    prefix = f"barrier/{generation}"
    release = f"{prefix}/release/{env.rank}"
    if int(store.add(f"{prefix}/count", 1)) == env.world_size:
        ranks = range(env.world_size)
        # torch's stub of Store lacks multi_set, which Store has at runtime (C++ binding).
        store.multi_set(  # type: ignore[attr-defined]
            [f"{prefix}/release/{rank}" for rank in ranks], ["ok"] * env.world_size
        )
        store.delete_key(f"{prefix}/count")
    doctor = _doctor(runtime)
    if doctor is not None:
        doctor.carry_on()
    token, errors = doctor.watch_barrier(generation, release) if doctor is not None else (None, [])
    start = time.monotonic()
    try:
        _wait_released(store, release, timeout)
    except RuntimeError as err:  # DistStoreError on timeout
        if store.check([release]):  # released just as the deadline passed
            store.delete_key(release)
            return
        missing = _missing_from_barrier(runtime, generation)
        late = f"rank(s) {missing}" if missing is not None else "some rank(s)"
        raise CollectiveTimeoutError(
            f"[rank {env.rank}/{env.world_size}] barrier timed out after {timeout:g} s: "
            f"{late} did not arrive. A rank that is alive but never arrives is usually "
            f"stuck elsewhere (a different code path, a data-loader hang, one collective too many).",
            missing_ranks=missing,
            timeout_s=timeout,
        ) from err
    finally:
        if doctor is not None and token is not None:
            doctor.unwatch_barrier(token)
    if errors:
        raise errors[0]
    store.delete_key(release)
    if doctor is not None and time.monotonic() - start > _hang.FIRST_CHECK_S:
        doctor.finish_slow(f"b{generation}")


def _group_barrier(group: Any, timeout_s: float | None) -> None:
    """:func:`barrier` among the ranks of ``group``, through the store: every member names the late."""
    if type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER:
        return  # what new_group returns on a rank it leaves out
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"barrier() group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(group).__name__}: {group!r}. Make one on every rank with "
            f"torch.distributed.new_group(ranks=[...])."
        )
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    if me not in ranks or len(ranks) < 2:
        return  # outside the group (torch's convention), or alone in it
    runtime = _require_runtime("barrier()")
    timeout = runtime.timeout_s if timeout_s is None else float(timeout_s)
    if timeout <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
    if runtime.device.type == "cuda":
        torch.cuda.synchronize(runtime.device)
    label = f"[rank {runtime.env.rank}/{runtime.env.world_size}]"
    if runtime.store is None:
        try:
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        except RuntimeError as err:
            raise CollectiveTimeoutError(
                f"{label} barrier on the group of ranks {ranks} timed out after {timeout:g} s: {err}.",
                missing_ranks=None,
                timeout_s=timeout,
            ) from err
        return
    # torch names a group alike on all its members (new_group is called by every rank in the same
    # order), and the members call their barriers in the same order, so the key names agree.
    name = group.group_name
    generation = runtime.group_barriers[name] = runtime.group_barriers.get(name, 0) + 1
    prefix = f"group_barrier/{name}/{generation}"
    store = runtime.store
    store.set(f"{prefix}/arrived/{me}", "1")
    if int(store.add(f"{prefix}/count", 1)) == len(ranks):
        # torch's stub of Store lacks multi_set, which Store has at runtime (C++ binding).
        store.multi_set(  # type: ignore[attr-defined]
            [f"{prefix}/release/{rank}" for rank in ranks], ["ok"] * len(ranks)
        )
        for key in [f"{prefix}/count", *(f"{prefix}/arrived/{rank}" for rank in ranks)]:
            store.delete_key(key)
    release = f"{prefix}/release/{me}"
    try:
        store.wait([release], timedelta(seconds=timeout))
    except RuntimeError as err:  # DistStoreError on timeout
        if not store.check([release]):
            missing = [r for r in ranks if r != me and not store.check([f"{prefix}/arrived/{r}"])]
            raise CollectiveTimeoutError(
                f"{label} barrier on the group of ranks {ranks} timed out after {timeout:g} s: "
                f"rank(s) {missing} did not arrive. Call it on every rank of the group, in the same "
                f"order.",
                missing_ranks=missing,
                timeout_s=timeout,
            ) from err
    store.delete_key(release)


def _wait_released(store: dist.Store, key: str, timeout: float) -> None:
    # Its own function: the hang doctor recognises a rank waiting in a barrier by this frame.
    store.wait([key], timedelta(seconds=timeout))


def _missing_from_barrier(runtime: _Runtime, generation: int) -> list[int] | None:
    """The ranks that are not in barrier ``generation``, as their answers (or silence) tell."""
    doctor = _doctor(runtime)
    if doctor is None:
        return None
    try:
        answers = doctor.ask(doctor.store, "where", wait_s=2.0)
    except RuntimeError:
        return None
    # A rank counts itself into barrier g when it enters it, so a count >= g means it arrived.
    return [
        rank
        for rank in range(runtime.env.world_size)
        if rank != runtime.env.rank and int(answers.get(rank, {}).get("barrier", 0)) < generation
    ]


def _watch_fit(trainer: Any, hang_timeout_s: float | str | None, run_dir: Any) -> Callable[[], None]:
    """Point the hang doctor at a Trainer's fit (this thread, its step, its directory).

    ``"auto"`` keeps what ``init(hang_timeout_s=...)`` or ``DISTKIT_HANG_TIMEOUT_S`` asked for, and
    else watches with the adaptive timeout. Returns what puts the previous settings back.
    """
    doctor = _doctor()
    if doctor is None:
        return lambda: None
    doctor.carry_on()  # a fit after a fit that raised (and was caught) on this rank
    if hang_timeout_s == "auto":
        asked = _runtime.hang_timeout_s if _runtime is not None else None
        timeout = asked if asked is not None else _hang.timeout_for_trainer("auto")
    else:
        timeout = hang_timeout_s
    return doctor.configure(timeout, run_dir=run_dir, trainer=trainer, watched=threading.get_ident())


def _on_failure(err: BaseException) -> None:
    """``err`` ends ``Trainer.fit`` (or validate, test, predict) on this rank.

    When it is this rank's own error, the other ranks learn it first (they name this rank as the
    cause); the caller re-raises. When it is a collective that failed because another rank ended,
    the hang doctor reports where every rank is, naming that rank, and this rank exits with
    :data:`~distkit.PEER_FAILED_EXIT_CODE` (or 124 when no rank failed: the job was stuck).
    """
    doctor = _doctor()
    if doctor is not None:
        doctor.record_failure(err)
        doctor.on_failure(err, always=True)


def _doctor(runtime: _Runtime | None = None) -> _hang.Doctor | None:
    """This process's hang doctor, when it can ask the other ranks (a job of several processes)."""
    runtime = runtime if runtime is not None else _runtime
    if runtime is None or runtime.doctor is None or not runtime.doctor.available:
        return None
    return runtime.doctor


def _monitored_barrier(runtime: _Runtime, timeout: float) -> None:
    group = runtime.cpu_group
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as err:
        raise CollectiveTimeoutError(
            f"[rank {runtime.env.rank}/{runtime.env.world_size}] barrier timed out after "
            f"{timeout:g} s: {err}. Only rank 0 can name the missing ranks on this path.",
            missing_ranks=None,
            timeout_s=timeout,
        ) from err


def _cpu_group() -> Any:
    """The gloo group for CPU-side collectives (``None`` means the default group)."""
    return _require_runtime("this collective").cpu_group


def _store() -> dist.Store | None:
    """distkit's prefixed view of the job's key-value store, when there is one."""
    return _require_runtime("this operation").store

"""Joining a job and leaving it: the device and backend, the store (its owner, the ranks'
claims), :func:`init` and :func:`shutdown`, and the hang doctor's hooks for the Trainer."""

from __future__ import annotations

import atexit
import difflib
import faulthandler
import gc
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distkit._doctor import doctor as _hang
from distkit._utils import daemon
from distkit._utils.slips import names_slips
from distkit.env import LaunchEnv, detect_env
from distkit.errors import CollectiveTimeoutError, DistkitError
from distkit.runtime import _state
from distkit.runtime._ranks import _default_device, get_world_size
from distkit.runtime._state import DEFAULT_TIMEOUT_S, _doctor, _Runtime

__all__: list[str] = []


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


def _check_backend_name(backend: str | None) -> None:
    """Refuse a backend name torch does not know (``"ncll"``), also in a world of one, which makes
    no process group and would let the slip through until the job runs on several processes."""
    if backend is None or ":" in backend:  # "cpu:gloo,cuda:nccl" is torch's to check
        return
    known = [name for name in dist.Backend.backend_list if name not in ("undefined", "fake")]
    if backend.lower() in known:
        return
    close = difflib.get_close_matches(backend.lower(), known, n=1, cutoff=0.6)
    raise ValueError(
        f"backend {backend!r} is not a torch.distributed backend ({', '.join(known)})."
        f"{f' Did you mean {close[0]!r}?' if close else ''} Use 'gloo' on CPU, 'nccl' on CUDA GPUs, or "
        f"backend=None to choose from the device."
    )


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

    thread = daemon.start(connect, "distkit-store-connect", timeout_s)  # see distkit._utils.daemon
    start = time.monotonic()
    silent = False
    try:
        while thread.is_alive() and (waited := time.monotonic() - start) < timeout_s:
            thread.join(min(0.5, timeout_s - waited))
            # A refused connection is rank 0 not up yet: wait up to timeout_s. A port that accepts
            # and stays silent this long is not a store (a real one answers within milliseconds).
            if thread.is_alive() and time.monotonic() - start >= _SILENT_STORE_S and _accepts(env):
                silent = True
                break
    finally:
        daemon.abandon(thread)
    if "store" in box:
        return box["store"]  # type: ignore[no-any-return]
    if "error" in box:
        raise box["error"]
    if not silent and not _accepts(env):
        # torch's client was still retrying refused connections: nothing listens there.
        raise DistkitError(
            f"[rank {env.rank}/{env.world_size}] nothing listens at MASTER_ADDR={env.master_addr} "
            f"MASTER_PORT={env.master_port}: no store came up there within {timeout_s:g} s. Rank 0 "
            f"hosts it: check that rank 0 started (and did not fail first: its own output says why), "
            f"and that every rank was given rank 0's host as MASTER_ADDR and the same MASTER_PORT."
        )
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
            if env.launcher == "slurm" and "SLURM_STEP_NUM_TASKS" not in os.environ:
                # An sbatch script runs once, on the first node: SLURM_NTASKS is the allocation's.
                text += (
                    f" Under SLURM, every rank is a task of one job step: start the script with srun "
                    f"(`srun python train.py`); run from the sbatch script directly, it is one process "
                    f"that reads the allocation's SLURM_NTASKS={env.world_size}."
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


@names_slips()
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
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
    hang = _hang.timeout_for_init(hang_timeout_s)
    if _state._runtime is not None:
        wanted_device = None if device is None else _resolve_device(_state._runtime.env, device)
        conflicts = [
            f"{name}: first init() used {old!r}, now {new!r}"
            for name, old, new, given in (
                ("backend", _state._runtime.backend, backend, backend is not None),
                ("timeout_s", _state._runtime.timeout_s, timeout_s, timeout_s is not None),
                ("device", _state._runtime.device, wanted_device, device is not None),
                ("hang_timeout_s", _state._runtime.hang_timeout_s, hang, hang_timeout_s is not None),
            )
            if given and new != old
        ]
        if conflicts:
            raise DistkitError(
                "distkit.init() was already called with other settings ("
                + "; ".join(conflicts)
                + "). Call distkit.shutdown() first to start over with new settings."
            )
        return _state._runtime.env

    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    if dist.is_available() and dist.is_initialized():
        _state._runtime = _adopt_existing_group(timeout)
        _start_doctor(_state._runtime, hang)
        return _state._runtime.env

    _check_backend_name(backend)
    env = detect_env()
    dev = _resolve_device(env, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # torchrun --nproc_per_node=1 (or RANK/WORLD_SIZE/MASTER_* set by hand) still gets a process
    # group: its users call torch.distributed and wrap DDP themselves. A plain `python` run, or one
    # task of SLURM or MPI with no rendezvous address of its own, is a world of one with no group.
    if not env.is_distributed and (env.launcher not in ("torchrun", "env") or env.master_addr is None):
        _state._runtime = _Runtime(env, backend, dev, timeout, hang_timeout_s=hang)
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
    _state._runtime = _Runtime(
        env,
        chosen,
        dev,
        timeout,
        dist.PrefixStore("distkit/", job_store),
        cpu_group,
        owns_group=True,
        hang_timeout_s=hang,
    )
    _start_doctor(_state._runtime, hang)
    if not _state._atexit_registered:
        # torch warns at exit when a group was never destroyed; users should not have to care.
        atexit.register(shutdown)
        _state._atexit_registered = True
    return env


def _start_doctor(runtime: _Runtime, hang: float | str | None) -> None:
    """Start the hang doctor of a job of several processes (see docs/debugging.md)."""
    runtime.hang_timeout_s = hang
    if runtime.store is None or runtime.env.world_size < 2:
        return
    if not faulthandler.is_enabled():
        # gloo aborts the process (SIGABRT, "EnforceNotMet ... 580 vs 4") when ranks meet in
        # collectives of different sizes (an all_reduce under `if rank == 0:` meeting DDP's): no
        # Python code runs then, so this is what names the line, in every thread's stack.
        faulthandler.enable(all_threads=True)
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
    runtime, _state._runtime = _state._runtime, None
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


def _require_runtime(what: str) -> _Runtime:
    if _state._runtime is None:
        if dist.is_available() and dist.is_initialized():
            init()  # adopt the group someone else created
            assert _state._runtime is not None
            return _state._runtime
        raise DistkitError(
            f"{what} needs a process group in this {get_world_size()}-process job; "
            f"call distkit.init() on every rank first."
        )
    return _state._runtime


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
        asked = _state._runtime.hang_timeout_s if _state._runtime is not None else None
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


def _cpu_group() -> Any:
    """The gloo group for CPU-side collectives (``None`` means the default group)."""
    return _require_runtime("this collective").cpu_group


def _store() -> dist.Store | None:
    """distkit's prefixed view of the job's key-value store, when there is one."""
    return _require_runtime("this operation").store

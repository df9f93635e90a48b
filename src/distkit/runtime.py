"""Process-group setup and teardown, rank queries, a barrier with a deadline, rank-aware output.

Every query works in three situations with one code path for the caller: before :func:`init`
(read from the launcher's environment), after it, and in a world of one (no launcher at all).
"""

from __future__ import annotations

import atexit
import builtins
import functools
import gc
import logging
import os
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from distkit.env import LaunchEnv, detect_env
from distkit.errors import CollectiveTimeoutError, DistkitError

__all__ = [
    "DEFAULT_TIMEOUT_S",
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
    "main_process_only",
    "rank_zero_print",
    "shutdown",
]

# NCCL's own default in torch (10 minutes). gloo's is 30 minutes, which is how long a job hangs
# today when one rank stops arriving; a shorter default surfaces such bugs sooner. Long rank-0-only
# work (downloads) belongs in main_process_first(), which has its own, longer deadline.
DEFAULT_TIMEOUT_S = 600.0

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

    def next_id(self, kind: str) -> int:
        self.counters[kind] = self.counters.get(kind, 0) + 1
        return self.counters[kind]


# The process group is process-wide state in torch itself; this mirrors it and holds nothing else.
_runtime: _Runtime | None = None
_atexit_registered = False


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


def _connect_store(env: LaunchEnv, timeout_s: float) -> dist.Store:
    assert env.master_addr is not None and env.master_port is not None  # detect_env guarantees it
    # Under torchrun (or the distkit.testing parent) the launcher already hosts the store, as
    # torch's own env:// rendezvous assumes; otherwise rank 0 hosts it.
    is_master = env.rank == 0 and not env.agent_store
    try:
        return dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=is_master,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except RuntimeError as err:
        text = str(err)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise DistkitError(
                f"[rank {env.rank}/{env.world_size}] MASTER_PORT={env.master_port} on "
                f"{env.master_addr} is already in use (another job, or a previous run that is still "
                f"exiting). Set MASTER_PORT to a free port, or launch with `torchrun --standalone`, "
                f"which picks a free one."
            ) from err
        raise DistkitError(
            f"[rank {env.rank}/{env.world_size}] could not reach the rendezvous store at "
            f"MASTER_ADDR={env.master_addr} MASTER_PORT={env.master_port} within {timeout_s:g} s: "
            f"{text.splitlines()[0] if text else type(err).__name__}. Check that rank 0 is running "
            f"and that every rank was given the same MASTER_ADDR and MASTER_PORT."
        ) from err


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
) -> LaunchEnv:
    """Join the job this process was launched into, or set up a world of one.

    Collective: call on every rank. Idempotent: a second call returns the same :class:`LaunchEnv`
    when its settings agree with the first (``None`` agrees with anything) and raises otherwise.
    Without a launcher it creates no process group; every helper then acts on a world of one.

    Picks ``nccl`` when this rank has a CUDA device, else ``gloo``; selects the CUDA device of the
    local rank; initialises NCCL eagerly so that the first collective already obeys the timeout.
    When the default group is not gloo, a gloo group is also made for CPU-side coordination.

    Args:
        backend: ``"gloo"``, ``"nccl"``, or ``None`` to choose from the device.
        timeout_s: Deadline of every collective and of the rendezvous, in seconds
            (default :data:`DEFAULT_TIMEOUT_S`, 600).
        device: This rank's device; ``None`` picks ``cuda:<local_rank>`` when CUDA is available,
            else the CPU.

    Returns:
        The launch environment this process joined.

    Raises:
        ValueError: The launcher's variables are inconsistent (names the variable).
        DistkitError: The settings conflict with an earlier ``init()``, ``MASTER_PORT`` is already
            in use, or the rendezvous store cannot be reached.

    Example:
        >>> import distkit
        >>> env = distkit.init()  # python, torchrun, srun or mpirun alike
        >>> distkit.get_world_size() == env.world_size
        True
    """
    global _runtime, _atexit_registered
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
    if _runtime is not None:
        wanted_device = None if device is None else _resolve_device(_runtime.env, device)
        conflicts = [
            f"{name}: first init() used {old!r}, now {new!r}"
            for name, old, new in (
                ("backend", _runtime.backend, backend),
                ("timeout_s", _runtime.timeout_s, timeout_s),
                ("device", _runtime.device, wanted_device),
            )
            if new is not None and new != old
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
        return _runtime.env

    env = detect_env()
    dev = _resolve_device(env, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not env.is_distributed:
        _runtime = _Runtime(env, backend, dev, timeout)
        return env

    chosen = _resolve_backend(backend, dev)
    # torchrun keeps one store across restarts of the workers; keys of an earlier attempt (gloo's
    # addresses, barrier arrivals) must not be read by this one, so every key carries the attempt,
    # as torch's own rendezvous does.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"distkit-attempt-{attempt}/", _connect_store(env, timeout))
    try:
        dist.init_process_group(
            chosen,
            store=dist.PrefixStore("pg/", store),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout),
            # Passing the device makes NCCL create its communicator now (eager init), so a rank
            # that never arrives is reported within the timeout instead of at the first collective.
            device_id=dev if chosen == "nccl" else None,
        )
        cpu_group = (
            None if chosen == "gloo" else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        )
    except Exception as err:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise DistkitError(
            f"[rank {env.rank}/{env.world_size}] init_process_group({chosen!r}) failed: {err}. "
            f"Check that all {env.world_size} ranks started and share MASTER_ADDR={env.master_addr} "
            f"and MASTER_PORT={env.master_port}."
        ) from err
    _runtime = _Runtime(
        env, chosen, dev, timeout, dist.PrefixStore("distkit/", store), cpu_group, owns_group=True
    )
    if not _atexit_registered:
        # torch warns at exit when a group was never destroyed; users should not have to care.
        atexit.register(shutdown)
        _atexit_registered = True
    return env


def shutdown() -> None:
    """Tear down what :func:`init` set up.

    Local: no communication (so it cannot hang on a dead peer). Idempotent; a group created by
    someone else than distkit is left as it was. Registered to run at exit by :func:`init`.

    Example:
        >>> import distkit
        >>> distkit.shutdown()
        >>> distkit.shutdown()  # a second call does nothing
    """
    global _runtime
    runtime, _runtime = _runtime, None
    if runtime is not None and runtime.owns_group and dist.is_initialized():
        dist.destroy_process_group()
        # A DDP reducer or pending gloo work in a reference cycle keeps the C++ group alive until
        # interpreter finalization, where freeing it aborts the process ("terminate called without
        # an active exception", pytorch/pytorch#190489). Free such cycles now, while Python is whole.
        gc.collect()


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


def main_process_only(fn: Callable[P, R]) -> Callable[P, R | None]:
    """Decorate ``fn`` to run on the main process only; other ranks return ``None`` at once.

    Local: no communication, so the other ranks do not wait for it.

    Example:
        >>> import distkit
        >>> @distkit.main_process_only
        ... def save_plot(path: str) -> str:
        ...     return path
        >>> save_plot("loss.png")
        'loss.png'
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
        return fn(*args, **kwargs) if is_main_process() else None

    return wrapper


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
        return self.logger.isEnabledFor(level)

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


def barrier(timeout_s: float | None = None) -> None:
    """Wait until every rank arrives, or raise naming the ranks that did not.

    Collective: call on every rank. Without a process group it returns at once.

    The barrier runs through the job's key-value store, so every waiting rank (not only rank 0, as
    with gloo's monitored barrier) learns which ranks are missing, on every backend.

    Args:
        timeout_s: Deadline in seconds; the process group's timeout when ``None``.

    Raises:
        CollectiveTimeoutError: Some rank did not arrive in time; ``missing_ranks`` lists them.

    Example:
        >>> import distkit
        >>> distkit.barrier(timeout_s=60)
    """
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
    keys = [f"barrier/{generation}/{rank}" for rank in range(env.world_size)]
    store.set(keys[env.rank], b"1")
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError as err:  # DistStoreError on timeout
        missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
        if not missing:  # everyone arrived just as the deadline passed
            _cleanup_barrier(store, env.rank, generation)
            return
        raise CollectiveTimeoutError(
            f"[rank {env.rank}/{env.world_size}] barrier timed out after {timeout:g} s: "
            f"rank(s) {missing} did not arrive. A rank that is alive but never arrives is usually "
            f"stuck elsewhere (a different code path, a data-loader hang, one collective too many).",
            missing_ranks=missing,
            timeout_s=timeout,
        ) from err
    _cleanup_barrier(store, env.rank, generation)


def _cleanup_barrier(store: dist.Store, rank: int, generation: int) -> None:
    # Passing generation g proves every rank passed g - 1, so nobody still waits on g - 2's keys.
    if generation > 2:
        store.delete_key(f"barrier/{generation - 2}/{rank}")


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

"""Rank queries (before, after and without :func:`init`), the decorators that run a function on
one rank, and rank-aware output. Local: nothing here communicates."""

from __future__ import annotations

import builtins
import functools
import logging
from collections.abc import Callable, MutableMapping
from typing import Any, ParamSpec, TypeVar, overload

import torch
import torch.distributed as dist

from distkit.env import LaunchEnv, detect_env
from distkit.errors import DistkitError
from distkit.runtime import _state

__all__: list[str] = []


P = ParamSpec("P")
R = TypeVar("R")


def is_initialized() -> bool:
    """True once :func:`init` has run in this process (also for a world of one). Local."""
    return _state._runtime is not None


def get_env() -> LaunchEnv:
    """This process's :class:`LaunchEnv`: the one :func:`init` joined, or read from the environment.

    Local: no communication.

    Example:
        >>> import distkit
        >>> distkit.get_env().launcher in {"none", "torchrun", "env", "slurm", "openmpi", "mpich"}
        True
    """
    if _state._runtime is not None:
        return _state._runtime.env
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
    if _state._runtime is not None:
        return _state._runtime.device
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
        return f"{_rank_label()} {msg}", kwargs


def _rank_label() -> str:
    """``[rank R/W]``, how distkit's messages name the process that prints them. Local."""
    env = get_env()
    return f"[rank {env.rank}/{env.world_size}]"


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

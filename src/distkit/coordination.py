"""Main-process-first sections that never hang, and run-on-main-and-share.

The pattern every multi-process job writes (the main process downloads, ``dist.barrier()``,
everyone reads) hangs every other rank until the process group's timeout when the main process
raises. Here the waiting ranks never sit in a collective: they wait on a key of the job's
key-value store, which the main process sets when its block ends, with either "done" (and a
result) or the exception it raised. So a failure on the main process reaches every rank at once,
and the wait has its own deadline, independent of the process group's.

While the main process is inside the block it bumps a heartbeat counter in the store; a waiting
rank that sees the counter stop for ``_HEARTBEAT_STALE_S`` seconds (the main process was killed or
ran out of memory) gives up, names it, and tells the others, instead of waiting for ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from distkit import collectives, runtime
from distkit._utils import daemon
from distkit._utils.slips import names_slips
from distkit.errors import CollectiveMismatchError, CollectiveTimeoutError, DistkitError, MainProcessError

__all__ = ["main_process_first", "run_on_main"]

R = TypeVar("R")

# Long enough for a large download or a dataset's preprocessing (100 GB at 50 MB/s is about 35
# minutes); a main process that dies is caught by the heartbeat long before this.
_DEFAULT_TIMEOUT_S = 2 * 3600.0
# The main process bumps its heartbeat this often while inside the block.
_HEARTBEAT_INTERVAL_S = 1.0
# A heartbeat that has not moved for this long means the main process is gone. The beat comes from
# a Python thread, so a C call that holds the GIL (a huge json.loads) delays it; 30 s leaves room
# for that and still reports a killed main process in seconds rather than after timeout_s.
_HEARTBEAT_STALE_S = 30.0
# A watchdog that woke this much later than asked was itself suspended (SLURM suspends a whole job
# with SIGSTOP): the main process may not have had the chance to beat since it resumed either.
_WATCHDOG_GAP_S = 5.0

_OK, _ERROR, _DEAD = "ok", "error", "dead"


def _check_first(rank: int, *, local: bool) -> None:
    """``rank`` names a process of the job (``local``: of this node) that can go first."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"main_process_first() rank must be an int, got {type(rank).__name__}: {rank!r}.")
    env = runtime.get_env()
    size, kind = (env.local_world_size, "local rank") if local else (env.world_size, "rank")
    if not 0 <= rank < size:
        where = f"this node runs {size} process(es)" if local else f"this job has {size} process(es)"
        raise ValueError(
            f"[rank {env.rank}/{env.world_size}] main_process_first(rank={rank}"
            f"{', local=True' if local else ''}) names no process: {where}, {kind}s 0..{size - 1}. "
            f"Pass a {kind} below {size}."
        )


def _check_timeout(timeout_s: float) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be a number of seconds, got {type(timeout_s).__name__}.")
    if not timeout_s > 0 or math.isinf(timeout_s):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s}.")
    return float(timeout_s)


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _error_status(exc: BaseException) -> tuple[Any, ...]:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return (_ERROR, _type_name(exc), str(exc), text)


# The side connection: heartbeats and the waiters' watchdog use a second connection to the store,
# because a TCPStore client holds its connection for the whole of a blocking wait() (measured:
# an add() from another thread waited 1.9 s behind a 2 s wait()). Kept per store, made once.
_side_lock = threading.Lock()
_side: tuple[Any, Any] | None = None
# How long a rank waits for its heartbeat or watchdog thread to stop. They stop within one store
# round trip, unless they are still opening the side connection to a store whose host just died
# (torch retries that for the store's whole timeout); such a thread is left to finish on its own.
_THREAD_STOP_S = 2.0


# How long a background thread waits for the side connection to open, and the process's exit for
# it (distkit._utils.daemon): a connection that returns into Python while the interpreter
# finalizes aborts the process. One to a live store can take 5 to 10 s where the name server drops
# the reverse lookup torch's client makes (distkit._doctor.doctor._CLONE_LIVE_S): a main process
# that raised inside its section then exited while its heartbeat thread was still connecting, and
# ended in SIGABRT instead of its exit code (test_failure_exit, 1 run in 6 on such a machine).
_SIDE_CONNECT_S = 30.0


def _side_store(store: Any) -> Any | None:
    """A second connection to ``store``; call it from background threads only (it may block, up to
    ``_SIDE_CONNECT_S``). ``None`` when the store opens none (in time)."""
    global _side
    with _side_lock:
        if _side is not None and _side[0] is store:
            return _side[1]
        try:
            clone = daemon.clone(store, _SIDE_CONNECT_S)
        except (AttributeError, RuntimeError, NotImplementedError, TimeoutError):
            # A store that cannot open a second connection (in time): heartbeats then share the
            # main one and waiters rely on timeout_s alone.
            clone = None
        _side = (store, clone)
        return clone


@dataclass
class _Box:
    """What the main process's block produced; published to the waiting ranks."""

    value: Any = None


class _Section:
    """One main-first section as this rank sees it: its role, its store keys and how to report."""

    def __init__(self, *, local: bool, what: str, site: str, first: int = 0) -> None:
        rt = runtime._require_runtime(what)
        env = rt.env
        self.rank, self.world_size, self.node_rank = env.rank, env.world_size, env.node_rank
        self.local = local
        self.what = what
        # Where this rank made the section ("main_process_first() at train.py:12"): the sections
        # are paired by their count, so ranks that made them in another order or number are told
        # by the sites, which the main process publishes (the same code on every rank makes the
        # same sites).
        self.site = site
        self.store = rt.store
        # The (local, with local=True) rank that goes first: 0, the main process, by default.
        self.first = first
        self.is_leader = env.local_rank == first if local else env.rank == first
        self.followers = (env.local_world_size if local else env.world_size) - 1
        # Every rank enters sections in the same order, so the counter agrees across ranks. The
        # restart count keeps a restarted job (torchrun --max-restarts, same agent store) from
        # reading the statuses of its previous attempt.
        call = rt.next_id("main_process_first")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        scope = f"node{env.node_rank}" if local else "all"
        prefix = f"main_first/{attempt}/{call}/{scope}"
        self.status_key = f"{prefix}/status"
        self.beat_key = f"{prefix}/beat"
        self.done_key = f"{prefix}/done"
        self.leader_key = f"{prefix}/leader"
        self.site_key = f"{prefix}/site"

    @property
    def label(self) -> str:
        return f"[rank {self.rank}/{self.world_size}]"

    @property
    def _live_store(self) -> dist.Store:
        """The store, on the paths that run only when the job has one (lead, follow, their helpers)."""
        assert self.store is not None, "a store-backed path of a section without a store"
        return self.store

    def leader_name(self, leader_rank: int | None) -> str:
        if not self.local:
            return "main process (rank 0)" if self.first == 0 else f"first process (rank {self.first})"
        where = f"rank {leader_rank}" if leader_rank is not None else f"local rank {self.first}"
        if self.first == 0:
            return f"local main process of node {self.node_rank} ({where})"
        return f"first process of node {self.node_rank} (local rank {self.first}, {where})"

    # -- the main process ------------------------------------------------------------------------

    @contextlib.contextmanager
    def lead(self) -> Iterator[_Box]:
        """Run the caller's block with a heartbeat, then publish how it ended."""
        store = self._live_store
        if self.local:
            store.set(self.leader_key, str(self.rank))
        store.set(self.site_key, self.site)
        store.add(self.beat_key, 1)  # the first beat also says "the main process has arrived"
        stop = threading.Event()
        beater = threading.Thread(
            target=_beat,
            args=(store, self.beat_key, stop),
            name="distkit-main-first-heartbeat",
            daemon=True,
        )
        beater.start()
        box = _Box()
        try:
            yield box
        except BaseException as exc:
            stop.set()
            beater.join(_THREAD_STOP_S)
            try:
                self._publish(pickle.dumps(_error_status(exc)))
            except Exception as err:
                # The block's own exception matters more; the waiters then see the store fail or
                # time out, and this line says why.
                runtime.get_logger("distkit.coordination").warning(
                    "could not tell the other ranks that %s failed: %s", self.what, err
                )
            raise
        stop.set()
        beater.join(_THREAD_STOP_S)
        try:
            payload = pickle.dumps((_OK, box.value), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:
            error = TypeError(
                f"{self.label} the result of {self.what} on this process cannot be sent to the other "
                f"ranks: {type(err).__name__}: {err}. Return plain data (numbers, strings, lists, "
                f"dicts, tensors, objects of module-level classes)."
            )
            error.__cause__ = err  # so that the traceback sent to the others shows the pickling error
            with contextlib.suppress(Exception):
                self._publish(pickle.dumps(_error_status(error)))
            raise error from err
        if not self._publish(payload):
            raise DistkitError(
                f"{self.label} the other ranks gave up on this process inside {self.what}: they saw "
                f"its heartbeat stop for {_HEARTBEAT_STALE_S:g} s. A call that holds the GIL that "
                f"long (a very large json.loads, for example) stalls the heartbeat thread; move such "
                f"work out of the section or split it."
            )

    def _publish(self, payload: bytes) -> bool:
        # compare_set, not set: if a waiter already declared this process dead, keep its verdict
        # so that every rank acts on the same status, and tell the caller.
        # torch's stub types the values as str; the binding takes bytes too (a pickled status).
        status = self._live_store.compare_set(self.status_key, "", payload)  # type: ignore[arg-type]
        return bytes(status) == payload

    # -- the waiting ranks -----------------------------------------------------------------------

    def follow(self, timeout_s: float) -> Any:
        """Wait for the main process's status; return its value or raise what it means here."""
        store = self._live_store
        stop = threading.Event()
        watcher = threading.Thread(
            target=_watch,
            args=(store, self.beat_key, self.status_key, self.rank, stop),
            name="distkit-main-first-watchdog",
            daemon=True,
        )
        watcher.start()
        try:
            store.wait([self.status_key], timedelta(seconds=timeout_s))
        except dist.DistStoreError as err:
            if not store.check([self.status_key]):  # it may have arrived just at the deadline
                raise self._timeout(timeout_s) from err
        except RuntimeError as err:
            raise DistkitError(
                f"{self.label} lost the connection to the job's key-value store while waiting for the "
                f"{self.leader_name(self._leader_rank())} inside {self.what}: {_first_line(err)}. The "
                f"store is hosted by rank 0 or by the launcher; the process that hosts it most likely "
                f"died — look for its error above."
            ) from err
        finally:
            stop.set()
            watcher.join(_THREAD_STOP_S)
        status = pickle.loads(store.get(self.status_key))
        leader_rank = self._leader_rank()
        site = store.get(self.site_key).decode() if store.check([self.site_key]) else self.site
        self._cleanup(keep_status=status[0] == _DEAD)
        self.check_site(site, leader_rank)
        return self._outcome(status, leader_rank)

    def _leader_rank(self) -> int | None:
        if not self.local:
            return self.first
        store = self._live_store
        try:
            if store.check([self.leader_key]):
                return int(store.get(self.leader_key))
        except RuntimeError:
            pass
        return None

    def _cleanup(self, *, keep_status: bool) -> None:
        # The last waiter to read the status removes the section's keys. A "dead" status stays:
        # the main process, if it was only slow, must still find it when it tries to publish.
        store = self._live_store
        if store.add(self.done_key, 1) < self.followers:
            return
        keys = [self.beat_key, self.done_key, self.leader_key, self.site_key]
        if not keep_status:
            keys.append(self.status_key)
        for key in keys:
            with contextlib.suppress(RuntimeError):
                store.delete_key(key)

    def check_site(self, site: str, leader_rank: int | None) -> None:
        """Raise when the leader's section paired with this one was made elsewhere."""
        if site == self.site:
            return
        who = self.leader_name(leader_rank)
        raise CollectiveMismatchError(
            f"{self.label} this rank's {self.site} was paired with the {who}'s {site}: the ranks "
            f"made main-first sections (main_process_first, run_on_main) in another order or "
            f"number, so each would have waited for, or taken the result of, another section. "
            f"They are collective: call them on every rank, in the same order, and not under "
            f"`if is_main_process():`.",
            missing_ranks=[leader_rank] if leader_rank is not None else [],
            where=[f"rank {leader_rank if leader_rank is not None else '?'}: {site}"],
        )

    def _outcome(self, status: tuple[Any, ...], leader_rank: int | None) -> Any:
        who = self.leader_name(leader_rank)
        if status[0] == _OK:
            return status[1]
        if status[0] == _ERROR:
            _, exc_type, exc_message, remote_tb = status
            raise MainProcessError(
                f"{self.label} {who} failed inside {self.what}: {exc_type}: {exc_message}\n"
                f"--- traceback of the {who} ---\n{remote_tb.rstrip()}",
                exc_type=exc_type,
                exc_message=exc_message,
                remote_traceback=remote_tb,
            )
        _, declared_by, stale_s = status
        error = DistkitError(
            f"{self.label} the {who} stopped inside {self.what}: its heartbeat has not moved for "
            f"{stale_s:.0f} s (seen by rank {declared_by}). It was most likely killed (out of memory, "
            f"a signal) — look for its last output; the others stop here instead of waiting."
        )
        # This rank only waited: the hang doctor names the rank that died as the cause, not this one.
        error.waited_for = leader_rank  # type: ignore[attr-defined]
        raise error

    def _timeout(self, timeout_s: float) -> CollectiveTimeoutError:
        leader_rank = self._leader_rank()
        who = self.leader_name(leader_rank)
        try:
            arrived = self._live_store.add(self.beat_key, 0) > 0
        except RuntimeError:
            arrived = False
        state = (
            "is still inside the block (its heartbeat is alive)"
            if arrived
            else f"never entered {self.what}: it is stuck or failed before reaching it"
        )
        return CollectiveTimeoutError(
            f"{self.label} {self.what} timed out after {timeout_s:g} s waiting for the {who}, which "
            f"{state}. Pass a larger timeout_s if the work legitimately takes longer.",
            missing_ranks=[leader_rank] if leader_rank is not None else None,
            timeout_s=timeout_s,
        )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _beat(store: Any, key: str, stop: threading.Event) -> None:
    side = _side_store(store) or store
    while not stop.wait(_HEARTBEAT_INTERVAL_S):
        try:
            side.add(key, 1)
        except RuntimeError:
            return  # the store is gone; the waiting ranks see that themselves


def _watch(store: Any, beat_key: str, status_key: str, rank: int, stop: threading.Event) -> None:
    side = _side_store(store)
    if side is None:
        return  # no second connection: the wait relies on timeout_s alone
    last_value = 0
    last_change = last_poll = time.monotonic()
    while not stop.wait(_HEARTBEAT_INTERVAL_S):
        now = time.monotonic()
        if now - last_poll > _HEARTBEAT_INTERVAL_S + _WATCHDOG_GAP_S:
            last_change = now  # this process was stalled; do not blame the main one for it
        last_poll = now
        try:
            value = side.add(beat_key, 0)
        except RuntimeError:
            return
        if value != last_value:
            last_value, last_change = value, now
        elif value > 0 and now - last_change > _HEARTBEAT_STALE_S:
            # The verdict goes where the main process would have written its status, so the wait
            # of every waiting rank ends with the same answer (and a slow main process learns it).
            with contextlib.suppress(RuntimeError):
                side.compare_set(status_key, "", pickle.dumps((_DEAD, rank, now - last_change)))
            return


# -- without access to the store ------------------------------------------------------------------


def _gather_status(section: _Section, status: tuple[Any, ...] | None) -> tuple[Any, ...]:
    # A group adopted without a reachable store: every rank meets in one gather over gloo, so the
    # wait is bounded by the process group's timeout instead of timeout_s.
    try:
        everyone = collectives.all_gather_object(
            (section.node_rank, section.is_leader, section.rank, status, section.site)
        )
    except RuntimeError as err:
        raise DistkitError(
            f"{section.label} {section.what} failed while waiting for the "
            f"{section.leader_name(None)}: {_first_line(err)}. A rank most likely died — look for "
            f"its error above."
        ) from err
    # Every node has a local rank 0 and the job a rank 0, so a leader is always found.
    leader_rank, leader_status, site = next(
        (rank, leader_status, site)
        for node_rank, is_leader, rank, leader_status, site in everyone
        if is_leader and (not section.local or node_rank == section.node_rank)
    )
    section.check_site(site, leader_rank)
    return leader_rank, leader_status


@contextlib.contextmanager
def _lead_without_store(section: _Section) -> Iterator[_Box]:
    box = _Box()
    try:
        yield box
    except BaseException as exc:
        # The block's own exception matters more than a broken group reported on the way out.
        with contextlib.suppress(DistkitError):
            _gather_status(section, _error_status(exc))
        raise
    _gather_status(section, (_OK, box.value))


def _follow_without_store(section: _Section) -> Any:
    leader_rank, status = _gather_status(section, None)
    return section._outcome(status, leader_rank)


# -- public API -----------------------------------------------------------------------------------


@names_slips()
def main_process_first(
    *, local: bool = False, rank: int = 0, timeout_s: float = _DEFAULT_TIMEOUT_S
) -> contextlib.AbstractContextManager[None]:
    """Run the block on the main process first; the other ranks run it once it has finished.

    Collective: call on every rank, as ``with distkit.main_process_first():``. Without a process
    group (a world of one) it just runs the block. Called without ``with`` it orders nothing (every
    rank would run the next lines at once), so a section never entered says so with a
    ``RuntimeWarning`` naming the line, as a coroutine never awaited does.

    If the main process raises inside the block, every waiting rank raises
    :class:`~distkit.MainProcessError` at once, carrying the exception's type, message and
    traceback text; the main process re-raises its own exception. If the main process dies inside
    the block (killed, out of memory), the waiting ranks notice that its heartbeat stopped and
    raise :class:`~distkit.DistkitError` within about 30 s. The waiting ranks wait on the job's
    key-value store, not in a collective, so the process group's timeout does not apply.

    Args:
        local: Let local rank 0 of every node go first (per-node work such as filling a node-local
            cache) instead of global rank 0.
        rank: The rank that goes first instead of the main process (rank 0); with ``local=True``,
            the local rank that goes first on every node. Everything said here of the main
            process then holds for that rank.
        timeout_s: How long the other ranks wait for the main process, in seconds (default 7200,
            two hours: long enough for a large download).

    Raises:
        MainProcessError: On the waiting ranks, when the main process raised inside the block.
        DistkitError: On the waiting ranks, when the main process died inside the block or the
            store became unreachable.
        CollectiveTimeoutError: On the waiting ranks, when the main process did not finish within
            ``timeout_s``; ``missing_ranks`` names it.
        ValueError: ``timeout_s`` is not a positive, finite number, or ``rank`` is not a rank of
            the job (with ``local=True``, of this node).

    Example:
        >>> import distkit
        >>> with distkit.main_process_first():
        ...     path = "data/train.bin"  # download or preprocess here; others reuse the result
    """
    caller = sys._getframe(2)  # 1 is names_slips's wrapper
    # Where a never-entered section's warning points (the frame itself is not kept: it holds locals).
    where = (
        caller.f_code.co_filename,
        caller.f_lineno,
        caller.f_globals.get("__name__"),
        caller.f_globals.setdefault("__warningregistry__", {}),
    )
    return _FirstSection((local, rank, timeout_s), where)


class _FirstSection(contextlib.ContextDecorator):
    """What :func:`main_process_first` returns: the section, entered by ``with`` (or as a decorator);
    one that is dropped without being entered warns, naming the line that made it."""

    def __init__(self, args: tuple[bool, int, float], where: tuple[str, int, Any, Any]) -> None:
        self._args = args
        self._where = where
        self._used = False
        self._inner: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        self._used = True
        if self._inner is not None:
            raise RuntimeError(
                "this main_process_first() section is already entered; call main_process_first() "
                "again for another section."
            )
        filename, lineno = self._where[:2]
        self._inner = _main_process_first(*self._args, site=_site(filename, lineno))
        self._inner.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        inner, self._inner = self._inner, None
        assert inner is not None, "__exit__ without __enter__"
        return inner.__exit__(*exc)

    def _recreate_cm(self) -> _FirstSection:
        # As a decorator: a fresh section for each call of the function.
        return _FirstSection(self._args, self._where)

    def __call__(self, func: Callable[..., R]) -> Callable[..., R]:  # type: ignore[override]
        self._used = True
        return super().__call__(func)

    def __del__(self) -> None:
        if self._used:
            return
        filename, lineno, module, registry = self._where
        warnings.warn_explicit(
            "distkit.main_process_first() was called but never entered, so it ordered nothing: "
            "every rank ran the lines after it at once. Write `with distkit.main_process_first():` "
            "and indent the work that the main process must do first (a download, a cache) under it.",
            RuntimeWarning,
            filename,
            lineno,
            module,
            registry,
        )


@contextlib.contextmanager
def _main_process_first(local: bool, rank: int, timeout_s: float, *, site: str) -> Iterator[None]:
    """The section itself (see :func:`main_process_first`)."""
    timeout_s = _check_timeout(timeout_s)
    _check_first(rank, local=local)
    if runtime.get_world_size() == 1:
        yield
        return
    what = "main_process_first()" if rank == 0 else f"main_process_first(rank={rank})"
    section = _Section(local=local, what=what, site=f"{what} at {site}", first=rank)
    if section.followers == 0:  # local=True on a node with one process: nobody waits
        yield
        return
    if section.store is None:
        if section.is_leader:
            with _lead_without_store(section):
                yield
        else:
            _follow_without_store(section)
            yield
        return
    if section.is_leader:
        with section.lead():
            yield
    else:
        section.follow(timeout_s)
        yield


def _run_leader_first(
    fn: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    local: bool,
    timeout_s: float,
    what: str,
    site: str,
) -> R:
    """Run ``fn`` on the main (or local main) process only; return its result on every rank."""
    if runtime.get_world_size() == 1:
        return fn(*args, **kwargs)
    section = _Section(local=local, what=what, site=site)
    if section.followers == 0:
        return fn(*args, **kwargs)
    if section.store is None:
        if not section.is_leader:
            return _follow_without_store(section)  # type: ignore[no-any-return]
        with _lead_without_store(section) as box:
            box.value = fn(*args, **kwargs)
        return box.value  # type: ignore[no-any-return]
    if not section.is_leader:
        return section.follow(timeout_s)  # type: ignore[no-any-return]
    with section.lead() as box:
        box.value = fn(*args, **kwargs)
    return box.value  # type: ignore[no-any-return]


def run_on_main(fn: Callable[..., R], *args: Any, local: bool = False, **kwargs: Any) -> R:
    """Call ``fn(*args, **kwargs)`` on the main process only and return its result on every rank.

    Collective: call on every rank. Without a process group it just calls ``fn``.

    The result travels pickled through the job's key-value store (keep it to plain data of a few
    megabytes); the main process gets the object ``fn`` returned, the others an equal copy. An
    exception in ``fn`` is re-raised on the main process and raised as
    :class:`~distkit.MainProcessError` on every other rank, as in :func:`main_process_first`,
    whose failure rules and two-hour deadline apply here too.

    Args:
        fn: The function to run; only the main process calls it.
        *args: Positional arguments for ``fn``.
        local: Call ``fn`` on local rank 0 of every node; each node gets its own main's result.
        **kwargs: Keyword arguments for ``fn``.

    Returns:
        What ``fn`` returned on the main process.

    Raises:
        MainProcessError: On the other ranks, when ``fn`` raised on the main process.
        TypeError: The result cannot be pickled (raised on every rank).

    Example:
        >>> import distkit
        >>> distkit.run_on_main(sorted, [3, 1, 2])
        [1, 2, 3]
    """
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    what = f"run_on_main({name})"
    caller = sys._getframe(1)
    site = f"{what} at {_site(caller.f_code.co_filename, caller.f_lineno)}"
    return _run_leader_first(
        fn, args, dict(kwargs), local=local, timeout_s=_DEFAULT_TIMEOUT_S, what=what, site=site
    )


def _site(filename: str, lineno: int) -> str:
    """A call site as every rank names it alike: the file's name, not its path (which differs
    between nodes that hold the code in other directories)."""
    return f"{os.path.basename(filename)}:{lineno}"

"""The barrier with a deadline that names the ranks that did not arrive (on the default group
through the store, on any group through its own)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distkit._doctor import doctor as _hang
from distkit._utils.slips import names_slips
from distkit.errors import CollectiveTimeoutError
from distkit.runtime._join import _require_runtime
from distkit.runtime._ranks import get_world_size
from distkit.runtime._state import _doctor, _Runtime

__all__: list[str] = []


@names_slips()
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
    runtime, timeout = _ready(timeout_s)
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


def _ready(timeout_s: float | None) -> tuple[_Runtime, float]:
    """The runtime and the barrier's deadline (checked), once this rank's GPU work is done. Local."""
    runtime = _require_runtime("barrier()")
    timeout = runtime.timeout_s if timeout_s is None else float(timeout_s)
    if timeout <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
    if runtime.device.type == "cuda":
        torch.cuda.synchronize(runtime.device)
    return runtime, timeout


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
    runtime, timeout = _ready(timeout_s)
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

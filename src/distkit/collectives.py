"""Collectives that are right by default: metrics in one all-reduce, uneven gathers, objects, flags.

Every function here is a no-op with the same return type in a world of one, so training code calls
them unconditionally.

On CPU they run on distkit's own gloo group (see :func:`distkit.init`), started with
``async_op=True`` and waited for by :func:`_wait`: the common case costs what a blocking call
costs, and a collective still pending after a second asks where the ranks that did not arrive are
(docs/debugging.md). One that waits in another collective, or has left the job, can never arrive:
the ranks that did raise :class:`~distkit.CollectiveMismatchError` at once.

Every function takes ``group=``, a group made with ``torch.distributed.new_group``: then only its
members communicate, results come in the group's rank order, and a rank outside the group does no
communication and gets what it would get in a world of one (torch's convention: a collective
called on a rank outside its group does nothing there). Waits on such a group are bounded by the
timeout of :func:`distkit.init`; the early mismatch detection covers distkit's own group only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import pickle
import reprlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from distkit import runtime
from distkit._doctor import doctor as _hang
from distkit._utils.secrets import redact_text
from distkit.errors import CollectiveTimeoutError, DistkitError
from distkit.runtime import _rank_label

__all__ = [
    "MetricValue",
    "all_gather",
    "all_gather_object",
    "all_ranks",
    "all_reduce",
    "any_rank",
    "broadcast_object",
    "reduce_metrics",
    "scatter_object",
]

T = TypeVar("T")

#: A metric for :func:`reduce_metrics`: a number, a one-element tensor, or a ``(sum, count)`` pair.
MetricValue = float | int | bool | torch.Tensor | tuple[Any, Any]

# Slots of float64 per all_reduce. Every call sends whole blocks, so ranks whose key sets differ
# still send tensors of the same size and the mismatch is caught by the header instead of hanging
# the collective. 256 slots (2 KiB) cost the same as one scalar on gloo: latency dominates.
_BLOCK = 256
# The fingerprint of the key set and the op travels as four 16-bit chunks: their squares summed over
# up to 2**21 ranks stay below 2**53, so float64 sums are exact and the equality test below is exact.
_CHUNKS = 4
# The chunks, their squares (or negatives), and one flag telling SUM-reduced ops from MAX-reduced ones.
_HEADER = 2 * _CHUNKS + 1

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
# torch's enum, for callers who pass it. AVG is "mean": a sum divided by the world size, because
# gloo has no AVG. PREMUL_SUM and the bitwise ops have no distkit name: call torch.distributed.
_REDUCE_OP_NAMES = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "mean",
    dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
}
# reduce_metrics() reduces these with SUM, the others (max, min) with MAX.
_SUM_REDUCED = ("mean", "sum")

# What ``op`` may be: a name (any case) or a member of ``torch.distributed.ReduceOp``.
_Op = str | dist.ReduceOp | dist.ReduceOp.RedOpType


def _op_name(op: _Op, allowed: tuple[str, ...], fn: str) -> str:
    """The lower-case distkit name of ``op``, or an error listing what ``fn`` accepts."""
    # ReduceOp(ReduceOp.SUM) wraps the enum member. The members pass isinstance(op, ReduceOp)
    # too, so they are recognised first.
    if not isinstance(op, dist.ReduceOp.RedOpType) and isinstance(op, dist.ReduceOp):
        # torch's stub of ReduceOp lacks `op`, the member a ReduceOp(member) wraps.
        op = op.op  # type: ignore[attr-defined]
    if isinstance(op, dist.ReduceOp.RedOpType):
        name, shown = _REDUCE_OP_NAMES.get(op), f"torch.distributed.ReduceOp.{op.name}"
    elif isinstance(op, str):
        # torch's functional collectives and ignite spell ops "avg", "SUM", "MIN": any case works,
        # and "avg" is torch's name for the mean.
        name, shown = ("mean" if op.lower() == "avg" else op.lower()), repr(op)
    else:
        raise TypeError(
            f"{fn} op must be a name such as 'sum' or a torch.distributed.ReduceOp member, got "
            f"{type(op).__name__}: {reprlib.repr(op)}."
        )
    if name not in allowed:
        members = "/".join(k.name for k, v in _REDUCE_OP_NAMES.items() if v in allowed)
        raise ValueError(
            f"{fn} op must be one of {', '.join(map(repr, allowed))} (any case; 'avg' is 'mean') or "
            f"torch.distributed.ReduceOp.{members}, got {shown}."
        )
    return name


def _require_tensor(fn: str, value: object, fix: str) -> None:
    # Checked before anything else, also in a world of one: a number or a string would otherwise
    # pass through unchanged there and fail deep inside torch.distributed in a real job.
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{fn} needs a torch.Tensor, got {type(value).__name__}: {reprlib.repr(value)}. {fix}"
        )


_FIRST_WAIT = timedelta(seconds=_hang.FIRST_CHECK_S)


def _wait(work: Any, what: str) -> None:
    """Wait for a collective of a gloo group started with ``async_op=True``.

    gloo's ``work.wait(timeout)`` raises when the timeout passes and leaves the collective pending,
    so it can be waited for again (measured: torch 2.13). The first wait covers every healthy call;
    after it, the hang doctor asks where the missing ranks are, and this returns when the collective
    completes, raises :class:`~distkit.CollectiveMismatchError` when some rank can never arrive,
    or reports and exits when the watchdog is on. The collective's own timeout (the process group's)
    still ends it.
    """
    try:
        work.wait(_FIRST_WAIT)
        return
    except RuntimeError as err:
        if work.is_completed():
            _finish(work, err, what)
            return
    doctor = runtime._doctor()
    if doctor is None:  # no store to ask through: a plain wait, bounded by the group's timeout
        _finish(work, None, what)
        return
    doctor.carry_on()
    start = time.monotonic() - _hang.FIRST_CHECK_S
    try:
        while True:
            next_s = doctor.check_collective(what, time.monotonic() - start)
            try:
                work.wait(timedelta(seconds=next_s))
                return
            except RuntimeError as err:
                if work.is_completed():
                    _finish(work, err, what)
                    return
    finally:
        doctor.finish_collective()


def _finish(work: Any, err: RuntimeError | None, what: str) -> None:
    """Wait for a completed (or, with ``err=None``, any) collective; explain a failure."""
    try:
        work.wait()  # completed: returns at once, or raises the collective's own error
    except RuntimeError as failure:
        _failed(failure, what)


def _failed(err: RuntimeError, what: str) -> NoReturn:
    doctor = runtime._doctor()
    if doctor is not None:
        doctor.on_failure(err, frames=_hang.current_frames())  # the watchdog on: reports and exits
        explained = doctor.explain_failure(err, f"{what}()")
        if explained is not None:
            raise explained from err
    raise err


# -- who takes part ---------------------------------------------------------------------------------

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class _Peers:
    """The ranks of one call: distkit's own group of every rank, or a group the caller made."""

    # The process group to pass to torch.distributed (None: the default group).
    handle: Any
    # Global ranks in the group's rank order; results are listed in this order.
    ranks: tuple[int, ...]
    # distkit's own gloo group: its waits go through the hang doctor (_wait).
    own: bool
    # Where bytes and metric buffers travel: the CPU on gloo, this rank's GPU on an NCCL-only group.
    device: torch.device

    @property
    def size(self) -> int:
        return len(self.ranks)

    def describe(self) -> str:
        return "" if self.own else f" on the group of ranks {list(self.ranks)}"


def _outside(group: Any) -> bool:
    """True for what ``torch.distributed.new_group`` returns on a rank it leaves out (an int)."""
    return type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER


def _peers(group: Any, fn: str) -> _Peers | None:
    """Who this call talks to, or ``None`` when this rank talks to nobody.

    Nobody means a world of one, a group of one, or a rank outside ``group``: then the caller
    answers as in a world of one, without communication.
    """
    if _outside(group):
        return None
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{fn} group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(group).__name__}: {reprlib.repr(group)}. Make one on every rank with "
            f"torch.distributed.new_group(ranks=[...]) and pass it to the group's ranks."
        )
    if group is None or group is dist.GroupMember.WORLD:
        world_size = runtime.get_world_size()
        if world_size == 1:
            return None
        return _Peers(runtime._cpu_group(), tuple(range(world_size)), own=True, device=_CPU)
    ranks = tuple(dist.get_process_group_ranks(group))
    if len(ranks) < 2 or dist.get_rank() not in ranks:
        return None
    backend = str(dist.get_backend(group)).lower()
    # gloo and MPI move CPU tensors; NCCL (and other device-only backends) need this rank's GPU.
    device = _CPU if ("gloo" in backend or "mpi" in backend) else runtime.get_device()
    return _Peers(group, ranks, own=False, device=device)


def _check_src(src: int, peers: _Peers | None, fn: str) -> None:
    """``src`` is a global rank of the job and, with a group, one of its members (torch's rule)."""
    world_size = runtime.get_world_size()
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world_size:
        raise ValueError(f"{fn} src must be a rank in 0..{world_size - 1}, got {src!r}.")
    if peers is not None and src not in peers.ranks:
        raise ValueError(
            f"{fn} src={src} is not a member of the group of ranks {list(peers.ranks)}; src is a "
            f"global rank, as in torch.distributed: pass one of {list(peers.ranks)}."
        )


def _wait_group(work: Any, what: str, peers: _Peers) -> None:
    """Wait for a collective of a caller's gloo group, bounded by distkit's timeout."""
    current = runtime._current()
    timeout_s = current.timeout_s if current is not None else runtime.DEFAULT_TIMEOUT_S
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as err:
        if work.is_completed():
            work.wait()  # the collective's own error, if it failed rather than timed out
            return
        raise CollectiveTimeoutError(
            f"{_rank_label()} {what}(){peers.describe()} did not complete within {timeout_s:g} s: some "
            f"rank of the group did not arrive (it waits in another collective, or is still "
            f"computing). Call it on every rank of the group, in the same order; a longer wait "
            f"needs distkit.init(timeout_s=...).",
            missing_ranks=None,
            timeout_s=timeout_s,
        ) from err


@contextlib.contextmanager
def _pending(work: Any, group: Any) -> Iterator[None]:
    """Wait for ``work`` inside this; an error that ends the wait early (a mismatch, a timeout, a
    signal) while ``work`` is still pending lets the process exit all the same (see
    :func:`distkit.runtime._abandon`)."""
    try:
        yield
    except BaseException:
        if not work.is_completed():
            runtime._abandon(group)
        raise


def _run_on(peers: _Peers, what: str, collective: Any, *args: Any, **kwargs: Any) -> None:
    """Run a collective of ``peers`` on data that lives on ``peers.device``."""
    if peers.device.type != "cpu":
        collective(*args, group=peers.handle, **kwargs)  # NCCL: bounded by the group's timeout
        return
    work = collective(*args, group=peers.handle, async_op=True, **kwargs)
    with _pending(work, peers.handle):
        if peers.own:
            _wait(work, what)
        else:
            _wait_group(work, what, peers)


def _run(what: str, tensor: torch.Tensor, peers: _Peers, collective: Any, *args: Any, **kwargs: Any) -> None:
    """Run a collective on ``tensor``'s device: CPU tensors over gloo, CUDA ones blocking.

    On distkit's own group a CUDA tensor goes to the default group (NCCL), a CPU one to the gloo
    group. NCCL's ``wait(timeout)`` has other semantics (it may abort the communicator), so the
    bounded first wait is for gloo only; NCCL collectives are bounded by the group's timeout.
    """
    if peers.own:
        if tensor.device.type == "cpu":
            work = collective(*args, group=peers.handle, async_op=True, **kwargs)
            with _pending(work, peers.handle):
                _wait(work, what)
        else:
            collective(*args, **kwargs)
        return
    if tensor.device.type == "cpu" and peers.device.type != "cpu":
        raise DistkitError(
            f"{_rank_label()} {what}() got a CPU tensor for a group whose backend "
            f"({dist.get_backend(peers.handle)}) only moves GPU tensors; pass "
            f"tensor.to(distkit.get_device()), or make the group with backend='gloo'."
        )
    if tensor.device.type == "cpu":
        work = collective(*args, group=peers.handle, async_op=True, **kwargs)
        with _pending(work, peers.handle):
            _wait_group(work, what, peers)
    else:
        collective(*args, group=peers.handle, **kwargs)


@functools.lru_cache(maxsize=256)
def _header(signature: tuple[tuple[str, bool], ...], op: str) -> tuple[float, ...]:
    # The op is part of the fingerprint, so ranks with the same keys and different ops disagree.
    # That alone is enough between ops reduced alike (mean/sum, or max/min). Between the two
    # families the ranks would run one all_reduce with different ReduceOps, where each element may
    # be combined by any mix of + and max depending on gloo's algorithm, and ranks may see
    # different results. The flag settles that for any mix: SUM-reduced ops send 1 and expect W,
    # MAX-reduced ops send 0 and expect 0. Any tree of + and max over non-negative values lies
    # between their max and their sum, so with both families present every rank sees a flag
    # between 1 and W - 1, which no rank expects.
    use_sum = op in _SUM_REDUCED
    digest = hashlib.blake2b(repr((op, signature)).encode(), digest_size=8).digest()
    chunks = [float(int.from_bytes(digest[2 * i : 2 * i + 2], "little")) for i in range(_CHUNKS)]
    return (*chunks, *(c * c if use_sum else -c for c in chunks), 1.0 if use_sum else 0.0)


def _to_float(key: str, value: Any) -> float | torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            shown = f": {value.detach().cpu().tolist()}" if 0 < value.numel() <= 8 else ""
            raise ValueError(
                f"metric {key!r} must be a number or a one-element tensor, got a tensor of shape "
                f"{tuple(value.shape)}{shown}; reduce it first (e.g. .mean()) or pass a (sum, count) pair."
            )
        return value.detach().reshape(())
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return float(value.item())
    raise TypeError(
        f"metric {key!r} must be a number, a one-element tensor or a (sum, count) pair, "
        f"got {type(value).__name__}: {reprlib.repr(value)}."
    )


def _flatten(metrics: Mapping[str, MetricValue]) -> tuple[tuple[tuple[str, bool], ...], list[float]]:
    signature: list[tuple[str, bool]] = []
    slots: list[float | torch.Tensor] = []
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metric names must be strings, got {key!r}.")
        is_pair = isinstance(value, tuple)
        if isinstance(value, tuple):
            if len(value) != 2:
                raise ValueError(f"metric {key!r}: a pair must be (sum, count), got {value!r}.")
            slots.append(_to_float(key, value[0]))
            slots.append(_to_float(key, value[1]))
        else:
            slots.append(_to_float(key, value))
        signature.append((key, is_pair))
    tensors = [s for s in slots if isinstance(s, torch.Tensor)]
    if not tensors:
        return tuple(signature), slots  # type: ignore[return-value]
    # One device-to-host copy for all tensor metrics, not one sync per metric.
    host = iter(torch.stack([t.to(torch.float64) for t in tensors]).cpu().tolist())
    return tuple(signature), [next(host) if isinstance(s, torch.Tensor) else s for s in slots]


def _unflatten(
    signature: Sequence[tuple[str, bool]], flat: Sequence[float], op: str, world_size: int
) -> dict[str, float]:
    out: dict[str, float] = {}
    i = 0
    for key, is_pair in signature:
        if is_pair:
            total, count = flat[i], flat[i + 1]
            out[key] = total / count if count else math.nan
            i += 2
        else:
            value = flat[i]
            out[key] = value / world_size if op == "mean" else -value if op == "min" else value
            i += 1
    return out


# What a rank whose own arguments are invalid puts in the header: above any 16-bit chunk, so every
# rank sees a mismatch whatever the others reduce with (any sum or max over non-negative values
# that include it is at least this large), and all of them then learn why (_tell_the_others).
_POISON = float(2**17)


def _tell_the_others(error: BaseException, peers: _Peers) -> NoReturn:
    """This rank's arguments are invalid: make every rank of the call raise now, then raise here.

    The others are (or will be) in the all-reduce of this call; without this they would wait there
    for the process group's timeout. This rank takes part with a header no rank expects, so every
    rank goes on to the gather of :func:`_explain_mismatch`, where it learns this error.
    """
    header = [_POISON] * _CHUNKS + [_POISON * _POISON] * _CHUNKS + [1.0]
    buffer = torch.tensor(header + [0.0] * _BLOCK, dtype=torch.float64, device=peers.device)
    text = f"{type(error).__name__}: {error}"
    try:
        _run_on(peers, "reduce_metrics", dist.all_reduce, buffer, op=dist.ReduceOp.SUM)
        _gather_objects((None, None, text), peers, "reduce_metrics")
    except DistkitError as other:
        raise error from other
    raise error


def _explain_mismatch(signature: Sequence[tuple[str, bool]], op: str, peers: _Peers) -> DistkitError:
    # Only reached when every rank saw the mismatch in the header, so every rank is here too.
    # Ranks are named by their global rank, also on a group of the caller's.
    gathered = _gather_objects((op, list(signature), None), peers, "reduce_metrics")
    everyone = dict(zip(peers.ranks, gathered, strict=True))
    invalid = [(rank, text) for rank, (_, _, text) in everyone.items() if text is not None]
    if invalid:
        ranks = [rank for rank, _ in invalid]
        described = "; ".join(f"rank {rank}: {text.rstrip('.')}" for rank, text in invalid)
        return DistkitError(
            f"{_rank_label()} reduce_metrics(){peers.describe()} got invalid "
            f"arguments on rank(s) {ranks}, so it raises on every rank: {described}. Fix the value on "
            f"that rank (every rank must pass numbers, one-element tensors or (sum, count) pairs)."
        )
    lines = []
    fixes = []
    ops = {rank: rank_op for rank, (rank_op, _, _) in everyone.items()}
    if len(set(ops.values())) > 1:
        each = ", ".join(f"rank {rank} op={rank_op!r}" for rank, rank_op in ops.items())
        lines.append(f"op differs between ranks: {each}")
        fixes.append("the same op")
    signatures = {rank: sig for rank, (_, sig, _) in everyone.items()}
    kinds = {rank: dict(sig) for rank, sig in signatures.items()}
    union = sorted(set().union(*kinds.values()))
    key_lines = []
    for rank, have in kinds.items():
        missing = [k for k in union if k not in have]
        if missing:
            key_lines.append(f"rank {rank} lacks {missing}")
    for key in union:
        seen = {rank: have[key] for rank, have in kinds.items() if key in have}
        if len(set(seen.values())) > 1:
            pairs = [r for r, p in seen.items() if p]
            key_lines.append(f"{key!r} is a (sum, count) pair on rank(s) {pairs} only")
    if key_lines:
        fixes.append("the same names, each as the same kind (number or (sum, count) pair)")
    else:
        # Same names and kinds: what is left to differ is their order.
        names = {rank: [key for key, _ in sig] for rank, sig in signatures.items()}
        first = peers.ranks[0]
        for rank, order in names.items():
            if order != names[first]:
                at = next(i for i, (a, b) in enumerate(zip(order, names[first], strict=True)) if a != b)
                key_lines.append(
                    f"the keys come in a different order: rank {rank} has {order[at]!r} at position "
                    f"{at} where rank {first} has {names[first][at]!r}"
                )
                fixes.append("the names in the same order (build the mapping the same way)")
                break
    lines.extend(key_lines)
    if not lines:  # unreachable while the header is a function of (op, signature) alone
        lines.append("the header differed although op, names, kinds and order agree")
        fixes.append("the same arguments")
    return DistkitError(
        f"{_rank_label()} reduce_metrics(){peers.describe()} was called with "
        f"different arguments on different ranks: {'; '.join(lines)}. Every rank must pass "
        f"{' and '.join(fixes)}."
    )


def reduce_metrics(
    metrics: Mapping[str, MetricValue], op: _Op = "mean", *, group: Any = None
) -> dict[str, float]:
    """Reduce a whole mapping of metrics across ranks in one collective.

    Collective: call on every rank (of ``group``, when given) with the same names. Without a
    process group, and on a rank outside ``group``, it returns the local values (pairs still become
    ``sum / count``).

    A value is a number, a one-element tensor, or a ``(sum, count)`` pair. Pairs always reduce to
    the exact weighted mean ``sum(sums) / sum(counts)`` (``nan`` when the total count is 0), the
    same number one process would compute over all samples. ``op`` applies to plain numbers:
    ``"mean"`` (over ranks), ``"sum"``, ``"max"`` or ``"min"``. Integers (Python ints, integer
    tensors) are reduced as floats, so their mean is the true quotient (``3`` and ``4`` give
    ``3.5``), never rounded. Names, kinds or ops that differ between ranks are detected inside the
    same collective and raise on every rank, naming them.

    Args:
        metrics: Metric names to values.
        op: How to combine plain numbers: a name in any case (``"MAX"`` as ignite spells it;
            ``"avg"`` is ``"mean"``) or ``torch.distributed.ReduceOp.SUM``, ``AVG`` (the mean),
            ``MAX`` or ``MIN``.
        group: A group made with ``torch.distributed.new_group``: reduce over its ranks only (the
            mean divides by its size). ``None``: every rank.

    Returns:
        Names to reduced floats, in the order given.

    Raises:
        DistkitError: Ranks passed different names, kinds or ops, or another rank's arguments are
            invalid (every rank raises at once, naming that rank and its value).
        CollectiveMismatchError: Some rank can never reach this call (it waits in another
            collective, or has left the job); raised at once, see ``docs/debugging.md``.
        CollectiveTimeoutError: With ``group``, a rank of the group did not arrive within the
            timeout of :func:`distkit.init`.
        ValueError: ``op`` is unknown, or a tensor has more than one element.
        TypeError: ``op`` is neither a name nor a ``ReduceOp``, a value is not a number, or
            ``group`` is not a process group.

    Example:
        >>> import distkit
        >>> distkit.reduce_metrics({"loss": 0.25, "acc": (90, 100)})
        {'loss': 0.25, 'acc': 0.9}
    """
    peers = _peers(group, "reduce_metrics()")
    try:
        op = _op_name(op, ("mean", "sum", "max", "min"), "reduce_metrics()")
        signature, values = _flatten(metrics)
        if op in ("max", "min") and any(is_pair for _, is_pair in signature):
            raise ValueError(
                f"op={op!r} does not apply to (sum, count) pairs; reduce them in a separate call "
                f"with op='mean'."
            )
    except (TypeError, ValueError) as err:
        if peers is None:
            raise
        _tell_the_others(err, peers)
    if op == "min":
        values = [-v for v in values]  # MIN is MAX of the negatives: the header test needs MAX or SUM.
    if peers is None:
        return _unflatten(signature, values, op, 1)

    world_size = peers.size
    use_sum = op in _SUM_REDUCED
    reduce_op = dist.ReduceOp.SUM if use_sum else dist.ReduceOp.MAX
    # SUM: sum(c) == W*c and sum(c^2) == W*c^2 hold on a rank only if every rank has the same c
    # (equality in Cauchy-Schwarz). MAX: max(c) == c and max(-c) == -c mean min == max == c.
    # The last slot (1 or 0) tells the two apart; see _header.
    header = _header(signature, op)
    expected = [h * world_size for h in header] if use_sum else list(header)
    n_blocks = max(1, -(-len(values) // _BLOCK))
    padded = values + [0.0] * (n_blocks * _BLOCK - len(values))
    reduced: list[float] = []
    for block in range(n_blocks):
        payload = padded[block * _BLOCK : (block + 1) * _BLOCK]
        # One tensor built from one list: each extra torch op costs as much as a metric.
        buffer = torch.tensor(
            [*header, *payload] if block == 0 else payload, dtype=torch.float64, device=peers.device
        )
        _run_on(peers, "reduce_metrics", dist.all_reduce, buffer, op=reduce_op)
        flat = buffer.tolist()
        if block == 0:
            if flat[:_HEADER] != expected:
                raise _explain_mismatch(signature, op, peers)
            flat = flat[_HEADER:]
        reduced.extend(flat)
    return _unflatten(signature, reduced, op, world_size)


def all_reduce(tensor: torch.Tensor, op: _Op = "sum", *, group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` in place across ranks and return it.

    Collective: call on every rank (of ``group``, when given) with tensors of the same shape and
    dtype. Without a process group, and on a rank outside ``group``, it returns ``tensor``
    unchanged (``"mean"`` of one rank is the value itself).

    ``"mean"`` is the sum divided by the number of ranks (gloo has no AVG). The tensor keeps its
    dtype, as every in-place op does, so on an integer tensor the mean is rounded down (floor, as
    Python's ``//`` and ``torch.div(..., rounding_mode="floor")``): ranks holding 1 and 2 get 1,
    ranks holding -1 and -2 get -2. For the exact quotient pass a float tensor, or use
    :func:`reduce_metrics`, which returns floats. The sum must fit in the dtype (as for ``"sum"``).

    Args:
        tensor: The tensor to reduce; CPU tensors travel over gloo even when the job uses NCCL.
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``, in any case
            (``"avg"`` is ``"mean"``), or ``torch.distributed.ReduceOp.SUM``, ``AVG``, ``MAX``,
            ``MIN`` or ``PRODUCT``.
        group: A group made with ``torch.distributed.new_group``: reduce over its ranks only.
            ``None``: every rank.

    Returns:
        ``tensor``, now holding the reduced values.

    Raises:
        ValueError: ``op`` is unknown.
        TypeError: ``tensor`` is not a tensor, ``op`` is neither a name nor a ``ReduceOp``,
            ``"mean"`` on a bool tensor, or ``group`` is not a process group.

    Example:
        >>> import torch, distkit
        >>> distkit.all_reduce(torch.tensor([1.0, 2.0]), op="mean")
        tensor([1., 2.])
    """
    _require_tensor(
        "all_reduce()",
        tensor,
        "It reduces a tensor in place: pass torch.tensor(value) and read the result from it, or "
        "use distkit.reduce_metrics({'name': value}) for plain numbers.",
    )
    op = _op_name(op, ("sum", "mean", "max", "min", "product"), "all_reduce()")
    if op == "mean" and tensor.dtype == torch.bool:
        raise TypeError(
            "op='mean' has no meaning for a bool tensor; count with op='sum' on "
            "tensor.long() and divide, or use distkit.any_rank()/all_ranks() for flags."
        )
    peers = _peers(group, "all_reduce()")
    if peers is None:
        return tensor
    _run("all_reduce", tensor, peers, dist.all_reduce, tensor, op=_OPS["sum" if op == "mean" else op])
    if op == "mean":
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(peers.size)
        else:
            tensor.div_(peers.size, rounding_mode="floor")
    return tensor


_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_MAX_DIMS = 8


def all_gather(tensor: torch.Tensor, *, group: Any = None) -> list[torch.Tensor]:
    """Gather one tensor from every rank; its shape may differ between ranks in every dimension.

    Collective: call on every rank (of ``group``, when given). Without a process group, and on a
    rank outside ``group``, it returns ``[tensor]``.

    Costs two collectives: one for the shapes (which also checks that dtype and number of
    dimensions agree), one for the data, each rank's tensor padded to the largest size of every
    dimension.

    Args:
        tensor: This rank's tensor, with at most 8 dimensions.
        group: A group made with ``torch.distributed.new_group``: gather from its ranks only, in
            the group's rank order. ``None``: every rank.

    Returns:
        One tensor per rank, in rank order, each with its rank's exact shape
        (``torch.cat(result)`` gives all rows when only the first dimension differs).

    Raises:
        DistkitError: Ranks disagree on dtype or number of dimensions.
        TypeError: ``tensor`` is not a tensor, or ``group`` is not a process group.

    Example:
        >>> import torch, distkit
        >>> [t.shape for t in distkit.all_gather(torch.zeros(3, 2))]
        [torch.Size([3, 2])]
    """
    _require_tensor(
        "all_gather()",
        tensor,
        "Pass torch.tensor(value), or use distkit.all_gather_object() for any picklable object.",
    )
    peers = _peers(group, "all_gather()")
    if peers is None:
        return [tensor]
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"all_gather supports up to {_MAX_DIMS} dimensions, got {tensor.dim()}.")
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"all_gather does not support dtype {tensor.dtype}.")
    scalar = tensor.dim() == 0
    data = tensor.reshape(1) if scalar else tensor.contiguous()
    meta = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64, device=data.device)
    meta[0] = _DTYPES.index(tensor.dtype)
    meta[1] = tensor.dim()
    meta[2 : 2 + data.dim()] = torch.tensor(data.shape, dtype=torch.int64)
    metas = [torch.empty_like(meta) for _ in range(peers.size)]
    _run("all_gather", data, peers, dist.all_gather, metas, meta)
    rows = dict(zip(peers.ranks, (m.tolist() for m in metas), strict=True))
    mine = rows[dist.get_rank()]
    if any(row[:2] != mine[:2] for row in rows.values()):
        described = ", ".join(
            f"rank {r}: {_DTYPES[row[0]]} shape {tuple(x for x in row[2:] if x >= 0)}"
            for r, row in rows.items()
        )
        raise DistkitError(
            f"{_rank_label()} all_gather(){peers.describe()} needs the same dtype and the same number of "
            f"dimensions on every rank (the sizes may differ), got {described}."
        )
    ndim = data.dim()
    shapes = [tuple(row[2 : 2 + ndim]) for row in rows.values()]
    largest = _padded_shape(shapes)
    if tuple(data.shape) != largest:
        # Padding every dimension (not only the first) costs the one copy a gather of uneven rows
        # costs too; the padding's zeros never reach the caller.
        padded = data.new_zeros(largest)
        padded[tuple(slice(0, n) for n in data.shape)] = data
        data = padded
    out = [torch.empty_like(data) for _ in range(peers.size)]
    _run("all_gather", data, peers, dist.all_gather, out, data)
    result = [chunk[tuple(slice(0, n) for n in shape)] for chunk, shape in zip(out, shapes, strict=True)]
    return [t.reshape(()) for t in result] if scalar else result


def _padded_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape every rank's tensor is padded to for one ``all_gather``: the largest size of each
    dimension over the ranks. Every rank must send the same number of elements (gloo aborts the
    process otherwise), so padding only the first dimension would not do. Local."""
    return tuple(max(sizes) for sizes in zip(*shapes, strict=True))


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> Any:
    data = data.cpu()
    try:
        raw = data.numpy().tobytes()
    except RuntimeError:  # torch without numpy
        raw = bytes(data.tolist())
    return pickle.loads(raw)  # what the ranks of this job sent, as torch's own all_gather_object trusts


def _gather_objects(obj: Any, peers: _Peers, what: str) -> list[Any]:
    """``all_gather_object`` on ``peers``: the sizes, then the pickled bytes padded to the longest."""
    data = _to_bytes(obj).to(peers.device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=peers.device)
    sizes = [torch.empty_like(size) for _ in range(peers.size)]
    _run_on(peers, what, dist.all_gather, sizes, size)
    lengths = [int(n.item()) for n in sizes]
    longest = max(lengths)
    if data.numel() < longest:
        data = torch.cat([data, data.new_zeros(longest - data.numel())])
    out = [torch.empty(longest, dtype=torch.uint8, device=peers.device) for _ in range(peers.size)]
    _run_on(peers, what, dist.all_gather, out, data)
    return [_from_bytes(chunk[:n]) for chunk, n in zip(out, lengths, strict=True)]


def all_gather_object(obj: T, *, group: Any = None) -> list[T]:
    """Gather a picklable object from every rank, in rank order.

    Collective: call on every rank (of ``group``, when given). Without a process group, and on a
    rank outside ``group``, it returns ``[obj]``. Objects travel over distkit's gloo group (CPU)
    even when the job uses NCCL: two collectives, the sizes then the pickled bytes, as torch's own
    ``all_gather_object``.

    Args:
        obj: This rank's object; anything ``pickle`` can send.
        group: A group made with ``torch.distributed.new_group``: gather from its ranks only, in
            the group's rank order. ``None``: every rank.

    Returns:
        One object per rank (per rank of ``group``), in rank order.

    Raises:
        TypeError: ``group`` is not a process group.

    Example:
        >>> import distkit
        >>> distkit.all_gather_object({"rank": distkit.get_rank()})
        [{'rank': 0}]
    """
    peers = _peers(group, "all_gather_object()")
    if peers is None:
        return [obj]
    return _gather_objects(obj, peers, "all_gather_object")


def _outcomes(failure: Exception | None, value: T) -> tuple[list[T], dict[int, str]]:
    """Every rank's ``value`` and the ranks whose work failed, by rank, as ``"Type: message"``.

    Collective: every rank calls it after the same work, whether that work failed (``failure``) or
    not, so that a failure on one rank cannot leave the others waiting in a later collective. A
    rank whose own work failed raises its ``failure`` after the gather; the others get the failed
    ranks to name in their own error, with any credentials in its text masked.
    """
    error = None if failure is None else redact_text(f"{type(failure).__name__}: {failure}")
    gathered = all_gather_object((value, error))
    if failure is not None:
        raise failure
    return [v for v, _ in gathered], {rank: e for rank, (_, e) in enumerate(gathered) if e is not None}


def broadcast_object(obj: T, src: int = 0, *, group: Any = None) -> T:
    """Send a picklable object from rank ``src`` to every rank and return it.

    Collective: call on every rank (of ``group``, when given); the value passed on other ranks is
    ignored. Without a process group, and on a rank outside ``group``, it returns ``obj``.

    Args:
        obj: The object to send (read on ``src`` only).
        src: The global rank that sends, as in ``torch.distributed``; with ``group``, a member.
        group: A group made with ``torch.distributed.new_group``: send to its ranks only.
            ``None``: every rank.

    Returns:
        ``src``'s object (on ``src`` itself, ``obj`` unchanged).

    Raises:
        ValueError: ``src`` is not a rank of the job, or not a member of ``group``.
        TypeError: ``group`` is not a process group.

    Example:
        >>> import distkit
        >>> distkit.broadcast_object({"lr": 0.1})
        {'lr': 0.1}
    """
    peers = _peers(group, "broadcast_object()")
    if not _outside(group):  # a rank outside the group sends and checks nothing
        _check_src(src, peers, "broadcast_object()")
    if peers is None:
        return obj
    mine = dist.get_rank() == src
    data = _to_bytes(obj).to(peers.device) if mine else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64, device=peers.device)
    _run_on(peers, "broadcast_object", dist.broadcast, size, src=src)
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=peers.device)
    _run_on(peers, "broadcast_object", dist.broadcast, data, src=src)
    return obj if mine else _from_bytes(data)


def _check_scatter_list(objects: Any, size: int) -> None:
    if isinstance(objects, (str, bytes)) or not isinstance(objects, Sequence):
        raise TypeError(
            f"scatter_object() objects must be a list with one object per rank on the source rank, "
            f"got {type(objects).__name__}: {reprlib.repr(objects)}."
        )
    if len(objects) != size:
        raise ValueError(
            f"scatter_object() needs one object per rank on the source rank: {size} for {size} "
            f"ranks, got {len(objects)}. Pass a list of exactly {size} objects (rank i gets item i)."
        )


def _scatter_payload(objects: Any, size: int) -> list[torch.Tensor]:
    """The pickled bytes of each object for :func:`scatter_object`, or why they cannot be sent."""
    _check_scatter_list(objects, size)
    payload = []
    for i, obj in enumerate(objects):
        try:
            payload.append(_to_bytes(obj))
        except Exception as err:
            raise TypeError(
                f"scatter_object() cannot send item {i} ({type(obj).__name__}): "
                f"{type(err).__name__}: {err}. Send plain data (numbers, strings, lists, dicts, "
                f"tensors, objects of module-level classes)."
            ) from err
    return payload


def scatter_object(objects: Sequence[T] | None, src: int = 0, *, group: Any = None) -> T:
    """Send item ``i`` of the source rank's list to rank ``i``; every rank returns its own item.

    Collective: call on every rank (of ``group``, when given); ``objects`` is read on ``src`` only
    (pass ``None`` elsewhere). Without a process group it returns ``objects[0]``. A rank outside
    ``group`` does no communication and returns ``None``: nothing is sent to it (torch's
    ``scatter_object_list`` leaves its output untouched there).

    Costs two collectives: a broadcast of the sizes, then a scatter of the pickled bytes, each
    rank receiving its own object only. An invalid list on ``src`` (wrong length, an object that
    cannot be pickled) raises there and makes every other rank raise at once, naming the error.

    Args:
        objects: On ``src``, one picklable object per rank (per rank of ``group``, in the group's
            rank order); ignored elsewhere.
        src: The global rank that sends, as in ``torch.distributed``; with ``group``, a member.
        group: A group made with ``torch.distributed.new_group``: scatter to its ranks only.
            ``None``: every rank.

    Returns:
        This rank's object.

    Raises:
        ValueError: On ``src``, ``objects`` does not hold one object per rank; ``src`` is not a
            rank of the job, or not a member of ``group``.
        TypeError: On ``src``, ``objects`` is not a sequence or an object cannot be pickled;
            ``group`` is not a process group.
        DistkitError: On the other ranks, when ``src``'s ``objects`` is invalid (names the error).

    Example:
        >>> import distkit
        >>> shards = [["a.bin", "b.bin"]] if distkit.is_main_process() else None
        >>> distkit.scatter_object(shards)
        ['a.bin', 'b.bin']
    """
    peers = _peers(group, "scatter_object()")
    if _outside(group):
        return None  # type: ignore[return-value]  # nothing is sent to it, as documented
    _check_src(src, peers, "scatter_object()")
    if peers is None:
        return _scatter_one(objects)
    mine = dist.get_rank() == src
    # Slot 0: the status (0 = valid, 1 = invalid: the slot of src holds the error text's length).
    sizes = torch.zeros(1 + peers.size, dtype=torch.int64, device=peers.device)
    payload: list[torch.Tensor] | None = None
    error: BaseException | None = None
    text = torch.empty(0, dtype=torch.uint8)
    if mine:
        try:
            payload = _scatter_payload(objects, peers.size)
            sizes[1:] = torch.tensor([p.numel() for p in payload], dtype=torch.int64)
        except (TypeError, ValueError) as err:
            error = err
            text = _to_bytes(f"{type(err).__name__}: {err}")
            sizes[0] = 1
            sizes[1] = text.numel()
    _run_on(peers, "scatter_object", dist.broadcast, sizes, src=src)
    lengths = sizes.tolist()
    if lengths[0]:
        # src's list is invalid: every rank learns why from one more broadcast, then raises.
        message = (
            text.to(peers.device) if mine else torch.empty(lengths[1], dtype=torch.uint8, device=peers.device)
        )
        _run_on(peers, "scatter_object", dist.broadcast, message, src=src)
        if error is not None:
            raise error
        raise DistkitError(
            f"{_rank_label()} scatter_object(){peers.describe()}: the source rank {src} passed invalid "
            f"objects, so it raises on every rank: {_from_bytes(message)}"
        )
    longest = max(lengths[1:])
    index = peers.ranks.index(dist.get_rank())
    received = torch.empty(longest, dtype=torch.uint8, device=peers.device)
    chunks = None
    if mine:
        assert payload is not None
        chunks = [torch.cat([p, p.new_zeros(longest - p.numel())]).to(peers.device) for p in payload]
    _run_on(peers, "scatter_object", dist.scatter, received, chunks, src=src)
    return _from_bytes(received[: lengths[1 + index]])  # type: ignore[no-any-return]


def _scatter_one(objects: Sequence[T] | None) -> T:
    # A world of one: the list is checked as on a source rank (nothing is pickled: nothing travels).
    _check_scatter_list(objects, 1)
    assert objects is not None
    return objects[0]


def _flag(flag: bool, op: dist.ReduceOp.RedOpType, what: str, group: Any) -> bool:
    peers = _peers(group, f"{what}()")
    if peers is None:
        return bool(flag)
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=peers.device)
    _run_on(peers, what, dist.all_reduce, value, op=op)
    return bool(value.item())


def any_rank(flag: bool, *, group: Any = None) -> bool:
    """True on every rank when ``flag`` is true on at least one rank.

    Collective: call on every rank (of ``group``, when given). Use it to agree on stopping,
    skipping or saving together. Without a process group, and on a rank outside ``group``, it
    returns ``flag``.

    Args:
        flag: This rank's flag.
        group: A group made with ``torch.distributed.new_group``: agree among its ranks only.
            ``None``: every rank.

    Example:
        >>> import distkit
        >>> distkit.any_rank(False)
        False
    """
    return _flag(flag, dist.ReduceOp.MAX, "any_rank", group)


def all_ranks(flag: bool, *, group: Any = None) -> bool:
    """True on every rank when ``flag`` is true on all ranks.

    Collective: call on every rank (of ``group``, when given). Without a process group, and on a
    rank outside ``group``, it returns ``flag``.

    Args:
        flag: This rank's flag.
        group: A group made with ``torch.distributed.new_group``: agree among its ranks only.
            ``None``: every rank.

    Example:
        >>> import distkit
        >>> distkit.all_ranks(True)
        True
    """
    return _flag(flag, dist.ReduceOp.MIN, "all_ranks", group)

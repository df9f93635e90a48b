"""Collectives that are right by default: metrics in one all-reduce, uneven gathers, objects, flags.

Every function here is a no-op with the same return type in a world of one, so training code calls
them unconditionally.

On CPU they run on distkit's own gloo group (see :func:`distkit.init`), started with
``async_op=True`` and waited for by :func:`_wait`: the common case costs what a blocking call
costs, and a collective still pending after a second asks where the ranks that did not arrive are
(docs/debugging.md). One that waits in another collective, or has left the job, can never arrive:
the ranks that did raise :class:`~distkit.CollectiveMismatchError` at once.
"""

from __future__ import annotations

import functools
import hashlib
import math
import pickle
import reprlib
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from distkit import _hang, runtime
from distkit.errors import DistkitError

__all__ = [
    "MetricValue",
    "all_gather",
    "all_gather_object",
    "all_ranks",
    "all_reduce",
    "any_rank",
    "broadcast_object",
    "reduce_metrics",
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
        op = op.op
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
        if is_pair:
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


def _tell_the_others(error: BaseException) -> NoReturn:
    """This rank's arguments are invalid: make every rank of the call raise now, then raise here.

    The others are (or will be) in the all-reduce of this call; without this they would wait there
    for the process group's timeout. This rank takes part with a header no rank expects, so every
    rank goes on to the gather of :func:`_explain_mismatch`, where it learns this error.
    """
    header = [_POISON] * _CHUNKS + [_POISON * _POISON] * _CHUNKS + [1.0]
    buffer = torch.tensor(header + [0.0] * _BLOCK, dtype=torch.float64)
    text = f"{type(error).__name__}: {error}"
    try:
        _wait(
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=runtime._cpu_group(), async_op=True),
            "reduce_metrics",
        )
        all_gather_object((None, None, text))
    except DistkitError as other:
        raise error from other
    raise error


def _explain_mismatch(signature: Sequence[tuple[str, bool]], op: str) -> DistkitError:
    # Only reached when every rank saw the mismatch in the header, so every rank is here too.
    everyone = all_gather_object((op, list(signature), None))
    invalid = [(rank, text) for rank, (_, _, text) in enumerate(everyone) if text is not None]
    if invalid:
        ranks = [rank for rank, _ in invalid]
        described = "; ".join(f"rank {rank}: {text.rstrip('.')}" for rank, text in invalid)
        return DistkitError(
            f"[rank {runtime.get_rank()}/{runtime.get_world_size()}] reduce_metrics() got invalid "
            f"arguments on rank(s) {ranks}, so it raises on every rank: {described}. Fix the value on "
            f"that rank (every rank must pass numbers, one-element tensors or (sum, count) pairs)."
        )
    lines = []
    fixes = []
    ops = [rank_op for rank_op, _, _ in everyone]
    if len(set(ops)) > 1:
        each = ", ".join(f"rank {rank} op={rank_op!r}" for rank, rank_op in enumerate(ops))
        lines.append(f"op differs between ranks: {each}")
        fixes.append("the same op")
    signatures = [sig for _, sig, _ in everyone]
    kinds = [dict(sig) for sig in signatures]
    union = sorted(set().union(*kinds))
    key_lines = []
    for rank, have in enumerate(kinds):
        missing = [k for k in union if k not in have]
        if missing:
            key_lines.append(f"rank {rank} lacks {missing}")
    for key in union:
        seen = {rank: kinds[rank][key] for rank in range(len(kinds)) if key in kinds[rank]}
        if len(set(seen.values())) > 1:
            pairs = [r for r, p in seen.items() if p]
            key_lines.append(f"{key!r} is a (sum, count) pair on rank(s) {pairs} only")
    if key_lines:
        fixes.append("the same names, each as the same kind (number or (sum, count) pair)")
    else:
        # Same names and kinds: what is left to differ is their order.
        names = [[key for key, _ in sig] for sig in signatures]
        for rank, order in enumerate(names):
            if order != names[0]:
                at = next(i for i, (a, b) in enumerate(zip(order, names[0], strict=True)) if a != b)
                key_lines.append(
                    f"the keys come in a different order: rank {rank} has {order[at]!r} at position "
                    f"{at} where rank 0 has {names[0][at]!r}"
                )
                fixes.append("the names in the same order (build the mapping the same way)")
                break
    lines.extend(key_lines)
    if not lines:  # unreachable while the header is a function of (op, signature) alone
        lines.append("the header differed although op, names, kinds and order agree")
        fixes.append("the same arguments")
    return DistkitError(
        f"[rank {runtime.get_rank()}/{runtime.get_world_size()}] reduce_metrics() was called with "
        f"different arguments on different ranks: {'; '.join(lines)}. Every rank must pass "
        f"{' and '.join(fixes)}."
    )


def reduce_metrics(metrics: Mapping[str, MetricValue], op: _Op = "mean") -> dict[str, float]:
    """Reduce a whole mapping of metrics across ranks in one collective.

    Collective: call on every rank with the same names. Without a process group it returns the
    local values (pairs still become ``sum / count``).

    A value is a number, a one-element tensor, or a ``(sum, count)`` pair. Pairs always reduce to
    the exact weighted mean ``sum(sums) / sum(counts)`` (``nan`` when the total count is 0), the
    same number one process would compute over all samples. ``op`` applies to plain numbers:
    ``"mean"`` (over ranks), ``"sum"``, ``"max"`` or ``"min"``. Names, kinds or ops that differ
    between ranks are detected inside the same collective and raise on every rank, naming them.

    Args:
        metrics: Metric names to values.
        op: How to combine plain numbers: a name in any case (``"MAX"`` as ignite spells it;
            ``"avg"`` is ``"mean"``) or ``torch.distributed.ReduceOp.SUM``, ``AVG`` (the mean),
            ``MAX`` or ``MIN``.

    Returns:
        Names to reduced floats, in the order given.

    Raises:
        DistkitError: Ranks passed different names, kinds or ops, or another rank's arguments are
            invalid (every rank raises at once, naming that rank and its value).
        CollectiveMismatchError: Some rank can never reach this call (it waits in another
            collective, or has left the job); raised at once, see ``docs/debugging.md``.
        ValueError: ``op`` is unknown, or a tensor has more than one element.
        TypeError: ``op`` is neither a name nor a ``ReduceOp``, or a value is not a number.

    Example:
        >>> import distkit
        >>> distkit.reduce_metrics({"loss": 0.25, "acc": (90, 100)})
        {'loss': 0.25, 'acc': 0.9}
    """
    world_size = runtime.get_world_size()
    try:
        op = _op_name(op, ("mean", "sum", "max", "min"), "reduce_metrics()")
        signature, values = _flatten(metrics)
        if op in ("max", "min") and any(is_pair for _, is_pair in signature):
            raise ValueError(
                f"op={op!r} does not apply to (sum, count) pairs; reduce them in a separate call "
                f"with op='mean'."
            )
    except (TypeError, ValueError) as err:
        if world_size == 1:
            raise
        _tell_the_others(err)
    if op == "min":
        values = [-v for v in values]  # MIN is MAX of the negatives: the header test needs MAX or SUM.
    if world_size == 1:
        return _unflatten(signature, values, op, 1)

    group = runtime._cpu_group()
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
        buffer = torch.tensor([*header, *payload] if block == 0 else payload, dtype=torch.float64)
        _wait(dist.all_reduce(buffer, op=reduce_op, group=group, async_op=True), "reduce_metrics")
        flat = buffer.tolist()
        if block == 0:
            if flat[:_HEADER] != expected:
                raise _explain_mismatch(signature, op)
            flat = flat[_HEADER:]
        reduced.extend(flat)
    return _unflatten(signature, reduced, op, world_size)


def all_reduce(tensor: torch.Tensor, op: _Op = "sum") -> torch.Tensor:
    """Reduce ``tensor`` in place across ranks and return it.

    Collective: call on every rank with tensors of the same shape and dtype. Without a process
    group it returns ``tensor`` unchanged (``"mean"`` of one rank is the value itself).

    Args:
        tensor: The tensor to reduce; CPU tensors travel over gloo even when the job uses NCCL.
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``, in any case
            (``"avg"`` is ``"mean"``), or ``torch.distributed.ReduceOp.SUM``, ``AVG``, ``MAX``,
            ``MIN`` or ``PRODUCT``. ``"mean"`` is a sum divided by the world size (gloo has no
            AVG), so it needs a floating-point tensor.

    Returns:
        ``tensor``, now holding the reduced values.

    Raises:
        ValueError: ``op`` is unknown.
        TypeError: ``tensor`` is not a tensor, ``op`` is neither a name nor a ``ReduceOp``, or
            ``"mean"`` on an integer tensor.

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
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"op='mean' needs a floating-point tensor, got {tensor.dtype}; convert it with "
            f".float() or reduce with op='sum' and divide yourself."
        )
    world_size = runtime.get_world_size()
    if world_size == 1:
        return tensor
    _run("all_reduce", tensor, dist.all_reduce, tensor, op=_OPS["sum" if op == "mean" else op])
    if op == "mean":
        tensor.div_(world_size)
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


def all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Gather one tensor from every rank; the first dimension may differ between ranks.

    Collective: call on every rank. Without a process group it returns ``[tensor]``.

    Costs two collectives: one for the shapes (which also checks that dtype and trailing
    dimensions agree), one for the data padded to the longest rank.

    Args:
        tensor: This rank's tensor, with at most 8 dimensions.

    Returns:
        One tensor per rank, in rank order, each with its rank's exact shape
        (``torch.cat(result)`` gives all rows).

    Raises:
        DistkitError: Ranks disagree on dtype, number of dimensions or trailing dimensions.
        TypeError: ``tensor`` is not a tensor.

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
    world_size = runtime.get_world_size()
    if world_size == 1:
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
    metas = [torch.empty_like(meta) for _ in range(world_size)]
    _run("all_gather", data, dist.all_gather, metas, meta)
    rows = [m.tolist() for m in metas]
    mine = rows[runtime.get_rank()]
    different = [r for r, row in enumerate(rows) if row[:2] != mine[:2] or row[3:] != mine[3:]]
    if different:
        described = ", ".join(
            f"rank {r}: {_DTYPES[row[0]]} shape {tuple(x for x in row[2:] if x >= 0)}"
            for r, row in enumerate(rows)
        )
        raise DistkitError(
            f"[rank {runtime.get_rank()}/{world_size}] all_gather() needs the same dtype and the "
            f"same dimensions after the first on every rank, got {described}."
        )
    lengths = [row[2] for row in rows]
    longest = max(lengths)
    if data.shape[0] < longest:
        pad = data.new_zeros((longest - data.shape[0], *data.shape[1:]))
        data = torch.cat([data, pad])
    out = [torch.empty_like(data) for _ in range(world_size)]
    _run("all_gather", data, dist.all_gather, out, data)
    result = [chunk[:n] for chunk, n in zip(out, lengths, strict=True)]
    return [t.reshape(()) for t in result] if scalar else result


def _run(what: str, tensor: torch.Tensor, collective: Any, *args: Any, **kwargs: Any) -> None:
    """Run a collective on ``tensor``'s group: CPU tensors through :func:`_wait`, CUDA ones blocking.

    NCCL's ``wait(timeout)`` has other semantics (it may abort the communicator), so the bounded
    first wait is for gloo only; NCCL collectives are bounded by the group's timeout.
    """
    if tensor.device.type == "cpu":
        _wait(collective(*args, group=runtime._cpu_group(), async_op=True, **kwargs), what)
    else:
        collective(*args, **kwargs)


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> Any:
    try:
        raw = data.numpy().tobytes()
    except RuntimeError:  # torch without numpy
        raw = bytes(data.tolist())
    return pickle.loads(raw)  # what the ranks of this job sent, as torch's own all_gather_object trusts


def all_gather_object(obj: T) -> list[T]:
    """Gather a picklable object from every rank, in rank order.

    Collective: call on every rank. Without a process group it returns ``[obj]``. Objects travel
    over distkit's gloo group (CPU) even when the job uses NCCL: two collectives, the sizes then the
    pickled bytes, as torch's own ``all_gather_object``.

    Example:
        >>> import distkit
        >>> distkit.all_gather_object({"rank": distkit.get_rank()})
        [{'rank': 0}]
    """
    world_size = runtime.get_world_size()
    if world_size == 1:
        return [obj]
    group = runtime._cpu_group()
    data = _to_bytes(obj)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world_size)]
    _wait(dist.all_gather(sizes, size, group=group, async_op=True), "all_gather_object")
    lengths = [int(n.item()) for n in sizes]
    longest = max(lengths)
    if data.numel() < longest:
        data = torch.cat([data, data.new_zeros(longest - data.numel())])
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
    _wait(dist.all_gather(out, data, group=group, async_op=True), "all_gather_object")
    return [_from_bytes(chunk[:n]) for chunk, n in zip(out, lengths, strict=True)]


def broadcast_object(obj: T, src: int = 0) -> T:
    """Send a picklable object from rank ``src`` to every rank and return it.

    Collective: call on every rank (the value passed on other ranks is ignored). Without a process
    group it returns ``obj``.

    Example:
        >>> import distkit
        >>> distkit.broadcast_object({"lr": 0.1})
        {'lr': 0.1}
    """
    world_size = runtime.get_world_size()
    if not 0 <= src < world_size:
        raise ValueError(f"src must be a rank in 0..{world_size - 1}, got {src}.")
    if world_size == 1:
        return obj
    group = runtime._cpu_group()
    mine = runtime.get_rank() == src
    data = _to_bytes(obj) if mine else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
    _wait(dist.broadcast(size, src=src, group=group, async_op=True), "broadcast_object")
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    _wait(dist.broadcast(data, src=src, group=group, async_op=True), "broadcast_object")
    return obj if mine else _from_bytes(data)  # type: ignore[no-any-return]


def _flag(flag: bool, op: dist.ReduceOp, what: str) -> bool:
    if runtime.get_world_size() == 1:
        return bool(flag)
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    _wait(dist.all_reduce(value, op=op, group=runtime._cpu_group(), async_op=True), what)
    return bool(value.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one rank.

    Collective: call on every rank. Use it to agree on stopping, skipping or saving together.

    Example:
        >>> import distkit
        >>> distkit.any_rank(False)
        False
    """
    return _flag(flag, dist.ReduceOp.MAX, "any_rank")


def all_ranks(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on all ranks.

    Collective: call on every rank.

    Example:
        >>> import distkit
        >>> distkit.all_ranks(True)
        True
    """
    return _flag(flag, dist.ReduceOp.MIN, "all_ranks")

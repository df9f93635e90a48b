"""Collectives that are right by default: metrics in one all-reduce, uneven gathers, objects, flags.

Every function here is a no-op with the same return type in a world of one, so training code calls
them unconditionally.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from distkit import runtime
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
# The key-set fingerprint travels as four 16-bit chunks: their squares summed over up to 2**21 ranks
# stay below 2**53, so float64 sums are exact and the equality test below is exact.
_CHUNKS = 4
_HEADER = 2 * _CHUNKS

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def _group_for(tensor: torch.Tensor) -> Any:
    # CPU tensors go through the gloo group when the default group is NCCL.
    return runtime._cpu_group() if tensor.device.type == "cpu" else None


@functools.lru_cache(maxsize=256)
def _header(signature: tuple[tuple[str, bool], ...], squares: bool) -> tuple[float, ...]:
    digest = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
    chunks = [float(int.from_bytes(digest[2 * i : 2 * i + 2], "little")) for i in range(_CHUNKS)]
    return (*chunks, *(c * c if squares else -c for c in chunks))


def _to_float(key: str, value: Any) -> float | torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"metric {key!r} must be a number or a one-element tensor, got a tensor of shape "
                f"{tuple(value.shape)}; reduce it first (e.g. .mean()) or pass a (sum, count) pair."
            )
        return value.detach().reshape(())
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return float(value.item())
    raise TypeError(
        f"metric {key!r} must be a number, a one-element tensor or a (sum, count) pair, "
        f"got {type(value).__name__}."
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


def _explain_key_mismatch(signature: Sequence[tuple[str, bool]]) -> DistkitError:
    # Only reached when every rank saw the mismatch in the header, so every rank is here too.
    everyone = all_gather_object(list(signature))
    kinds = [dict(sig) for sig in everyone]
    union = sorted(set().union(*kinds))
    lines = []
    for rank, have in enumerate(kinds):
        missing = [k for k in union if k not in have]
        if missing:
            lines.append(f"rank {rank} lacks {missing}")
    for key in union:
        seen = {rank: kinds[rank][key] for rank in range(len(kinds)) if key in kinds[rank]}
        if len(set(seen.values())) > 1:
            pairs = [r for r, p in seen.items() if p]
            lines.append(f"{key!r} is a (sum, count) pair on rank(s) {pairs} only")
    if not lines:
        lines.append("the keys come in a different order on some ranks")
    return DistkitError(
        f"[rank {runtime.get_rank()}/{runtime.get_world_size()}] reduce_metrics() was called with "
        f"different metrics on different ranks: {'; '.join(lines)}. Every rank must pass the same "
        f"names, each as the same kind (number or (sum, count) pair)."
    )


def reduce_metrics(metrics: Mapping[str, MetricValue], op: str = "mean") -> dict[str, float]:
    """Reduce a whole mapping of metrics across ranks in one collective.

    Collective: call on every rank with the same names. Without a process group it returns the
    local values (pairs still become ``sum / count``).

    A value is a number, a one-element tensor, or a ``(sum, count)`` pair. Pairs always reduce to
    the exact weighted mean ``sum(sums) / sum(counts)`` (``nan`` when the total count is 0), the
    same number one process would compute over all samples. ``op`` applies to plain numbers:
    ``"mean"`` (over ranks), ``"sum"``, ``"max"`` or ``"min"``. Names that differ between ranks are
    detected inside the same collective and raise on every rank, naming the names.

    Args:
        metrics: Metric names to values.
        op: How to combine plain numbers.

    Returns:
        Names to reduced floats, in the order given.

    Raises:
        DistkitError: Ranks passed different names or kinds.
        ValueError: ``op`` is unknown, or a tensor has more than one element.

    Example:
        >>> import distkit
        >>> distkit.reduce_metrics({"loss": 0.25, "acc": (90, 100)})
        {'loss': 0.25, 'acc': 0.9}
    """
    if op not in ("mean", "sum", "max", "min"):
        raise ValueError(f"op must be 'mean', 'sum', 'max' or 'min', got {op!r}.")
    signature, values = _flatten(metrics)
    if op in ("max", "min") and any(is_pair for _, is_pair in signature):
        raise ValueError(
            f"op={op!r} does not apply to (sum, count) pairs; reduce them in a separate call with op='mean'."
        )
    if op == "min":
        values = [-v for v in values]  # MIN is MAX of the negatives: the header test needs MAX or SUM.
    world_size = runtime.get_world_size()
    if world_size == 1:
        return _unflatten(signature, values, op, 1)

    group = runtime._cpu_group()
    use_sum = op in ("mean", "sum")
    reduce_op = dist.ReduceOp.SUM if use_sum else dist.ReduceOp.MAX
    # SUM: sum(c) == W*c and sum(c^2) == W*c^2 hold on a rank only if every rank has the same c
    # (equality in Cauchy-Schwarz). MAX: max(c) == c and max(-c) == -c mean min == max == c.
    header = _header(signature, use_sum)
    expected = [h * world_size for h in header] if use_sum else list(header)
    n_blocks = max(1, -(-len(values) // _BLOCK))
    padded = values + [0.0] * (n_blocks * _BLOCK - len(values))
    reduced: list[float] = []
    for block in range(n_blocks):
        payload = padded[block * _BLOCK : (block + 1) * _BLOCK]
        # One tensor built from one list: each extra torch op costs as much as a metric.
        buffer = torch.tensor([*header, *payload] if block == 0 else payload, dtype=torch.float64)
        dist.all_reduce(buffer, op=reduce_op, group=group)
        flat = buffer.tolist()
        if block == 0:
            if flat[:_HEADER] != expected:
                raise _explain_key_mismatch(signature)
            flat = flat[_HEADER:]
        reduced.extend(flat)
    return _unflatten(signature, reduced, op, world_size)


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` in place across ranks and return it.

    Collective: call on every rank with tensors of the same shape and dtype. Without a process
    group it returns ``tensor`` unchanged (``"mean"`` of one rank is the value itself).

    Args:
        tensor: The tensor to reduce; CPU tensors travel over gloo even when the job uses NCCL.
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``. ``"mean"`` is a sum
            divided by the world size (gloo has no AVG), so it needs a floating-point tensor.

    Returns:
        ``tensor``, now holding the reduced values.

    Raises:
        ValueError: ``op`` is unknown.
        TypeError: ``"mean"`` on an integer tensor.

    Example:
        >>> import torch, distkit
        >>> distkit.all_reduce(torch.tensor([1.0, 2.0]), op="mean")
        tensor([1., 2.])
    """
    if op != "mean" and op not in _OPS:
        raise ValueError(f"op must be one of {['mean', *_OPS]}, got {op!r}.")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"op='mean' needs a floating-point tensor, got {tensor.dtype}; convert it with "
            f".float() or reduce with op='sum' and divide yourself."
        )
    world_size = runtime.get_world_size()
    if world_size == 1:
        return tensor
    dist.all_reduce(tensor, op=_OPS["sum" if op == "mean" else op], group=_group_for(tensor))
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

    Example:
        >>> import torch, distkit
        >>> [t.shape for t in distkit.all_gather(torch.zeros(3, 2))]
        [torch.Size([3, 2])]
    """
    world_size = runtime.get_world_size()
    if world_size == 1:
        return [tensor]
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"all_gather supports up to {_MAX_DIMS} dimensions, got {tensor.dim()}.")
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"all_gather does not support dtype {tensor.dtype}.")
    scalar = tensor.dim() == 0
    data = tensor.reshape(1) if scalar else tensor.contiguous()
    group = _group_for(data)
    meta = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64, device=data.device)
    meta[0] = _DTYPES.index(tensor.dtype)
    meta[1] = tensor.dim()
    meta[2 : 2 + data.dim()] = torch.tensor(data.shape, dtype=torch.int64)
    metas = [torch.empty_like(meta) for _ in range(world_size)]
    dist.all_gather(metas, meta, group=group)
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
    dist.all_gather(out, data, group=group)
    result = [chunk[:n] for chunk, n in zip(out, lengths, strict=True)]
    return [t.reshape(()) for t in result] if scalar else result


def all_gather_object(obj: T) -> list[T]:
    """Gather a picklable object from every rank, in rank order.

    Collective: call on every rank. Without a process group it returns ``[obj]``. Objects travel
    over gloo (CPU) even when the job uses NCCL.

    Example:
        >>> import distkit
        >>> distkit.all_gather_object({"rank": distkit.get_rank()})
        [{'rank': 0}]
    """
    world_size = runtime.get_world_size()
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=runtime._cpu_group())
    return out


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
    box = [obj if runtime.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=runtime._cpu_group())
    return box[0]  # type: ignore[return-value]


def _flag(flag: bool, op: dist.ReduceOp) -> bool:
    if runtime.get_world_size() == 1:
        return bool(flag)
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(value, op=op, group=runtime._cpu_group())
    return bool(value.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one rank.

    Collective: call on every rank. Use it to agree on stopping, skipping or saving together.

    Example:
        >>> import distkit
        >>> distkit.any_rank(False)
        False
    """
    return _flag(flag, dist.ReduceOp.MAX)


def all_ranks(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on all ranks.

    Collective: call on every rank.

    Example:
        >>> import distkit
        >>> distkit.all_ranks(True)
        True
    """
    return _flag(flag, dist.ReduceOp.MIN)

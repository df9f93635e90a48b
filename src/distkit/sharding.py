"""Fully sharded data parallelism (FSDP2) for hand-written loops, applied as the Trainer applies it.

:func:`shard_model` turns a model into torch's FSDP2 modules (``torch.distributed.fsdp.fully_shard``)
in place: each rank then holds a ``1/world_size`` shard of every parameter, of its gradient and of
the optimizer state made over it. The model is cut into *sharding units*, each all-gathered just
before its forward pass and freed again after it, so no rank ever holds more than the whole model's
shards plus one unit in full. The root module is always a unit of its own (it holds whatever the
units leave over).

Units are chosen by module classes (``unit_classes=(Block,)``, as torchtitan shards a transformer
block by block) or, when no classes are given, by a parameter-count rule: every module that holds
at least ``min_unit_params`` parameters (its own and its children's that are not in a unit yet),
innermost first, as FSDP1's ``size_based_auto_wrap_policy`` did.

A hand-written loop then reads (see ``docs/fsdp.md``)::

    model = distkit.shard_model(model)                 # before the optimizer is made
    optimizer = torch.optim.AdamW(model.parameters())  # over the local shards
    for micro, batch in enumerate(batches):
        model.set_requires_gradient_sync(micro == last)  # accumulate without communication
        loss_fn(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # works on the sharded gradients
    optimizer.step()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distkit import collectives

__all__ = ["shard_model", "sync_buffers"]

# The parameter-count rule's default: a unit as large as a small transformer block (about 1 M
# parameters, 4 MB in fp32). Smaller units mean more, shorter all-gathers, each with a fixed cost.
DEFAULT_MIN_UNIT_PARAMS = 1_000_000


def _fsdp() -> Any:
    # torch.distributed.fsdp imports about 0.3 s of modules: only when sharding is used.
    import torch.distributed.fsdp as fsdp

    return fsdp


# Layers whose buffers are float32 statistics updated in forward: under bf16 mixed precision each is a
# unit that computes in float32 (as FSDP1's MixedPrecision kept _BatchNorm out of its casts).
_FLOAT32_NORMS = (nn.modules.batchnorm._BatchNorm,)


def _norm_policy(reduce_dtype: torch.dtype) -> Any:
    # The input cast up to float32, the output down to bfloat16 for the next layer of its unit.
    return _fsdp().MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=reduce_dtype, output_dtype=torch.bfloat16
    )


def _own_params(module: nn.Module, taken: set[int]) -> int:
    return sum(p.numel() for p in module.parameters() if id(p) not in taken)


def _select_units(
    model: nn.Module,
    *,
    unit_classes: tuple[type[nn.Module], ...] = (),
    min_unit_params: int | None = None,
) -> list[nn.Module]:
    """The sharding units of ``model`` (not the root), innermost first. Local.

    By ``unit_classes`` when given (every module of those classes except the root), else by the
    parameter-count rule (``min_unit_params``, :data:`DEFAULT_MIN_UNIT_PARAMS` when ``None``).
    """
    if unit_classes:
        return [m for m in _post_order(model) if m is not model and isinstance(m, unit_classes)]
    threshold = DEFAULT_MIN_UNIT_PARAMS if min_unit_params is None else min_unit_params
    units: list[nn.Module] = []
    taken: set[int] = set()
    for module in _post_order(model):
        if module is model:
            continue
        if _own_params(module, taken) >= threshold:
            units.append(module)
            taken.update(id(p) for p in module.parameters())
    return units


def _post_order(module: nn.Module) -> Iterable[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` recomputed in the backward pass instead of keeping its activations."""
    from torch.utils.checkpoint import checkpoint

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _prepare_units(units: list[nn.Module], *, activation_checkpointing: bool, compile: bool) -> None:
    """Compile and/or checkpoint each unit's ``forward`` in place (before sharding). Local.

    The forward methods are replaced on the instances, not wrapped in new modules, so parameter
    names (and so checkpoints) stay free of ``_orig_mod.`` and ``_checkpoint_wrapped_module.``.
    FSDP's hooks sit around ``forward`` (on ``__call__``), outside the compiled region and the
    recomputed one, as torchtitan arranges them with its wrappers.
    """
    for unit in units:
        forward = unit.forward
        if compile:
            forward = torch.compile(forward)
        if activation_checkpointing:
            forward = _checkpointed(forward)
        if forward is not unit.forward:
            unit.forward = forward


def _check_sharding_options(
    *, unit_classes: Any, min_unit_params: Any, mixed_precision: Any, reduce_dtype: Any = None
) -> tuple[type[nn.Module], ...]:
    """Validate the options :func:`shard_model` and ``FSDPStrategy`` share. Local."""
    classes = (unit_classes,) if isinstance(unit_classes, type) else tuple(unit_classes or ())
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad:
        raise TypeError(f"unit_classes must be nn.Module subclasses, got {bad!r}.")
    if min_unit_params is not None and (
        isinstance(min_unit_params, bool) or not isinstance(min_unit_params, int) or min_unit_params < 1
    ):
        raise ValueError(f"min_unit_params must be an int >= 1 or None, got {min_unit_params!r}.")
    if classes and min_unit_params is not None:
        raise ValueError(
            f"give unit_classes or min_unit_params, not both (got {[c.__name__ for c in classes]} and "
            f"{min_unit_params}): classes choose the units, the count rule is for models without them."
        )
    if mixed_precision not in (None, "bf16"):
        raise ValueError(
            f"mixed_precision must be None (float32) or 'bf16' (bfloat16 parameters and compute, "
            f"float32 gradient reduction), got {mixed_precision!r}."
        )
    if reduce_dtype is not None and reduce_dtype not in _REDUCE_DTYPES:
        raise ValueError(
            f"reduce_dtype must be None (float32), 'bf16' or 'fp16' (the dtype of the gradients' "
            f"reduce-scatter), got {reduce_dtype!r}."
        )
    return classes


# shard_model(reduce_dtype=...) and FSDPStrategy(reduce_dtype=...).
_REDUCE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shard_model(
    model: nn.Module,
    *,
    unit_classes: type[nn.Module] | Iterable[type[nn.Module]] = (),
    min_unit_params: int | None = None,
    reshard_after_forward: bool = True,
    mixed_precision: str | None = None,
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
    compile: bool = False,
    reduce_dtype: str | None = None,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2, unit by unit, and return it.

    Collective: call on every rank, with the same model (the same parameter shapes) everywhere,
    before the optimizer is made (the optimizer must hold the sharded parameters). Each rank keeps
    ``1/world_size`` of every parameter as a ``DTensor``; forward and backward all-gather and
    reduce-scatter unit by unit. Without a process group it raises: a world of one has nothing to
    shard (train the plain model).

    Parameters are sharded from what each rank holds: seed the model identically on every rank
    (``distkit.seed_everything``) or load the same weights before sharding.

    Args:
        model: The module; it becomes an ``FSDPModule`` (its class changes, its parameter names
            do not).
        unit_classes: Module classes that form the units (e.g. a transformer block class).
        min_unit_params: Without ``unit_classes``: the smallest parameter count of a unit
            (default 1,000,000). A model smaller than that is one unit (the root).
        reshard_after_forward: Free each unit's gathered parameters after its forward pass and
            gather them again in backward (least memory); ``False`` keeps them until backward
            (one all-gather fewer per unit per step, more memory). The root is never resharded
            after forward (its backward comes first).
        mixed_precision: ``"bf16"``: units compute in bfloat16 (parameters cast after the
            all-gather) and reduce gradients in float32; the sharded parameters, the optimizer and
            the model's outputs stay float32. Every BatchNorm layer becomes a unit of its own that
            computes in float32 (its running statistics are float32 buffers, which bfloat16
            kernels refuse) and hands bfloat16 on. ``None``: float32.
        cpu_offload: Keep the sharded parameters, gradients and optimizer state in CPU memory
            (``CPUOffloadPolicy``); the optimizer step then runs on the CPU.
        activation_checkpointing: Recompute each unit's activations in backward instead of keeping
            them (``torch.utils.checkpoint``, non-reentrant); the root is not checkpointed.
        compile: ``torch.compile`` each unit's forward before sharding (per unit, as torchtitan
            does; the root's forward only when it is the one unit); parameter names stay free of
            ``_orig_mod.``.
        reduce_dtype: ``"bf16"`` or ``"fp16"``: gradients are reduce-scattered in that dtype (half
            the bytes of float32, a rounding of each rank's gradient before the sum) and kept
            float32 in the shards (with ``mixed_precision="bf16"`` too); ``None``: float32.
            FSDP's counterpart of DDP's compression hooks (docs/trainer.md).

    Returns:
        ``model`` itself, sharded.

    Raises:
        DistkitError: No process group is initialized.
        TypeError, ValueError: A misshapen option (the message names it).

    Example:
        >>> distkit.init()  # doctest: +SKIP
        >>> model = distkit.shard_model(Transformer(), unit_classes=Block, mixed_precision="bf16")
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)  # doctest: +SKIP
    """
    from distkit.errors import DistkitError

    classes = _check_sharding_options(
        unit_classes=unit_classes,
        min_unit_params=min_unit_params,
        mixed_precision=mixed_precision,
        reduce_dtype=reduce_dtype,
    )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if not (dist.is_available() and dist.is_initialized()):
        raise DistkitError(
            "shard_model() shards over the ranks of a process group, but none is initialized. Call "
            "distkit.init() first (under torchrun), or train the plain model in a single process."
        )
    fsdp = _fsdp()
    units = _select_units(model, unit_classes=classes, min_unit_params=min_unit_params)
    _prepare_units(units, activation_checkpointing=activation_checkpointing, compile=compile)
    if compile and not units:
        # One unit, the root: FSDP's hooks are on its __call__, outside the compiled forward. With
        # units the root's forward is left alone, as it would trace into their hooks.
        _prepare_units([model], activation_checkpointing=False, compile=True)
    kwargs: dict[str, Any] = {}
    root_kwargs: dict[str, Any] = {}
    norms: list[nn.Module] = []
    reduce = torch.float32 if reduce_dtype is None else _REDUCE_DTYPES[reduce_dtype]
    if mixed_precision == "bf16":
        norms = [m for m in _post_order(model) if m is not model and isinstance(m, _FLOAT32_NORMS)]
        units = [unit for unit in units if not isinstance(unit, _FLOAT32_NORMS)]
        policy = {"param_dtype": torch.bfloat16, "reduce_dtype": reduce}
        kwargs["mp_policy"] = fsdp.MixedPrecisionPolicy(**policy)
        # The model's output in float32: the loss is computed in float32, as under autocast.
        # Between units the activations stay bfloat16.
        root_kwargs["mp_policy"] = fsdp.MixedPrecisionPolicy(**policy, output_dtype=torch.float32)
    elif reduce_dtype is not None:
        # float32 parameters and compute; only the reduce-scatter is cast (and cast back).
        kwargs["mp_policy"] = fsdp.MixedPrecisionPolicy(reduce_dtype=reduce)
    if cpu_offload:
        kwargs["offload_policy"] = fsdp.CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    # Children before their parents: a BatchNorm is a leaf, inside a unit or the root.
    for norm in norms:
        fsdp.fully_shard(
            norm,
            reshard_after_forward=reshard_after_forward,
            **{**kwargs, "mp_policy": _norm_policy(reduce)},
        )
    for unit in units:
        fsdp.fully_shard(unit, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root's parameters are gathered first in backward, so resharding it after forward would
    # only gather them again at once (torchtitan does the same).
    fsdp.fully_shard(model, reshard_after_forward=False, **{**kwargs, **root_kwargs})
    # A training_step or validation_step calls the model's layers outside its forward: FSDP then
    # gathers the root's parameters there too (without this, torch raises "got mixed torch.Tensor
    # and DTensor" on the first step).
    for method in ("training_step", "validation_step"):
        if callable(getattr(model, method, None)):
            fsdp.register_fsdp_forward_method(model, method)
    return model


def _buffer_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(module, name)`` of every persistent buffer of ``model`` (what its ``state_dict`` holds).

    Non-persistent buffers (caches, masks derived from the configuration) are left out: they are
    not state, and broadcasting a large constant mask every step would cost bandwidth for nothing.
    """
    return [
        (module, name)
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and name not in module._non_persistent_buffers_set
    ]


def _broadcast_buffers(slots: list[tuple[nn.Module, str]], src: int = 0) -> None:
    """Overwrite every rank's buffers of ``slots`` with rank ``src``'s. Collective (every rank).

    Through distkit's collectives, so that a rank that skips it is named at once instead of leaving
    the others waiting for the group's timeout. One broadcast per device, of every buffer's bytes:
    widest element types first, so that each buffer's offset in the flat byte tensor is a multiple
    of its element size.
    """
    tensors = sorted(
        (module._buffers[name] for module, name in slots),
        key=lambda t: -t.element_size(),  # type: ignore[union-attr]
    )
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor.detach())  # type: ignore[union-attr]
    peers = collectives._peers(None, "sync_buffers()")
    if peers is None:  # a world of one
        return
    receiving = dist.get_rank() != src
    for parts in by_device.values():
        flat = torch.cat([part.reshape(-1).view(torch.uint8) for part in parts])
        collectives._run("sync_buffers", flat, peers, dist.broadcast, flat, src=src)
        if receiving:
            offset = 0
            for part in parts:
                size = part.numel() * part.element_size()
                part.copy_(flat[offset : offset + size].view(part.dtype).view(part.shape))
                offset += size


def sync_buffers(model: nn.Module, *, src: int = 0) -> None:
    """Give every rank rank ``src``'s persistent buffers of ``model`` (BatchNorm's running statistics).

    Collective: every rank, the same model. DDP broadcasts rank 0's buffers before each forward;
    FSDP2 (:func:`shard_model`) leaves them rank-local, so each rank's running statistics follow
    its own batches, evaluation differs by rank and a checkpoint keeps one rank's. Call it after
    each optimizer step of a hand-written FSDP loop (the Trainer does, see ``docs/fsdp.md``).
    Buffers registered with ``persistent=False`` are not state and are left alone. One broadcast
    per device holding buffers; nothing when the model has none.

    Args:
        model: The module (sharded or not) whose buffers to make equal on every rank.
        src: The global rank whose buffers every rank receives.

    Example:
        >>> optimizer.step()  # doctest: +SKIP
        >>> distkit.sync_buffers(model)  # doctest: +SKIP
    """
    from distkit.errors import DistkitError

    if not (dist.is_available() and dist.is_initialized()):
        raise DistkitError(
            "sync_buffers() broadcasts over a process group, but none is initialized: call "
            "distkit.init() first (one process has nothing to synchronize)."
        )
    slots = _buffer_slots(model)
    if slots:
        _broadcast_buffers(slots, src)

"""Where the model runs: one device, ``nn.DataParallel`` over several GPUs, DDP or FSDP over processes.

The strategy is resolved once per :meth:`distkit.Trainer.fit` from the ``strategy`` and ``devices``
the user gave and from the job this process is in (a launcher's variables, or none). The result,
a :class:`_Plan`, says how many processes run, which device each uses, and whether ``fit`` must
start the processes itself. What the loop does differently per strategy lives in the strategy
objects of this package's private modules: ``_base`` (the interface, single, DP, DDP) and
``_fsdp``.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distkit import runtime
from distkit.env import detect_env
from distkit.errors import DistkitError
from distkit.sharding import _check_sharding_options

__all__ = ["DDPStrategy", "FSDPStrategy"]

# Run ids of the jobs fit() starts itself (launch.py), so the start-up report can say so.
LOCAL_RUN_PREFIX = "distkit-fit-"

_NAMES = ("auto", "single", "dp", "ddp", "fsdp")


@dataclass(frozen=True)
class DDPStrategy:
    """DistributedDataParallel with its options, for ``Trainer(strategy=DDPStrategy(...))``.

    Local: configuration only. ``strategy="ddp"`` is ``DDPStrategy()``. The DDP options pass
    through to :class:`torch.nn.parallel.DistributedDataParallel` unchanged; in a world of one (one
    process, no launcher) the model is not wrapped and they have no effect.

    Gradient compression (``comm_hook``) trades exactness of the gradient all-reduce for fewer
    bytes on the wire; it pays on communication-bound jobs (large models, slow interconnects
    between nodes) and costs a little accuracy (``docs/trainer.md``, "Compressing gradients"). A
    skipped or discarded step leaves PowerSGD's state as it was, and checkpoints hold that state,
    so a resumed run equals the uninterrupted one.

    Attributes:
        find_unused_parameters: Let DDP find parameters that got no gradient in a step (costs a
            graph traversal every step; needed when a forward pass skips some layers).
        static_graph: Promise that the set of used parameters never changes between steps.
        gradient_as_bucket_view: Gradients are views into DDP's buckets (saves one copy and memory).
        bucket_cap_mb: Size of the gradient buckets in MiB; ``None`` is torch's default (25).
        backend: ``"gloo"``, ``"nccl"`` or ``None`` (NCCL on CUDA, else gloo).
        timeout_s: Deadline of every collective; ``None`` is :data:`distkit.DEFAULT_TIMEOUT_S`.
        comm_hook: How DDP reduces the gradients. ``None``: a float32 all-reduce (exact).
            ``"fp16"``: each bucket is cast to float16 for the all-reduce (half the bytes; values
            beyond 65504 overflow to inf, caught as any overflow is: clipping by norm, the fp16
            scaler).
            ``"bf16"``: cast to bfloat16 (half the bytes, float32's range, 3 significant digits);
            on gloo too, where torch's own bf16 hook refuses to run. ``"powersgd"``: torch's
            PowerSGD, a low-rank approximation of each weight matrix's gradient with error
            feedback (for a ``n x m`` matrix ``(n + m) * powersgd_rank`` numbers instead of
            ``n * m``; vectors such as biases are all-reduced plainly).
        powersgd_rank: PowerSGD's matrix approximation rank (``None``: 1). Higher is more accurate
            and sends more; torch suggests trying 1, 2, 4, ...
        powersgd_warmup_steps: Optimizer steps reduced plainly before PowerSGD starts (``None``:
            1000, torch's default; torch suggests about 10% of the run). At least 2: DDP rebuilds
            its buckets after the first step.

    Example:
        >>> import distkit
        >>> trainer = distkit.Trainer(strategy=DDPStrategy(find_unused_parameters=True), max_steps=1)
        >>> strategy = DDPStrategy(comm_hook="powersgd", powersgd_rank=2, powersgd_warmup_steps=100)
    """

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float | None = None
    backend: str | None = None
    timeout_s: float | None = None
    comm_hook: str | None = None
    powersgd_rank: int | None = None
    powersgd_warmup_steps: int | None = None

    def __post_init__(self) -> None:
        _check_comm_hook(self.comm_hook, self.powersgd_rank, self.powersgd_warmup_steps)
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0 or None, got {self.bucket_cap_mb}.")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}.")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {self.backend!r}.")

    def ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments given to ``DistributedDataParallel``."""
        kwargs: dict[str, Any] = {
            "find_unused_parameters": self.find_unused_parameters,
            "static_graph": self.static_graph,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
        }
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        return kwargs


# DDPStrategy(comm_hook=...): what each name does is in DDPStrategy's docstring.
COMM_HOOKS = ("fp16", "bf16", "powersgd")
# torch's defaults for PowerSGDState (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py).
DEFAULT_POWERSGD_RANK = 1
DEFAULT_POWERSGD_WARMUP_STEPS = 1000


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_comm_hook(comm_hook: object, rank: object, warmup_steps: object) -> None:
    """Validate DDPStrategy's compression options. Local."""
    if comm_hook is not None and comm_hook not in COMM_HOOKS:
        raise ValueError(
            f"comm_hook must be None (a float32 all-reduce), {', '.join(repr(h) for h in COMM_HOOKS)}, "
            f"got {comm_hook!r}."
        )
    if comm_hook != "powersgd":
        given = [
            name
            for name, value in (("powersgd_rank", rank), ("powersgd_warmup_steps", warmup_steps))
            if value is not None
        ]
        if given:
            raise ValueError(
                f"{' and '.join(given)} apply to comm_hook='powersgd' only, got comm_hook={comm_hook!r}; "
                f"pass comm_hook='powersgd' or leave them out."
            )
        return
    if rank is not None and (not _is_int(rank) or rank < 1):  # type: ignore[operator]
        raise ValueError(f"powersgd_rank must be an int >= 1 or None (1), got {rank!r}.")
    if warmup_steps is not None and (not _is_int(warmup_steps) or warmup_steps < 2):  # type: ignore[operator]
        raise ValueError(
            f"powersgd_warmup_steps must be an int >= 2 or None ({DEFAULT_POWERSGD_WARMUP_STEPS}), got "
            f"{warmup_steps!r}: DDP rebuilds its gradient buckets after the first step, and torch's "
            f"PowerSGD (with error feedback and warm start) starts after that."
        )


@dataclass(frozen=True)
class FSDPStrategy:
    """Fully sharded data parallelism (torch's FSDP2) with its options, for ``Trainer(strategy=...)``.

    Local: configuration only. ``strategy="fsdp"`` is ``FSDPStrategy()``. Every rank holds
    ``1/world_size`` of the parameters, gradients and optimizer state; the model is sharded in
    place, unit by unit, as :func:`distkit.shard_model` does (see its options and ``docs/fsdp.md``).
    The Trainer's ``precision="bf16-mixed"`` becomes FSDP's ``MixedPrecisionPolicy`` (bfloat16
    parameters and compute, float32 gradient reduction) instead of autocast, and
    ``Trainer(compile=True)`` compiles each unit before sharding. In a world of one (one process,
    no launcher) nothing is sharded and the model trains as under ``strategy="single"``.

    Attributes:
        unit_classes: Module classes that form the sharding units (e.g. a transformer block).
        min_unit_params: Without ``unit_classes``: the smallest parameter count of a unit
            (``None``: 1,000,000).
        reshard_after_forward: Free each unit's gathered parameters after its forward pass
            (least memory); ``False`` keeps them until backward (one all-gather fewer per unit).
        cpu_offload: Keep the sharded parameters, gradients and optimizer state in CPU memory.
        activation_checkpointing: Recompute each unit's activations in backward.
        broadcast_buffers: After every optimizer step, give every rank rank 0's persistent buffers
            (BatchNorm's running statistics), as DDP broadcasts them: one broadcast per step, and
            none for a model without buffers. ``False`` leaves them rank-local (FSDP2's own
            behaviour): each rank's statistics then follow its own batches, and a resumed run
            starts every rank from one rank's.
        reduce_dtype: The dtype of the gradients' reduce-scatter: ``None`` (float32, exact),
            ``"bf16"`` or ``"fp16"`` (half the bytes, FSDP's counterpart of DDP's ``comm_hook``
            compression; ``MixedPrecisionPolicy(reduce_dtype=...)``). The sharded gradients and
            the optimizer stay float32. FSDP has no PowerSGD.
        backend: ``"gloo"``, ``"nccl"`` or ``None`` (NCCL on CUDA, else gloo).
        timeout_s: Deadline of every collective; ``None`` is :data:`distkit.DEFAULT_TIMEOUT_S`.

    Example:
        >>> import distkit
        >>> trainer = distkit.Trainer(strategy=FSDPStrategy(min_unit_params=10_000), max_steps=1)
    """

    unit_classes: tuple[type[nn.Module], ...] = ()
    min_unit_params: int | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    broadcast_buffers: bool = True
    backend: str | None = None
    timeout_s: float | None = None
    reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        classes = _check_sharding_options(
            unit_classes=self.unit_classes,
            min_unit_params=self.min_unit_params,
            mixed_precision=None,
            reduce_dtype=self.reduce_dtype,
        )
        object.__setattr__(self, "unit_classes", classes)
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}.")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {self.backend!r}.")


def check_strategy(strategy: object) -> str | DDPStrategy | FSDPStrategy:
    """Validate the ``strategy`` argument of the Trainer (local, no device probing)."""
    if isinstance(strategy, (DDPStrategy, FSDPStrategy)):
        return strategy
    if isinstance(strategy, str) and strategy in _NAMES:
        return strategy
    meant = _meant_strategy(strategy)
    raise ValueError(
        f"strategy must be one of {list(_NAMES)}, a DDPStrategy(...) or an FSDPStrategy(...), got "
        f"{strategy!r}.{f' Did you mean {meant}?' if meant else ''} Use 'ddp' for several processes (CPU "
        f"or GPU), 'fsdp' to shard the model, its gradients and optimizer state over them, 'dp' for "
        f"nn.DataParallel over the GPUs of one process."
    )


# Lightning's strategy names and what they are here.
_LIGHTNING_STRATEGIES = {
    "ddp_spawn": "'ddp' (fit() under plain python starts its processes itself)",
    "ddp_fork": "'ddp' (fit() under plain python starts its processes itself)",
    "ddp_notebook": "'ddp' (fit() under plain python starts its processes itself)",
    "ddp_find_unused_parameters_true": "DDPStrategy(find_unused_parameters=True)",
    "ddp_find_unused_parameters_false": "'ddp'",
    "fsdp2": "'fsdp' (FSDP2's fully_shard)",
    "single_device": "'single'",
}


def _meant_strategy(strategy: object) -> str | None:
    """The strategy a slip (``'DDP'``, ``'dpp'``) or another tool's name most likely meant."""
    if strategy in (DDPStrategy, FSDPStrategy):  # the class, not an instance
        return f"{strategy.__name__}()"
    if not isinstance(strategy, str):
        return None
    name = strategy.strip().lower()
    if name in _LIGHTNING_STRATEGIES:
        return _LIGHTNING_STRATEGIES[name]
    if name in _NAMES:  # 'DDP'
        return repr(name)
    close = difflib.get_close_matches(name, _NAMES, n=2, cutoff=0.6)  # 'dpp': 'dp' or 'ddp'
    return " or ".join(repr(found) for found in close) or None


def check_devices(devices: object) -> int | str | tuple[int, ...]:
    """Validate ``devices``: ``"auto"``, a count >= 1, or a non-empty list of distinct CUDA indices."""
    if devices == "auto":
        return "auto"
    if isinstance(devices, bool):
        raise TypeError(f"devices must be 'auto', an int or a list of ints, got {devices!r}.")
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices must be >= 1, got {devices}.")
        return devices
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        indices = tuple(devices)
        if not indices or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
            raise TypeError(f"devices must be a non-empty list of CUDA device indices, got {devices!r}.")
        if any(i < 0 for i in indices) or len(set(indices)) != len(indices):
            raise ValueError(f"devices must list distinct CUDA indices >= 0, got {list(indices)}.")
        return indices
    meant = f" Did you mean devices={int(devices)}?" if isinstance(devices, str) and devices.isdigit() else ""
    raise TypeError(f"devices must be 'auto', an int or a list of CUDA indices, got {devices!r}.{meant}")


def check_cuda_indices(indices: Sequence[int], what: str) -> None:
    """Raise unless CUDA is available and every index names a visible device."""
    if not torch.cuda.is_available():
        raise DistkitError(
            f"{what} needs CUDA, but CUDA is not available on this machine (torch "
            f"{torch.__version__}). On CPU use strategy='ddp' with devices=<number of processes>."
        )
    count = torch.cuda.device_count()
    missing = [i for i in indices if i >= count]
    if missing:
        raise DistkitError(
            f"devices={list(indices)} names CUDA device(s) {missing}, but this process sees {count} "
            f"(indices 0..{count - 1}; CUDA_VISIBLE_DEVICES renumbers them from 0)."
        )


@dataclass(frozen=True)
class _Plan:
    """How one ``fit`` runs: what every process does and whether ``fit`` starts the processes."""

    # "single", "dp", "ddp" or "fsdp".
    kind: str
    # Processes on this node (to start, or already running) and in the whole job.
    local_processes: int
    world_size: int
    # Start `local_processes` processes through torch's elastic launcher (no launcher around us).
    launch: bool
    # Who started this process: "none", "torchrun", "slurm", ..., or "existing group".
    launcher: str
    # Explicit CUDA indices: DP's devices, single's device, or DDP's device per local rank. Empty:
    # the device distkit.init() picks (cuda:<local_rank> when CUDA is available, else the CPU).
    cuda_indices: tuple[int, ...] = ()
    ddp: DDPStrategy = field(default_factory=DDPStrategy)
    fsdp: FSDPStrategy = field(default_factory=FSDPStrategy)

    @property
    def options(self) -> DDPStrategy | FSDPStrategy:
        """The options of the multi-process strategy (backend and timeout included)."""
        return self.fsdp if self.kind == "fsdp" else self.ddp

    def device(self) -> torch.device:
        """This process's device (DP: the first of its devices, where outputs are gathered)."""
        if not self.cuda_indices:
            return runtime.get_device()
        index = (
            self.cuda_indices[runtime.get_local_rank()]
            if self.kind in ("ddp", "fsdp")
            else self.cuda_indices[0]
        )
        return torch.device("cuda", index)


def _job() -> tuple[str, int, int]:
    """``(launcher, world_size, local_world_size)`` of the job this process already is in."""
    if dist.is_available() and dist.is_initialized():
        env = runtime.get_env()
        launcher = "existing group" if env.launcher == "none" else env.launcher
    else:
        env = detect_env()
        launcher = env.launcher
    if os.environ.get("TORCHELASTIC_RUN_ID", "").startswith(LOCAL_RUN_PREFIX):
        launcher = "Trainer.fit (local processes)"
    return launcher, env.world_size, env.local_world_size


def _auto_name(devices: int | str | tuple[int, ...], world_size: int, in_job: bool) -> str:
    if world_size > 1 or (isinstance(devices, tuple) and len(devices) > 1):
        return "ddp"
    if isinstance(devices, int) and devices > 1:
        return "ddp"
    if devices == "auto" and not in_job and torch.cuda.is_available() and torch.cuda.device_count() > 1:
        return "ddp"
    return "single"


def resolve(strategy: str | DDPStrategy | FSDPStrategy, devices: int | str | tuple[int, ...]) -> _Plan:
    """Turn the Trainer's ``strategy``/``devices`` and this process's job into a :class:`_Plan`.

    Local: reads the environment and counts CUDA devices.
    """
    launcher, world_size, local_world_size = _job()
    in_job = launcher != "none"
    ddp = strategy if isinstance(strategy, DDPStrategy) else DDPStrategy()
    fsdp = strategy if isinstance(strategy, FSDPStrategy) else FSDPStrategy()
    if isinstance(strategy, (DDPStrategy, FSDPStrategy)):
        name = "ddp" if isinstance(strategy, DDPStrategy) else "fsdp"
    else:
        name = strategy
    if name == "auto":
        name = _auto_name(devices, world_size, in_job)

    if name in ("single", "dp") and world_size > 1:
        raise DistkitError(
            f"strategy={name!r} runs in one process, but this process is rank {runtime.get_rank()} of a "
            f"{world_size}-process job started by {launcher}. Use strategy='ddp' (or 'fsdp') under a "
            f"launcher, or "
            f"start the script with plain `python` for strategy={name!r}."
        )

    if name == "single":
        if (isinstance(devices, int) and devices != 1) or (isinstance(devices, tuple) and len(devices) != 1):
            shown = list(devices) if isinstance(devices, tuple) else devices
            raise ValueError(
                f"strategy='single' uses one device, got devices={shown}; use strategy='ddp' "
                f"(processes) or 'dp' (GPUs of one process) for more."
            )
        if isinstance(devices, tuple):
            check_cuda_indices(devices, f"devices={list(devices)}")
            return _Plan("single", 1, 1, False, launcher, devices)
        return _Plan("single", 1, 1, False, launcher)

    if name == "dp":
        # nn.DataParallel silently runs the plain module on the CPU when CUDA is absent
        # (FACTS.md): refuse instead of pretending to run in parallel.
        check_cuda_indices((), "strategy='dp' (nn.DataParallel)")
        if isinstance(devices, tuple):
            indices = devices
        else:
            indices = tuple(range(torch.cuda.device_count() if devices == "auto" else int(devices)))
        check_cuda_indices(indices, "strategy='dp' (nn.DataParallel)")
        return _Plan("dp", 1, 1, False, launcher, indices)

    if in_job:
        # Under a launcher each process drives one device; `devices` can only confirm that.
        count = len(devices) if isinstance(devices, tuple) else devices
        if count != "auto" and count != local_world_size:
            raise DistkitError(
                f"devices={list(devices) if isinstance(devices, tuple) else devices} but the {launcher} "
                f"job runs {local_world_size} process(es) on this node, each on one device. Pass "
                f"devices='auto', or start {count} processes per node (torchrun --nproc_per_node={count})."
            )
        if isinstance(devices, tuple):
            check_cuda_indices(devices, f"devices={list(devices)}")
            return _Plan(name, local_world_size, world_size, False, launcher, devices, ddp, fsdp)
        return _Plan(name, local_world_size, world_size, False, launcher, (), ddp, fsdp)

    if isinstance(devices, tuple):
        check_cuda_indices(devices, f"devices={list(devices)}")
        count, indices = len(devices), devices
    elif devices == "auto":
        if not torch.cuda.is_available():
            # One process per GPU has no CPU counterpart (one per core would oversubscribe the
            # cores with intra-op threads), and one process would be DDP in name only.
            raise DistkitError(
                f"strategy={name!r} with devices='auto' outside a launcher starts one process per GPU, but "
                "CUDA is not available here, so the number of processes is unknown. Pass devices=N "
                "(e.g. devices=2) to start N CPU processes, or start the script with "
                "`torchrun --nproc_per_node=N`."
            )
        count, indices = torch.cuda.device_count(), ()
    else:
        count, indices = int(devices), ()
        if torch.cuda.is_available() and count > torch.cuda.device_count():
            raise DistkitError(
                f"devices={count} asks for {count} processes, one per GPU, but this machine has "
                f"{torch.cuda.device_count()} GPU(s); pass devices<={torch.cuda.device_count()}."
            )
    return _Plan(name, count, count, count > 1, launcher, indices, ddp, fsdp)

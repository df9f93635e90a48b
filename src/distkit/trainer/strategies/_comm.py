"""DDP's gradient compression, ``DDPStrategy(comm_hook=...)``: the hooks, and PowerSGD's state as a
checkpoint entry that survives DDP's bucket rebuild, a skipped step and a resume.

``"fp16"`` is torch's ``fp16_compress_hook``. ``"bf16"`` is the same idea written here
(:func:`bf16_allreduce_hook`): DDP refuses torch's own ``bf16_compress_hook`` unless NCCL (or XCCL)
runs it, and gloo all-reduces bfloat16 correctly (FACTS.md; tests/test_comm_hooks.py). Both are
stateless, and both keep a poisoned rank's nan: nan survives the cast and the sum.

``"powersgd"`` is torch's ``powerSGD_hook`` over a ``PowerSGDState``, which keeps state between
steps: each rank's error feedback (what compression left out of its gradient, added to its next
one) and the ``Q`` matrices each step starts from (warm start), both keyed by DDP's bucket index,
and a step count. The Trainer needs three things more than torch gives, which :class:`PowerSGD`
adds around torch's hook:

- **DDP's bucket layouts.** A DDP model reduces its first step in buckets of the parameters in
  registration order and rebuilds them after it, in the order the gradients became ready. torch
  avoids the change by starting PowerSGD at step 2 or later, but a resumed run builds a new DDP
  model whose first step (PowerSGD already on) uses the first layout again. So the hook checks each
  bucket's parameters, and the state of buckets of a stale layout moves into a store per parameter,
  from which the buckets of the new layout are assembled. torch's computations are per parameter
  (``batch_tensors_with_same_shape=False``) or elementwise, so a layout change leaves the numbers
  as they were (bitwise on 2 ranks; over more ranks gloo may add the ranks' values in another order).
- **The first ``Q``** of each matrix is drawn here, from a generator seeded by the parameter's
  position in the model, so it does not depend on the layout either (torch draws one seed per
  bucket, from a NumPy generator that is then never used).
- **Steps that are not taken.** A step skipped on every rank (a nan), discarded for a stop request,
  or skipped by the fp16 scaler ran its reduction anyway; under PowerSGD a nan in one gradient turns
  the error feedback and ``Q`` to nan on every rank, for every later step. The state is kept when a
  step's reduction starts and put back when the loop reports the step not taken
  (:meth:`PowerSGD.finish_step`), so such a step leaves no trace, as it leaves none in the weights.

Saved, the state is per parameter (independent of the layout): the step count, the ``Q`` matrices
(the same on every rank) and every rank's error feedback (gathered: a full checkpoint holds
``world_size`` copies of the gradients' size).
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations
# with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, and strings fail.

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from distkit import runtime
from distkit.collectives import all_gather

__all__: list[str] = []

_log = runtime.get_logger("distkit.trainer", main_process_only=True)

# The seed of a parameter's first Q is this plus the parameter's position in the model (torch's
# PowerSGDState seeds its generator with 0 by default; any fixed number does, the same on every rank).
_Q_SEED = 0


def bf16_allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket in bfloat16: cast, divide by the world size, all-reduce, cast back in place.

    What torch's ``default_hooks.bf16_compress_hook`` does (``_compress_hook``), under another name:
    DDP refuses any hook *named* ``bf16_compress_hook`` unless NCCL runs it
    (``DistributedDataParallel._check_comm_hook``), so this one must not be. Collective, as every
    DDP hook.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        # In place, as torch's hooks do, to keep the peak memory down (pytorch/pytorch#45968).
        buffer.copy_(fut.value()[0])
        return buffer

    fut: torch.futures.Future[torch.Tensor] = (
        dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)
    )
    return fut


def register(
    ddp: nn.parallel.DistributedDataParallel, comm_hook: str | None, powersgd: "PowerSGD | None"
) -> None:
    """Register ``comm_hook`` on ``ddp`` (``powersgd``: the state made for ``"powersgd"``). Local."""
    if comm_hook == "fp16":
        ddp.register_comm_hook(None, fp16_compress_hook)
    elif comm_hook == "bf16":
        ddp.register_comm_hook(None, bf16_allreduce_hook)
    elif comm_hook == "powersgd":
        assert powersgd is not None  # the runner makes it for "powersgd"
        powersgd.attach(ddp)


@dataclass(frozen=True)
class _Layout:
    """Where each parameter of one bucket sits in the bucket's flat buffer and in its P/Q memory."""

    # id() of the bucket's parameters in order: how a rebuilt layout is recognised.
    key: tuple[int, ...]
    # (name, offset, numel) of every parameter in the flat gradient (and error feedback).
    pieces: tuple[tuple[str, int, int], ...]
    # (name, offset in Q memory, m, r) of the matrices PowerSGD compresses, in torch's order.
    matrices: tuple[tuple[str, int, int, int], ...]
    size: int
    p_size: int
    q_size: int


@dataclass
class _Saved:
    """The state when a step's reduction started (what an untaken step puts back)."""

    iter: int
    errors: dict[int, torch.Tensor]
    qs: dict[int, torch.Tensor]
    ps: dict[int, torch.Tensor]
    layouts: dict[int, _Layout]
    stored_errors: dict[str, torch.Tensor]
    stored_qs: dict[str, torch.Tensor]


class PowerSGD:
    """torch's PowerSGD for one DDP model, as the Trainer runs it: the hook's state (given to
    ``register_comm_hook``) and the checkpoint entry ``"comm_hook"``.

    Local, except :meth:`state_dict` (collective when attached to a DDP model of several ranks).
    """

    def __init__(self, *, rank: int, warmup_steps: int) -> None:
        # process_group None: the hook reduces over the default group, as DDP does here.
        # orthogonalization_epsilon: torch's default 0 divides by a zero norm when a weight's
        # gradient is all zeros (an unused layer, a first step without error feedback), and the
        # nan would reach the weights unseen unless it hit the sentinel; torch suggests 1e-8.
        self.state = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=warmup_steps,
            use_error_feedback=True,
            warm_start=True,
            orthogonalization_epsilon=1e-8,
        )
        # The DDP model's parameters by name, their names by id(), and their positions (Q seeds).
        self._params: dict[str, nn.Parameter] = {}
        self._names: dict[int, str] = {}
        self._positions: dict[str, int] = {}
        self._attached = False
        # torch's per-bucket state is in self.state; this is which layout each bucket index has,
        # and in which reduction the hook last found it unchanged.
        self._layouts: dict[int, _Layout] = {}
        self._checked: dict[int, int] = {}
        # The state of parameters in no current bucket (a stale layout's, or a checkpoint's).
        self._errors: dict[str, torch.Tensor] = {}
        self._qs: dict[str, torch.Tensor] = {}
        # Reductions started; whether one is under way (between its first and last bucket).
        self._reductions = 0
        self._reducing = False
        self._saved: _Saved | None = None
        # The previous bucket's reduction of this step, which the next bucket waits for.
        self._previous: torch.futures.Future[torch.Tensor] | None = None

    def attach(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Register torch's hook, through this state, on ``ddp``. Local."""
        for position, (name, param) in enumerate(ddp.module.named_parameters()):
            self._params[name] = param
            self._names[id(param)] = name
            self._positions[name] = position
        ddp.register_comm_hook(self, _powersgd_hook)
        self._attached = True

    # ---- the hook's side

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The hook's work for one bucket: the state kept at the step's first bucket, the bucket's
        state fitted to its parameters, then torch's PowerSGD. Collective."""
        if not self._reducing:  # the step's first bucket
            self._reducing = True
            self._reductions += 1
            self._saved = self._save()
            self._previous = None  # DDP waited for the last step's buckets before it finished it
        if bucket.is_last():  # torch's mark of the step's last bucket (it counts steps there too)
            self._reducing = False
        if self.state.iter < self.state.start_powerSGD_iter:
            return powerSGD_hook(self.state, bucket)  # a plain all-reduce, from this thread
        # torch's hook starts the second and third all-reduce of a bucket from the callbacks of its
        # first, on gloo's threads, while DDP starts the next bucket's first one from the backward
        # pass: the ranks may then start them in different orders, and gloo pairs them by order
        # ("Received data size doesn't match expected size", or a hang; seen on 2 CPU ranks with
        # several buckets). So a bucket starts once the previous one is reduced, on every backend
        # (checked on gloo only): PowerSGD's buckets then overlap with the backward pass, not with
        # each other.
        if self._previous is not None:
            self._previous.wait()
        self._fit_layout(bucket)
        self._previous = powerSGD_hook(self.state, bucket)
        return self._previous

    def finish_step(self, taken: bool) -> None:
        """After an optimizer step: one not ``taken`` leaves the state as it was before its reduction."""
        saved, self._saved = self._saved, None
        if taken or saved is None:
            return
        state = self.state
        state.iter = saved.iter
        state.error_dict, state.q_memory_dict, state.p_memory_dict = saved.errors, saved.qs, saved.ps
        self._layouts, self._errors, self._qs = saved.layouts, saved.stored_errors, saved.stored_qs
        self._checked.clear()

    def _save(self) -> _Saved:
        # torch replaces the error tensors and P's allocation, but writes into Q's: Q is copied.
        state = self.state
        return _Saved(
            iter=state.iter,
            errors=dict(state.error_dict),
            qs={index: q.clone() for index, q in state.q_memory_dict.items()},
            ps=dict(state.p_memory_dict),
            layouts=dict(self._layouts),
            stored_errors=dict(self._errors),
            stored_qs=dict(self._qs),
        )

    def _fit_layout(self, bucket: dist.GradBucket) -> None:
        """Make torch's state of this bucket index the state of the parameters it now holds."""
        index = bucket.index()
        params = bucket.parameters()
        layout = self._layouts.get(index)
        if layout is not None and layout.key == tuple(map(id, params)):
            self._checked[index] = self._reductions
            return
        # A bucket not seen yet, or DDP rebuilt its buckets: every bucket this reduction has not
        # reached yet holds a finished step's state, which moves to the store; those it reached
        # hold this step's, of the current layout (a parameter is in one bucket of a layout).
        for stale in [i for i in self._layouts if self._checked.get(i) != self._reductions]:
            self._unpack(stale)
        self._pack(index, self._layout_of(params), bucket.buffer())
        self._checked[index] = self._reductions

    def _layout_of(self, params: list[torch.Tensor]) -> _Layout:
        pieces: list[tuple[str, int, int]] = []
        by_shape: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        offset = 0
        rank, rate = self.state.matrix_approximation_rank, self.state.min_compression_rate
        for param in params:
            name = self._names[id(param)]
            numel = param.numel()
            pieces.append((name, offset, numel))
            offset += numel
            # torch's powerSGD_hook: each gradient viewed as (shape[0], -1), compressed when
            # (n + m) * r * min_compression_rate < n * m (_should_compress).
            n = param.shape[0] if param.dim() else 1
            m = numel // n if n else 0
            r = min(n, m, rank)
            if (n + m) * r * rate < n * m:
                by_shape.setdefault((n, m), []).append((name, m, r))
        # torch groups the matrices by shape (in order of first appearance) before laying out P and Q.
        matrices: list[tuple[str, int, int, int]] = []
        p_size = q_size = 0
        for (n, _), group in by_shape.items():
            for name, m, r in group:
                matrices.append((name, q_size, m, r))
                p_size += n * r
                q_size += m * r
        return _Layout(tuple(map(id, params)), tuple(pieces), tuple(matrices), offset, p_size, q_size)

    def _unpack(self, index: int) -> None:
        """Move bucket ``index``'s state (of its finished reductions) into the per-parameter store."""
        layout = self._layouts.pop(index)
        self._checked.pop(index, None)
        state = self.state
        errors = state.error_dict.pop(index, None)
        q = state.q_memory_dict.pop(index, None)
        state.p_memory_dict.pop(index, None)
        if errors is not None:
            for name, offset, numel in layout.pieces:
                self._errors[name] = errors[offset : offset + numel]
        if q is not None:
            for name, offset, m, r in layout.matrices:
                self._qs[name] = q[offset : offset + m * r].view(m, r)

    def _pack(self, index: int, layout: _Layout, buffer: torch.Tensor) -> None:
        """Assemble bucket ``index``'s state from the store: zero error feedback and a first Q for
        parameters it lacks. torch then finds P and Q memory and draws no Q of its own."""
        dtype, device = buffer.dtype, buffer.device
        errors = torch.zeros(layout.size, dtype=dtype, device=device)
        for name, offset, numel in layout.pieces:
            saved = self._errors.pop(name, None)
            if saved is not None:
                errors[offset : offset + numel].copy_(saved.reshape(-1))
        q = torch.empty(layout.q_size, dtype=dtype, device=device)
        for name, offset, m, r in layout.matrices:
            saved = self._qs.pop(name, None)
            if saved is None or tuple(saved.shape) != (m, r):
                saved = self._first_q(name, m, r)
            q[offset : offset + m * r].copy_(saved.reshape(-1))
        state = self.state
        state.error_dict[index] = errors
        state.q_memory_dict[index] = q
        state.p_memory_dict[index] = torch.empty(layout.p_size, dtype=dtype, device=device)  # written first
        self._layouts[index] = layout

    def _first_q(self, name: str, m: int, r: int) -> torch.Tensor:
        # Standard normal, as torch draws it (it orthogonalizes Q before use).
        generator = torch.Generator().manual_seed(_Q_SEED + self._positions[name])
        return torch.randn(m, r, generator=generator)

    # ---- the checkpoint's side

    def _per_parameter(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Error feedback and Q per parameter name (copies): the store and every current bucket."""
        errors = {name: e.detach().clone() for name, e in self._errors.items()}
        qs = {name: q.detach().clone() for name, q in self._qs.items()}
        state = self.state
        for index, layout in self._layouts.items():
            flat = state.error_dict.get(index)
            if flat is not None:
                for name, offset, numel in layout.pieces:
                    errors[name] = flat[offset : offset + numel].detach().clone()
            q = state.q_memory_dict.get(index)
            if q is not None:
                for name, offset, m, r in layout.matrices:
                    qs[name] = q[offset : offset + m * r].view(m, r).detach().clone()
        return errors, qs

    def state_dict(self) -> dict[str, Any]:
        """The state per parameter, every rank's error feedback included.

        Collective when attached to a DDP model of several ranks (the error feedback is gathered,
        one all-gather per dtype): checkpoint saves call it on every rank.
        """
        errors, qs = self._per_parameter()
        world_size = runtime.get_world_size() if self._attached else 1
        per_rank: list[dict[str, torch.Tensor]] = [errors] if errors else []
        if errors and world_size > 1:
            per_rank = _gather_per_rank(errors, world_size)
        return {
            "iter": int(self.state.iter),
            "rank": int(self.state.matrix_approximation_rank),
            "world_size": world_size,
            "q": {name: q.cpu() for name, q in sorted(qs.items())},
            "errors": [{name: e.cpu() for name, e in rank_errors.items()} for rank_errors in per_rank],
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result. Local. Saved on another number of ranks, every rank
        starts from the mean of the saved ranks' error feedback; with another ``powersgd_rank``,
        from new Q matrices (both with a warning: the run then differs from one that went on)."""
        state = self.state
        state.iter = int(saved["iter"])
        state.error_dict, state.q_memory_dict, state.p_memory_dict = {}, {}, {}
        self._layouts, self._checked, self._saved = {}, {}, None
        self._reducing, self._previous = False, None
        self._qs = dict(saved.get("q", {}))
        if int(saved.get("rank", state.matrix_approximation_rank)) != state.matrix_approximation_rank:
            _log.warning(
                "PowerSGD: the checkpoint's matrix approximation rank is %s, this run's %s: its Q "
                "matrices are drawn anew (the error feedback is kept)",
                saved.get("rank"),
                state.matrix_approximation_rank,
            )
            self._qs = {}
        per_rank = list(saved.get("errors", []))
        saved_size = int(saved.get("world_size", len(per_rank) or 1))
        world_size, rank = (runtime.get_world_size(), runtime.get_rank()) if self._attached else (1, 0)
        if not per_rank:
            self._errors = {}
        elif saved_size == world_size and len(per_rank) == world_size:
            self._errors = dict(per_rank[rank])
        else:
            # What enters the averaged gradient is the mean of the ranks' error feedback: giving
            # every rank that mean keeps it, on any number of ranks.
            _log.warning(
                "PowerSGD: the checkpoint was saved on %d rank(s), this run has %d: every rank starts "
                "from the mean of the saved ranks' error feedback (the run is not the one that went on)",
                saved_size,
                world_size,
            )
            names = per_rank[0].keys()
            self._errors = {name: torch.stack([e[name] for e in per_rank]).mean(0) for name in names}
        if self._attached:  # onto the parameters' devices; a name the model lacks is dropped
            params = self._params
            self._errors = {n: e.to(params[n].device) for n, e in self._errors.items() if n in params}
            self._qs = {n: q.to(params[n].device) for n, q in self._qs.items() if n in params}


def _gather_per_rank(errors: dict[str, torch.Tensor], world_size: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's ``errors`` (the same names and shapes on every rank). Collective."""
    names = sorted(errors)
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name in names:
        by_dtype.setdefault(errors[name].dtype, []).append(name)
    per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(world_size)]
    for group in by_dtype.values():
        flat = torch.cat([errors[name].reshape(-1) for name in group])
        for rank, gathered in enumerate(all_gather(flat)):
            offset = 0
            for name in group:
                numel = errors[name].numel()
                per_rank[rank][name] = gathered[offset : offset + numel].view_as(errors[name])
                offset += numel
    return per_rank


def _powersgd_hook(hook: PowerSGD, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook`` as :meth:`PowerSGD.reduce` runs it."""
    return hook.reduce(bucket)

"""FSDP (torch's FSDP2) in the Trainer and in hand-written loops, on real 2-rank gloo groups: losses
equal DDP's, accumulation without gradient sync, clipping on sharded gradients, non-finite steps and
stop requests as under DDP, mixed precision, CPU offload, activation checkpointing, torch.compile,
validation with uneven shards, a self-launched fit and two torchrun agents."""

from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import Dataset

import distkit
from _launch import free_port, job_env, torchrun
from distkit.errors import DistkitError
from distkit.trainer import Callback, FSDPStrategy, ModelCheckpoint, Trainer

SCRIPTS = pathlib.Path(__file__).parent / "fsdp_scripts"


# --------------------------------------------------------------------------------------------------
# Models and data


class MLP(nn.Module):
    """Three blocks of 4,560 to 4,660 parameters each: min_unit_params=4000 makes each a sharding unit."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 50)),
            nn.Sequential(nn.Linear(50, 64), nn.ReLU(), nn.Linear(64, 20)),
            nn.Sequential(nn.Linear(20, 150), nn.ReLU(), nn.Linear(150, 10)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class BatchNormMLP(MLP):
    """The MLP with a BatchNorm1d in each block: running statistics (buffers) that each rank's
    forward passes update from its own batches, and a layer that bf16 kernels refuse."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.blocks:
            block.insert(1, nn.BatchNorm1d(block[0].out_features))


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


class TinyTransformer(nn.Module):
    """A two-layer transformer classifier over sequences of 8 tokens (no dropout: deterministic)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 32)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
            for _ in range(2)
        )
        self.head = nn.Linear(32, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))


class Vectors(Dataset):  # type: ignore[type-arg]
    def __init__(self, length: int, tokens: bool = False) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.data = (
            torch.randint(0, 32, (length, 8), generator=generator)
            if tokens
            else torch.randn(length, 20, generator=generator)
        )
        self.targets = torch.randint(0, 10, (length,), generator=generator)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index], self.targets[index]

    def __len__(self) -> int:
        return len(self.targets)


class RecordLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        self.losses.append(loss.item())


def quiet_trainer(tmp: str, **kwargs: object) -> Trainer:
    options: dict[str, object] = {
        "default_root_dir": tmp,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "seed": 0,
    }
    options.update(kwargs)
    return Trainer(**options)  # type: ignore[arg-type]


def full_weights(model: nn.Module) -> torch.Tensor:
    """Every parameter in full (gathered from the shards under FSDP), flattened. Collective."""
    from torch.distributed.tensor import DTensor

    parts = []
    for p in model.parameters():
        value = p.detach()
        parts.append((value.full_tensor() if isinstance(value, DTensor) else value).reshape(-1).clone())
    return torch.cat(parts)


def fit(
    tmp: str, strategy: object, model_name: str = "mlp", steps: int = 50, **kwargs: object
) -> tuple[list[float], nn.Module]:
    """Train on every rank of the pool; this rank's step losses and the trained model."""
    tokens = model_name == "transformer"
    torch.manual_seed(0)
    model: nn.Module = {"transformer": TinyTransformer, "mlp": MLP, "bn": BatchNormMLP}[model_name]()
    record = RecordLosses()
    callbacks = [record, *kwargs.pop("callbacks", [])]  # type: ignore[misc]
    trainer = quiet_trainer(
        tmp, strategy=strategy, max_steps=steps, batch_size=16, callbacks=callbacks, **kwargs
    )
    trainer.fit(
        model,
        Vectors(1024, tokens),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        loss_fn=nn.functional.cross_entropy,
    )
    return record.losses, model


def train(
    tmp: str, strategy: object, model_name: str = "mlp", steps: int = 50, **kwargs: object
) -> tuple[list[float], torch.Tensor]:
    """This rank's step losses and the full weights after training."""
    losses, model = fit(tmp, strategy, model_name, steps, **kwargs)
    return losses, full_weights(model)


def assert_close_losses(expected: list[float], got: list[float], rtol: float = 1e-5) -> None:
    assert len(expected) == len(got)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert abs(a - b) <= rtol * abs(a), f"step {step + 1}: DDP {a!r}, FSDP {b!r}"


MLP_UNITS = FSDPStrategy(min_unit_params=4000)
BLOCK_UNITS = FSDPStrategy(unit_classes=(nn.TransformerEncoderLayer,))


# --------------------------------------------------------------------------------------------------
# Equivalence with DDP


@pytest.mark.parametrize(
    ("model_name", "fsdp"), [("mlp", MLP_UNITS), ("transformer", BLOCK_UNITS)], ids=["mlp", "transformer"]
)
def test_fsdp_losses_equal_ddps_within_1e_5_over_50_steps(ranks, tmp_path, model_name, fsdp) -> None:
    ddp = ranks.run(train, str(tmp_path / "ddp"), "ddp", model_name)
    sharded = ranks.run(train, str(tmp_path / "fsdp"), fsdp, model_name)
    for (ddp_losses, ddp_weights), (fsdp_losses, fsdp_weights) in zip(ddp, sharded, strict=True):
        assert len(ddp_losses) == 50
        assert_close_losses(ddp_losses, fsdp_losses)
        torch.testing.assert_close(fsdp_weights, ddp_weights, rtol=1e-4, atol=1e-6)
    assert ddp[0][0] != ddp[1][0]  # the ranks saw different data: the comparison is per rank


def test_accumulation_and_clipping_on_sharded_gradients_equal_ddps(ranks, tmp_path) -> None:
    # Accumulation skips the gradient sync on the first micro-batch of each step; clipping reads
    # the norm of sharded (DTensor) gradients. A tight clip makes every step clip.
    options = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05, "steps": 20}
    ddp = ranks.run(train, str(tmp_path / "ddp"), "ddp", **options)
    sharded = ranks.run(train, str(tmp_path / "fsdp"), MLP_UNITS, **options)
    for (ddp_losses, ddp_weights), (fsdp_losses, fsdp_weights) in zip(ddp, sharded, strict=True):
        assert_close_losses(ddp_losses, fsdp_losses)
        torch.testing.assert_close(fsdp_weights, ddp_weights, rtol=1e-4, atol=1e-6)


class CountReduceScatters(Callback):
    """Counts FSDP's gradient reduce-scatters in the second optimizer step: a whole step of
    micro-batches, and nothing of what a fit does once (start-up, the end)."""

    def __init__(self) -> None:
        self.profiler: profile | None = None
        self.count: int | None = None

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        if trainer.global_step == 1:
            self.profiler = profile(activities=[ProfilerActivity.CPU])
            self.profiler.start()
        elif trainer.global_step == 2:
            assert self.profiler is not None
            self.profiler.stop()
            # gloo runs a reduce-scatter as an all-reduce, which the non-finite flag's all-reduce
            # would blur: the reduce-scatter's own op is counted.
            events = self.profiler.events()
            self.count = sum(1 for event in events if event.name == "c10d::_reduce_scatter_base_")


def fsdp_reduce_scatters_in_one_step(tmp: str) -> int | None:
    torch.manual_seed(0)
    model = MLP()
    counter = CountReduceScatters()
    trainer = quiet_trainer(
        tmp,
        strategy=MLP_UNITS,
        max_steps=2,
        batch_size=16,
        accumulate_grad_batches=4,
        log_every_n_steps=1000,
        callbacks=[counter],
    )
    trainer.fit(
        model,
        Vectors(1024),  # 32 batches per rank: both steps inside the first epoch
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=nn.functional.cross_entropy,
    )
    return counter.count


def test_accumulation_reduce_scatters_once_per_optimizer_step(ranks, tmp_path) -> None:
    # An optimizer step of 4 micro-batches: only the last one syncs, reduce-scattering the
    # gradients of the 3 units that hold parameters (the root holds none): 3 reduce-scatters, not
    # 12. Comparing the losses with DDP cannot see a sync on every micro-batch: the sum of the
    # synced gradients is the same.
    counts = ranks.run(fsdp_reduce_scatters_in_one_step, str(tmp_path))
    assert counts == [3, 3], (
        f"an optimizer step of 4 micro-batches ran {counts} reduce-scatters per rank, not 3 (one per "
        f"unit): FSDP synced the gradients on micro-batches that should run with "
        f"set_requires_gradient_sync(False)"
    )


def test_cpu_offload_activation_checkpointing_and_kept_parameters_equal_ddps(ranks, tmp_path) -> None:
    fsdp = FSDPStrategy(
        min_unit_params=4000, cpu_offload=True, activation_checkpointing=True, reshard_after_forward=False
    )
    ddp = ranks.run(train, str(tmp_path / "ddp"), "ddp", steps=10)
    sharded = ranks.run(train, str(tmp_path / "fsdp"), fsdp, steps=10)
    for (ddp_losses, _), (fsdp_losses, _) in zip(ddp, sharded, strict=True):
        assert_close_losses(ddp_losses, fsdp_losses)


# --------------------------------------------------------------------------------------------------
# What the strategy does to the model


class Inspect(Callback):
    def on_fit_start(self, trainer: Trainer) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        model = trainer.model
        assert model is not None
        self.units = sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))
        # Each unit's MixedPrecisionPolicy as fully_shard got it (torch keeps it on the unit's
        # FSDP state; there is no public getter).
        self.policies = {
            name: (m._get_fsdp_state()._mp_policy.param_dtype, m._get_fsdp_state()._mp_policy.reduce_dtype)
            for name, m in model.named_modules()
            if isinstance(m, FSDPModule)
        }
        self.dtensors = all(isinstance(p, DTensor) for p in model.parameters())
        local = sum(p.to_local().numel() for p in model.parameters())
        self.local_share = local / sum(p.numel() for p in model.parameters())
        self.optimizer_holds_shards = all(
            isinstance(p, DTensor) for g in trainer.optimizer.param_groups for p in g["params"]
        )
        self.names = sorted(model.state_dict())
        self.forward_dtypes: set[torch.dtype] = set()
        # The first layer inside the first unit: it computes in the unit's dtype.
        model.blocks[0][0].register_forward_hook(lambda m, i, o: self.forward_dtypes.add(o.dtype))

    def on_fit_end(self, trainer: Trainer) -> None:
        from torch.distributed.tensor import DTensor

        model = trainer.model
        assert model is not None
        self.param_dtypes = {p.dtype for p in model.parameters()}
        self.state_dtypes = {
            v.dtype
            for s in trainer.optimizer.state.values()
            for v in s.values()
            if isinstance(v, DTensor)  # exp_avg, exp_avg_sq: sharded like the parameters
        }


def inspect_fsdp(tmp: str, precision: str, compile: bool) -> dict[str, object]:
    inspect = Inspect()
    train(tmp, MLP_UNITS, steps=3, precision=precision, compile=compile, callbacks=[inspect])
    return {k: v for k, v in vars(inspect).items()}


def test_fsdp_shards_every_parameter_and_the_optimizer_state_unit_by_unit(ranks, tmp_path) -> None:
    for seen in ranks.run(inspect_fsdp, str(tmp_path), "32", False):
        assert seen["units"] == ["", "blocks.0", "blocks.1", "blocks.2"]  # the root and three blocks
        assert seen["dtensors"] and seen["optimizer_holds_shards"]
        assert 0.45 < seen["local_share"] < 0.55  # half of the parameters on each of 2 ranks
        assert seen["state_dtypes"] == {torch.float32}
        # Parameter names stay the model's own (checkpoints load into an unsharded model).
        assert seen["names"] == sorted(MLP().state_dict())


def test_bf16_mixed_computes_in_bfloat16_reduces_in_float32_and_keeps_float32_shards(ranks, tmp_path) -> None:
    for seen in ranks.run(inspect_fsdp, str(tmp_path), "bf16-mixed", False):
        # Gradients summed in bfloat16 lose the low bits of every rank's contribution (8 bits of
        # mantissa): every unit, the root included, must reduce in float32.
        for unit, (param_dtype, reduce_dtype) in seen["policies"].items():
            assert (param_dtype, reduce_dtype) == (torch.bfloat16, torch.float32), (
                f"unit {unit!r} has MixedPrecisionPolicy(param_dtype={param_dtype}, "
                f"reduce_dtype={reduce_dtype}): bf16-mixed must compute in bfloat16 and reduce the "
                f"gradients in float32"
            )
        assert sorted(seen["policies"]) == ["", "blocks.0", "blocks.1", "blocks.2"]
        assert seen["forward_dtypes"] == {torch.bfloat16}  # the first unit's output
        assert seen["param_dtypes"] == {torch.float32}  # the sharded parameters
        assert seen["state_dtypes"] == {torch.float32}


# --------------------------------------------------------------------------------------------------
# Non-finite steps and stop requests, as under DDP


class PoisonOnRankOne(Callback):
    """Makes rank 1's loss nan at the given steps (through a module flag read in forward)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        assert trainer.model is not None
        trainer.model.poison = distkit.get_rank() == 1 and trainer.global_step + 1 in self.steps


class PoisonableMLP(MLP):
    poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * float("nan") if self.poison else out


def train_poisoned(tmp: str, poisoned: set[int], steps: int) -> tuple[int, int, list[float]]:
    torch.manual_seed(0)
    model = PoisonableMLP()
    record = RecordLosses()
    trainer = quiet_trainer(
        tmp, strategy=MLP_UNITS, max_steps=steps, batch_size=16, callbacks=[PoisonOnRankOne(poisoned), record]
    )
    trainer.fit(
        model,
        Vectors(512),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=nn.functional.cross_entropy,
    )
    return trainer.global_step, trainer.skipped_steps, full_weights(model).tolist()[:5]


def test_nonfinite_loss_on_one_rank_skips_that_step_on_every_rank(ranks, tmp_path) -> None:
    (steps0, skipped0, weights0), (steps1, skipped1, weights1) = ranks.run(
        train_poisoned, str(tmp_path), {2}, 4
    )
    assert (steps0, skipped0) == (steps1, skipped1) == (4, 1)
    assert weights0 == weights1 and all(map(lambda w: w == w, weights0))  # finite, identical


class _InfGradOnSecondHalf(torch.autograd.Function):
    """Adds 0 in forward; in backward, an infinite gradient on the second half of the rows of its
    argument (a parameter), finite on the first: an overflow only one shard of that parameter holds."""

    @staticmethod
    def forward(ctx, param: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def, override]
        ctx.shape = param.shape
        return param.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def, override]
        spike = torch.zeros(ctx.shape, dtype=grad.dtype)
        spike[ctx.shape[0] // 2 :] = math.inf
        return spike


class OverflowInRankOnesShards(Callback):
    """In step ``step``, rank 0's backward pass overflows in the second half of the rows of every
    parameter: after the reduce-scatter rank 1's shard of every parameter is inf and rank 0's are
    all finite (2 ranks shard dim 0 in halves; every row count of MLP is even). Every loss stays
    finite. Each rank checks at the end of that step that it skipped it: a rank that took the step
    alone fails there, naming it, instead of leaving the other waiting in a collective."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.armed = False

    def on_fit_start(self, trainer: Trainer) -> None:
        assert trainer.model is not None
        for module in trainer.model.modules():
            if isinstance(module, nn.Linear):
                # Inside the unit's forward pass: its parameters are the gathered (unsharded) ones.
                module.register_forward_hook(self.spike)

    def spike(self, module: nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return output
        return output + _InfGradOnSecondHalf.apply(module.weight) + _InfGradOnSecondHalf.apply(module.bias)

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        if trainer.global_step == self.step and trainer.skipped_steps != 1:
            raise AssertionError(
                f"[rank {distkit.get_rank()}] took step {self.step}, whose gradients were inf in rank "
                f"1's shards only: the non-finite flag was read on each rank's own shard and not "
                f"agreed across ranks (skipped_steps={trainer.skipped_steps})"
            )
        self.armed = distkit.get_rank() == 0 and trainer.global_step + 1 == self.step


def overflow_in_one_shard(tmp: str) -> tuple[int, int, list[float]]:
    torch.manual_seed(0)
    model = MLP()
    trainer = quiet_trainer(
        tmp, strategy=MLP_UNITS, max_steps=3, batch_size=16, callbacks=[OverflowInRankOnesShards(2)]
    )
    trainer.fit(
        model,
        Vectors(512),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=nn.functional.cross_entropy,
    )
    return trainer.global_step, trainer.skipped_steps, full_weights(model).tolist()[:5]


def test_an_overflow_that_only_one_ranks_shard_holds_skips_the_step_on_every_rank(ranks, tmp_path) -> None:
    # Each rank reads the non-finite flag in its own shard of the sentinel parameter: rank 0 sees a
    # finite value, rank 1 inf. Only the all-reduce of the flag makes them agree to skip step 2
    # (with gradient_clip_val unset, no global norm would tell them).
    (steps0, skipped0, weights0), (steps1, skipped1, weights1) = ranks.run(
        overflow_in_one_shard, str(tmp_path)
    )
    assert (steps0, skipped0) == (steps1, skipped1) == (3, 1)
    assert weights0 == weights1 and all(map(math.isfinite, weights0))


def stop_on_one_rank(tmp: str) -> int:
    class StopAtTwo(Callback):
        def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
            if distkit.get_rank() == 1 and trainer.global_step == 2:
                trainer.should_stop = True

    torch.manual_seed(0)
    model = MLP()
    trainer = quiet_trainer(tmp, strategy=MLP_UNITS, max_steps=10, batch_size=16, callbacks=[StopAtTwo()])
    trainer.fit(
        model, Vectors(512), optimizer=lambda p: torch.optim.SGD(p, 0.1), loss_fn=nn.functional.cross_entropy
    )
    return trainer.global_step


def test_should_stop_on_one_rank_stops_every_rank_after_that_step(ranks, tmp_path) -> None:
    # The request travels in step 3's backward pass, which is discarded.
    assert ranks.run(stop_on_one_rank, str(tmp_path)) == [2, 2]


# --------------------------------------------------------------------------------------------------
# Validation: a sharded forward pass is collective, evaluation shards may be uneven


def validate_uneven(tmp: str) -> dict[str, float]:
    torch.manual_seed(0)
    model = MLP()
    # Units kept gathered after forward: only a backward pass (or the Trainer) reshards them.
    strategy = FSDPStrategy(min_unit_params=4000, reshard_after_forward=False)
    trainer = quiet_trainer(tmp, strategy=strategy, max_epochs=1, batch_size=16, val_batch_size=4)
    # 41 validation samples: 21 and 20 per rank, 6 batches of 4 against 5, so rank 1 repeats one
    # forward pass (without it, rank 0's sixth forward would wait for rank 1 in its all-gather).
    trainer.fit(
        model,
        Vectors(64),
        Vectors(41),
        optimizer=lambda p: torch.optim.SGD(p, 0.1),
        loss_fn=nn.functional.cross_entropy,
    )
    assert trainer.model is not None
    # After validation (forward passes without backward) the model holds its shards again: the
    # optimizer's parameters, as a checkpoint saved at the epoch's end needs them.
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in trainer.model.parameters()}
    # The exact validation loss over all 41 samples, on the gathered weights, for comparison.
    weights = {k: v.full_tensor() for k, v in trainer.model.state_dict().items()}
    reference = MLP()
    reference.load_state_dict(weights)
    data = Vectors(41)
    with torch.no_grad():
        exact = nn.functional.cross_entropy(reference(data.data), data.targets).item()
    return {"val_loss": trainer.callback_metrics["val_loss"], "exact": exact}


def test_validation_with_uneven_shards_runs_in_lockstep_and_is_exact(ranks, tmp_path) -> None:
    for result in ranks.run(validate_uneven, str(tmp_path), timeout_s=60):
        assert result["val_loss"] == pytest.approx(result["exact"], rel=1e-5)


# --------------------------------------------------------------------------------------------------
# Options and refusals


def test_fsdp_options_are_checked_with_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"not both"):
        FSDPStrategy(unit_classes=(nn.Linear,), min_unit_params=10)
    with pytest.raises(ValueError, match=r"min_unit_params must be an int >= 1 or None, got 0"):
        FSDPStrategy(min_unit_params=0)
    with pytest.raises(TypeError, match=r"unit_classes must be nn.Module subclasses"):
        FSDPStrategy(unit_classes=(int,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'16-mixed' is not supported with strategy='fsdp'.*bf16-mixed"):
        Trainer(strategy="fsdp", precision="16-mixed", max_steps=1)  # refused before CUDA is checked
    with pytest.raises(TypeError, match=r"compile must be True or False"):
        Trainer(max_steps=1, compile="yes")  # type: ignore[arg-type]


def test_shard_model_without_a_process_group_says_to_initialize_one() -> None:
    with pytest.raises(DistkitError, match=r"distkit.init\(\)"):
        distkit.shard_model(MLP())
    with pytest.raises(DistkitError, match=r"distkit.init\(\)"):
        distkit.sync_buffers(MLP())


class NormsWithoutAffine(nn.Module):
    """A BatchNorm without parameters (affine=False) and a non-persistent buffer beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(20, 32), nn.BatchNorm1d(32, affine=False), nn.ReLU(), nn.Linear(32, 10)
        )
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scratch.fill_(float(distkit.get_rank()))  # rank-local by design: not state
        return self.net(x)


def hand_loop_sync_buffers(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    rank = distkit.get_rank()
    torch.manual_seed(0)
    model = distkit.shard_model(NormsWithoutAffine(), mixed_precision="bf16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Vectors(1024)
    losses = []
    for step in range(steps):
        x, y = data.data[(step * 2 + rank) * 8 :][:8], data.targets[(step * 2 + rank) * 8 :][:8]
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        distkit.sync_buffers(model)
        losses.append(loss.item())
    return losses, buffers(model)


def test_sync_buffers_in_a_hand_written_bf16_loop_gives_every_rank_rank_0s_statistics(ranks) -> None:
    (losses0, buffers0), (losses1, buffers1) = ranks.run(hand_loop_sync_buffers, 4)
    assert all(math.isfinite(v) for v in losses0 + losses1) and losses0 != losses1
    assert buffers0["net.1.running_mean"].dtype == torch.float32  # a BatchNorm without parameters ran
    for name in ("net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"):
        assert torch.equal(buffers0[name], buffers1[name]), name
    assert int(buffers0["net.1.num_batches_tracked"]) == 4
    # Non-persistent buffers are not state: each rank keeps its own.
    assert buffers0["scratch"].tolist() == [0.0] * 3 and buffers1["scratch"].tolist() == [1.0] * 3


def optimizer_made_before_fit(tmp: str) -> tuple[bool, float]:
    """An optimizer made over the unsharded parameters (as for DDP) is rebound to the shards."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    trainer = quiet_trainer(tmp, strategy=MLP_UNITS, max_steps=2, batch_size=16)
    trainer.fit(
        model, Vectors(128), optimizer=optimizer, lr_scheduler=scheduler, loss_fn=nn.functional.cross_entropy
    )
    held = [p for g in optimizer.param_groups for p in g["params"]]
    return all(
        isinstance(p, DTensor) for p in held
    ) and trainer.optimizer is optimizer, optimizer.param_groups[0]["lr"]


def test_an_optimizer_made_before_fit_is_rebound_to_the_shards(ranks, tmp_path) -> None:
    assert ranks.run(optimizer_made_before_fit, str(tmp_path)) == [(True, 0.025)] * 2


# --------------------------------------------------------------------------------------------------
# The hand-written loop helper


def hand_loop(steps: int) -> tuple[list[float], torch.Tensor]:
    rank, world_size = distkit.get_rank(), distkit.get_world_size()
    torch.manual_seed(0)
    model = distkit.shard_model(MLP(), min_unit_params=4000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Vectors(1024)
    losses = []
    for step in range(steps):
        for micro in range(2):
            start = ((step * 2 + micro) * world_size + rank) * 8
            x, y = data.data[start : start + 8], data.targets[start : start + 8]
            model.set_requires_gradient_sync(micro == 1)
            loss = nn.functional.cross_entropy(model(x), y)
            (loss / 2).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, full_weights(model)


def hand_loop_ddp(steps: int) -> tuple[list[float], torch.Tensor]:
    import contextlib

    rank, world_size = distkit.get_rank(), distkit.get_world_size()
    torch.manual_seed(0)
    module = MLP()
    model = nn.parallel.DistributedDataParallel(module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Vectors(1024)
    losses = []
    for step in range(steps):
        for micro in range(2):
            start = ((step * 2 + micro) * world_size + rank) * 8
            x, y = data.data[start : start + 8], data.targets[start : start + 8]
            with contextlib.nullcontext() if micro == 1 else model.no_sync():
                loss = nn.functional.cross_entropy(model(x), y)
                (loss / 2).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, full_weights(module)


def test_shard_model_in_a_hand_written_loop_equals_the_ddp_loop(ranks) -> None:
    for (fsdp_losses, fsdp_weights), (ddp_losses, ddp_weights) in zip(
        ranks.run(hand_loop, 10), ranks.run(hand_loop_ddp, 10), strict=True
    ):
        assert_close_losses(ddp_losses, fsdp_losses)
        torch.testing.assert_close(fsdp_weights, ddp_weights, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Real launches: `python script.py` (fit starts the processes) and two torchrun agents (c10d)


def test_python_launch_and_two_torchrun_agents_train_the_same_fsdp_job(tmp_path) -> None:
    script = str(SCRIPTS / "train_fsdp.py")
    env = job_env()
    launched = tmp_path / "python"
    launched.mkdir()
    # All three at once: most of a launch's time is start-up and rendezvous waits, not compute.
    python_launch = subprocess.Popen(
        [sys.executable, script, str(launched), "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    port = free_port()
    two_nodes = tmp_path / "torchrun"
    two_nodes.mkdir()
    agents = [
        subprocess.Popen(
            torchrun(
                script,
                str(two_nodes),
                "auto",
                options=[
                    "--nnodes=2",
                    f"--node-rank={node}",
                    "--nproc-per-node=1",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}",
                    "--rdzv-id=distkit-fsdp-two-node",
                    "--local-addr=127.0.0.1",
                ],
            ),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for node in (0, 1)
    ]
    for process in [python_launch, *agents]:
        out, _ = process.communicate(timeout=300)
        assert process.returncode == 0, out.decode(errors="replace")[-3000:]
    python_run = json.loads((launched / "result.json").read_text())
    torchrun_run = json.loads((two_nodes / "result.json").read_text())
    assert python_run["step"] == torchrun_run["step"] == 6
    assert len(python_run["losses"]) == 6
    # The launching process took over rank 0's final state: full weights and a full optimizer state
    # (every exp_avg as large as its parameter), the same job as under two torchrun agents.
    assert python_run["losses"] == torchrun_run["losses"]
    assert python_run["weights"] == torchrun_run["weights"]
    assert python_run["exp_avg_shapes"] == torchrun_run["exp_avg_shapes"]
    sizes = sorted(math.prod(shape) for shape in python_run["exp_avg_shapes"].values())
    assert sizes == sorted(len(w) for w in python_run["weights"])


# --------------------------------------------------------------------------------------------------
# torch.compile


def compiled_run(tmp: str, strategy: object) -> tuple[list[float], list[str], bool]:
    losses, model = fit(tmp, strategy, steps=3, compile=True)
    compiled = any("forward" in vars(m) for m in model.modules())  # a compiled forward on an instance
    return losses, sorted(model.state_dict()), compiled


def test_compile_for_ddp_and_fsdp_keeps_the_losses_and_the_parameter_names(ranks, tmp_path) -> None:
    eager = ranks.run(train, str(tmp_path / "eager"), "ddp", steps=3)
    ddp = ranks.run(compiled_run, str(tmp_path / "ddp"), "ddp", timeout_s=600)
    fsdp = ranks.run(compiled_run, str(tmp_path / "fsdp"), MLP_UNITS, timeout_s=600)
    names = sorted(MLP().state_dict())
    for (eager_losses, _), (ddp_losses, ddp_names, ddp_compiled), (
        fsdp_losses,
        fsdp_names,
        fsdp_compiled,
    ) in zip(eager, ddp, fsdp, strict=True):
        assert_close_losses(eager_losses, ddp_losses)
        assert_close_losses(eager_losses, fsdp_losses)
        assert ddp_names == fsdp_names == names  # no "_orig_mod." anywhere
        assert not ddp_compiled  # fit put the user's module back as it was
        assert fsdp_compiled  # the sharding units stay compiled, as shard_model leaves them


# --------------------------------------------------------------------------------------------------
# Checkpoints: sharded through the CheckpointManager, resumed bitwise at the same world size


def fsdp_resumable(
    tmp: str, max_steps: int, resume: str | None, model_name: str = "mlp"
) -> tuple[list[float], torch.Tensor, list[str], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = BatchNormMLP() if model_name == "bn" else MLP()
    record = RecordLosses()
    trainer = quiet_trainer(
        tmp,
        strategy=MLP_UNITS,
        max_steps=max_steps,
        batch_size=16,
        resume=resume,
        enable_checkpointing=True,
        callbacks=[record, ModelCheckpoint(every_n_steps=3, every_n_epochs=0)],
    )
    trainer.fit(
        model,
        Vectors(1024),  # 32 steps per epoch: every checkpoint is mid-epoch
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        loss_fn=nn.functional.cross_entropy,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
    )
    files = sorted(os.listdir(os.path.join(tmp, "checkpoints", "step_000000003")))
    return record.losses, full_weights(model), files, buffers(model)


def test_fsdp_checkpoints_are_sharded_and_a_resumed_run_is_bitwise_the_uninterrupted_one(
    ranks, tmp_path
) -> None:
    # BatchNorm in train mode: FSDP leaves buffers rank-local and a checkpoint holds one copy, so
    # a resumed rank 1 would start from rank 0's running statistics unless the Trainer keeps the
    # ranks' buffers equal at every step boundary.
    uninterrupted = ranks.run(fsdp_resumable, str(tmp_path / "a"), 8, None, "bn")
    ranks.run(fsdp_resumable, str(tmp_path / "b"), 4, None, "bn")  # "killed" after step 4: last checkpoint 3
    resumed = ranks.run(fsdp_resumable, str(tmp_path / "b"), 8, "auto", "bn")
    for rank, (
        (losses, weights, files, bufs),
        (resumed_losses, resumed_weights, _, resumed_bufs),
    ) in enumerate(zip(uninterrupted, resumed, strict=True)):
        assert any(name.endswith(".distcp") for name in files)  # every rank wrote its shards
        assert resumed_losses == losses[3:]  # steps 4..8, bitwise
        assert torch.equal(resumed_weights, weights)
        assert sorted(bufs) == sorted(resumed_bufs) and len(bufs) == 9  # 3 BatchNorms x 3 buffers
        for name, value in bufs.items():
            assert torch.equal(resumed_bufs[name], value), (
                f"rank {rank}: buffer {name} of the resumed run differs from the uninterrupted run's"
            )


def batchnorm_buffers(tmp: str, strategy: object, steps: int, **kwargs: object) -> dict[str, torch.Tensor]:
    _, model = fit(tmp, strategy, "bn", steps=steps, **kwargs)
    return buffers(model)


def test_fsdp_keeps_every_ranks_buffers_equal_to_rank_0s_as_ddp_broadcasts_them(ranks, tmp_path) -> None:
    # DDP broadcasts rank 0's buffers before each forward; FSDP2 leaves them rank-local, so each
    # rank's running statistics would follow its own batches (and evaluation would differ by rank).
    ddp = ranks.run(batchnorm_buffers, str(tmp_path / "ddp"), "ddp", 6, accumulate_grad_batches=2)
    sharded = ranks.run(batchnorm_buffers, str(tmp_path / "fsdp"), MLP_UNITS, 6, accumulate_grad_batches=2)
    local = FSDPStrategy(min_unit_params=4000, broadcast_buffers=False)
    left_alone = ranks.run(batchnorm_buffers, str(tmp_path / "local"), local, 6, accumulate_grad_batches=2)
    # broadcast_buffers=False is FSDP2's own behaviour: each rank's statistics follow its batches.
    assert not torch.equal(left_alone[0]["blocks.0.1.running_mean"], left_alone[1]["blocks.0.1.running_mean"])
    for name, value in sharded[0].items():
        assert torch.equal(sharded[1][name], value), (
            f"buffer {name} differs between rank 0 and rank 1 after an FSDP fit: the ranks' buffers "
            f"are not kept in sync"
        )
        # Rank 0's statistics follow rank 0's batches alone, as under DDP (up to float rounding:
        # the parameters before each BatchNorm are equal within 1e-5, not bitwise).
        torch.testing.assert_close(value.double(), ddp[0][name].double(), rtol=1e-4, atol=1e-6)
    assert not torch.equal(sharded[0]["blocks.0.1.running_mean"], BatchNormMLP().blocks[0][1].running_mean)


class InspectBatchNorm(Callback):
    def on_fit_start(self, trainer: Trainer) -> None:
        from torch.distributed.fsdp import FSDPModule

        model = trainer.model
        assert model is not None
        self.policies = {
            name: m._get_fsdp_state()._mp_policy
            for name, m in model.named_modules()
            if isinstance(m, FSDPModule)
        }
        self.norm_dtypes: set[torch.dtype] = set()
        self.after_norm: set[torch.dtype] = set()
        # Forward hooks see the input after FSDP's cast and the output after its cast back.
        model.blocks[0][1].register_forward_hook(lambda m, i, o: self.norm_dtypes.add(i[0].dtype))
        model.blocks[0][2].register_forward_hook(lambda m, i, o: self.after_norm.add(i[0].dtype))
        self.losses: list[float] = []

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        self.losses.append(loss.item())


def bf16_batchnorm(tmp: str) -> dict[str, object]:
    inspect = InspectBatchNorm()
    _, model = fit(tmp, MLP_UNITS, "bn", steps=20, precision="bf16-mixed", callbacks=[inspect])
    seen = {k: v for k, v in vars(inspect).items()}
    seen["buffer_dtypes"] = {b.dtype for b in model.buffers()}
    return seen


def test_bf16_mixed_fsdp_keeps_batchnorm_in_float32_and_trains(ranks, tmp_path) -> None:
    # CPU kernels refuse a bfloat16 input with float32 running statistics; each BatchNorm becomes a
    # unit of its own that computes in float32 and hands bfloat16 on to the next layer.
    float32 = ranks.run(train, str(tmp_path / "fp32"), MLP_UNITS, "bn", steps=20)
    for seen, (losses, _) in zip(ranks.run(bf16_batchnorm, str(tmp_path / "bf16")), float32, strict=True):
        norms = {name for name in seen["policies"] if name.count(".") == 2}  # blocks.N.1
        assert norms == {"blocks.0.1", "blocks.1.1", "blocks.2.1"}
        for name, policy in seen["policies"].items():
            expected = (torch.float32, torch.float32) if name in norms else (torch.bfloat16, torch.float32)
            assert (policy.param_dtype, policy.reduce_dtype) == expected, name
        assert seen["norm_dtypes"] == {torch.float32}  # input cast up: computed in float32
        assert seen["after_norm"] == {torch.bfloat16}  # handed on in the next layer's dtype
        assert seen["buffer_dtypes"] == {torch.float32, torch.int64}
        # The float32 run's losses within bfloat16's rounding at every step: it trains alike.
        assert_close_losses(losses, seen["losses"], rtol=2e-2)


class TermOnRankOne(Callback):
    """SIGTERM to rank 1 after ``step``, as a scheduler preempting the job would send it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        if trainer.global_step == self.step and distkit.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def fsdp_preempted(tmp: str, term_step: int) -> tuple[int | None, int, list[str]]:
    torch.manual_seed(0)
    model = MLP()
    trainer = quiet_trainer(
        tmp,
        strategy=MLP_UNITS,
        max_steps=8,
        batch_size=16,
        enable_checkpointing=True,
        callbacks=[TermOnRankOne(term_step), ModelCheckpoint(every_n_steps=100, every_n_epochs=0)],
    )
    code = None
    try:
        trainer.fit(
            model,
            Vectors(1024),
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
            loss_fn=nn.functional.cross_entropy,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
        )
    except SystemExit as stop:  # what a preempted fit ends with: exit code 0 once the checkpoint is saved
        code = stop.code  # type: ignore[assignment]
    return code, trainer.global_step, sorted(os.listdir(os.path.join(tmp, "checkpoints")))


def test_sigterm_on_one_rank_under_fsdp_saves_a_sharded_checkpoint_and_resumes_bitwise(
    ranks, tmp_path
) -> None:
    # Rank 1 gets SIGTERM after step 3: the next step tells every rank and is discarded, every rank
    # saves its shards of step 3 and ends with exit code 0; resumed, the run ends where an
    # uninterrupted one does.
    for code, step, steps in ranks.run(fsdp_preempted, str(tmp_path / "b"), 3):
        assert (code, step, steps) == (0, 3, ["step_000000003"])
    uninterrupted = ranks.run(fsdp_resumable, str(tmp_path / "a"), 8, None)
    resumed = ranks.run(fsdp_resumable, str(tmp_path / "b"), 8, "auto")
    for (losses, weights, _, _), (resumed_losses, resumed_weights, _, _) in zip(
        uninterrupted, resumed, strict=True
    ):
        assert resumed_losses == losses[3:]
        assert torch.equal(resumed_weights, weights)

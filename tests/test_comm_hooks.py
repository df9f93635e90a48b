"""Gradient compression on real 2-rank gloo groups: ``DDPStrategy(comm_hook="fp16" | "bf16" |
"powersgd")`` trains, keeps the ranks equal, works with accumulation and clipping, skips a rank's
nan on every rank, and resumes bitwise (PowerSGD's error feedback and warm start in the
checkpoint); ``FSDPStrategy(reduce_dtype=...)``, FSDP's counterpart, trains too."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

import distkit
from distkit.trainer import Callback, DDPStrategy, FSDPStrategy, ModelCheckpoint, Trainer
from distkit.trainer.precision import Precision
from distkit.trainer.strategies._comm import PowerSGD, bf16_allreduce_hook

HOOKS = ["fp16", "bf16", "powersgd"]
REDUCE_DTYPES = ["bf16", "fp16"]
# 192 samples per rank, 16 per batch, 2 batches per step: 6 optimizer steps per epoch.
SAMPLES, BATCH, ACCUMULATE = 384, 16, 2
STEPS = 24
WARMUP = 4  # PowerSGD compresses from step 5 on
# The largest ratio of a hook's final loss to the float32 all-reduce's that the tests accept.
LOSS_RATIO = {"fp16": 1.01, "bf16": 1.01, "powersgd": 3.0}


class Regression(Dataset):  # type: ignore[type-arg]
    """y = x A + noise: a problem a small network learns well (the loss falls about 10x)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, 16, generator=generator)
        weights = torch.randn(16, 8, generator=generator) / 4
        self.y = self.x @ weights + 0.01 * torch.randn(SAMPLES, 8, generator=generator)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]

    def __len__(self) -> int:
        return SAMPLES


class Net(nn.Module):
    """The head is registered before the body it follows: DDP's first bucket layout (registration
    order) differs from the one it rebuilds after the first step (gradient-ready order)."""

    def __init__(self, nan_batches: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.head = nn.Linear(32, 8)
        self.body = nn.Linear(16, 32)
        # Rank 1's loss is nan at these micro-batches of the run (counted across epochs).
        self.nan_batches = nan_batches
        self.batches = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if distkit.get_rank() == 1 and self.batches in self.nan_batches:
            loss = loss * math.nan
        self.batches += 1
        return loss


class Record(Callback):
    def __init__(self, stop_after: int | None = None) -> None:
        self.losses: list[float] = []
        self.stop_after = stop_after

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        self.losses.append(loss.item())
        if distkit.get_rank() == 1 and trainer.global_step == self.stop_after:
            trainer.should_stop = True  # reaches rank 0 in the next step, which is discarded


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def strategy_of(hook: str | None, **options: Any) -> DDPStrategy:
    # 1 KB buckets: DDP rebuilds its one first bucket into one per layer, and PowerSGD reduces
    # several buckets per step (whose all-reduces once went out in different orders on the ranks).
    options = {"bucket_cap_mb": 0.001, **options}
    if hook == "powersgd":
        options = {"powersgd_rank": 1, "powersgd_warmup_steps": WARMUP, **options}
    return DDPStrategy(comm_hook=hook, **options)


def train(
    root: str,
    strategy: object,
    *,
    resume: str | None = None,
    stop_after: int | None = None,
    nan_batches: tuple[int, ...] = (),
    max_steps: int = STEPS,
) -> dict[str, Any]:
    """Fit on every rank of the pool: this rank's step losses, weights and skipped steps."""
    torch.manual_seed(0)
    model = Net(nan_batches)
    record = Record(stop_after)
    callbacks: list[Callback] = [record]
    if resume is not None or stop_after is not None:
        callbacks.append(ModelCheckpoint(every_n_steps=None, every_n_epochs=1))
    trainer = Trainer(
        strategy=strategy,
        max_steps=max_steps,
        batch_size=BATCH,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=1.0,
        seed=3,
        resume=resume,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=resume is not None or stop_after is not None,
        callbacks=callbacks,
        hang_timeout_s=None,
    )
    trainer.fit(
        model,
        Regression(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    )
    return {
        "losses": record.losses,
        "weights": flat_weights(model),
        "skipped": trainer.skipped_steps,
        "steps": trainer.global_step,
    }


def mean_tail(losses: list[float], n: int = 4) -> float:
    return sum(losses[-n:]) / n


# --------------------------------------------------------------------------------------------------
# Training and exact resume, with accumulation and clipping


@pytest.mark.parametrize("hook", HOOKS)
def test_compressed_training_converges_and_a_stopped_run_resumes_bitwise(ranks, tmp_path, hook) -> None:
    strategy = strategy_of(hook)
    plain = ranks.run(train, str(tmp_path / "plain"), strategy_of(None))
    whole = ranks.run(train, str(tmp_path / "whole"), strategy)
    for result, exact in zip(whole, plain, strict=True):  # this rank's losses, with and without
        losses, baseline = result["losses"], mean_tail(exact["losses"])
        assert len(losses) == STEPS and mean_tail(losses) < 0.2 * losses[0], (
            f"comm_hook={hook!r}: the loss went from {losses[0]:.4f} to {mean_tail(losses):.4f} in "
            f"{STEPS} steps (float32 all-reduce: {baseline:.4f})"
        )
        # What compression costs here (measured: fp16 and bf16 within 0.1% of the float32
        # all-reduce's loss after 24 steps, PowerSGD of rank 1 2.2x, as a rank-8 target needs more).
        assert mean_tail(losses) < LOSS_RATIO[hook] * baseline
    assert torch.equal(whole[0]["weights"], whole[1]["weights"])  # every rank applied the same update
    assert not torch.equal(whole[0]["weights"], plain[0]["weights"])  # the hook did run

    # Rank 1 asks to stop after step 9 (mid-epoch, PowerSGD compressing since step 5): step 10 is
    # discarded, its reduction already ran. The checkpoint then written resumes to the same run.
    root = tmp_path / "stopped"
    stopped = ranks.run(train, str(root), strategy, stop_after=9)
    assert [r["steps"] for r in stopped] == [9, 9]
    saved = distkit.load_checkpoint(str(root / "checkpoints" / "step_000000009"))
    assert ("comm_hook" in saved) == (hook == "powersgd")  # only a stateful hook adds an entry
    resumed = ranks.run(train, str(root), strategy, resume="auto")
    for rank in range(2):
        assert stopped[rank]["losses"] == whole[rank]["losses"][:9]
        assert resumed[rank]["losses"] == whole[rank]["losses"][9:], (
            f"comm_hook={hook!r}, rank {rank}: the resumed losses differ from the uninterrupted run's"
        )
        assert torch.equal(resumed[rank]["weights"], whole[rank]["weights"])


def test_powersgd_checkpoint_holds_every_ranks_error_feedback_per_parameter(ranks, tmp_path) -> None:
    root = tmp_path / "run"
    ranks.run(train, str(root), strategy_of("powersgd"), stop_after=9)
    saved = distkit.load_checkpoint(str(root / "checkpoints" / "step_000000009"))["comm_hook"]
    assert saved["iter"] == 9 and saved["world_size"] == 2 and saved["rank"] == 1
    # The weight matrices are compressed (rank 1: a Q of m x 1); the biases are reduced plainly.
    assert {name: tuple(q.shape) for name, q in saved["q"].items()} == {
        "module.head.weight": (32, 1),
        "module.body.weight": (16, 1),
    }
    names = {"module.head.weight", "module.head.bias", "module.body.weight", "module.body.bias"}
    assert [set(errors) for errors in saved["errors"]] == [names, names]
    # Each rank's residual is its own: what compression left out of its gradient.
    assert not torch.equal(saved["errors"][0]["module.body.weight"], saved["errors"][1]["module.body.weight"])


# --------------------------------------------------------------------------------------------------
# A nan on one rank is skipped on every rank, and leaves PowerSGD's state unharmed


@pytest.mark.parametrize("hook", HOOKS)
def test_a_nan_loss_on_one_rank_is_skipped_on_every_rank_and_training_goes_on(ranks, tmp_path, hook) -> None:
    # Batch 14 is the first (no_sync) micro-batch of step 8, after PowerSGD started.
    results = ranks.run(train, str(tmp_path), strategy_of(hook), nan_batches=(14,))
    for result in results:
        assert result["skipped"] == 1 and result["steps"] == STEPS
        losses = result["losses"]
        assert all(math.isfinite(loss) for i, loss in enumerate(losses) if i != 7)
        assert torch.isfinite(result["weights"]).all()
        # Under PowerSGD the nan went through the error feedback and Q of every rank: had the
        # skipped step not put them back, every later step would be nan too.
        assert mean_tail(losses) < 0.2 * losses[0]
    assert torch.equal(results[0]["weights"], results[1]["weights"])


# --------------------------------------------------------------------------------------------------
# The hooks themselves


def bf16_average(values: list[float]) -> dict[str, torch.Tensor]:
    """Run the bf16 hook's all-reduce on a bucket-like object; the result and the reference."""

    class Bucket:
        def __init__(self, buffer: torch.Tensor) -> None:
            self._buffer = buffer

        def buffer(self) -> torch.Tensor:
            return self._buffer

    rank = dist.get_rank()
    mine = torch.tensor(values) * (rank + 1)
    reduced = bf16_allreduce_hook(None, Bucket(mine.clone())).wait()  # type: ignore[arg-type]
    parts = [(torch.tensor(values) * (r + 1)).to(torch.bfloat16) / 2 for r in range(2)]
    return {"reduced": reduced, "expected": (parts[0] + parts[1]).float()}


def test_the_bf16_hook_averages_on_gloo_as_bfloat16_arithmetic_does(ranks) -> None:
    values = [1.0, 3.5, 1e-3, 300.0, -2.25, 1e30, math.nan]
    for result in ranks.run(bf16_average, values):
        assert result["reduced"].dtype == torch.float32
        torch.testing.assert_close(result["reduced"], result["expected"], rtol=0, atol=0, equal_nan=True)
        assert math.isnan(result["reduced"][-1].item())  # a nan survives the cast and the sum


# --------------------------------------------------------------------------------------------------
# FSDP's counterpart


def train_fsdp(root: str, reduce_dtype: str | None) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = Net()
    record = Record()
    trainer = Trainer(
        strategy=FSDPStrategy(reduce_dtype=reduce_dtype),
        max_steps=12,
        batch_size=BATCH,
        seed=3,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[record],
    )
    trainer.fit(model, Regression(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    dtypes = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
    weights = torch.cat(
        [(p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1) for p in model.parameters()]
    )
    return {"losses": record.losses, "weights": weights, "dtypes": dtypes}


def test_fsdp_reduce_dtype_trains_with_half_precision_reductions(ranks, tmp_path) -> None:
    exact = ranks.run(train_fsdp, str(tmp_path / "a"), None)
    for dtype in REDUCE_DTYPES:
        results = ranks.run(train_fsdp, str(tmp_path / dtype), dtype)
        for result in results:
            losses = result["losses"]
            assert mean_tail(losses) < 0.5 * losses[0]
            assert result["dtypes"] <= {"torch.float32"}  # the sharded gradients stay float32
        assert torch.equal(results[0]["weights"], results[1]["weights"])
        assert not torch.equal(results[0]["weights"], exact[0]["weights"])  # reduced in `dtype`
        assert torch.allclose(results[0]["weights"], exact[0]["weights"], atol=0.05)


# --------------------------------------------------------------------------------------------------
# Options


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"comm_hook": "int8"},
            "comm_hook must be None (a float32 all-reduce), 'fp16', 'bf16', 'powersgd', got 'int8'",
        ),
        (
            {"comm_hook": "powersgd", "powersgd_rank": 0},
            "powersgd_rank must be an int >= 1 or None (1), got 0",
        ),
        ({"comm_hook": "powersgd", "powersgd_rank": 1.5}, "powersgd_rank must be an int >= 1"),
        ({"comm_hook": "powersgd", "powersgd_warmup_steps": 1}, "powersgd_warmup_steps must be an int >= 2"),
        ({"comm_hook": "fp16", "powersgd_rank": 2}, "powersgd_rank apply to comm_hook='powersgd' only"),
        (
            {"powersgd_warmup_steps": 10},
            "powersgd_warmup_steps apply to comm_hook='powersgd' only, got comm_hook=None",
        ),
    ],
)
def test_bad_compression_options_are_refused_with_the_value_and_the_choices(options, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        DDPStrategy(**options)


def test_bad_fsdp_reduce_dtype_is_refused_with_the_value_and_the_choices() -> None:
    with pytest.raises(
        ValueError, match=r"reduce_dtype must be None \(float32\), 'bf16' or 'fp16'.*got 'fp8'"
    ):
        FSDPStrategy(reduce_dtype="fp8")


def test_powersgd_state_saved_on_two_ranks_resumes_in_a_world_of_one_with_their_mean_error() -> None:
    errors = [{"w": torch.full((2, 3), 1.0)}, {"w": torch.full((2, 3), 3.0)}]
    hook = PowerSGD(rank=1, warmup_steps=2)
    hook.load_state_dict(
        {"iter": 7, "rank": 1, "world_size": 2, "q": {"w": torch.ones(3, 1)}, "errors": errors}
    )
    state = hook.state_dict()
    assert state["iter"] == 7 and state["world_size"] == 1
    assert torch.equal(state["errors"][0]["w"], torch.full((2, 3), 2.0))
    assert torch.equal(state["q"]["w"], torch.ones(3, 1))


def test_the_loop_learns_when_the_fp16_scaler_skipped_a_step() -> None:
    # Under precision="16-mixed" (CUDA) a step the scaler skips must put PowerSGD's state back
    # too; the scaler is the same on the CPU.
    precision = Precision("32", torch.device("cpu"))
    precision.scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    weight = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    taken = []
    for factor in [1.0, math.inf, 1.0, math.nan]:
        precision.backward((weight * factor).sum())
        taken.append(precision.step_and_report(optimizer))
        optimizer.zero_grad()
    assert taken == [True, False, True, False]  # the scale grew after each taken step

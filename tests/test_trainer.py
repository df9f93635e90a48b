"""The Trainer on real 2-rank gloo groups, real files and real torchrun jobs: equivalence with
hand-written loops, accumulation and clipping, non-finite steps, logging, callbacks, exact resume,
preemption and restart after a SIGKILL."""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import math
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import distkit
from _launch import job_env, torchrun
from distkit.checkpoint import ForeignCheckpointError
from distkit.errors import DistkitError
from distkit.trainer import (
    Callback,
    CSVLogger,
    DDPStrategy,
    EarlyStopping,
    LearningRateMonitor,
    Logger,
    ModelCheckpoint,
    TensorBoardLogger,
    ThroughputMonitor,
    TorchProfiler,
    Trainer,
    accuracy,
)

SCRIPTS = pathlib.Path(__file__).parent / "trainer_scripts"


# --------------------------------------------------------------------------------------------------
# The model and data of seed 002's single-file DDP example (smaller, so tests stay fast)


class SimpleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class RandomDataset(Dataset):  # type: ignore[type-arg]
    def __init__(self, size: int, length: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.len = length
        self.data = torch.randn(length, size, generator=generator)
        self.targets = torch.randint(0, 10, (length,), generator=generator)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index], self.targets[index]

    def __len__(self) -> int:
        return self.len


class RecordLosses(Callback):
    """Keeps every step's local loss (as the hand-written loops print it) and the weights after it."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.weights: list[torch.Tensor] = []

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        self.losses.append(loss.item())
        self.weights.append(flat_weights(trainer.model))


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def quiet_trainer(tmp: str, **kwargs: object) -> Trainer:
    options: dict[str, object] = {
        "default_root_dir": tmp,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
    }
    options.update(kwargs)
    return Trainer(**options)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Equivalence with hand-written loops


def handwritten_ddp(epochs: int, accumulate: int, clip: float | None) -> tuple[list[float], torch.Tensor]:
    # Seed 002's loop: DistributedSampler + DataLoader, DDP, Adam, CrossEntropyLoss; with
    # accumulation as in its no_sync() section (stepping every N micro-batches and at epoch end).
    rank, world_size = distkit.get_rank(), distkit.get_world_size()
    torch.manual_seed(0)
    model = DDP(SimpleModel())
    dataset = RandomDataset(20, 328)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    criterion = nn.CrossEntropyLoss()
    losses: list[float] = []
    micro: list[torch.Tensor] = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for i, (data, target) in enumerate(loader):
            last = (i + 1) % accumulate == 0 or i + 1 == len(loader)
            with contextlib.nullcontext() if last else model.no_sync():
                loss = criterion(model(data), target)
                (loss / accumulate if accumulate > 1 else loss).backward()
            micro.append(loss.detach())
            if not last:
                continue
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(torch.stack(micro).mean().item())
            micro = []
    return losses, flat_weights(model.module)


def trainer_ddp(
    tmp: str, epochs: int, accumulate: int, clip: float | None
) -> tuple[list[float], torch.Tensor]:
    rank, world_size = distkit.get_rank(), distkit.get_world_size()
    torch.manual_seed(0)
    model = SimpleModel()
    dataset = RandomDataset(20, 328)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    record = RecordLosses()
    trainer = quiet_trainer(
        tmp,
        strategy="ddp",
        devices=2,
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        callbacks=[record],
    )
    trainer.fit(
        model,
        loader,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.001),
        loss_fn=nn.CrossEntropyLoss(),
    )
    return record.losses, flat_weights(model)


def test_ddp_trainer_matches_handwritten_ddp_loop_bitwise(ranks, tmp_path) -> None:
    expected = ranks.run(handwritten_ddp, 2, 1, None)
    got = ranks.run(trainer_ddp, str(tmp_path), 2, 1, None)
    for (want_losses, want_weights), (losses, weights) in zip(expected, got, strict=True):
        assert len(losses) == 2 * 6
        assert losses == want_losses  # every step's loss on every rank, bitwise
        assert torch.equal(weights, want_weights)


def test_accumulation_with_clipping_matches_handwritten_no_sync_loop_bitwise(ranks, tmp_path) -> None:
    # 6 batches per epoch and N=4: a full step of 4 micro-batches, then a partial one of 2 at the
    # epoch's end; clipping by norm on each optimizer step only.
    expected = ranks.run(handwritten_ddp, 2, 4, 0.05)
    got = ranks.run(trainer_ddp, str(tmp_path), 2, 4, 0.05)
    for (want_losses, want_weights), (losses, weights) in zip(expected, got, strict=True):
        assert len(losses) == 2 * 2
        assert losses == want_losses
        assert torch.equal(weights, want_weights)


def gradient_all_reduces(tmp: str) -> tuple[int, int]:
    """The gloo all-reduces of DDP fits of 2 and of 4 optimizer steps of 4 micro-batches each."""
    counts = []
    for steps in (2, 4):
        torch.manual_seed(0)
        model = SimpleModel()  # about 2,000 parameters: one DDP bucket, so one all-reduce per sync
        trainer = quiet_trainer(
            tmp, strategy="ddp", max_steps=steps, accumulate_grad_batches=4, log_every_n_steps=1000
        )
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.fit(
                model,
                RandomDataset(20, 2048),  # 32 batches per rank: 4 steps stay inside the first epoch
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                loss_fn=nn.functional.cross_entropy,
            )
        counts.append(sum(1 for event in prof.events() if event.name == "gloo:all_reduce"))
    return counts[0], counts[1]


def test_accumulation_syncs_gradients_once_per_optimizer_step(ranks, tmp_path) -> None:
    # Two more steps of 4 micro-batches add 8 backward passes but only 2 all-reduces: the 3
    # micro-batches before each step's last run under no_sync. What a fit does once (start-up,
    # the end) is the same in both fits and cancels out.
    results = ranks.run(gradient_all_reduces, str(tmp_path))
    assert [four - two for two, four in results] == [2, 2], results


def test_single_trainer_matches_handwritten_single_loop_bitwise(tmp_path) -> None:
    dataset = RandomDataset(20, 200)

    torch.manual_seed(0)
    model = SimpleModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(5))
    expected = []
    for _ in range(2):
        for data, target in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            expected.append(loss.item())
    expected_weights = flat_weights(model)

    torch.manual_seed(0)
    model = SimpleModel()
    record = RecordLosses()
    loader = DataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(5))
    trainer = quiet_trainer(str(tmp_path), strategy="single", max_epochs=2, callbacks=[record])
    trainer.fit(
        model,
        loader,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        loss_fn=nn.functional.cross_entropy,
    )
    assert record.losses == expected
    assert torch.equal(flat_weights(model), expected_weights)


# --------------------------------------------------------------------------------------------------
# Non-finite losses: skipped on every rank alike, counted, and fatal when they keep coming


class PoisonedModel(SimpleModel):
    """Makes the loss nan on `rank` at the given batch indices (within the first epoch)."""

    def __init__(self, rank: int, poisoned: set[int]) -> None:
        super().__init__()
        self.poison_rank = rank
        self.poisoned = poisoned

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        data, target = batch
        loss = nn.functional.cross_entropy(self(data), target)
        if distkit.get_rank() == self.poison_rank and batch_idx in self.poisoned:
            loss = self.poison(loss)
        return loss

    def poison(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * math.nan


class WideBiasPoisonedModel(PoisonedModel):
    """Its shortest bias has 40 elements: DDP reads the sentinel by indexing, not with tolist()."""

    def __init__(self, rank: int, poisoned: set[int]) -> None:
        super().__init__(rank, poisoned)
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 40))


class NoBiasPoisonedModel(PoisonedModel):
    """No one-dimensional parameter: the sentinel is a weight matrix."""

    def __init__(self, rank: int, poisoned: set[int]) -> None:
        super().__init__(rank, poisoned)
        self.net = nn.Sequential(nn.Linear(20, 64, bias=False), nn.ReLU(), nn.Linear(64, 10, bias=False))


class OverflowModel(PoisonedModel):
    """A finite loss whose gradients are inf: the gradient of sqrt(w - w) at 0 is 1 / 0 (an
    overflow inside backward)."""

    def poison(self, loss: torch.Tensor) -> torch.Tensor:
        weight = self.net[2].weight
        return loss + torch.sqrt(weight - weight.detach()).sum()


class NonFiniteLossFiniteGradientsModel(PoisonedModel):
    """A loss that is inf or nan although every gradient is finite: a constant added to it (as a
    non-finite term that does not depend on the weights would be) changes no gradient."""

    constant = math.inf

    def poison(self, loss: torch.Tensor) -> torch.Tensor:
        return loss + self.constant


class NanLossFiniteGradientsModel(NonFiniteLossFiniteGradientsModel):
    constant = math.nan


class RankHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(20, 10), nn.Linear(20, 10)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads[distkit.get_rank()](x)


class TwoHeadModel(PoisonedModel):
    """Rank r trains head r only (find_unused_parameters): no parameter is used by both ranks."""

    def __init__(self, rank: int, poisoned: set[int]) -> None:
        super().__init__(rank, poisoned)
        self.net = RankHeads()


class RaiseOnNonFiniteWeights(Callback):
    """Checks this rank's weights after every step, on the rank itself: a non-finite step taken on
    one rank only fails there at once, instead of leaving the ranks in different collectives until
    the test's deadline."""

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        if not torch.isfinite(flat_weights(trainer.model)).all():
            raise AssertionError(
                f"[rank {distkit.get_rank()}] took a non-finite optimizer step: its weights are not "
                f"finite after step {trainer.global_step}"
            )


def train_poisoned(
    tmp: str, poisoned: set[int], max_consecutive: int, model_class: type = PoisonedModel, **options: object
) -> dict[str, object]:
    torch.manual_seed(0)
    model = model_class(rank=1, poisoned=poisoned)
    record = RecordLosses()
    trainer = quiet_trainer(
        tmp,
        **{"strategy": "ddp", "max_steps": 6, **options},
        max_consecutive_nonfinite=max_consecutive,
        callbacks=[RaiseOnNonFiniteWeights(), record],
    )
    try:
        trainer.fit(model, RandomDataset(20, 400), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    except DistkitError as err:
        return {"error": str(err), "skipped": trainer.skipped_steps}
    return {"skipped": trainer.skipped_steps, "weights": record.weights, "steps": trainer.global_step}


class _StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def test_the_lean_step_of_a_world_of_one_trains_as_the_general_step(tmp_path) -> None:
    # epoch.py takes a lean way through the steps of a world of one (a model with loss_fn, nothing
    # timed, no clipping; issue 29). profiler="simple" times the phases, which takes the general
    # way: both must give the same losses, weights, learning rates, skipped steps and stop.
    dataset = RandomDataset(20, 256)
    dataset.data[70] = math.nan  # the third batch's loss is non-finite: that step is skipped

    def fit(**options: object) -> tuple[RecordLosses, nn.Module, Trainer]:
        torch.manual_seed(0)
        model = SimpleModel()
        record = RecordLosses()
        trainer = quiet_trainer(
            str(tmp_path / str(len(options))),
            strategy="single",
            max_epochs=3,
            log_every_n_steps=4,
            callbacks=[record, _StopAt(17)],
            **options,
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        trainer.fit(
            model,
            DataLoader(dataset, batch_size=32),
            optimizer=optimizer,
            lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5),
            loss_fn=nn.functional.cross_entropy,
        )
        return record, model, trainer

    lean, lean_model, lean_trainer = fit()
    general, general_model, general_trainer = fit(profiler="simple")
    assert lean_trainer.global_step == general_trainer.global_step == 17
    assert lean_trainer.skipped_steps == general_trainer.skipped_steps == 2  # step 3 of each epoch
    assert len(lean.losses) == 17 and math.isnan(lean.losses[2]) and math.isnan(general.losses[2])
    assert torch.equal(torch.tensor(lean.losses).nan_to_num(), torch.tensor(general.losses).nan_to_num())
    assert all(torch.equal(a, b) for a, b in zip(lean.weights, general.weights, strict=True))
    assert torch.equal(flat_weights(lean_model), flat_weights(general_model))
    assert lean_trainer.optimizer.param_groups[0]["lr"] == general_trainer.optimizer.param_groups[0]["lr"]
    assert lean_trainer.callback_metrics == general_trainer.callback_metrics


@pytest.mark.parametrize(
    "model_class",
    [PoisonedModel, WideBiasPoisonedModel, NoBiasPoisonedModel],
    ids=["short-bias-sentinel", "wide-bias-sentinel", "matrix-sentinel"],
)
def test_nonfinite_loss_on_one_rank_skips_that_step_on_every_rank(ranks, tmp_path, model_class) -> None:
    # Each way DDP reads its sentinel (a short bias copied out, a longer one or a matrix indexed).
    results = ranks.run(train_poisoned, str(tmp_path), {2}, 3, model_class)
    for result in results:
        assert result["skipped"] == 1 and result["steps"] == 6
        weights = result["weights"]
        assert torch.equal(weights[2], weights[1])  # step 3 (batch 2) changed nothing
        assert not torch.equal(weights[3], weights[2])  # training went on
        assert all(torch.isfinite(w).all() for w in weights)
    assert torch.equal(results[0]["weights"][-1], results[1]["weights"][-1])


def test_nonfinite_loss_in_a_no_sync_micro_batch_skips_the_step_on_every_rank(ranks, tmp_path) -> None:
    # Two micro-batches per step: batch 4 is the first (no_sync) micro-batch of step 3.
    results = ranks.run(train_poisoned, str(tmp_path), {4}, 3, accumulate_grad_batches=2)
    for result in results:
        assert result["skipped"] == 1 and result["steps"] == 6
        weights = result["weights"]
        assert torch.equal(weights[2], weights[1]) and not torch.equal(weights[3], weights[2])
    assert torch.equal(results[0]["weights"][-1], results[1]["weights"][-1])


@pytest.mark.parametrize(
    "model_class", [NonFiniteLossFiniteGradientsModel, NanLossFiniteGradientsModel], ids=["inf", "nan"]
)
def test_a_nonfinite_loss_whose_gradients_are_finite_skips_that_step_on_every_rank(
    ranks, tmp_path, model_class
) -> None:
    # Rank 1's loss of step 3 is not finite but its gradients are: only the poisoned backward pass
    # of a rank whose loss is not finite tells the other rank to skip with it.
    results = ranks.run(train_poisoned, str(tmp_path), {2}, 3, model_class)
    for rank, result in enumerate(results):
        assert result["skipped"] == 1, (
            f"rank {rank} skipped {result['skipped']} steps, not step 3: rank 1's non-finite loss "
            f"(with finite gradients) did not poison its backward pass, so no rank saw it"
        )
        weights = result["weights"]
        assert result["steps"] == 6 and torch.equal(weights[2], weights[1])  # step 3 changed nothing
        assert not torch.equal(weights[3], weights[2])  # training went on
    assert torch.equal(results[0]["weights"][-1], results[1]["weights"][-1])


def test_nonfinite_loss_reaches_every_rank_when_the_ranks_use_disjoint_parameters(ranks, tmp_path) -> None:
    # find_unused_parameters: rank 1's nan lands in head 1 only, which rank 0 never uses.
    strategy = DDPStrategy(find_unused_parameters=True)
    results = ranks.run(train_poisoned, str(tmp_path), {2}, 3, TwoHeadModel, strategy=strategy)
    for result in results:
        assert result["skipped"] == 1 and result["steps"] == 6
        weights = result["weights"]
        assert torch.equal(weights[2], weights[1])
        assert all(torch.isfinite(w).all() for w in weights)


def test_overflowing_gradients_of_a_finite_loss_are_skipped_when_clipping(ranks, tmp_path) -> None:
    # The loss stays finite, so only the clipped norm (inf, the same on every rank) can tell.
    results = ranks.run(train_poisoned, str(tmp_path), {2}, 3, OverflowModel, gradient_clip_val=1.0)
    for result in results:
        assert result["skipped"] == 1 and result["steps"] == 6
        weights = result["weights"]
        assert torch.equal(weights[2], weights[1])
        assert all(torch.isfinite(w).all() for w in weights)
    assert torch.equal(results[0]["weights"][-1], results[1]["weights"][-1])


def test_consecutive_nonfinite_losses_raise_on_every_rank_with_the_step_numbers(ranks, tmp_path) -> None:
    results = ranks.run(train_poisoned, str(tmp_path), {1, 2, 3, 4}, 3)
    for result in results:
        assert result["skipped"] == 3
        assert "3 consecutive optimizer steps [2, 3, 4]" in result["error"]
        assert "rank(s) [1]" in result["error"]


# --------------------------------------------------------------------------------------------------
# Metrics: one collective per logging step, exact validation


class RankMetricModel(SimpleModel):
    """Reports its rank as an extra training metric, so the logged value shows the reduction."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, object]:
        data, target = batch
        loss = nn.functional.cross_entropy(self(data), target)
        return {"loss": loss, "rank_value": float(distkit.get_rank())}


class KeepLogged(Callback):
    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []

    def on_log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.logged.append(dict(metrics))


def collectives_per_run(tmp: str, log_every: int, extras: bool) -> dict[str, object]:
    torch.manual_seed(0)
    model = RankMetricModel() if extras else SimpleModel()
    record, keep = RecordLosses(), KeepLogged()
    trainer = quiet_trainer(
        tmp, strategy="ddp", max_steps=8, log_every_n_steps=log_every, callbacks=[record, keep]
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.fit(
            model,
            RandomDataset(20, 640),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=None if extras else nn.functional.cross_entropy,
        )
    count = sum(1 for event in prof.events() if event.name.startswith("gloo:"))
    return {"collectives": count, "logged": keep.logged, "losses": record.losses}


@pytest.mark.parametrize("extras", [True, False], ids=["extra-metrics", "loss-only"])
def test_logging_costs_one_collective_per_logging_step_and_reduces_across_ranks(
    ranks, tmp_path, extras
) -> None:
    every_step = ranks.run(collectives_per_run, str(tmp_path), 1, extras)
    never = ranks.run(collectives_per_run, str(tmp_path), 100, extras)
    for rank in range(2):
        assert every_step[rank]["collectives"] - never[rank]["collectives"] == 8  # 8 logging steps
        logged = every_step[rank]["logged"]
        if extras:
            assert [m["rank_value"] for m in logged] == [0.5] * 8  # mean of rank 0's 0 and rank 1's 1
        for step, metrics in enumerate(logged):
            # train_loss is the job's mean of the ranks' losses of that step (/2 is exact).
            mean = (every_step[0]["losses"][step] + every_step[1]["losses"][step]) / 2
            assert metrics["train_loss"] == pytest.approx(mean, rel=1e-6)
    assert never[0]["logged"] == []


def validation_metrics(tmp: str) -> dict[str, float]:
    torch.manual_seed(0)
    model = SimpleModel()
    val = RandomDataset(20, 37)  # 19 + 18 samples on the ranks: uneven, never padded
    trainer = quiet_trainer(tmp, strategy="ddp", max_epochs=1, val_batch_size=4)
    trainer.fit(
        model,
        RandomDataset(20, 64),
        val,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=nn.functional.cross_entropy,
        metrics={"acc": accuracy},
    )
    with torch.no_grad():
        output = model(val.data)
        exact = {
            "val_loss": nn.functional.cross_entropy(output, val.targets).item(),
            "val_acc": (output.argmax(1) == val.targets).float().mean().item(),
        }
    return {"logged": dict(trainer.callback_metrics), "exact": exact}


def test_validation_metrics_are_exact_over_every_sample_once(ranks, tmp_path) -> None:
    for result in ranks.run(validation_metrics, str(tmp_path)):
        for name, value in result["exact"].items():
            assert result["logged"][name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


# --------------------------------------------------------------------------------------------------
# Stopping together


class StopAfterStep(Callback):
    """Sets should_stop on one rank only, after the given step."""

    def __init__(self, rank: int, step: int = 3) -> None:
        self.rank, self.step = rank, step

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        if distkit.get_rank() == self.rank and trainer.global_step == self.step:
            trainer.should_stop = True


def stop_requested_on_one_rank(tmp: str, strategy: str = "ddp", rank: int = 1) -> int | str:
    torch.manual_seed(0)
    model = SimpleModel()
    # The hang doctor off: it would end a rank left waiting (exit 124) before this test could say why.
    trainer = quiet_trainer(
        tmp, strategy=strategy, max_epochs=5, callbacks=[StopAfterStep(rank)], hang_timeout_s=None
    )

    def fit() -> None:
        trainer.fit(
            model,
            RandomDataset(20, 640),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=nn.functional.cross_entropy,
        )

    if strategy == "single":
        fit()
        return trainer.global_step
    # In a thread: a rank that goes on training after another stopped waits in a collective that
    # never completes; the test then names it at once instead of the pool's deadline a minute later.
    runner = threading.Thread(target=fit, daemon=True)
    runner.start()
    runner.join(20.0)
    assert not runner.is_alive(), (
        f"rank {distkit.get_rank()} is still in fit 20 s after rank {rank} asked to stop after step 3 "
        f"(this rank is at step {trainer.global_step}): the stop request was not agreed across ranks"
    )
    return trainer.global_step


def test_should_stop_on_one_rank_stops_every_rank_after_that_step(ranks, tmp_path) -> None:
    # Rank 1 sets it after step 3: step 4 tells every rank and is discarded, as if a single process
    # had stopped after step 3.
    steps = ranks.run(stop_requested_on_one_rank, str(tmp_path))
    assert steps == [3, 3], (
        f"rank 1 asked to stop after step 3; the ranks ended at {steps}: the stop request was not "
        f"agreed across ranks"
    )


def test_should_stop_in_one_process_stops_after_that_step(tmp_path) -> None:
    assert stop_requested_on_one_rank(str(tmp_path), "single", 0) == 3


def early_stopping(tmp: str) -> tuple[int, int | None]:
    torch.manual_seed(0)
    model = SimpleModel()
    stopper = EarlyStopping("val_loss", patience=1)
    trainer = quiet_trainer(tmp, strategy="ddp", max_epochs=10, callbacks=[stopper])
    # lr=0: the validation loss never improves after the first epoch.
    trainer.fit(
        model,
        RandomDataset(20, 64),
        RandomDataset(20, 16),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        loss_fn=nn.functional.cross_entropy,
    )
    return trainer.current_epoch, stopper.stopped_epoch


def test_early_stopping_stops_every_rank_at_the_same_epoch(ranks, tmp_path) -> None:
    assert ranks.run(early_stopping, str(tmp_path)) == [(2, 1), (2, 1)]  # epochs run, stopped at


# --------------------------------------------------------------------------------------------------
# Exact resume: model, optimizer, scheduler, RNG (dropout) and the loader's mid-epoch position


class DropoutModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def resumable_run(
    directory: str,
    max_steps: int,
    resume: str | None,
    accumulate: int = 1,
    stop_after: int | None = None,
    every: tuple[int | None, int] = (3, 0),
) -> torch.Tensor:
    torch.manual_seed(0)
    model = DropoutModel()
    callbacks: list[Callback] = [ModelCheckpoint(every_n_steps=every[0], every_n_epochs=every[1])]
    if stop_after is not None:
        callbacks.insert(0, StopAfterStep(1, stop_after))
    trainer = quiet_trainer(
        directory,
        strategy="ddp",
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        seed=3,
        resume=resume,
        enable_checkpointing=True,
        callbacks=callbacks,
    )
    trainer.fit(
        model,
        RandomDataset(20, 320),  # 5 steps per epoch: step 3 is mid-epoch
        optimizer=lambda params: torch.optim.AdamW(params, lr=0.01),
        loss_fn=nn.functional.cross_entropy,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
    )
    return flat_weights(model)


def test_resume_auto_continues_exactly_where_the_checkpoint_stopped(ranks, tmp_path) -> None:
    uninterrupted = ranks.run(resumable_run, str(tmp_path / "a"), 8, None)
    ranks.run(resumable_run, str(tmp_path / "b"), 3, None)  # "killed" after step 3
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["step_000000003"]
    resumed = ranks.run(resumable_run, str(tmp_path / "b"), 8, "auto")
    # Dropout draws from the restored RNG and step 4 starts mid-epoch: equal only if both resumed.
    for want, got in zip(uninterrupted, resumed, strict=True):
        assert torch.equal(got, want)


def test_a_stop_request_gives_back_the_discarded_steps_batches_and_random_draws(ranks, tmp_path) -> None:
    # 5 batches per epoch and rank, 2 per step: steps 1-3 are epoch 0, steps 4-6 epoch 1. Rank 1
    # asks to stop after step 4; step 5 (batches 2 and 3 of epoch 1, two dropout draws) is discarded
    # and the epoch-end checkpoint records epoch 1 after batch 1. Resumed, the job ends with the
    # weights of a run that never stopped.
    kwargs = {"accumulate": 2, "every": (None, 1)}
    uninterrupted = ranks.run(resumable_run, str(tmp_path / "a"), 8, None, **kwargs)
    ranks.run(resumable_run, str(tmp_path / "b"), 8, None, stop_after=4, **kwargs)
    checkpoints = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert checkpoints == ["step_000000003", "step_000000004"]
    resumed = ranks.run(resumable_run, str(tmp_path / "b"), 8, "auto", **kwargs)
    for want, got in zip(uninterrupted, resumed, strict=True):
        assert torch.equal(got, want)


class ExtraMetricsModel(DropoutModel):
    """Logs two extra metrics that differ between ranks: a tensor (accuracy) and a float."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, object]:
        data, target = batch
        output = self(data)
        return {
            "loss": nn.functional.cross_entropy(output, target),
            "acc": (output.argmax(1) == target).float().mean(),
            "rank_batch": float(distkit.get_rank() * 100 + batch_idx),
        }


class Interrupt(Callback):
    """After step `step`: "crash" raises on every rank; "preempt" has rank 1 send itself SIGTERM."""

    def __init__(self, step: int, how: str) -> None:
        self.step, self.how = step, how

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        if trainer.global_step != self.step:
            return
        if self.how == "crash":
            raise RuntimeError(f"crash after step {self.step}")
        if distkit.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def logged_run(
    directory: str, max_steps: int, resume: str | None, interrupt: tuple[int, str] | None = None
) -> str:
    """2 ranks, 5 steps per epoch, a log every 2 steps and a checkpoint every 3, CSV and TensorBoard."""
    torch.manual_seed(0)
    model = ExtraMetricsModel()
    callbacks: list[Callback] = [ModelCheckpoint(every_n_steps=3, every_n_epochs=0, keep_last=10)]
    if interrupt is not None:
        callbacks.insert(0, Interrupt(*interrupt))
    trainer = Trainer(
        strategy="ddp",
        max_steps=max_steps,
        log_every_n_steps=2,
        seed=3,
        resume=resume,
        default_root_dir=directory,
        logger=[CSVLogger(), TensorBoardLogger()],
        enable_progress_bar=False,
        callbacks=callbacks,
    )
    try:
        trainer.fit(
            model,
            RandomDataset(20, 320),
            optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
            lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5),
        )
    except RuntimeError as err:
        return str(err)
    except SystemExit as exit:
        return f"exit {exit.code}"
    return f"finished at step {trainer.global_step}"


def tensorboard_scalars(directory: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_logs_of_a_run_interrupted_mid_epoch_and_resumed_equal_the_uninterrupted_runs(
    ranks, tmp_path
) -> None:
    # Epochs are steps 1-5, 6-10, 11-12; logs at every even step and at epoch ends. The first
    # attempt crashes after step 7 and resumes from the checkpoint of step 6, a logging step (its
    # TensorBoard point must survive the resume). The second is preempted after step 7 (rank 1 gets
    # SIGTERM; step 8 is discarded on every rank, its extra metrics given back) and saves step 7,
    # between two logging steps: the window then holds step 7 and the epoch sums steps 6-7, on
    # each rank its own. The third runs to the end.
    uninterrupted, interrupted = tmp_path / "a", tmp_path / "b"
    assert ranks.run(logged_run, str(uninterrupted), 12, None) == ["finished at step 12"] * 2
    assert ranks.run(logged_run, str(interrupted), 12, None, (7, "crash")) == ["crash after step 7"] * 2
    assert ranks.run(logged_run, str(interrupted), 12, "auto", (7, "preempt")) == ["exit 0"] * 2
    checkpoints = sorted(p.name for p in (interrupted / "checkpoints").iterdir())
    assert checkpoints == ["step_000000003", "step_000000006", "step_000000007"]
    assert ranks.run(logged_run, str(interrupted), 12, "auto") == ["finished at step 12"] * 2

    want_csv = (uninterrupted / "metrics.csv").read_text()
    assert (interrupted / "metrics.csv").read_text() == want_csv
    want = tensorboard_scalars(uninterrupted / "tensorboard")
    assert sorted(want) == ["acc", "epoch", "rank_batch", "skipped_steps", "train_loss", "train_loss_epoch"]
    assert [step for step, _ in want["train_loss"]] == [2, 4, 6, 8, 10, 12]
    assert tensorboard_scalars(interrupted / "tensorboard") == want

    # A checkpoint written before the partial sums were saved still resumes (with empty sums).
    state = distkit.load_checkpoint(interrupted / "checkpoints" / "step_000000007", map_location="cpu")
    state["counters"] = {"skipped_steps": state["counters"]["skipped_steps"]}
    old = distkit.save_checkpoint(tmp_path / "old" / "step_000000007", state, step=7)
    assert ranks.run(logged_run, str(tmp_path / "old"), 9, old) == ["finished at step 9"] * 2


def fresh_fit(directory: str, resume: str | None, overwrite: bool) -> tuple[str, int]:
    """A new run (3 steps, a checkpoint each step) in ``directory``; the refusal's text, or ''."""
    torch.manual_seed(1)
    model = DropoutModel()
    trainer = quiet_trainer(
        directory,
        strategy="ddp",
        max_steps=3,
        resume=resume,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(every_n_steps=1, keep_last=2, overwrite=overwrite)],
    )
    try:
        trainer.fit(
            model,
            RandomDataset(20, 320),
            # resumable_run's optimizer: a resume restores its state (another kind is refused).
            optimizer=lambda params: torch.optim.AdamW(params, lr=0.01),
            loss_fn=nn.functional.cross_entropy,
        )
    except distkit.CheckpointConflictError as err:
        return str(err), trainer.global_step
    return "", trainer.global_step


def test_a_fresh_fit_never_inherits_or_destroys_another_runs_checkpoints(ranks, tmp_path) -> None:
    # The old run's checkpoints are steps 6 and 3; a new run's (1, 2, 3) would be the "oldest", so
    # retention used to delete them and a later resume="auto" continued the old run.
    old = str(tmp_path / "run")
    ranks.run(resumable_run, old, 6, None)
    checkpoints = tmp_path / "run" / "checkpoints"
    before = {p.name: (p / "manifest.json").read_bytes() for p in checkpoints.iterdir()}
    assert sorted(before) == ["step_000000003", "step_000000006"]

    refusals = ranks.run(fresh_fit, old, None, False)
    for rank, (message, steps) in enumerate(refusals):
        assert steps == 0, f"rank {rank} trained {steps} steps before the refusal"
        assert str(checkpoints) in message and "steps 3..6" in message
        for way_out in ("resume='auto'", "default_root_dir=", "ModelCheckpoint(overwrite=True)"):
            assert way_out in message, (way_out, message)
    assert {p.name: (p / "manifest.json").read_bytes() for p in checkpoints.iterdir()} == before

    # Resuming from a checkpoint of that directory continues its run: no refusal.
    resumed = ranks.run(fresh_fit, old, str(checkpoints / "step_000000003"), False)
    assert resumed == [("", 3)] * 2
    # Starting over is explicit, and leaves only the new run's checkpoints.
    assert ranks.run(fresh_fit, old, None, True) == [("", 3)] * 2
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000000002", "step_000000003"]


def test_resume_auto_without_checkpoints_starts_fresh(tmp_path) -> None:
    model = SimpleModel()
    trainer = quiet_trainer(
        str(tmp_path), strategy="single", max_steps=2, resume="auto", enable_checkpointing=True
    )
    trainer.fit(
        model,
        RandomDataset(20, 64),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=nn.functional.cross_entropy,
    )
    assert trainer.global_step == 2


def checkpointed_fit(root: str, max_steps: int, resume: str | None) -> Trainer:
    """A fit of the simple model in ``root`` with checkpoints, resumed from ``resume``."""
    model = SimpleModel()
    trainer = quiet_trainer(
        root, strategy="single", max_steps=max_steps, enable_checkpointing=True, resume=resume
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer.fit(model, RandomDataset(20, 64), optimizer=optimizer, loss_fn=nn.functional.cross_entropy)
    return trainer


@pytest.mark.parametrize("form", ["file_url", "home"])
def test_a_resume_path_inside_the_runs_own_directory_continues_it_in_any_form(
    tmp_path, monkeypatch, form
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # "~" is tmp_path
    root = "~/run" if form == "home" else str(tmp_path / "run")

    checkpointed_fit(root, 2, None)
    step = tmp_path / "run" / "checkpoints" / "step_000000002"
    assert step.is_dir()
    resume = f"file://{step}" if form == "file_url" else "~/run/checkpoints/step_000000002"
    # Was: "already holds the checkpoints of another run, and this fit() starts a new one": the
    # file:// URL was compared as text with a local path, and "~" was not expanded.
    assert checkpointed_fit(root, 4, resume).global_step == 4


def resume_from_each_nodes_own_disk(root: str) -> str:
    # Two nodes, each with a local disk at the same path: only rank 0's holds the checkpoint.
    resume = f"{root}/node{distkit.get_rank()}/checkpoints/step_000000003"
    try:
        resumable_run(f"{root}/run", 8, resume)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_an_explicit_resume_path_that_one_rank_cannot_read_ends_every_rank_before_training(
    ranks, tmp_path
) -> None:
    # Was: rank 1 raised FileNotFoundError while rank 0 went on to train, until its first
    # collective waited for a rank that had left (the hang doctor's report, or a torch timeout).
    ranks.run(resumable_run, str(tmp_path / "node0"), 3, None)
    message0, message1 = ranks.run(resume_from_each_nodes_own_disk, str(tmp_path), timeout_s=60)
    assert message1.startswith("FileNotFoundError: "), message1
    assert message0.startswith("DistkitError: [rank 0/2] resume="), message0
    assert "could not be read on rank(s) [1]: rank 1: FileNotFoundError: " in message0, message0
    assert "filesystem every node mounts" in message0, message0
    saved = tmp_path / "run" / "checkpoints"  # no step trained, none saved
    assert not saved.exists() or not any(saved.iterdir())


def test_a_resume_that_names_the_runs_checkpoint_directory_itself_is_told_to_name_one_step(tmp_path) -> None:
    # Was: "already holds the checkpoints of another run, and this fit() starts a new one", for a
    # fit that asked to resume: the claim took the directory itself for another run's.
    root = str(tmp_path / "run")

    checkpointed_fit(root, 2, None)
    directory = tmp_path / "run" / "checkpoints"
    for resume in (str(directory), f"{directory}/", f"file://{directory}"):
        with pytest.raises(
            ForeignCheckpointError, match=r"is not one checkpoint: it is a CheckpointManager"
        ) as err:
            checkpointed_fit(root, 4, resume)
        assert "step_000000002" in str(err.value) and "resume='auto'" in str(err.value)
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith("step_")) == ["step_000000002"]


# --------------------------------------------------------------------------------------------------
# Strategies, devices and precision: clear errors instead of silent fallbacks


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_dataparallel_without_cuda_is_refused_not_run_silently_on_cpu() -> None:
    with pytest.raises(DistkitError, match=r"strategy='dp'.*needs CUDA"):
        Trainer(strategy="dp", max_epochs=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_fp16_without_cuda_is_refused_with_the_bf16_alternative() -> None:
    with pytest.raises(DistkitError, match=r"'16-mixed' needs CUDA.*bf16-mixed"):
        Trainer(precision="16-mixed", max_epochs=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_device_indices_without_cuda_are_refused() -> None:
    with pytest.raises(DistkitError, match="needs CUDA"):
        Trainer(strategy="single", devices=[1], max_epochs=1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"strategy": "deepspeed"}, ValueError, "strategy must be one of"),
        ({"strategy": "DDP"}, ValueError, r"got 'DDP'\. Did you mean 'ddp'\?"),
        ({"strategy": "dpp"}, ValueError, r"got 'dpp'\. Did you mean 'dp' or 'ddp'\?"),
        ({"strategy": "ddp_spawn"}, ValueError, r"Did you mean 'ddp' \(fit\(\) under plain python starts"),
        ({"strategy": "ddp_find_unused_parameters_true"}, ValueError, r"DDPStrategy\(find_unused_parameters"),
        ({"devices": 0}, ValueError, "devices must be >= 1, got 0"),
        ({"devices": [0, 0]}, ValueError, "distinct CUDA indices"),
        ({"precision": "64"}, ValueError, "precision must be one of"),
        ({"precision": 16}, ValueError, r"got 16\. Did you mean '16-mixed'\?"),  # Lightning's names
        ({"precision": "bf16"}, ValueError, r"got 'bf16'\. Did you mean 'bf16-mixed'\?"),
        ({"precision": "bf16-true"}, ValueError, r"Did you mean 'bf16-mixed' \(the weights stay float32"),
        ({"accumulate_grad_batches": 0}, ValueError, "accumulate_grad_batches must be >= 1, got 0"),
        ({"gradient_clip_val": -1.0}, ValueError, "gradient_clip_val must be > 0"),
        ({"gradient_clip_algorithm": "max"}, ValueError, "'norm' or 'value'"),
        ({"strategy": "single", "devices": 2}, ValueError, "strategy='single' uses one device"),
        ({"val_check_interval": 2.0}, ValueError, "fraction of an epoch"),
        ({"batch_size": 2.5}, TypeError, "batch_size must be an int"),
        ({"seed": "0"}, TypeError, "seed must be an int, got str '0'"),  # here, not when fit starts
        ({"seed": -1}, ValueError, r"seed must be in \[0, 4294967295\], got -1"),
        ({"logger": "tensorboard"}, TypeError, r"pass distkit\.trainer\.TensorBoardLogger\(\.\.\.\)"),
        ({"devices": "2"}, TypeError, r"got '2'\. Did you mean devices=2\?"),
        ({"callbacks": [ModelCheckpoint]}, TypeError, r"the class ModelCheckpoint: pass an instance"),
        ({"logger": CSVLogger}, TypeError, r"the class CSVLogger: pass an instance, CSVLogger\(\.\.\.\)"),
        ({"strategy": DDPStrategy}, ValueError, r"Did you mean DDPStrategy\(\)\?"),
        ({"profiler": TorchProfiler}, ValueError, r"Did you mean TorchProfiler\(\)\?"),
        ({"gradient_clip_val": "1"}, TypeError, r"gradient_clip_val must be a number > 0 or None, got str"),
        ({"resume": "last"}, ValueError, r"resume='last' is fit\(ckpt_path='last'\)'s word.*resume='auto'"),
        ({"default_root_dir": None}, TypeError, r"default_root_dir must be the path of the run's directory"),
        # Keywords the Trainer does not take: a slip, or Lightning's name (Python names neither).
        (
            {"max_epoch": 3},
            TypeError,
            r"Trainer\(\) got an unexpected keyword argument 'max_epoch'\. Did you mean max_epochs=",
        ),
        ({"hang_timeout": 60}, TypeError, r"Did you mean hang_timeout_s=\? distkit's durations are seconds"),
        ({"gpus": 2}, TypeError, r"'gpus': devices=N"),
        (
            {"accelerator": "cpu"},
            TypeError,
            r"'accelerator': the Trainer trains on CUDA when torch sees",
        ),
        ({"num_nodes": 2}, TypeError, r"'num_nodes': the nodes come from the launcher"),
        ({"weights": 1}, TypeError, r"'weights'; it takes strategy, devices, precision, max_epochs"),
    ],
)
def test_bad_trainer_arguments_name_the_argument_and_value(kwargs, error, match) -> None:
    options = {"max_epochs": 1, **kwargs}
    with pytest.raises(error, match=match):
        Trainer(**options)


def test_a_home_root_dir_is_expanded(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Trainer(default_root_dir="~/runs").default_root_dir == tmp_path / "runs"  # not ./~/runs


def test_keywords_that_fit_and_modelcheckpoint_do_not_take_name_the_one_meant(tmp_path) -> None:
    trainer, model, data = Trainer(max_epochs=1), SimpleModel(), RandomDataset(20, 8)
    optimizer = functools.partial(torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match=r"Trainer\.fit\(\) got .* 'train_dataloaders': pass the training"):
        trainer.fit(model, train_dataloaders=data, optimizer=optimizer)
    with pytest.raises(TypeError, match=r"'optimiser'\. Did you mean optimizer=\?"):
        trainer.fit(model, data, optimiser=optimizer)
    with pytest.raises(TypeError, match=r"metrics must map names to metric functions, .* got list"):
        trainer.fit(model, data, optimizer=optimizer, metrics=[distkit.trainer.accuracy])
    with pytest.raises(TypeError, match=r"'criterion': the loss function goes in loss_fn="):
        trainer.fit(model, data, optimizer=optimizer, criterion=nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match=r"Trainer\.validate\(\) got .* 'dataloaders': pass the data"):
        trainer.validate(model, dataloaders=data)
    with pytest.raises(TypeError, match=r"Trainer\.predict\(\) got .* 'datamodule': pass the dataset"):
        trainer.predict(model, datamodule=data)
    with pytest.raises(TypeError, match=r"ModelCheckpoint\(\) got .* 'save_top_k': keep_best=k"):
        ModelCheckpoint(str(tmp_path), monitor="val_loss", save_top_k=1)
    with pytest.raises(TypeError, match=r"'every_n_train_steps': it is every_n_steps= here"):
        ModelCheckpoint(str(tmp_path), every_n_train_steps=100)
    # A TypeError from inside the call (a call that binds) is left as it is.
    with pytest.raises(TypeError, match=r"^seed must be an int, got str 'x'\.$"):
        Trainer(seed="x")


def test_one_callback_alone_is_taken_as_lightning_takes_it() -> None:
    stopper = EarlyStopping("val_loss")
    trainer = Trainer(max_epochs=1, callbacks=stopper)
    assert trainer.callbacks[0] is stopper and isinstance(trainer.callbacks[-1], ModelCheckpoint)


def refusal_in_a_ddp_job(tmp: str, strategy: str, devices: int | str) -> str:
    model = SimpleModel()
    try:
        quiet_trainer(tmp, strategy=strategy, devices=devices, max_steps=1).fit(
            model,
            RandomDataset(20, 64),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=nn.functional.cross_entropy,
        )
    except DistkitError as err:
        return str(err)
    return "no error"


def test_strategy_that_does_not_fit_the_launched_job_is_refused(ranks, tmp_path) -> None:
    for message in ranks.run(refusal_in_a_ddp_job, str(tmp_path), "single", "auto"):
        assert "strategy='single' runs in one process, but this process is rank" in message
    for message in ranks.run(refusal_in_a_ddp_job, str(tmp_path), "ddp", 4):
        assert "devices=4 but the env job runs 2 process(es) on this node" in message


def test_optimizer_of_another_model_copy_is_refused(tmp_path) -> None:
    model, other = SimpleModel(), SimpleModel()
    trainer = quiet_trainer(str(tmp_path), strategy="single", max_steps=1)
    with pytest.raises(ValueError, match="not parameters of the model given to fit"):
        trainer.fit(
            model,
            RandomDataset(20, 64),
            optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
            loss_fn=nn.functional.cross_entropy,
        )


class LayersInAPlainList(nn.Module):
    """The classic slip: the blocks are in a Python list, which nn.Module does not register."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(20, 10)
        self.blocks = [nn.Linear(20, 20) for _ in range(2)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_model_or_optimizer_that_would_train_nothing_is_refused(tmp_path) -> None:
    def fit(model: nn.Module, params: Iterable[nn.Parameter] | None = None) -> None:
        trainer = quiet_trainer(str(tmp_path), strategy="single", max_steps=2)
        optimizer = functools.partial(torch.optim.SGD, lr=0.1)
        trainer.fit(
            model,
            RandomDataset(20, 64),
            optimizer=optimizer if params is None else optimizer(params),
            loss_fn=nn.functional.cross_entropy,
        )

    # Was: the blocks stayed at their initial weights, in silence (and differed across ranks).
    with pytest.raises(
        ValueError, match=r"LayersInAPlainList\.blocks is a plain list of 2 module.*nn\.ModuleList"
    ):
        fit(LayersInAPlainList())
    # Was: torch's "element 0 of tensors does not require grad".
    frozen = SimpleModel().requires_grad_(False)
    with pytest.raises(
        ValueError, match=r"all 4 of its parameters have requires_grad=False.*trainer\.validate"
    ):
        fit(frozen)
    with pytest.raises(ValueError, match=r"SiLU\) has no parameters"):
        fit(nn.SiLU())
    # Was: fit ran and the model came out unchanged, in silence.
    model = SimpleModel()
    model.net[0].requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"the optimizer updates nothing: its 2 parameter\(s\) all have"):
        fit(model, model.net[0].parameters())
    # Meant to stay fixed: a frozen module kept out of the model (a teacher) is fine.
    model.net[0].requires_grad_(True)
    model.teacher = [SimpleModel().requires_grad_(False)]
    fit(model)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_unpicklable_objects_are_named_before_any_process_starts(tmp_path) -> None:
    model = SimpleModel()
    trainer = quiet_trainer(str(tmp_path), strategy="ddp", devices=2, max_steps=1)
    with pytest.raises(DistkitError, match=r"cannot be pickled.*torchrun"):
        trainer.fit(
            model,
            RandomDataset(20, 64),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=lambda output, target: nn.functional.cross_entropy(output, target),
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, devices='auto' is one process per GPU")
def test_ddp_with_auto_devices_outside_a_launcher_without_cuda_asks_for_a_process_count(tmp_path) -> None:
    # Not a silent one-process "DDP" run: how many CPU processes to start is the user's choice.
    model = SimpleModel()
    trainer = quiet_trainer(str(tmp_path), strategy="ddp", max_steps=1)
    with pytest.raises(DistkitError, match=r"devices='auto' outside a launcher .* Pass devices=N"):
        trainer.fit(
            model,
            RandomDataset(20, 64),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=nn.functional.cross_entropy,
        )
    assert trainer.global_step == 0


def ddp_options_reach_ddp(tmp: str) -> tuple[bool, bool, int]:
    class Capture(Callback):
        def on_fit_start(self, trainer: Trainer) -> None:
            self.ddp = trainer._shown.wrapped  # the DDP module itself (the run state): its options

    # A branch that the forward pass never uses: plain DDP fails on it at the second step.
    torch.manual_seed(0)
    model = SimpleModel()
    model.unused = nn.Linear(3, 3)
    capture = Capture()
    strategy = DDPStrategy(find_unused_parameters=True, gradient_as_bucket_view=True, bucket_cap_mb=1)
    quiet_trainer(tmp, strategy=strategy, max_steps=3, callbacks=[capture]).fit(
        model,
        RandomDataset(20, 256),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=nn.functional.cross_entropy,
    )
    ddp = capture.ddp
    return ddp.find_unused_parameters, ddp.gradient_as_bucket_view, ddp.bucket_bytes_cap


def test_ddp_options_pass_through_to_distributed_data_parallel(ranks, tmp_path) -> None:
    assert ranks.run(ddp_options_reach_ddp, str(tmp_path)) == [(True, True, 1024 * 1024)] * 2


class DtypeProbe(SimpleModel):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        data, target = batch
        output = self(data)
        self.seen_dtype = output.dtype
        return nn.functional.cross_entropy(output, target)


def test_bf16_mixed_runs_the_forward_pass_in_bfloat16_on_cpu(tmp_path) -> None:
    torch.manual_seed(0)
    model = DtypeProbe()
    trainer = quiet_trainer(
        str(tmp_path), strategy="single", precision="bf16-mixed", max_steps=3, log_every_n_steps=1
    )
    trainer.fit(model, RandomDataset(20, 128), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.seen_dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32  # master weights stay fp32
    assert math.isfinite(trainer.callback_metrics["train_loss"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 with GradScaler needs CUDA")
def test_fp16_unscales_once_per_optimizer_step_with_accumulation_and_clipping(tmp_path) -> None:
    calls = []
    original = torch.amp.GradScaler.unscale_

    def counting_unscale(self, optimizer):  # counts the real method's calls; no behaviour change
        calls.append(1)
        return original(self, optimizer)

    torch.amp.GradScaler.unscale_ = counting_unscale
    try:
        torch.manual_seed(0)
        model = SimpleModel()
        trainer = quiet_trainer(
            str(tmp_path),
            strategy="single",
            precision="16-mixed",
            max_steps=4,
            accumulate_grad_batches=3,
            gradient_clip_val=1.0,
        )
        trainer.fit(
            model,
            RandomDataset(20, 512),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=nn.functional.cross_entropy,
        )
    finally:
        torch.amp.GradScaler.unscale_ = original
    assert len(calls) == 4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nn.DataParallel needs 2 CUDA devices")
def test_dataparallel_splits_each_batch_over_the_listed_gpus(tmp_path) -> None:
    torch.manual_seed(0)
    model = SimpleModel()
    trainer = quiet_trainer(str(tmp_path), strategy="dp", devices=[0, 1], max_steps=3, batch_size=8)
    trainer.fit(
        model,
        RandomDataset(20, 256),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=nn.functional.cross_entropy,
    )
    assert trainer.effective_batch_size == 16
    assert math.isfinite(trainer.callback_metrics.get("train_loss_epoch", 0.0))


# --------------------------------------------------------------------------------------------------
# Start-up report, loggers and monitors


def startup_report(tmp: str) -> str:
    torch.manual_seed(0)
    model = SimpleModel()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        quiet_trainer(tmp, strategy="ddp", max_steps=2, batch_size=16, accumulate_grad_batches=2).fit(
            model,
            RandomDataset(20, 256),
            optimizer=torch.optim.Adam(model.parameters(), lr=3e-4),
            loss_fn=nn.functional.cross_entropy,
        )
    return out.getvalue()


def test_startup_report_is_printed_once_by_the_main_process(ranks, tmp_path) -> None:
    main, other = ranks.run(startup_report, str(tmp_path))
    assert other == ""
    assert main.count("distkit.Trainer") == 1
    for line in (
        "strategy       ddp",
        "devices        cpu per process; 2 process(es) x 1 node(s)",
        "world size     2",
        "backend        gloo",
        "precision      32",
        "batch size     16 per rank, 64 effective (16 x 2 ranks x 2 accumulated)",
        "learning rate  0.0003 base (Adam)",
    ):
        assert line in main, line


def test_csv_tensorboard_and_monitors_record_the_run(tmp_path) -> None:
    torch.manual_seed(0)
    model = SimpleModel()
    trainer = Trainer(
        strategy="single",
        max_epochs=2,
        log_every_n_steps=2,
        default_root_dir=tmp_path,
        logger=[CSVLogger(), TensorBoardLogger()],
        callbacks=[LearningRateMonitor(), ThroughputMonitor()],
        enable_progress_bar=False,
    )
    trainer.fit(
        model,
        RandomDataset(20, 160),
        RandomDataset(20, 40),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=nn.functional.cross_entropy,
        metrics={"acc": accuracy},
    )
    with open(tmp_path / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    step_rows = [r for r in rows if r["train_loss"]]
    epoch_rows = [r for r in rows if r["val_loss"]]
    assert [int(r["step"]) for r in step_rows] == [2, 4, 6, 8, 10]
    assert [int(r["step"]) for r in epoch_rows] == [5, 10]
    assert all(float(r["lr"]) == 0.1 and float(r["samples_per_s"]) > 0 for r in step_rows)
    assert 0.0 <= float(epoch_rows[-1]["val_acc"]) <= 1.0
    assert (tmp_path / "hparams.json").exists()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000000005",
        "step_000000010",
    ]


class SlowDataset(RandomDataset):
    """A validation set that takes ``seconds`` in all to read (a slow disk, a big model)."""

    def __init__(self, length: int, seconds: float) -> None:
        super().__init__(20, length)
        self.delay = seconds / length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return super().__getitem__(index)


def test_throughput_leaves_out_the_time_of_a_validation_mid_epoch(tmp_path) -> None:
    """Was: a mid-epoch validation (val_check_interval) counted as training time: samples_per_s 15
    to 40 times too low, without a word."""
    monitor, records = ThroughputMonitor(), []

    class Record(Callback):
        def on_log(self, trainer, metrics):
            records.append(dict(metrics))

    trainer = quiet_trainer(
        str(tmp_path),
        strategy="single",
        max_steps=4,
        batch_size=8,
        log_every_n_steps=2,
        val_check_interval=2,
        callbacks=[monitor, Record()],
    )
    model = SimpleModel()
    trainer.fit(
        model,
        RandomDataset(20, 64),
        SlowDataset(8, seconds=0.5),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=nn.functional.cross_entropy,
    )
    rates = [r["steps_per_s"] for r in records if "steps_per_s" in r]
    # Two logging steps, each after a validation of 0.5 s: counted, they would give 4 steps/s at most.
    assert len(rates) == 2 and min(rates) > 10, records


def test_a_resume_from_a_checkpoint_at_an_epochs_last_step_logs_the_epoch_end_once(tmp_path) -> None:
    """The step-end checkpoint of an epoch's last step comes before the epoch's end (validation,
    the epoch's row), which a resume does again. Was: metrics.csv held that row twice."""

    def run() -> None:
        model = SimpleModel()
        trainer = quiet_trainer(
            str(tmp_path),
            strategy="single",
            max_epochs=2,
            batch_size=8,  # 64 samples: 8 steps an epoch, so every 4th step's save is an epoch's last
            log_every_n_steps=3,
            logger=True,
            enable_checkpointing=True,
            callbacks=[ModelCheckpoint(every_n_steps=4)],
            resume="auto",
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer.fit(
            model,
            RandomDataset(20, 64),
            RandomDataset(20, 16),
            optimizer=optimizer,
            lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5),
            loss_fn=nn.functional.cross_entropy,
        )

    run()
    first, hparams = (tmp_path / "metrics.csv").read_text(), (tmp_path / "hparams.json").read_text()
    run()  # the finished run again: resumes at its last checkpoint, step 16, the second epoch's end
    assert (tmp_path / "metrics.csv").read_text() == first
    # The run's lr, not the schedule's at step 16 (was: "lr": [0.0015625] after the resume).
    assert (tmp_path / "hparams.json").read_text() == hparams and '"lr": [\n    0.1\n  ]' in hparams


def test_a_fresh_run_keeps_the_metrics_of_an_earlier_run_in_the_same_directory(tmp_path, caplog) -> None:
    def run(lr: float) -> None:
        model = SimpleModel()
        trainer = quiet_trainer(
            str(tmp_path),
            strategy="single",
            max_steps=2,
            log_every_n_steps=1,
            logger=[CSVLogger(), TensorBoardLogger()],
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        trainer.fit(model, RandomDataset(20, 64), optimizer=optimizer, loss_fn=nn.functional.cross_entropy)

    run(0.1)
    first = (tmp_path / "metrics.csv").read_text()
    events = sorted(p.name for p in (tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    # Was: the second run's metrics.csv and hparams.json replaced the first run's, in silence, and
    # its TensorBoard events went beside the first run's: one curve restarting at step 1.
    with caplog.at_level("WARNING", logger="distkit.trainer"):
        run(0.5)
    assert (tmp_path / "metrics.1.csv").read_text() == first
    assert (tmp_path / "hparams.1.json").exists() and (tmp_path / "hparams.json").exists()
    assert (tmp_path / "metrics.csv").read_text() != first
    assert "held the metrics of an earlier run in this directory: kept as metrics.1.csv" in caplog.text
    assert sorted(p.name for p in (tmp_path / "tensorboard" / "earlier.1").iterdir()) == events
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert "held the TensorBoard events of an earlier run: moved into" in caplog.text


def test_csv_loggers_of_other_files_in_one_directory_keep_their_own_hparams(tmp_path) -> None:
    # Was: every CSVLogger wrote <dir>/hparams.json, so a second run logging to b.csv beside a.csv
    # replaced the first run's configuration in silence.
    def run(filename: str, lr: float) -> CSVLogger:
        model = SimpleModel()
        logger = CSVLogger(tmp_path / "logs", filename=filename)
        trainer = quiet_trainer(str(tmp_path / filename), strategy="single", max_steps=2, logger=logger)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        trainer.fit(model, RandomDataset(20, 64), optimizer=optimizer, loss_fn=nn.functional.cross_entropy)
        return logger

    first = run("a.csv", 0.1)
    second = run("b.csv", 0.5)
    assert first.hparams_path == tmp_path / "logs" / "a.hparams.json"
    assert second.hparams_path == tmp_path / "logs" / "b.hparams.json"
    assert '"lr": [\n    0.1\n  ]' in first.hparams_path.read_text()
    assert '"lr": [\n    0.5\n  ]' in second.hparams_path.read_text()
    assert not (tmp_path / "logs" / "hparams.json").exists()
    # A fresh run to the same file keeps the earlier one's rows and configuration, numbered alike.
    run("a.csv", 0.3)
    assert '"lr": [\n    0.1\n  ]' in (tmp_path / "logs" / "a.hparams.1.json").read_text()
    assert (tmp_path / "logs" / "a.1.csv").exists()


def test_a_tensorboard_logger_in_the_run_directory_itself_moves_only_its_events(tmp_path) -> None:
    def run() -> None:
        model = SimpleModel()
        logger = [CSVLogger(), TensorBoardLogger(save_dir=tmp_path)]
        trainer = quiet_trainer(
            str(tmp_path), strategy="single", max_steps=2, log_every_n_steps=1, logger=logger
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer.fit(model, RandomDataset(20, 64), optimizer=optimizer, loss_fn=nn.functional.cross_entropy)

    run()
    run()
    # Was: the whole run directory renamed to <dir>.1 at the second run's start, with the
    # hparams.json and the held metrics.csv lock the second run had just written there.
    assert not tmp_path.with_name(tmp_path.name + ".1").exists()
    assert {"metrics.csv", "metrics.1.csv", "hparams.json", "hparams.1.json"} <= {
        p.name for p in tmp_path.iterdir()
    }
    assert len(list((tmp_path / "earlier.1").glob("events.out.tfevents.*"))) == 1
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1


class _FailsAtTheEnd(Logger):
    """A tracker whose server is gone when the run finishes."""

    def finalize(self) -> None:
        raise ConnectionError("tracking server unreachable at finish")


def test_a_logger_failing_to_finalize_does_not_keep_the_others_directories_locked(tmp_path) -> None:
    def run(logger: list[Logger]) -> Trainer:
        trainer = quiet_trainer(str(tmp_path), strategy="single", max_steps=2, logger=logger)
        model = SimpleModel()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with contextlib.suppress(ConnectionError):
            trainer.fit(
                model, RandomDataset(20, 64), optimizer=optimizer, loss_fn=nn.functional.cross_entropy
            )
        return trainer

    first = run([_FailsAtTheEnd(), CSVLogger(), TensorBoardLogger()])
    # Was: the CSV and TensorBoard loggers after it were never finalized, and the next fit in this
    # process (a notebook's next cell, the first Trainer still alive) was refused as "another run
    # writes metrics.csv", naming this very process.
    assert run([CSVLogger(), TensorBoardLogger()]).global_step == 2
    assert first.global_step == 2


@pytest.mark.parametrize("running", [CSVLogger, TensorBoardLogger])
def test_a_second_run_logging_into_a_directory_another_run_writes_is_refused(tmp_path, running) -> None:
    # The run in progress: its logger set up, as the Trainer sets it up at the start of fit.
    other = running()
    other.setup(tmp_path, None)
    other.log_metrics({"train_loss": 1.5}, step=1)
    files = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    def run() -> None:
        model = SimpleModel()
        trainer = quiet_trainer(
            str(tmp_path), strategy="single", max_steps=2, log_every_n_steps=1, logger=[running()]
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer.fit(model, RandomDataset(20, 64), optimizer=optimizer, loss_fn=nn.functional.cross_entropy)

    # Was, with checkpoints off (no checkpoint directory's lock): the second run renamed the first's
    # metrics.csv away and both wrote rows into the new one.
    refused = r"another run writes .*: pid \d+ on host .*Two runs logging"
    with pytest.raises(distkit.DistkitError, match=refused):
        run()
    assert {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files
    other.finalize()  # that run ended: its directory may be reused
    run()


# --------------------------------------------------------------------------------------------------
# Real processes: fit() starting its own, SIGTERM (preemption), SIGKILL under torchrun --max-restarts


def reference_weights(root: str, max_steps: int) -> dict[str, torch.Tensor]:
    # The uninterrupted run of trainer_scripts/train_job.py, on the pool's ranks.
    sys.path.insert(0, str(SCRIPTS))
    try:
        import train_job
    finally:
        sys.path.remove(str(SCRIPTS))
    model = train_job.make_model()
    train_job.fit(train_job.make_trainer(root, max_steps, []), model)
    return model.state_dict()


def run_job(
    args: list[str], env: dict[str, str], timeout_s: float = 240.0
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s)
    print(result.stdout[-4000:], result.stderr[-6000:], sep="\n")  # shown by pytest on failure
    return result


def assert_same(got: object, want: object, where: str = "") -> None:
    """Equal, tensors bitwise, in nested dicts and lists."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got, key=str) == sorted(want, key=str), where
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert got == want, where


def test_python_and_torchrun_launches_of_one_script_train_the_same_job_bitwise(tmp_path) -> None:
    # launch_parity.py seeds with seed_everything() only and draws from torch, python and numpy
    # before fit and in every forward pass. Under `python` fit starts the workers itself (spawn:
    # fresh interpreters); under torchrun every rank ran the script. Run twice with python (the
    # second time with optimizer and scheduler factories) and once with torchrun: the same weights,
    # optimizer, scheduler, EarlyStopping state, best checkpoint, counters, metrics and metrics.csv,
    # bitwise; and in the launching process, what rank 0 had at the end of fit. No warning in any
    # process.
    env = job_env()
    env["PYTHONWARNINGS"] = "always"  # every warning of every process reaches stderr
    del env["OMP_NUM_THREADS"]  # each launcher's own default thread count, which must agree
    script = str(SCRIPTS / "launch_parity.py")
    runs = {
        "python": [sys.executable, script, str(tmp_path / "python")],
        "python-factories": [sys.executable, script, str(tmp_path / "python-factories"), "factories"],
        "torchrun": torchrun(script, str(tmp_path / "torchrun")),
    }
    records = {}
    for name, args in runs.items():
        (tmp_path / name).mkdir()
        result = run_job(args, env)
        assert result.returncode == 0, name
        warned = [line for line in (result.stdout + result.stderr).splitlines() if "Warning: " in line]
        assert warned == [], name
        records[name] = torch.load(tmp_path / name / "after_fit.pt")

    python = records["python"]
    assert python.pop("passed_objects") is True  # trainer.optimizer is the optimizer passed
    assert records["python-factories"].pop("passed_objects") is None
    assert records["torchrun"].pop("passed_objects") is True
    assert_same(python, torch.load(tmp_path / "python" / "rank0.pt"), "launching process vs rank 0")
    assert python["early_stopping"]["best"] is not None and python["global_step"] == 18
    assert python["best_checkpoint"].startswith("step_")
    logged = (tmp_path / "python" / "metrics.csv").read_text()
    for name in ("python-factories", "torchrun"):
        assert_same(records[name], python, name)
        assert (tmp_path / name / "metrics.csv").read_text() == logged, name


UNGUARDED_SCRIPT = """import os
import torch
from torch import nn
from distkit.trainer import Trainer

model = nn.Linear(4, 2)
data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
trainer = Trainer(strategy="ddp", devices=2, max_steps=2, default_root_dir=os.path.dirname(__file__))
trainer.fit(model, data, optimizer=torch.optim.SGD(model.parameters(), 0.1), loss_fn=nn.CrossEntropyLoss())
"""


def test_self_launch_from_a_script_without_main_guard_fails_with_one_short_error(tmp_path) -> None:
    # spawn re-imports the script in every worker; without the guard each would call fit() again.
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    result = run_job([sys.executable, str(script)], job_env(), timeout_s=120)
    output = result.stdout + result.stderr
    assert result.returncode == 1
    assert (
        "DistkitError: unguarded.py, line 9: fit() with 2 processes was called from the top level of "
        'the script without an `if __name__ == "__main__":` guard.' in output
    )
    assert output.count("Traceback") == 1 and len(output.splitlines()) <= 20
    assert not (tmp_path / "checkpoints").exists()  # refused before any process started


CLASS_UNDER_GUARD_SCRIPT = """import os
import torch
from torch import nn
from distkit.trainer import Trainer

if __name__ == "__main__":
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

        def forward(self, x):
            return self.layer(x)

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    trainer = Trainer(strategy="ddp", devices=2, max_steps=2, default_root_dir=os.path.dirname(__file__))
    trainer.fit(Net(), data, optimizer=torch.optim.SGD, loss_fn=nn.CrossEntropyLoss())
"""


def test_a_class_defined_under_the_main_guard_is_named_before_any_process_starts(tmp_path) -> None:
    # Was: every worker failed to unpickle it, and torch's ChildFailedError (AttributeError: Can't get
    # attribute 'Net' on <module '__mp_main__'>) with some 40 lines of its traceback.
    script = tmp_path / "guarded_class.py"
    script.write_text(CLASS_UNDER_GUARD_SCRIPT)
    result = run_job([sys.executable, str(script)], job_env(), timeout_s=120)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert (
        'which refer to Net of the script; but Net is defined under its `if __name__ == "__main__":` '
        "block, which the processes do not run" in output
    ), output
    assert "ChildFailedError" not in output and not (tmp_path / "checkpoints").exists()


GUARDED_SCRIPT = """import os
import torch
from torch import nn
from distkit.trainer import Trainer

if __name__ == "__main__":
    model = nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    trainer = Trainer(strategy="ddp", devices=2, max_steps=2, default_root_dir=os.path.dirname(__file__))
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    trainer.fit(model, data, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())
"""


def test_an_error_in_self_launched_workers_is_raised_once_as_the_workers_own(tmp_path) -> None:
    # Run twice into one directory: the second run's workers refuse to start a new run over the
    # first one's checkpoints. The launching process raises that very error (type and message),
    # with the worker's traceback as a note, instead of torch's agent log, a ChildFailedError and
    # the same traceback three times.
    script = tmp_path / "train.py"
    script.write_text(GUARDED_SCRIPT)
    assert run_job([sys.executable, str(script)], job_env(), timeout_s=120).returncode == 0
    result = run_job([sys.executable, str(script)], job_env(), timeout_s=120)
    output = result.stdout + result.stderr
    assert result.returncode == 1
    last = output.strip().splitlines()[-1]
    assert last.startswith("distkit.checkpoint.CheckpointConflictError: [rank ") and "resume='auto'" in last
    assert "raised in fit()'s worker process rank " in output
    assert "ChildFailedError" not in output and output.count("Traceback") == 2  # the parent's, the worker's
    assert len(output.splitlines()) <= 40


def test_sigterm_on_one_rank_of_a_self_launched_fit_saves_exits_zero_and_resumes_exactly(
    ranks, tmp_path
) -> None:
    # `python train_job.py`: fit() starts 2 workers itself. Rank 1 gets SIGTERM after step 3; step 4
    # tells every rank and is discarded, a checkpoint of step 3 is saved, and the launching process
    # exits 0 with rank 0's weights of step 3 loaded into its model. Run again, the job resumes
    # from step 3 and ends with the weights of an uninterrupted run: the discarded step gave its
    # batches and its dropout draws back.
    result = run_job(
        [
            sys.executable,
            str(SCRIPTS / "train_job.py"),
            str(tmp_path),
            "8",
            "--term-rank",
            "1",
            "--term-step",
            "3",
        ],
        job_env(),
    )
    assert result.returncode == 0
    assert "SIGTERM received: saving a checkpoint at step 3" in result.stderr
    steps = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert steps == ["step_000000002", "step_000000003"]
    saved = torch.load(tmp_path / "weights.pt")
    assert saved["world_size"] == 2 and saved["step"] == 3
    checkpoint = distkit.load_checkpoint(tmp_path / "checkpoints" / "step_000000003", map_location="cpu")
    expected = ranks.run(reference_weights, str(tmp_path / "reference3"), 3)[0]
    for name, tensor in saved["weights"].items():
        assert torch.equal(tensor, checkpoint["model"][name]), name
        assert torch.equal(tensor, expected[name]), name

    resumed = run_job([sys.executable, str(SCRIPTS / "train_job.py"), str(tmp_path), "8"], job_env())
    assert resumed.returncode == 0
    assert "resumed at step 3" in resumed.stdout
    saved = torch.load(tmp_path / "weights.pt")
    assert saved["step"] == 8
    expected = ranks.run(reference_weights, str(tmp_path / "reference8"), 8)[0]
    for name, tensor in saved["weights"].items():
        assert torch.equal(tensor, expected[name]), name


ONE_PROCESS_JOB = """import os, signal, sys
import torch
from torch import nn
from distkit.trainer import ModelCheckpoint, Trainer

root, max_steps, term_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 10))
generator = torch.Generator().manual_seed(1234)
inputs, targets = torch.randn(320, 20, generator=generator), torch.randint(0, 10, (320,), generator=generator)
data = torch.utils.data.TensorDataset(inputs, targets)
trainer = Trainer(
    strategy="single", max_steps=max_steps, seed=3, resume="auto", default_root_dir=root, logger=False,
    enable_progress_bar=False, callbacks=[ModelCheckpoint(every_n_steps=2, every_n_epochs=0, keep_last=10)],
)

def forward_hook(module, inputs, output):
    # SIGTERM in the middle of a step: between its forward and its backward pass.
    if trainer.global_step == term_step - 1 and not os.environ.get("RESUMED"):
        os.kill(os.getpid(), signal.SIGTERM)

model[0].register_forward_hook(forward_hook)
try:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    trainer.fit(model, data, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())
finally:
    torch.save({"step": trainer.global_step, "weights": model.state_dict()}, os.path.join(root, "weights.pt"))
"""


class _Boom(Callback):
    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        raise RuntimeError("boom at step 1")


def test_a_failing_fit_shows_its_own_error_though_a_logger_fails_to_finalize(tmp_path, caplog) -> None:
    trainer = quiet_trainer(
        str(tmp_path),
        strategy="single",
        max_steps=4,
        logger=[_FailsAtTheEnd(), CSVLogger()],
        callbacks=[_Boom()],
    )
    model = SimpleModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # The training error is the one to see; the logger's own failure is told beside it.
    with (
        caplog.at_level("WARNING", logger="distkit.trainer"),
        pytest.raises(RuntimeError, match="boom at step 1"),
    ):
        trainer.fit(model, RandomDataset(20, 64), optimizer=optimizer, loss_fn=nn.functional.cross_entropy)
    assert "_FailsAtTheEnd could not finish: tracking server unreachable at finish" in caplog.text


KILLED_WITH_WORKERS = """
import os, signal, sys, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import distkit

class Die(distkit.trainer.Callback):
    def on_train_step_end(self, trainer, loss):
        if trainer.global_step == 3:  # checkpoint and logs written, the loader's workers busy
            os.kill(os.getpid(), signal.SIGKILL)

data = TensorDataset(torch.randn(512, 4), torch.randint(0, 2, (512,)))
loader = DataLoader(data, batch_size=8, num_workers=2)  # forked: they share the locks' files
model = nn.Linear(4, 2)
trainer = distkit.Trainer(
    default_root_dir=sys.argv[1], max_epochs=1, enable_progress_bar=False, callbacks=[
        Die(), distkit.trainer.ModelCheckpoint(every_n_steps=2)]
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
trainer.fit(model, loader, optimizer=optimizer, loss_fn=nn.functional.cross_entropy)
"""


def test_a_killed_run_lets_go_of_its_locks_at_once_though_its_loader_workers_live_on(tmp_path) -> None:
    from distkit.checkpoint._lock import _LocalWriterLock

    root = tmp_path / "run"
    log = tmp_path / "log.txt"
    with log.open("w") as out:  # not a pipe: reading one to its end would wait for the workers too
        job = subprocess.Popen([sys.executable, "-c", KILLED_WITH_WORKERS, str(root)], stdout=out, stderr=out)
        assert job.wait(timeout=120) == -signal.SIGKILL, log.read_text()[-2000:]
    # Was: the orphaned workers held the flock of metrics.csv and of the checkpoint directory
    # until DataLoader's watchdog ended them (up to 5 s), so a restart at once (torchrun
    # --max-restarts) was refused naming the dead pid.
    for path in (root / "metrics.csv", root / "checkpoints"):
        lock = _LocalWriterLock(str(path), 0o600)
        lock.acquire()
        lock.release()


def test_sigterm_mid_step_in_one_process_keeps_that_step_saves_and_resumes_exactly(tmp_path) -> None:
    # A world of one has no rank to tell: SIGTERM between step 3's forward and backward pass lets
    # step 3 finish, saves a checkpoint of it and exits 0 (issue 29: no random-generator state is
    # kept per step for a discard). The resumed run ends with the uninterrupted run's weights,
    # dropout draws included.
    script = tmp_path / "job.py"
    script.write_text(ONE_PROCESS_JOB)
    stopped = run_job(
        [sys.executable, str(script), str(tmp_path / "run"), "6", "3"], job_env(), timeout_s=120
    )
    assert stopped.returncode == 0
    assert "SIGTERM received: saving a checkpoint at step 3" in stopped.stderr
    assert torch.load(tmp_path / "run" / "weights.pt")["step"] == 3
    resumed = run_job(
        [sys.executable, str(script), str(tmp_path / "run"), "6", "3"],
        {**job_env(), "RESUMED": "1"},
        timeout_s=120,
    )
    assert resumed.returncode == 0
    reference = run_job(
        [sys.executable, str(script), str(tmp_path / "reference"), "6", "3"],
        {**job_env(), "RESUMED": "1"},
        timeout_s=120,
    )
    assert reference.returncode == 0
    got, want = (torch.load(tmp_path / name / "weights.pt") for name in ("run", "reference"))
    assert got["step"] == want["step"] == 6
    for name, tensor in want["weights"].items():
        assert torch.equal(got["weights"][name], tensor), name


def test_sigkilled_rank_restarts_under_torchrun_and_ends_with_uninterrupted_weights(ranks, tmp_path) -> None:
    env = job_env()
    # pytorch/pytorch#135712: without it the restarted gloo group often fails to form (FACTS.md).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    result = run_job(
        torchrun(
            str(SCRIPTS / "train_job.py"),
            str(tmp_path),
            "8",
            "--kill-rank",
            "1",
            "--kill-step",
            "5",
            options=["--standalone", "--nproc_per_node=2", "--max-restarts=1"],
        ),
        env,
    )
    assert result.returncode == 0
    assert "rank 1 sends itself signal 9 after step 5" in result.stdout
    assert "resumed at step 4" in result.stdout  # the checkpoint before the kill
    saved = torch.load(tmp_path / "weights.pt")
    assert saved["step"] == 8
    expected = ranks.run(reference_weights, str(tmp_path / "reference"), 8)[0]
    for name, tensor in saved["weights"].items():
        assert torch.equal(tensor, expected[name]), name


def test_checkpoints_to_an_fsspec_url_resume_and_refuse_a_fresh_run_there(tmp_path, monkeypatch) -> None:
    # ModelCheckpoint(dirpath=URL) used to become a local directory named "memory:" (pathlib
    # collapses "//"). The URL carries credentials, which no message may show.
    monkeypatch.chdir(tmp_path)
    url = f"memory://user:s3cr3tpass@bucket/{tmp_path.name}/ckpt"

    def run(max_steps: int, resume: str | None) -> Trainer:
        model = SimpleModel()
        trainer = quiet_trainer(
            str(tmp_path),
            strategy="single",
            max_steps=max_steps,
            resume=resume,
            callbacks=[ModelCheckpoint(url, every_n_steps=2, keep_last=2)],
        )
        trainer.fit(
            model,
            RandomDataset(20, 128),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=nn.functional.cross_entropy,
        )
        return trainer

    run(4, None)
    assert not (tmp_path / "memory:").exists()
    fs, root = fsspec_url_to_fs(url)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == [
        "step_000000002",
        "step_000000004",
    ]
    assert run(6, "auto").global_step == 6
    with pytest.raises(distkit.CheckpointConflictError) as refused:
        run(2, None)
    assert "s3cr3tpass" not in str(refused.value) and "memory://***@bucket/" in str(refused.value)


def fsspec_url_to_fs(url: str) -> tuple[object, str]:
    import fsspec

    return fsspec.core.url_to_fs(url)  # type: ignore[no-any-return]

"""The straggler report (issue 27, point 4): each rank's phase times, compared at logging steps;
a rank slowed on purpose is named with its phase, a balanced job never."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

import distkit
from distkit.stragglers import PHASES
from distkit.testing import Ranks
from distkit.trainer import Callback, TrainerView

# ------------------------------------------------------------------------------------------------
# The decision, local: StragglerDetector.observe


def _window(slow_rank: int | None, phase: str, world: int = 4, extra_s: float = 0.05) -> list[list[float]]:
    rows = [[0.01, 0.02, 0.03, 0.005] for _ in range(world)]
    if slow_rank is not None:
        rows[slow_rank][PHASES.index(phase)] += extra_s
    return rows


def test_a_rank_slow_in_windows_in_a_row_is_named_with_its_phase() -> None:
    detector = distkit.StragglerDetector(margin=0.2, windows=2)
    assert detector.observe(_window(2, "data"), steps=10) is None  # one window is not "consistently"
    named = detector.observe(_window(2, "data"), steps=10)
    assert named is not None
    assert (named.rank, named.phase, named.windows) == (2, "data", 2)
    assert named.seconds == pytest.approx(0.006) and named.median_s == pytest.approx(0.001)
    assert "rank 2" in named.message() and "'data'" in named.message()


def test_a_break_in_the_run_of_slow_windows_starts_the_count_again() -> None:
    detector = distkit.StragglerDetector(margin=0.2, windows=2)
    assert detector.observe(_window(1, "forward"), steps=10) is None
    assert detector.observe(_window(None, "forward"), steps=10) is None
    assert detector.observe(_window(1, "forward"), steps=10) is None
    assert detector.observe(_window(1, "optimizer"), steps=10) is None  # another phase: a new run


def test_balanced_ranks_and_small_differences_are_never_named() -> None:
    detector = distkit.StragglerDetector(margin=0.2, windows=1)
    for _ in range(5):
        assert detector.observe(_window(None, "data"), steps=10) is None
        # 10% slower: within the margin.
        assert detector.observe(_window(0, "data", extra_s=0.01 * 0.1), steps=10) is None
        # 3x slower but by 0.8 ms a step: under min_excess_s (timing noise of tiny phases).
        assert detector.observe(_window(0, "optimizer", extra_s=0.008), steps=10) is None


def test_waiting_in_the_gradient_sync_never_names_a_rank() -> None:
    # The fast ranks wait for a straggler in backward (DDP's all-reduce ends there).
    detector = distkit.StragglerDetector(margin=0.2, windows=1)
    assert detector.observe(_window(3, "backward"), steps=10) is None


def test_a_job_of_one_names_nobody_and_bad_options_say_what_is_expected() -> None:
    detector = distkit.StragglerDetector(windows=1)
    assert detector.observe([[1.0, 1.0, 1.0, 1.0]], steps=1) is None
    with pytest.raises(ValueError, match=r"margin must be >= 0, got -0\.1"):
        distkit.StragglerDetector(margin=-0.1)
    with pytest.raises(ValueError, match=r"windows must be >= 1, got 0"):
        distkit.StragglerDetector(windows=0)
    with pytest.raises(ValueError, match=r"straggler_margin must be a number >= 0"):
        distkit.Trainer(straggler_margin=-1)


def test_step_timer_adds_each_lap_to_its_phase() -> None:
    timer = distkit.StepTimer()
    timer.start()
    time.sleep(0.01)
    timer.lap("data")
    timer.lap("forward")
    timer.step()
    assert timer.sums[0] >= 0.01 and timer.sums[1] < 0.01 and timer.steps == 1
    sums = timer.sums
    timer.reset()
    assert sums is timer.sums and timer.sums == [0.0] * 4 and timer.steps == 0
    with pytest.raises(ValueError, match="phase must be one of"):
        timer.lap("loss")


def test_step_timer_costs_about_a_microsecond_a_step() -> None:
    timer, n = distkit.StepTimer(), 20_000
    start = time.perf_counter()
    for _ in range(n):
        for phase in PHASES:
            timer.lap(phase)
        timer.step()
    per_step = (time.perf_counter() - start) / n
    assert per_step < 20e-6, per_step  # about 1-2 us here; loose for a shared machine


# ------------------------------------------------------------------------------------------------
# In the Trainer, on 2 gloo ranks


class _Data(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Rank ``slow_rank`` sleeps ``sleep_s`` per sample; every rank sleeps ``base_s``."""

    def __init__(self, slow_rank: int | None, sleep_s: float, base_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 8, generator=g)
        self.y = (self.x.sum(1) > 0).long()
        self.slow_rank, self.sleep_s, self.base_s = slow_rank, sleep_s, base_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.base_s + (self.sleep_s if dist.get_rank() == self.slow_rank else 0.0))
        return self.x[i], self.y[i]


class _Model(nn.Module):
    def __init__(self, slow_rank: int | None, sleep_s: float, base_s: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.slow_rank, self.sleep_s, self.base_s = slow_rank, sleep_s, base_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.base_s + (self.sleep_s if dist.get_rank() == self.slow_rank else 0.0))
        return self.net(x)  # type: ignore[no-any-return]


class _ModelWithExtras(_Model):
    """A training_step with an extra metric: the logging step reduces through reduce_metrics."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        x, y = batch
        logits = self(x)
        return {"loss": nn.functional.cross_entropy(logits, y), "acc": (logits.argmax(1) == y).float().mean()}


class _Metrics(Callback):
    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []

    def on_log(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        self.logged.append(dict(metrics))


def fit_with(root: str, where: str, slow_rank: int | None, sleep_s: float, base_s: float) -> dict[str, Any]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("distkit.trainer")
    logger.addHandler(handler)
    metrics = _Metrics()
    try:
        trainer = distkit.Trainer(
            max_steps=8,
            batch_size=2,
            log_every_n_steps=2,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            default_root_dir=root,
            seed=0,
            callbacks=[metrics],
        )
        slow = (slow_rank, sleep_s, base_s)
        trainer.fit(
            {"forward": _Model, "extras": _ModelWithExtras}.get(where, _Model)(
                *(slow if where in ("forward", "extras") else (None, 0.0, base_s))
            ),
            _Data(*slow) if where == "data" else _Data(None, 0.0, base_s),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
            loss_fn=nn.functional.cross_entropy,
        )
    finally:
        logger.removeHandler(handler)
    named = [(m.get("straggler_rank"), m.get("straggler_slowdown")) for m in metrics.logged]
    extras = [m.get("acc") for m in metrics.logged]
    return {"named": named, "lines": [r for r in records if "straggler" in r], "extras": extras}


@pytest.mark.parametrize("where", ["data", "forward", "extras"])
def test_a_rank_slowed_on_purpose_is_named_with_its_phase(ranks: Ranks, tmp_path: Path, where: str) -> None:
    # Rank 1 sleeps 5 ms a sample (10 ms a step) in its loader or its forward; 4 logging windows.
    # "extras": its forward, with a training_step that logs an extra metric (the times then ride
    # on reduce_metrics' block instead of the loss's two numbers).
    out = ranks.run(fit_with, str(tmp_path), where, 1, 0.005, 0.0)
    assert all((acc is not None) == (where == "extras") for acc in out[0]["extras"])
    where = "forward" if where == "extras" else where
    assert out[0]["named"] == out[1]["named"]  # every rank decides alike, from the same numbers
    named = out[0]["named"]
    assert named[:2] == [(None, None)] * 2  # named in the third window in a row
    assert all(rank == 1.0 and slowdown is not None and slowdown > 1.2 for rank, slowdown in named[2:]), named
    lines = out[0]["lines"]  # the main process logs
    assert len(lines) == 2 and f"rank 1 is slow in '{where}'" in lines[0], lines
    assert out[1]["lines"] == []


def test_a_balanced_job_is_never_named(ranks: Ranks, tmp_path: Path) -> None:
    # Both ranks sleep alike in both phases: host noise stays far under the 20% margin.
    for where in ("data", "forward"):
        out = ranks.run(fit_with, str(tmp_path), where, None, 0.0, 0.003)
        assert out[0]["named"] == [(None, None)] * 4 and out[0]["lines"] == [], out

"""Trainer(profiler=...) (issue 27, point 5): one Chrome trace per rank of a chosen window of
steps, and the simple per-phase summary printed at the end of fit."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.testing import Ranks
from distkit.trainer import TorchProfiler


def _fit(root: str, profiler: Any, max_steps: int = 6) -> str:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    trainer = distkit.Trainer(
        max_steps=max_steps,
        batch_size=4,
        log_every_n_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=root,
        seed=0,
        profiler=profiler,
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.fit(
            model,
            TensorDataset(x, (x.sum(1) > 0).long()),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
            loss_fn=nn.functional.cross_entropy,
        )
    return out.getvalue()


def torch_profile(root: str) -> list[str]:
    _fit(root, TorchProfiler(wait=1, warmup=1, active=2, dir=str(Path(root) / "traces")))
    return sorted(p.name for p in (Path(root) / "traces").iterdir())


def test_torch_profiler_writes_one_chrome_trace_per_rank_of_the_step_window(
    ranks: Ranks, tmp_path: Path
) -> None:
    names = ranks.run(torch_profile, str(tmp_path))
    expected = ["rank0.steps3-4.pt.trace.json", "rank1.steps3-4.pt.trace.json"]
    assert names[0] == names[1] == expected  # a shared directory: both ranks' files
    for name in expected:
        trace = json.loads((tmp_path / "traces" / name).read_text())
        spans = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
        # torch numbers the profiler's steps from 0: global steps 3 and 4 are its steps 2 and 3.
        assert spans == {"ProfilerStep#2", "ProfilerStep#3"}, spans
        ops = {e.get("name") for e in trace["traceEvents"]}
        assert "aten::addmm" in ops  # the model's forward is in it


def test_a_fit_ending_inside_the_window_writes_what_it_recorded(tmp_path: Path) -> None:
    _fit(str(tmp_path), TorchProfiler(wait=0, warmup=1, active=5, dir=str(tmp_path / "t")), max_steps=3)
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["rank0.steps2-3.pt.trace.json"]


def simple_profile(root: str) -> str:
    return _fit(root, "simple", max_steps=5)  # a partial window after the last logging step


def test_simple_profiler_prints_each_phase_with_the_slowest_rank(ranks: Ranks, tmp_path: Path) -> None:
    out = ranks.run(simple_profile, str(tmp_path))
    assert "profile (5 steps, 2 ranks" in out[0], out[0]
    for phase in ("data", "forward", "backward", "optimizer"):
        assert f"  {phase} " in out[0]
    assert "profile" not in out[1]  # the main process prints


def test_profiler_options_are_checked_and_torch_means_the_default_window(tmp_path: Path) -> None:
    assert distkit.Trainer(profiler="torch").profiler == TorchProfiler()
    with pytest.raises(ValueError, match="profiler must be None, 'simple', 'torch'"):
        distkit.Trainer(profiler="fast")
    with pytest.raises(ValueError, match=r"TorchProfiler\(active=...\) must be an int >= 1, got 0"):
        TorchProfiler(active=0)

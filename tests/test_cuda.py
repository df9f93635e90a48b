"""CUDA paths on real hardware: NCCL, AMP fp16 with GradScaler, DataParallel on the GPUs there are,
NVML. Every test here skips, naming what it needs, on a machine without CUDA (CI); they run where a
GPU is lent (see docs/testing.md, "GPU checks")."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.testing import Ranks

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _data(n: int = 256, features: int = 20, classes: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


def _trainer(tmp: str, **kwargs: object) -> distkit.Trainer:
    options: dict[str, object] = {
        "default_root_dir": tmp,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "batch_size": 32,
    }
    options.update(kwargs)
    return distkit.Trainer(**options)  # type: ignore[arg-type]


def _nccl_collectives() -> dict[str, object]:
    import torch.distributed as dist

    rank = distkit.get_rank()
    t = torch.full((3,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    metrics = distkit.reduce_metrics({"loss": torch.tensor(2.0, device="cuda"), "n": 3}, op="sum")
    gathered = distkit.all_gather(torch.arange(rank + 2, device="cuda"))
    distkit.barrier()
    return {
        "backend": dist.get_backend(),
        "device": str(t.device),
        "all_reduce": t.tolist(),
        "metrics": {k: float(v) for k, v in metrics.items()},
        "gathered": [g.tolist() for g in gathered],
    }


@needs_cuda
def test_nccl_group_runs_torch_and_distkit_collectives_on_the_gpu(ranks: Ranks) -> None:
    world = min(torch.cuda.device_count(), 2)
    results = ranks.run(_nccl_collectives, backend="nccl", world_size=world)
    total = float(sum(range(1, world + 1)))
    for result in results:
        assert result["backend"] == "nccl" and str(result["device"]).startswith("cuda")
        assert result["all_reduce"] == [total] * 3
        assert result["metrics"] == {"loss": 2.0 * world, "n": 3.0 * world}
        assert result["gathered"] == [list(range(r + 2)) for r in range(world)]


@needs_cuda
def test_init_without_a_backend_picks_nccl_and_the_local_gpu_in_a_torchrun_world_of_one(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "probe.py"
    script.write_text(
        "import torch, torch.distributed as dist, distkit\n"
        "distkit.init(timeout_s=60)\n"
        "device = distkit.get_device()\n"
        "t = torch.ones(2, device=device)\n"
        "dist.all_reduce(t)\n"
        "print('RESULT', dist.get_backend(), device, t.tolist(), flush=True)\n"
        "distkit.shutdown()\n"
    )
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RESULT nccl cuda:0 [1.0, 1.0]" in out.stdout


@needs_cuda
def test_fp16_with_grad_scaler_trains_on_the_gpu_with_fp32_master_weights(tmp_path) -> None:
    model = _model()
    trainer = _trainer(
        str(tmp_path), strategy="single", precision="16-mixed", max_steps=20, log_every_n_steps=1
    )
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(
        model,
        _data(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=nn.functional.cross_entropy,
    )
    assert next(model.parameters()).device.type == "cuda"
    assert next(model.parameters()).dtype == torch.float32  # master weights stay fp32
    assert any(not torch.equal(b, p.detach().cpu()) for b, p in zip(before, model.parameters(), strict=True))
    assert math.isfinite(trainer.callback_metrics["train_loss"])
    assert trainer.global_step == 20


@needs_cuda
def test_bf16_autocast_on_cuda_computes_in_bf16_with_fp32_master_weights(tmp_path) -> None:
    seen: list[torch.dtype] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.net(x)
            seen.append(out.dtype)
            return out

    model = Probe()
    trainer = _trainer(str(tmp_path), strategy="single", precision="bf16-mixed", max_steps=3)
    trainer.fit(
        model,
        _data(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=nn.functional.cross_entropy,
    )
    assert seen and set(seen) == {torch.bfloat16}
    assert next(model.parameters()).dtype == torch.float32


@needs_cuda
def test_dataparallel_on_the_one_gpu_there_is_trains(tmp_path) -> None:
    model = _model()
    trainer = _trainer(str(tmp_path), strategy="dp", devices=[0], max_steps=5, log_every_n_steps=1)
    trainer.fit(
        model,
        _data(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=nn.functional.cross_entropy,
    )
    assert trainer.effective_batch_size == 32
    assert math.isfinite(trainer.callback_metrics["train_loss"])
    assert isinstance(model, nn.Module) and next(model.parameters()).device.type == "cuda"


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="needs exactly one CUDA GPU")
def test_dataparallel_asking_for_more_gpus_than_there_are_names_the_count(tmp_path) -> None:
    with pytest.raises(distkit.DistkitError, match=r"names CUDA device\(s\) \[1\], but this process sees 1"):
        _trainer(str(tmp_path), strategy="dp", devices=[0, 1], max_steps=1)


@needs_cuda
def test_gpu_monitor_and_memory_stats_in_a_trainer_run(tmp_path) -> None:
    model = _model()
    with distkit.GPUMonitor(interval_s=0.05) as mon:
        _trainer(str(tmp_path), strategy="single", max_steps=30).fit(
            model,
            _data(),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=nn.functional.cross_entropy,
        )
        stats = distkit.memory_stats(0)
    assert stats["peak_allocated_mib"] > 0
    if mon.available:  # NVML present: one entry per visible GPU, named by its torch index
        summary = mon.summary()
        assert "cuda:0" in summary and summary["cuda:0"]["mem_total_mib"] > 1000


def _ddp_fp16_fit(root: str) -> dict[str, object]:
    import torch.distributed as dist

    model = _model()
    trainer = _trainer(
        root,
        strategy="ddp",
        precision="16-mixed",
        max_steps=6,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        log_every_n_steps=1,
    )
    trainer.fit(
        model,
        _data(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=nn.functional.cross_entropy,
    )
    return {
        "backend": dist.get_backend(),
        "steps": trainer.global_step,
        "loss": trainer.callback_metrics["train_loss"],
        "device": str(next(model.parameters()).device),
    }


@needs_cuda
def test_ddp_on_nccl_with_fp16_accumulation_and_clipping_trains(ranks: Ranks, tmp_path) -> None:
    world = min(torch.cuda.device_count(), 2)
    for result in ranks.run(_ddp_fp16_fit, str(tmp_path), backend="nccl", world_size=world):
        assert result["backend"] == "nccl" and result["steps"] == 6
        assert str(result["device"]).startswith("cuda") and math.isfinite(float(result["loss"]))


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="needs exactly one CUDA GPU")
def test_two_processes_on_one_gpu_get_distkits_error_instead_of_nccls_invalid_usage(tmp_path) -> None:
    import os
    import subprocess
    import sys

    script = tmp_path / "two_on_one.py"
    script.write_text("import distkit\ndistkit.init(timeout_s=60)\n")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode != 0
    assert "this node runs 2 processes but sees 1 GPU" in out.stderr
    assert "torchrun --nproc_per_node=1" in out.stderr and "invalid usage" not in out.stderr

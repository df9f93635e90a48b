"""CUDA paths on real hardware: NCCL, AMP fp16 with GradScaler, DataParallel on the GPUs there are,
NVML, FSDP2 (the Trainer's strategy="fsdp", shard_model, sync_buffers) and its sharded checkpoints.
Every test here skips, naming what it needs, on a machine without CUDA (CI); they run where a GPU is
lent (see docs/testing.md, "GPU checks")."""

from __future__ import annotations

import math
import os
import statistics

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


# --------------------------------------------------------------------------------------------------
# FSDP on one GPU. One NCCL rank is a world of one, where Trainer(strategy="fsdp") shards nothing
# and trains the plain model (docs/fsdp.md): the Trainer tests check that on the GPU. torch's FSDP2
# itself (DTensor shards on CUDA, NCCL all-gathers and reduce-scatters, MixedPrecisionPolicy, DCP)
# runs through distkit.shard_model, which shards over any process group, a group of one included.


class _Blocks(nn.Module):
    """Three blocks of 4,560 to 4,960 parameters (with a BatchNorm1d in each when ``norm``), so that
    min_unit_params=4000 makes each block a sharding unit, as tests/test_fsdp.py's MLP."""

    def __init__(self, norm: bool = True) -> None:
        super().__init__()

        def block(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
            middle: list[nn.Module] = [nn.BatchNorm1d(hidden)] if norm else []
            return nn.Sequential(nn.Linear(inputs, hidden), *middle, nn.ReLU(), nn.Linear(hidden, outputs))

        self.blocks = nn.Sequential(block(20, 64, 50), block(50, 64, 20), block(20, 150, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _learnable(n: int = 2048) -> TensorDataset:
    """Vectors whose class (of 10) is the index of the largest of their first 4 features: a rule
    that _Blocks learns within a few dozen steps (measured on the CPU, fp32 and bf16: the loss falls
    to 0.36-0.48 of its start in 40 steps of 32), so that a falling loss shows that training works.
    Random labels, as in _data(), give a loss that barely moves on batches the model has not seen."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 20, generator=g)
    return TensorDataset(x, x[:, :4].argmax(dim=1))


def _assert_trains(losses: list[float], what: str) -> None:
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert all(math.isfinite(v) for v in losses), f"{what}: non-finite losses {losses}"
    assert last < 0.7 * first, (
        f"{what}: the loss did not fall: {first:.4f} over the first 5 steps, {last:.4f} over the last 5"
    )


def _running_stats(
    model: nn.Module, initial: dict[str, torch.Tensor]
) -> dict[str, tuple[str, torch.dtype, bool]]:
    """(device, dtype, changed since ``initial``) of every BatchNorm running mean and variance."""
    return {
        name: (str(b.device), b.dtype, not torch.equal(b.cpu(), initial[name].cpu()))
        for name, b in model.named_buffers()
        if "running" in name
    }


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict in full on the CPU (DTensors gathered from their shards). Collective."""
    from torch.distributed.tensor import DTensor

    return {
        name: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
        for name, v in model.state_dict().items()
    }


class _Observe(distkit.Callback):
    """Each step's loss, and the dtype of the first Linear's output (the dtype the forward computes in)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.forward_dtypes: set[torch.dtype] = set()

    def on_fit_start(self, trainer: distkit.Trainer) -> None:
        assert trainer.model is not None
        trainer.model.blocks[0][0].register_forward_hook(lambda m, i, o: self.forward_dtypes.add(o.dtype))

    def on_train_step_end(self, trainer: distkit.Trainer, loss: torch.Tensor) -> None:
        self.losses.append(loss.item())


def _fsdp_strategy_fit(root: str, precision: str) -> dict[str, object]:
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = _Blocks()
    initial = {name: b.clone() for name, b in model.named_buffers()}
    observe = _Observe()
    trainer = _trainer(
        root,
        strategy=distkit.FSDPStrategy(min_unit_params=4000),
        precision=precision,
        max_steps=40,
        batch_size=32,
        seed=0,
        callbacks=[observe],
    )
    trainer.fit(
        model,
        _learnable(),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        loss_fn=nn.functional.cross_entropy,
    )
    return {
        "losses": observe.losses,
        "forward_dtypes": observe.forward_dtypes,
        "sharded": any(isinstance(p, DTensor) for p in model.parameters()),
        "params": {(str(p.device), p.dtype) for p in model.parameters()},
        "running": _running_stats(model, initial),
    }


@needs_cuda
@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_fsdp_strategy_on_one_nccl_rank_trains_the_plain_model_with_batchnorm_on_the_gpu(
    ranks: Ranks, tmp_path, precision: str
) -> None:
    # A world of one: strategy="fsdp" trains as "single" does, so bf16-mixed is autocast and each
    # BatchNorm computes on bfloat16 inputs with float32 parameters and statistics (CUDA's kernels
    # take that mix; the CPU's refuse it, which is why sharded bf16 makes them float32 units).
    (seen,) = ranks.run(_fsdp_strategy_fit, str(tmp_path), precision, backend="nccl", world_size=1)
    _assert_trains(seen["losses"], f"Trainer(strategy='fsdp', precision={precision!r})")
    assert len(seen["losses"]) == 40
    assert not seen["sharded"]  # docs/fsdp.md: a world of one shards nothing
    assert seen["params"] == {("cuda:0", torch.float32)}  # float32 master weights on the GPU
    assert seen["forward_dtypes"] == {torch.bfloat16 if precision == "bf16-mixed" else torch.float32}
    assert len(seen["running"]) == 6  # 3 BatchNorms x (running_mean, running_var)
    for name, stat in seen["running"].items():
        assert stat == ("cuda:0", torch.float32, True), f"{name}: (device, dtype, changed) = {stat}"


def _shard_model_loop(mixed_precision: str | None, norm: bool) -> dict[str, object]:
    """A hand-written loop over distkit.shard_model on this rank's GPU, distkit.sync_buffers after
    every step (as docs/fsdp.md asks of a hand-written FSDP loop)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = _Blocks(norm).cuda()
    initial = {name: b.clone() for name, b in model.named_buffers()}
    distkit.shard_model(model, min_unit_params=4000, mixed_precision=mixed_precision)
    dtypes: dict[str, set[torch.dtype]] = {
        "first": set(),
        "norm_input": set(),
        "after_norm": set(),
        "output": set(),
    }
    # Forward hooks see a unit's input after FSDP's cast and its output before the next unit's.
    model.blocks[0][0].register_forward_hook(lambda m, i, o: dtypes["first"].add(o.dtype))
    if norm:
        model.blocks[0][1].register_forward_hook(lambda m, i, o: dtypes["norm_input"].add(i[0].dtype))
        model.blocks[0][2].register_forward_hook(lambda m, i, o: dtypes["after_norm"].add(i[0].dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x_all, y_all = _learnable().tensors
    losses = []
    synced_unchanged = True
    for step in range(40):
        x, y = x_all[step * 32 : (step + 1) * 32].cuda(), y_all[step * 32 : (step + 1) * 32].cuda()
        out = model(x)
        dtypes["output"].add(out.dtype)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        before = {name: b.clone() for name, b in model.named_buffers()}
        distkit.sync_buffers(model)  # a group of one: nothing to receive, so nothing may change
        synced_unchanged = synced_unchanged and all(
            torch.equal(b, before[n]) for n, b in model.named_buffers()
        )
        losses.append(loss.item())
    # sync_buffers on a plain (unsharded) model on the GPU, with statistics that are not the initial ones.
    plain = _Blocks(norm).cuda()
    plain(x_all[:16].cuda())
    before = {name: b.clone() for name, b in plain.named_buffers()}
    distkit.sync_buffers(plain)
    plain_unchanged = all(torch.equal(b, before[n]) for n, b in plain.named_buffers())
    params = list(model.parameters())
    return {
        "losses": losses,
        "units": sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule)),
        "sharded": all(isinstance(p, DTensor) for p in params),
        "mesh": {p.device_mesh.device_type for p in params},
        "shards": {(str(p.to_local().device), p.dtype) for p in params},
        "local_share": sum(p.to_local().numel() for p in params) / sum(p.numel() for p in params),
        "dtypes": dtypes,
        "running": _running_stats(model, initial),
        "synced_unchanged": synced_unchanged,
        "plain_unchanged": plain_unchanged,
    }


@needs_cuda
@pytest.mark.parametrize("mixed_precision", [None, "bf16"], ids=["fp32", "bf16"])
def test_shard_model_on_one_nccl_rank_holds_float32_dtensor_shards_on_the_gpu_and_trains(
    ranks: Ranks, mixed_precision: str | None
) -> None:
    (seen,) = ranks.run(_shard_model_loop, mixed_precision, False, backend="nccl", world_size=1)
    _assert_trains(seen["losses"], f"shard_model(mixed_precision={mixed_precision!r})")
    assert seen["units"] == ["", "blocks.0", "blocks.1", "blocks.2"]  # the root and three blocks
    assert seen["sharded"] and seen["mesh"] == {"cuda"}  # FSDP2 chose the CUDA mesh
    # The shards (the optimizer's parameters) stay float32 on the GPU; one rank holds all of them.
    assert seen["shards"] == {("cuda:0", torch.float32)}
    assert seen["local_share"] == 1.0
    compute = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    assert seen["dtypes"]["first"] == {compute}
    assert seen["dtypes"]["output"] == {torch.float32}  # the loss is computed in float32
    assert seen["synced_unchanged"] and seen["plain_unchanged"]


@needs_cuda
def test_bf16_shard_model_with_batchnorm_trains_on_the_gpu_with_float32_statistics(ranks: Ranks) -> None:
    (seen,) = ranks.run(_shard_model_loop, "bf16", True, backend="nccl", world_size=1)
    _assert_trains(seen["losses"], "shard_model(mixed_precision='bf16') with BatchNorm1d")
    # Each BatchNorm is a float32 unit of its own inside its block's unit.
    assert seen["units"] == ["", "blocks.0", "blocks.0.1", "blocks.1", "blocks.1.1", "blocks.2", "blocks.2.1"]
    assert seen["dtypes"]["first"] == {torch.bfloat16}
    assert seen["dtypes"]["norm_input"] == {torch.float32}  # cast up: the norm computes in float32
    assert seen["dtypes"]["after_norm"] == {torch.bfloat16}  # handed on in the next layer's dtype
    assert len(seen["running"]) == 6
    for name, stat in seen["running"].items():
        assert stat == ("cuda:0", torch.float32, True), f"{name}: (device, dtype, changed) = {stat}"
    assert seen["synced_unchanged"] and seen["plain_unchanged"]


# Why bitwise equality is expected on a GPU, as on the CPU: the resumed run repeats the uninterrupted
# run's kernels with the same shapes, in the same process, on the same GPU, and none of the kernels
# these models use (cuBLAS GEMMs, BatchNorm, cross-entropy, AdamW's foreach kernels, NCCL on one
# rank) accumulates with atomics, so each gives the same bits every time.


def _fsdp_strategy_resumable(root: str, max_steps: int, resume: str | None) -> dict[str, object]:
    torch.manual_seed(0)
    model = _Blocks()
    observe = _Observe()
    trainer = _trainer(
        root,
        strategy=distkit.FSDPStrategy(min_unit_params=4000),
        max_steps=max_steps,
        batch_size=16,
        seed=0,
        resume=resume,
        enable_checkpointing=True,
        callbacks=[observe, distkit.ModelCheckpoint(every_n_steps=3, every_n_epochs=0)],
    )
    trainer.fit(
        model,
        _learnable(),  # 128 steps per epoch: every checkpoint is mid-epoch
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        loss_fn=nn.functional.cross_entropy,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
    )
    return {
        "losses": observe.losses,
        "state": _full_state(model),
        "files": sorted(os.listdir(os.path.join(root, "checkpoints", "step_000000003"))),
    }


@needs_cuda
def test_fsdp_strategy_checkpoint_on_the_gpu_resumes_bitwise(ranks: Ranks, tmp_path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    uninterrupted = ranks.run(_fsdp_strategy_resumable, a, 8, None, backend="nccl", world_size=1)[0]
    ranks.run(_fsdp_strategy_resumable, b, 4, None, backend="nccl", world_size=1)  # "killed" after step 4
    resumed = ranks.run(_fsdp_strategy_resumable, b, 8, "auto", backend="nccl", world_size=1)[0]
    # A world of one trains the plain model, so the checkpoint is a full one (no DCP shards).
    assert not any(name.endswith(".distcp") for name in resumed["files"])
    assert resumed["losses"] == uninterrupted["losses"][3:]  # steps 4..8, bitwise
    assert sorted(resumed["state"]) == sorted(uninterrupted["state"])  # weights and BatchNorm buffers
    for name, value in uninterrupted["state"].items():
        assert torch.equal(resumed["state"][name], value), f"{name} of the resumed run differs"


def _shard_model_checkpointed(directory: str, steps: int, resume: bool) -> dict[str, object]:
    """A shard_model loop on the GPU that saves a sharded checkpoint after step 3 and, with
    ``resume``, starts from the newest checkpoint in ``directory``."""
    torch.manual_seed(0)
    model = distkit.shard_model(_Blocks().cuda(), min_unit_params=4000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optimizer": optimizer}
    x_all, y_all = _learnable().tensors
    losses = []
    with distkit.CheckpointManager(directory) as manager:
        start = (manager.restore(state) or 0) if resume else 0
        for step in range(start, steps):
            x, y = x_all[step * 16 : (step + 1) * 16].cuda(), y_all[step * 16 : (step + 1) * 16].cuda()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            distkit.sync_buffers(model)
            losses.append(loss.item())
            if step + 1 == 3:
                manager.save(3, state)
    return {
        "start": start,
        "losses": losses,
        "state": _full_state(model),
        "files": sorted(os.listdir(os.path.join(directory, "step_000000003"))),
    }


@needs_cuda
def test_a_sharded_checkpoint_of_a_shard_model_loop_on_the_gpu_resumes_bitwise(
    ranks: Ranks, tmp_path
) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    uninterrupted = ranks.run(_shard_model_checkpointed, a, 8, False, backend="nccl", world_size=1)[0]
    ranks.run(_shard_model_checkpointed, b, 4, False, backend="nccl", world_size=1)  # "killed" after step 4
    resumed = ranks.run(_shard_model_checkpointed, b, 8, True, backend="nccl", world_size=1)[0]
    assert resumed["start"] == 3
    # Written through torch.distributed.checkpoint from the CUDA shards: DCP's metadata and one
    # shard file of rank 0.
    assert ".metadata" in resumed["files"] and "__0_0.distcp" in resumed["files"]
    assert resumed["losses"] == uninterrupted["losses"][3:]  # steps 4..8, bitwise
    assert sorted(resumed["state"]) == sorted(uninterrupted["state"])
    for name, value in uninterrupted["state"].items():
        assert torch.equal(resumed["state"][name], value), f"{name} of the resumed run differs"

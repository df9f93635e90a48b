"""The Trainer on streams (ShardFiles, torch IterableDatasets): the same steps on every rank, a
stream's last accumulation synced, exact validation and predictions in stream order, and a run
stopped mid-epoch that resumes on 1, 2 and 3 processes with nothing repeated or skipped (sample
ids listed)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from _launch import job_env, torchrun
from distkit.testing import Ranks
from distkit.trainer import ModelCheckpoint, warmup_schedule

SHARDS, LINES, BATCH = 5, 23, 4  # 115 samples


def _shards(root: Path) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(SHARDS):
        path = root / f"shard-{shard}.txt"
        path.write_text("".join(f"s{shard}-{line}\n" for line in range(LINES)))
        paths.append(str(path))
    return paths


def _features(ids: list[str]) -> torch.Tensor:
    pairs = [sample[1:].split("-") for sample in ids]
    return torch.tensor([[float(shard), float(line) / 10.0] for shard, line in pairs])


class IdModel(nn.Module):
    """Learns from the ids themselves, and lists the ids it trained on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(2, 1)
        self.seen: list[str] = []

    def forward(self, ids: list[str]) -> torch.Tensor:
        return self.lin(_features(ids)).squeeze(1)

    def training_step(self, batch: list[str], batch_idx: int) -> torch.Tensor:
        self.seen.extend(batch)
        return (self(batch) - 1.0).pow(2).mean()

    def validation_step(self, batch: list[str], batch_idx: int) -> dict[str, Any]:
        errors = (self(batch) - 1.0).pow(2)
        return {"val_loss": (errors.sum(), len(batch))}


def _trainer(root: str, **options: Any) -> distkit.Trainer:
    defaults: dict[str, Any] = {
        "batch_size": BATCH,
        "seed": 0,
        "logger": False,
        "enable_progress_bar": False,
        "default_root_dir": root,
        "callbacks": [ModelCheckpoint(every_n_steps=5, every_n_minutes=None)],
    }
    defaults.update(options)
    return distkit.Trainer(**defaults)


def fit_stream(paths: list[str], root: str, workers: int, **options: Any) -> dict[str, Any]:
    model = IdModel()
    trainer = _trainer(root, num_workers=workers, **options)
    trainer.fit(model, distkit.ShardFiles(paths), optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    return {
        "seen": model.seen,
        "weights": [p.detach().clone() for p in model.parameters()],
        "step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "batches": trainer.num_training_batches,
        "total": trainer.total_steps,
    }


def _stream_order(paths: list[str]) -> list[str]:
    """The epoch-0 global stream the Trainer's training loader reads (seed 0, shuffled)."""
    loader = distkit.distributed_dataloader(
        distkit.ShardFiles(paths), BATCH, seed=0, evaluation=True, shuffle=True, collate_fn=list
    )
    return [sample for batch in loader for sample in batch]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("after", [1, 2, 3])
def test_a_stream_stopped_mid_epoch_resumes_on_any_number_of_ranks(
    ranks: Ranks, tmp_path: Path, workers: int, after: int
) -> None:
    paths, root = _shards(tmp_path / "data"), str(tmp_path / "run")
    first = ranks.run(fit_stream, paths, root, workers, max_epochs=1, max_steps=5)
    assert [r["step"] for r in first] == [5, 5] and first[0]["batches"] is None
    rest = ranks.run(fit_stream, paths, root, workers, max_epochs=1, resume="auto", world_size=after)
    done = [s for r in first for s in r["seen"]]
    then = [s for r in rest for s in r["seen"]]
    assert len(done) == 5 * 2 * BATCH
    assert len(set(done + then)) == len(done + then), "a sample was trained on twice"
    consumed = len(done) + (115 - len(done)) // (after * BATCH) * (after * BATCH)
    assert sorted(done + then) == sorted(_stream_order(paths)[:consumed]), "a sample was skipped"
    assert all(r["epoch"] == 1 and r["total"] is None for r in rest)
    if after == 2:  # the same world size: bitwise the uninterrupted run
        whole = ranks.run(fit_stream, paths, str(tmp_path / "whole"), workers, max_epochs=1)
        for w, f, r in zip(whole, first, rest, strict=True):
            assert w["seen"] == f["seen"] + r["seen"]
            assert all(torch.equal(a, b) for a, b in zip(w["weights"], r["weights"], strict=True))


def test_accumulation_over_a_stream_syncs_its_last_partial_group(ranks: Ranks, tmp_path: Path) -> None:
    # 115 samples, 2 ranks x 4: 14 batches a rank; 3 per step: 5 steps, the last of 2 batches.
    paths = _shards(tmp_path / "data")
    out = ranks.run(fit_stream, paths, str(tmp_path / "run"), 0, max_epochs=2, accumulate_grad_batches=3)
    assert [r["step"] for r in out] == [10, 10] and [len(r["seen"]) for r in out] == [112, 112]
    # An unsynced last group would leave the ranks' weights apart.
    assert all(torch.equal(a, b) for a, b in zip(out[0]["weights"], out[1]["weights"], strict=True))


def validate_and_predict(paths: list[str], root: str) -> tuple[float, list[float] | None]:
    model = IdModel()
    trainer = _trainer(root, max_epochs=1, enable_checkpointing=False, callbacks=[])
    metrics = trainer.validate(model, distkit.ShardFiles(paths))

    class Predict(IdModel):
        def predict_step(self, batch: list[str], batch_idx: int) -> torch.Tensor:
            return self(batch)

    predictions = trainer.predict(Predict(), distkit.ShardFiles(paths))
    return metrics["val_loss"], None if predictions is None else predictions.tolist()


def test_validation_and_prediction_on_a_stream_equal_one_process(ranks: Ranks, tmp_path: Path) -> None:
    paths = _shards(tmp_path / "data")
    one = ranks.run(validate_and_predict, paths, str(tmp_path / "one"), world_size=1)[0]
    three = ranks.run(validate_and_predict, paths, str(tmp_path / "three"), world_size=3)
    assert three[0][0] == pytest.approx(one[0], rel=1e-6) and three[1][0] == three[0][0]
    expected = IdModel()(_stream_order_plain(paths)).tolist()
    assert one[1] == pytest.approx(expected) and three[0][1] == pytest.approx(expected)
    assert len(expected) == 115


def _stream_order_plain(paths: list[str]) -> list[str]:
    return [f"s{i}-{j}" for i in range(SHARDS) for j in range(LINES)]


class Numbers(torch.utils.data.IterableDataset[torch.Tensor]):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return (torch.tensor([float(i)]) for i in range(10))


def test_a_dataloader_without_a_length_trains_and_ends_its_epochs(tmp_path: Path) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return (batch * self.w).pow(2).mean() + self.w.sum()

    loader = torch.utils.data.DataLoader(Numbers(), batch_size=3)  # 4 batches, no len()
    trainer = _trainer(str(tmp_path), max_epochs=2, accumulate_grad_batches=3, callbacks=[])
    trainer.fit(Model(), loader, optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    assert trainer.global_step == 4 and trainer.current_epoch == 2  # 2 steps an epoch: 3 + 1
    assert trainer.num_training_batches is None and trainer.total_steps is None


def test_a_warmup_schedule_in_epochs_over_a_stream_asks_for_max_steps(tmp_path: Path) -> None:
    paths = _shards(tmp_path / "data")
    trainer = _trainer(str(tmp_path / "run"), max_epochs=1, callbacks=[], enable_checkpointing=False)
    with pytest.raises(ValueError, match="max_steps"):
        trainer.fit(
            IdModel(),
            distkit.ShardFiles(paths),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
            lr_scheduler=warmup_schedule(warmup_epochs=1),
        )


SCRIPTS = Path(__file__).resolve().parent / "trainer_scripts"
CORPUS = 115  # stream_job.py's SAMPLES


def _tar_corpus(root: Path) -> None:
    root.mkdir(parents=True)
    for shard in range(5):
        with tarfile.open(root / f"train-{shard}.tar", "w") as archive:
            for i in range(shard * 23, (shard + 1) * 23):
                data = f"sample {i}".encode()
                info = tarfile.TarInfo(f"{i:05d}.txt")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))


def _job(kind: str, data: Path, run: Path, out: Path, processes: int, *extra: str) -> None:
    out.mkdir(exist_ok=True)
    command = torchrun(
        str(SCRIPTS / "stream_job.py"),
        kind,
        str(data),
        str(run),
        str(out),
        *extra,
        options=("--standalone", f"--nproc_per_node={processes}"),
    )
    result = subprocess.run(command, env=job_env(), capture_output=True, text=True, timeout=300)
    print(result.stdout[-3000:], result.stderr[-5000:], sep="\n")
    assert result.returncode == 0


def _seen(out: Path, processes: int) -> list[list[int]]:
    ranks = [json.loads((out / f"seen-{processes}-{rank}.json").read_text()) for rank in range(processes)]
    return [rank["seen"] for rank in ranks]


def _global_order(kind: str, data: Path) -> list[int]:
    """The epoch's shuffled global stream (seed 0, the default buffer), as one process reads it."""
    if kind == "tar":
        source: Any = distkit.ShardFiles(sorted(str(p) for p in data.glob("*.tar")))
    else:
        import datasets

        sys.path.insert(0, str(SCRIPTS))
        try:
            from stream_job import rows
        finally:
            sys.path.remove(str(SCRIPTS))
        source = datasets.IterableDataset.from_generator(rows, gen_kwargs={"n": CORPUS})
    loader = distkit.distributed_dataloader(source, 4, seed=0, evaluation=True, shuffle=True, collate_fn=list)
    return [int(s["__key__"] if kind == "tar" else s["id"]) for batch in loader for s in batch]


@pytest.mark.parametrize("kind", ["tar", "hf"])
def test_a_torchrun_job_on_a_stream_stops_mid_epoch_and_resumes_on_1_and_3_processes(
    tmp_path: Path, kind: str, world_of_one: pytest.MonkeyPatch
) -> None:
    data, run = tmp_path / "data", tmp_path / "run"
    if kind == "tar":
        _tar_corpus(data)
    else:
        data.mkdir()
    _job(kind, data, run, tmp_path / "first", 2, "--max-steps", "5")
    done = [i for rank in _seen(tmp_path / "first", 2) for i in rank]
    assert len(done) == 5 * 2 * 4
    order = _global_order(kind, data)
    assert sorted(order) == list(range(CORPUS))
    for after in (1, 3):
        copy = tmp_path / f"run-{after}"
        shutil.copytree(run, copy)
        _job(kind, data, copy, tmp_path / f"then-{after}", after)
        then = [i for rank in _seen(tmp_path / f"then-{after}", after) for i in rank]
        assert len(set(done + then)) == len(done + then), f"a sample trained twice ({after} processes)"
        consumed = len(done) + (CORPUS - len(done)) // (after * 4) * (after * 4)
        assert sorted(done + then) == sorted(order[:consumed]), f"a sample skipped ({after} processes)"

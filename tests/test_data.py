"""Distributed data loading on real gloo groups: reproducible batches, exact evaluation, mid-epoch
resume, equal batch counts on uneven data, bad input, metric gathering, profiling, LR helpers."""

from __future__ import annotations

import random
import time
import warnings
from collections import namedtuple
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import distkit
from distkit.data import DistributedLoader, DistributedSplitSampler
from distkit.data._split import _batch_plan, _rank_batches

# DataLoader workers start from the rank's own forkserver, which distkit.testing preloads with torch
# (milliseconds a worker once it runs). Not "fork": a worker forked from a rank can hang for good
# when one of the rank's gloo threads takes an interpreter lock at that moment (docs/testing.md).
WORKER_START_METHOD = "forkserver"


class AugmentedDataset(torch.utils.data.Dataset):
    """Sample i is (i, features + noise): the noise draws on python's, numpy's and torch's RNGs,
    as random augmentations do."""

    def __init__(self, n: int = 22) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = random.random() + float(np.random.rand()) + torch.rand(()).item()
        x = torch.full((4,), i / self.n) + noise / 3  # of order 1, so that training stays finite
        return torch.tensor(i), x


class DrawsDataset(torch.utils.data.Dataset):
    """Sample i records who loaded it and three random draws."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        worker = -1 if info is None else info.id
        draws = [random.random(), float(np.random.rand()), torch.rand(()).item()]
        return torch.tensor([float(distkit.get_rank()), float(worker), float(i), *draws], dtype=torch.float64)


class SlowDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.002)
        return torch.tensor(float(i))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))


def train_steps(
    seed: int, num_workers: int, steps: int
) -> tuple[list[list[int]], list[torch.Tensor], list[float]]:
    distkit.seed_everything(seed)
    loader = distkit.distributed_dataloader(
        AugmentedDataset(), 4, num_workers=num_workers, multiprocessing_context=WORKER_START_METHOD
    )
    model = DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    indices, inputs, losses = [], [], []
    while len(losses) < steps:
        for idx, x in loader:
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            indices.append(idx.tolist())
            inputs.append(x)
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return indices, inputs, losses


def test_two_seeded_runs_give_bitwise_identical_batches_and_losses(ranks) -> None:
    # 22 samples on 2 ranks in batches of 4: 3 batches per epoch, so 7 steps cross two epochs.
    first = ranks.run(train_steps, 5, 2, 7, world_size=2)
    second = ranks.run(train_steps, 5, 2, 7, world_size=2)
    other_seed = ranks.run(train_steps, 6, 2, 7, world_size=2)
    for (idx_a, x_a, loss_a), (idx_b, x_b, loss_b), (idx_c, _, _) in zip(
        first, second, other_seed, strict=True
    ):
        assert idx_a == idx_b
        assert all(torch.equal(a, b) for a, b in zip(x_a, x_b, strict=True))
        assert loss_a == loss_b
        assert idx_a != idx_c  # the seed does change the order: the comparison above can fail
    epoch0 = [{i for batch in indices[:3] for i in batch} for indices, _, _ in first]
    assert not epoch0[0] & epoch0[1]  # disjoint in epoch 0 (22 divides by 2: no padding)


def test_batches_do_not_depend_on_the_number_of_workers(ranks) -> None:
    with_workers = ranks.run(train_steps, 5, 2, 4, world_size=2)
    in_process = ranks.run(train_steps, 5, 0, 4, world_size=2)
    for (idx_a, x_a, loss_a), (idx_b, x_b, loss_b) in zip(with_workers, in_process, strict=True):
        assert idx_a == idx_b and loss_a == loss_b
        assert all(torch.equal(a, b) for a, b in zip(x_a, x_b, strict=True))


def draws_by_rank_and_worker(num_workers: int) -> tuple[torch.Tensor, bool]:
    distkit.seed_everything(0)
    before = torch.get_rng_state()
    loader = distkit.distributed_dataloader(
        DrawsDataset(), 2, num_workers=num_workers, seed=1, multiprocessing_context=WORKER_START_METHOD
    )
    rows = torch.cat([batch for _ in range(2) for batch in loader])
    return rows, torch.equal(before, torch.get_rng_state())


def test_ranks_workers_and_epochs_draw_distinct_random_streams(ranks) -> None:
    results = ranks.run(draws_by_rank_and_worker, 2, world_size=2)
    rows = torch.cat([rows for rows, _ in results])
    assert set(rows[:, 0].tolist()) == {0.0, 1.0} and set(rows[:, 1].tolist()) == {0.0, 1.0}
    for column in (3, 4, 5):  # python, numpy, torch draws: all distinct across ranks, workers, epochs
        assert rows[:, column].unique().numel() == rows.shape[0]
    # Loading in the training process leaves its RNGs as they were.
    in_process = ranks.run(draws_by_rank_and_worker, 0, world_size=2)
    assert all(untouched for _, untouched in results + in_process)
    assert torch.cat([rows for rows, _ in in_process])[:, 3:].unique().numel() == 3 * rows.shape[0]


# What this worker drew in its worker_init_fn, before it loaded any batch (per worker process).
_WORKER_START_DRAWS: list[float] = []


def draw_at_worker_start(worker_id: int) -> None:
    # Randomness outside any batch, as a dataset that picks a shard order or opens a random file at
    # worker start draws it: it sees the worker's own stream, not a batch's.
    _WORKER_START_DRAWS[:] = [random.random(), float(np.random.rand()), torch.rand(()).item()]


class WorkerStartDataset(torch.utils.data.Dataset):
    """Sample i records who loaded it and what that worker drew when it started."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        worker = -1 if info is None else info.id
        return torch.tensor(
            [float(distkit.get_rank()), float(worker), *_WORKER_START_DRAWS], dtype=torch.float64
        )


def draws_at_worker_start() -> torch.Tensor:
    loader = distkit.distributed_dataloader(  # the same seed on every rank, as in a job
        WorkerStartDataset(),
        2,
        num_workers=2,
        seed=1,
        worker_init_fn=draw_at_worker_start,
        multiprocessing_context=WORKER_START_METHOD,
    )
    return torch.cat(list(loader))


def test_every_rank_and_worker_draws_its_own_stream_at_worker_start(ranks) -> None:
    # 8 samples in batches of 2 on 2 ranks: each rank's 2 batches go one to each of its 2 workers.
    rows = torch.cat(ranks.run(draws_at_worker_start, world_size=2))
    starts = {(int(rank), int(worker)): tuple(draws) for rank, worker, *draws in rows.tolist()}
    assert sorted(starts) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for column in range(3):  # python, numpy, torch: four distinct draws for 2 ranks x 2 workers
        assert len({draws[column] for draws in starts.values()}) == 4, starts


def epoch_orders() -> dict[str, list[list[int]]]:
    loader = distkit.distributed_dataloader(list(range(20)), 5, seed=3)
    sampler = distkit.distributed_sampler(list(range(20)), seed=3)
    user_loader = torch.utils.data.DataLoader(list(range(20)), batch_size=5, sampler=sampler)
    orders = {
        "loader": [torch.cat(list(loader)).tolist() for _ in range(3)],
        "sampler": [torch.cat(list(user_loader)).tolist() for _ in range(2)],
    }
    loader.set_epoch(0)
    orders["loader_again"] = [torch.cat(list(loader)).tolist()]
    sampler.set_epoch(0)
    orders["sampler_again"] = [torch.cat(list(user_loader)).tolist()]
    return orders


def test_each_pass_uses_a_new_epoch_order_without_set_epoch(ranks) -> None:
    results = ranks.run(epoch_orders, world_size=2)
    for kind in ("loader", "sampler"):
        per_epoch = [results[0][kind][e] + results[1][kind][e] for e in range(len(results[0][kind]))]
        assert all(sorted(order) == list(range(20)) for order in per_epoch)
        assert per_epoch[0] != per_epoch[1]
        for rank in (0, 1):  # set_epoch(0) still replays epoch 0
            assert results[rank][f"{kind}_again"][0] == results[rank][kind][0]
    loader_epochs = [results[0]["loader"][e] + results[1]["loader"][e] for e in range(3)]
    assert loader_epochs[1] != loader_epochs[2]


# ---------------------------------------------------------------------------------------------
# Evaluation split


@settings(max_examples=300, deadline=None)
@given(
    world_size=st.integers(1, 16),
    extra=st.integers(0, 300),
    batch_size=st.integers(1, 40),
)
def test_evaluation_plan_covers_every_index_once_with_equal_batch_counts(
    world_size: int, extra: int, batch_size: int
) -> None:
    n = world_size + extra
    plan = _batch_plan(n, world_size, batch_size, drop_last=False, evaluation=True)
    positions = []
    for rank in range(world_size):
        batches = _rank_batches(plan, rank)
        assert all(1 <= size <= batch_size for _, size in batches)
        positions += [p for start, size in batches for p in range(start, start + size)]
    assert sorted(positions) == list(range(n))
    counts = [sum(sizes) for sizes in plan]
    assert max(counts) - min(counts) <= 1
    if batch_size >= 2:
        assert len({len(sizes) for sizes in plan}) == 1


def eval_indices(n: int, batch_size: int, shuffle: bool) -> tuple[list[list[int]], list[int]]:
    loader = distkit.distributed_dataloader(
        torch.arange(n), batch_size, evaluation=True, shuffle=shuffle, seed=2
    )
    sampler = distkit.distributed_sampler(torch.arange(n), evaluation=True, shuffle=shuffle, seed=2)
    return [batch.tolist() for batch in loader], list(sampler)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 90), batch_size=st.integers(2, 12), shuffle=st.booleans())
def test_evaluation_loader_and_sampler_see_every_sample_exactly_once_on_two_ranks(
    ranks, n: int, batch_size: int, shuffle: bool
) -> None:
    results = ranks.run(eval_indices, n, batch_size, shuffle, world_size=2)
    loaded = [i for batches, _ in results for batch in batches for i in batch]
    sampled = [i for _, indices in results for i in indices]
    assert sorted(loaded) == list(range(n)) and sorted(sampled) == list(range(n))
    assert len(results[0][0]) == len(results[1][0])  # same number of batches on both ranks
    if not shuffle:  # rank-order concatenation gives dataset order
        assert sampled == list(range(n))
        steps = zip(*(batches for batches, _ in results), strict=True)
        assert [i for step in steps for batch in step for i in batch] == list(range(n))


@pytest.mark.parametrize("n", [3, 10, 31])
def test_evaluation_on_three_ranks_sees_every_sample_exactly_once(ranks, n: int) -> None:
    results = ranks.run(eval_indices, n, 4, False, world_size=3)
    assert sorted(i for batches, _ in results for batch in batches for i in batch) == list(range(n))
    assert len({len(batches) for batches, _ in results}) == 1


class Points(torch.utils.data.Dataset):
    """A fixed 2-class problem; a fixed linear classifier gets some of it wrong."""

    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(11)
        self.x = torch.randn(n, 3, generator=generator)
        self.y = (self.x[:, 0] + 0.5 * torch.randn(n, generator=generator) > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _classifier() -> torch.nn.Module:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[-1.0, 0.2, 0.0], [1.0, 0.0, 0.3]]))
        model.bias.zero_()
    return model


def distributed_accuracy(n: int, batch_size: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    loader = distkit.distributed_dataloader(Points(n), batch_size, evaluation=True)
    model = _classifier()
    correct = seen = 0
    predictions, labels = [], []
    with torch.no_grad():
        for x, y in loader:
            pred = model(x).argmax(1)
            correct += int((pred == y).sum())
            seen += len(y)
            gathered = distkit.gather_for_metrics({"pred": pred, "label": y})
            predictions.append(gathered["pred"])
            labels.append(gathered["label"])
    accuracy = distkit.reduce_metrics({"acc": (correct, seen)})["acc"]
    return accuracy, torch.cat(predictions), torch.cat(labels)


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_accuracy_equals_single_process_accuracy_exactly(ranks, world_size: int) -> None:
    n, batch_size = 101, 8
    dataset = Points(n)
    with torch.no_grad():
        single_pred = _classifier()(dataset.x).argmax(1)
    single_accuracy = (single_pred == dataset.y).sum().item() / n
    assert 0.5 < single_accuracy < 1.0  # a metric that a duplicate or a missed sample would change
    for accuracy, predictions, labels in ranks.run(
        distributed_accuracy, n, batch_size, world_size=world_size
    ):
        assert accuracy == single_accuracy
        assert torch.equal(predictions, single_pred) and torch.equal(labels, dataset.y)


def padded_evaluation_is_wrong(n: int) -> float:
    # What torch's DistributedSampler does to evaluation: pads with duplicates.
    sampler = torch.utils.data.DistributedSampler(Points(n), shuffle=False)
    loader = torch.utils.data.DataLoader(Points(n), batch_size=8, sampler=sampler)
    model = _classifier()
    correct = seen = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(1) == y).sum())
            seen += len(y)
    return distkit.reduce_metrics({"acc": (correct, seen)})["acc"]


def test_padded_evaluation_of_torch_sampler_differs_from_exact_accuracy(ranks) -> None:
    # The control for the test above: a padded split changes this metric, so exactness is not luck.
    dataset = Points(101)
    with torch.no_grad():
        single_accuracy = (_classifier()(dataset.x).argmax(1) == dataset.y).sum().item() / 101
    assert ranks.run(padded_evaluation_is_wrong, 101, world_size=2)[0] != single_accuracy


# ---------------------------------------------------------------------------------------------
# Mid-epoch resume


def resumable_run(
    path: str, steps: int, stop_at: int | None, resume: bool, num_workers: int
) -> tuple[list[torch.Tensor], list[float]]:
    """Train `steps` steps; with stop_at, save everything after that many and stop; with resume,
    load that checkpoint and train the remaining steps."""
    ckpt = Path(path) / f"rank{distkit.get_rank()}.pt"
    distkit.seed_everything(123)
    loader = distkit.distributed_dataloader(
        AugmentedDataset(), 4, num_workers=num_workers, multiprocessing_context=WORKER_START_METHOD
    )
    model = DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    done = 0
    if resume:
        torch.rand(17)  # a restarted process is in another RNG state until the checkpoint says otherwise
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        distkit.restore_rng_state(state["rng"])
        done = state["step"]
    inputs, losses = [], []
    while done < steps:
        for _, x in loader:
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            inputs.append(x)
            losses.append(loss.item())
            done += 1
            if done == stop_at:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict(),
                    "rng": distkit.capture_rng_state(),
                    "step": done,
                }
                torch.save(state, ckpt)
                return inputs, losses
            if done == steps:
                break
    return inputs, losses


@pytest.mark.parametrize("stop_at", [2, 3])  # mid-epoch, and right at the end of epoch 0
def test_mid_epoch_resume_with_workers_sees_the_batches_of_an_uninterrupted_run(
    ranks, tmp_path: Path, stop_at: int
) -> None:
    steps = 8  # 3 batches per epoch: resumes into epoch 0 or 1 and runs on into epoch 2
    full = ranks.run(resumable_run, str(tmp_path), steps, None, False, 2, world_size=2)
    before = ranks.run(resumable_run, str(tmp_path), steps, stop_at, False, 2, world_size=2)
    after = ranks.run(resumable_run, str(tmp_path), steps, None, True, 2, world_size=2)
    for (x_full, loss_full), (x_before, loss_before), (x_after, loss_after) in zip(
        full, before, after, strict=True
    ):
        assert len(x_before) == stop_at and len(x_after) == steps - stop_at
        assert all(torch.equal(a, b) for a, b in zip(x_full, x_before + x_after, strict=True))
        assert loss_full == loss_before + loss_after


def loader_positions() -> dict[str, object]:
    loader = distkit.distributed_dataloader(list(range(12)), 2, seed=0)  # 3 batches per rank
    out: dict[str, object] = {"initial": loader.state_dict()["epoch"]}
    it = iter(loader)
    next(it)
    out["inside"] = (loader.state_dict()["epoch"], loader.state_dict()["batches_consumed"])
    for _ in it:
        pass
    out["finished"] = (loader.state_dict()["epoch"], loader.state_dict()["batches_consumed"])
    for _ in loader:
        break  # left early without the ranks communicating: no trace, the next pass is epoch 1 again
    out["after_break"] = (loader.epoch, loader.state_dict()["batches_consumed"])
    stale = iter(loader)
    next(stale)
    fresh = iter(loader)
    try:
        next(stale)
        out["stale"] = "no error"
    except distkit.DistkitError as err:
        out["stale"] = str(err)
    del fresh
    return out


def test_loader_position_counts_handed_out_batches_and_passes(ranks) -> None:
    for out in ranks.run(loader_positions, world_size=2):
        assert out["initial"] == 0
        assert out["inside"] == (0, 1)
        assert out["finished"] == (1, 0)
        assert out["after_break"] == (1, 0)
        assert "superseded" in out["stale"]


def test_load_state_dict_rejects_mid_epoch_state_from_other_settings() -> None:
    loader = distkit.distributed_dataloader(list(range(12)), 2, seed=0)
    other = distkit.distributed_dataloader(list(range(12)), 3, seed=0)
    it = iter(other)
    next(it)
    state = other.state_dict()
    with pytest.raises(ValueError, match=r"batch_size: saved 3, now 2.*batches_consumed'\] = 0"):
        loader.load_state_dict(state)
    loader.load_state_dict({**state, "batches_consumed": 0})  # an epoch boundary is fine
    assert (loader.epoch, loader.seed) == (0, 0)
    with pytest.raises(ValueError, match=r"without \['seed'\]"):
        loader.load_state_dict({"epoch": 0, "batches_consumed": 0})
    with pytest.raises(ValueError, match="only 6 batches"):
        loader.load_state_dict({**loader.state_dict(), "batches_consumed": 7})


def test_loader_state_survives_a_weights_only_load(tmp_path: Path) -> None:
    loader = distkit.distributed_dataloader(list(range(12)), 2, seed=4)
    torch.save(loader.state_dict(), tmp_path / "loader.pt")
    assert torch.load(tmp_path / "loader.pt", weights_only=True) == loader.state_dict()


# ---------------------------------------------------------------------------------------------
# Epochs: passes made on some ranks only (docs/data.md, "Epochs")

# 15 batches of 4 per rank on 2 ranks, 10 on 3, no padding. Through a sampler, 2 workers draw 4
# batches ahead: a debugging pass of 3 batches must not draw the whole epoch (it would count as run
# to its end, which the epoch check then reports: docs/data.md, "Epochs").
EPOCH_SAMPLES = 120


def _split_loader(kind: str, num_workers: int = 0, persistent: bool = False) -> Any:
    """A shuffled training loader: distkit's ("loader"), a DataLoader over distkit's sampler
    ("sampler"), or one over torch's DistributedSampler ("torch", the reference)."""
    data = torch.arange(EPOCH_SAMPLES)
    context = WORKER_START_METHOD if num_workers else None
    if kind == "loader":
        return distkit.distributed_dataloader(
            data,
            4,
            seed=7,
            num_workers=num_workers,
            persistent_workers=persistent if num_workers else None,
            multiprocessing_context=context,
        )
    sampler = (
        distkit.distributed_sampler(data, seed=7)
        if kind == "sampler"
        else torch.utils.data.DistributedSampler(data, seed=7)
    )
    return torch.utils.data.DataLoader(
        data,
        batch_size=4,
        sampler=sampler,
        num_workers=num_workers,
        persistent_workers=persistent,
        multiprocessing_context=context,
    )


def _set_epoch(loader: Any, epoch: int) -> None:
    (loader.sampler if isinstance(loader, torch.utils.data.DataLoader) else loader).set_epoch(epoch)


def _train_epoch(loader: Any) -> list[int]:
    """One epoch of a training loop, with a collective per step as DDP's gradient all-reduce."""
    seen: list[int] = []
    for batch in loader:
        torch.distributed.all_reduce(torch.zeros(1))
        seen += batch.tolist()
    return seen


def _assert_disjoint_and_covering(per_rank: list[list[list[int]]], epochs: int) -> None:
    for epoch in range(epochs):
        assert sorted(i for epochs_of_rank in per_rank for i in epochs_of_rank[epoch]) == list(
            range(EPOCH_SAMPLES)
        ), f"epoch {epoch} is not split into disjoint, covering shares"
    for epochs_of_rank in per_rank:  # and the epochs do move on: each has its own order
        assert len({tuple(order) for order in epochs_of_rank}) == epochs


def _looks_then_training(loader: Any, held: bool, set_epoch_each_epoch: bool) -> list[list[int]]:
    rank, last = distkit.get_rank(), distkit.get_world_size() - 1
    kept = None
    if rank == last:
        if held:
            kept = iter(loader)
            next(kept)
        else:
            next(iter(loader))
    torch.distributed.barrier()
    out = []
    for epoch in range(3):
        if set_epoch_each_epoch:
            _set_epoch(loader, epoch)
        out.append(_train_epoch(loader))
        for _ in range(2 if epoch == 0 and rank == 0 else 0):  # two debugging passes in a row
            for step, _ in enumerate(loader):
                if step == 2:
                    break
    del kept
    return out


def looks_then_training(kind: str, num_workers: int, persistent: bool, held: bool) -> dict[str, list]:
    """The last rank looks at a batch before training (keeping the iterator alive through training
    when `held`), the ranks then communicate (as DDP's set-up does), and rank 0 runs two debugging
    passes of three batches after epoch 0: with distkit's `kind`, and with torch's sampler and
    set_epoch(epoch)."""
    return {
        "reference": _looks_then_training(_split_loader("torch"), held, True),
        "distkit": _looks_then_training(_split_loader(kind, num_workers, persistent), held, False),
    }


@pytest.mark.parametrize(
    ("kind", "num_workers", "persistent", "held", "world_size"),
    [
        ("loader", 0, False, False, 2),
        ("loader", 0, False, True, 2),
        ("loader", 2, True, False, 2),
        ("loader", 2, True, True, 2),
        ("sampler", 0, False, False, 2),
        ("sampler", 0, False, True, 2),
        ("sampler", 2, False, False, 2),
        ("sampler", 2, True, False, 2),
        ("sampler", 2, True, True, 2),
        ("loader", 0, False, True, 3),
        ("sampler", 2, True, False, 3),
    ],
)
def test_a_look_or_a_debugging_pass_on_one_rank_keeps_every_epoch_disjoint_and_covering(
    ranks, kind: str, num_workers: int, persistent: bool, held: bool, world_size: int
) -> None:
    results = ranks.run(
        looks_then_training, kind, num_workers, persistent, held, world_size=world_size, timeout_s=60
    )
    # The reference: torch's DistributedSampler with set_epoch(epoch) every epoch stays aligned.
    _assert_disjoint_and_covering([result["reference"] for result in results], 3)
    _assert_disjoint_and_covering([result["distkit"] for result in results], 3)


def statistics_pass_then_training() -> list[list[int]]:
    """Every rank first makes a full pass without collectives (computing statistics; rank 1 slowly,
    so that rank 0 starts training while rank 1 is still in it), then trains 2 epochs; rank 0 looks
    at a batch between them."""
    loader = _split_loader("loader")
    rank = distkit.get_rank()
    for _ in loader:
        if rank == 1:
            time.sleep(0.01)
    out = [_train_epoch(loader)]
    if rank == 0:
        next(iter(loader))
    out.append(_train_epoch(loader))
    return out


def test_ranks_a_collective_free_pass_apart_and_a_late_look_raise_nothing_and_stay_aligned(ranks) -> None:
    # The epoch check must not take a rank still in a pass without collectives for a misaligned one.
    _assert_disjoint_and_covering(ranks.run(statistics_pass_then_training, world_size=2, timeout_s=60), 2)


def _full_pass_on_rank_0_then_training(loader: Any, set_epoch_each_epoch: bool) -> list[list[int]] | str:
    rank, last = distkit.get_rank(), distkit.get_world_size() - 1
    if rank == 0:
        for _ in loader:
            pass
    out = []
    try:
        for epoch in range(3):
            if set_epoch_each_epoch:
                if rank == 1:
                    next(iter(loader))
                _set_epoch(loader, epoch)
                if rank == last:
                    next(iter(loader))
            seen = []
            for batch in loader:
                stop = torch.zeros(1)
                torch.distributed.all_reduce(stop)
                if stop.item():
                    return "stopped: another rank raised"
                seen += batch.tolist()
            out.append(seen)
    except distkit.DistkitError as err:
        torch.distributed.all_reduce(torch.ones(1))
        return str(err)
    return out


def full_pass_on_rank_0_then_training(kind: str, set_epoch_each_epoch: bool) -> dict[str, Any]:
    """Rank 0 alone runs a whole pass (inspecting the data), then 3 epochs of training; with
    set_epoch, the ranks also look at batches before and after it. A rank that gets the
    DistkitError tells the others, through the next step's collective, to stop. The reference is
    torch's sampler with set_epoch(epoch)."""
    return {
        "reference": _full_pass_on_rank_0_then_training(_split_loader("torch"), True),
        "distkit": _full_pass_on_rank_0_then_training(_split_loader(kind), set_epoch_each_epoch),
    }


@pytest.mark.parametrize(
    ("kind", "set_epoch_each_epoch", "world_size"),
    [
        ("loader", True, 2),
        ("sampler", True, 2),
        ("loader", False, 2),
        ("sampler", False, 2),
        ("loader", False, 3),
    ],
)
def test_a_full_pass_on_one_rank_is_realigned_by_set_epoch_or_raises_at_the_end_of_the_next_epoch(
    ranks, kind: str, set_epoch_each_epoch: bool, world_size: int
) -> None:
    results = ranks.run(
        full_pass_on_rank_0_then_training, kind, set_epoch_each_epoch, world_size=world_size, timeout_s=60
    )
    _assert_disjoint_and_covering([result["reference"] for result in results], 3)
    if set_epoch_each_epoch:
        assert all(isinstance(result["distkit"], list) for result in results), results
        _assert_disjoint_and_covering([result["distkit"] for result in results], 3)
        return
    what = "DistributedLoader" if kind == "loader" else "DistributedSplitSampler"
    for rank, result in enumerate(results):
        # Every rank compares with both neighbours, and a rank that raises never publishes the next
        # pass: the end of epoch 0's training pass is enough for every rank to see the other epoch.
        message = result["distkit"]
        assert isinstance(message, str) and message.startswith(f"[rank {rank}/{world_size}] {what}: ")
        ran, other = (1, 0) if rank == 0 else (0, 1)
        assert f"this rank just ran epoch {ran} while rank " in message
        assert f"ran epoch {other} alongside it" in message
        assert "Call set_epoch(epoch) on every rank right before each epoch's loop" in message


def extra_pass_then_distkit_collectives_only(sync: str) -> Any:
    """Rank 0 runs a whole extra pass; then an epoch whose steps exchange through distkit only
    (its own gloo group, or the store's barrier), never the default group."""
    loader = distkit.distributed_dataloader(list(range(20)), batch_size=2)
    if distkit.get_rank() == 0:
        for _ in loader:
            pass
    try:
        for step, _ in enumerate(loader):
            if sync == "reduce_metrics":
                distkit.reduce_metrics({"loss": 1.0})
            else:
                distkit.barrier(timeout_s=60)
                if step == 1:
                    break
    except distkit.DistkitError as err:
        return str(err)
    return loader.state_dict()["batches_consumed"]


def test_the_epoch_check_counts_distkits_own_collectives(ranks) -> None:
    # Was: no error, and every epoch covered some samples twice and others never.
    for message in ranks.run(extra_pass_then_distkit_collectives_only, "reduce_metrics", world_size=2):
        assert "alongside it (both passes started after the same collective)" in message
    # Was: a loop synchronised by distkit.barrier alone counted as one rank's look at a batch, so
    # its state said 0 batches consumed and a resume replayed the epoch.
    assert ranks.run(extra_pass_then_distkit_collectives_only, "barrier", world_size=2) == [2, 2]


def _stop_every_epoch_after(
    loader: Any, steps: int, set_epoch_each_epoch: bool
) -> tuple[list[list[int]], str]:
    out: list[list[int]] = []
    try:
        for epoch in range(3):
            if set_epoch_each_epoch:
                _set_epoch(loader, epoch)
            seen: list[int] = []
            for step, batch in enumerate(loader):
                torch.distributed.all_reduce(torch.zeros(1))
                seen += batch.tolist()
                if step + 1 == steps:
                    break
            out.append(seen)
    except distkit.DistkitError as err:
        return out, str(err)
    return out, ""


def stop_every_epoch_after(
    kind: str, steps: int, num_workers: int, persistent: bool
) -> dict[str, tuple[list[list[int]], str]]:
    """A loop that trains `steps` steps per epoch on every rank, then breaks: with distkit's `kind`
    with and without set_epoch(epoch), and with torch's sampler and set_epoch (the reference)."""
    return {
        "reference": _stop_every_epoch_after(_split_loader("torch"), steps, True),
        "set_epoch": _stop_every_epoch_after(_split_loader(kind, num_workers, persistent), steps, True),
        "plain": _stop_every_epoch_after(_split_loader(kind, num_workers, persistent), steps, False),
    }


@pytest.mark.parametrize(
    ("kind", "num_workers", "persistent"),
    [("loader", 0, False), ("loader", 2, True), ("sampler", 0, False), ("sampler", 2, True)],
)
def test_a_loop_that_stops_every_epoch_early_never_silently_repeats_its_batches(
    ranks, kind: str, num_workers: int, persistent: bool
) -> None:
    results = ranks.run(stop_every_epoch_after, kind, 3, num_workers, persistent, world_size=2, timeout_s=60)
    for name in ("reference", "set_epoch"):  # three epochs, each a new order, split disjointly
        for epochs, message in (result[name] for result in results):
            assert message == "" and len(epochs) == 3 and len({tuple(e) for e in epochs}) == 3
        for epoch in range(3):
            assert not set(results[0][name][0][epoch]) & set(results[1][name][0][epoch])
    for rank, result in enumerate(results):
        # A pass left early restarts its epoch, so the second pass repeated the first (once); the
        # third raises instead of repeating again.
        epochs, message = result["plain"]
        assert len(epochs) == 2 and epochs[0] == epochs[1]
        assert message.startswith(f"[rank {rank}/2] ")
        assert "the last 2 passes over epoch 0 were left early while the ranks communicated" in message
        assert f"Call {'loader' if kind == 'loader' else 'sampler'}.set_epoch(epoch) at the start" in message


def test_in_a_world_of_one_looks_leave_no_trace_and_a_loop_stopping_every_epoch_raises() -> None:
    loader = distkit.distributed_dataloader(torch.arange(40), 4, seed=3)
    untouched = distkit.distributed_dataloader(torch.arange(40), 4, seed=3)
    next(iter(loader))
    next(iter(loader))  # two looks at a batch are not a loop that stops every epoch early
    assert all(torch.equal(a, b) for a, b in zip(loader, untouched, strict=True))  # epoch 0 for both
    assert loader.epoch == 1
    seen = []
    with pytest.raises(distkit.DistkitError) as error:
        for _ in range(3):
            for step, batch in enumerate(loader):
                seen.append(batch)
                if step == 2:
                    break
    assert str(error.value).startswith("DistributedLoader: the last 2 passes over epoch 1 were left early (")
    assert "loader.set_epoch(epoch)" in str(error.value)
    assert len(seen) == 6 and all(torch.equal(a, b) for a, b in zip(seen[:3], seen[3:], strict=True))
    epoch1 = list(untouched)
    assert all(torch.equal(a, b) for a, b in zip(seen[:3], epoch1, strict=False))
    loader.load_state_dict(loader.state_dict())  # one fix: go on where the last pass stopped
    assert torch.equal(next(iter(loader)), epoch1[3])
    loader.set_epoch(2)  # the other: the caller picks each pass's epoch
    assert torch.equal(next(iter(loader)), next(iter(untouched)))  # epoch 2 for both


def train_then_stop(steps: int, state: dict[str, Any] | None) -> tuple[list[list[int]], dict, dict]:
    """Train `steps` steps (a collective each), breaking out of the pass at the last one; the state
    is taken after the loop, and again after the main process looks at a batch."""
    loader = _split_loader("loader")
    if state is not None:
        loader.load_state_dict(state)
    seen: list[list[int]] = []
    while len(seen) < steps:
        for batch in loader:
            torch.distributed.all_reduce(torch.zeros(1))
            seen.append(batch.tolist())
            if len(seen) == steps:
                break
    after_loop = loader.state_dict()
    if distkit.is_main_process():
        next(iter(loader))
    return seen, after_loop, loader.state_dict()


def test_state_dict_after_breaking_out_at_max_steps_resumes_exactly(ranks) -> None:
    # 15 batches per epoch on 2 ranks: stop 3 batches into epoch 1, resume, go on into epoch 2.
    full = ranks.run(train_then_stop, 34, None, world_size=2)
    first = ranks.run(train_then_stop, 18, None, world_size=2)
    state = first[0][1]
    assert (state["epoch"], state["batches_consumed"]) == (1, 3)
    assert all(after_loop == state and after_look == state for _, after_loop, after_look in first)
    second = ranks.run(train_then_stop, 16, state, world_size=2)
    for (whole, _, _), (before, _, _), (after, _, _) in zip(full, first, second, strict=True):
        assert before + after == whole


# ---------------------------------------------------------------------------------------------
# Uneven training data


def train_uneven(n: int, drop_last: bool) -> tuple[int, int, list[int]]:
    loader = distkit.distributed_dataloader(torch.arange(n), 2, drop_last=drop_last, seed=0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    seen, steps = [], 0
    for _ in range(2):
        for batch in loader:
            model(batch.float().unsqueeze(1)).sum().backward()  # an all-reduce per step
            seen += batch.tolist()
            steps += 1
    return len(loader), steps, seen


@pytest.mark.parametrize("drop_last", [False, True])
def test_uneven_training_data_gives_every_rank_the_same_batch_count_and_never_hangs(
    ranks, drop_last: bool
) -> None:
    n = 7  # 3.5 samples per rank
    results = ranks.run(train_uneven, n, drop_last, world_size=2, timeout_s=60)
    assert results[0][:2] == results[1][:2]
    epoch_samples = [i for _, _, seen in results for i in seen[: len(seen) // 2]]
    if drop_last:  # 3 samples per rank, then the incomplete last batch goes: 2 each, all distinct
        assert len(epoch_samples) == 4 and len(set(epoch_samples)) == 4
    else:
        assert len(epoch_samples) == 8 and set(epoch_samples) == set(range(n))


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1, got 0"),
        ({"batch_size": 2.0}, TypeError, "batch_size must be an int >= 1, got float 2.0"),
        ({"num_workers": -1}, ValueError, "num_workers must be >= 0, got -1"),
        ({"evaluation": True, "drop_last": True}, ValueError, "pass drop_last=False"),
        ({"prefetch_factor": 4}, ValueError, "prefetch_factor=4 needs worker processes"),
        ({"persistent_workers": True}, ValueError, "persistent_workers=True needs worker processes"),
        (
            {"batch_size": 11, "drop_last": True},
            ValueError,
            r"leaves no batch: the dataset has 10 samples\. Pass batch_size <= 10",
        ),
        ({"seed": -1}, ValueError, r"seed must be in \[0, 18446744073709551615\], got -1"),
        # A flag read from a config or the environment as a string: "False" is true to Python.
        ({"shuffle": "False"}, TypeError, r"shuffle must be True, False or None, got str 'False' \(a"),
        ({"drop_last": 1}, TypeError, r"drop_last must be True or False, got int 1"),
        ({"evaluation": "yes"}, TypeError, r"evaluation must be True or False, got str"),
        ({"pin_memory": "auto"}, TypeError, r"pin_memory must be True, False or None"),
    ],
)
def test_bad_loader_arguments_are_rejected_saying_what_to_change(
    kwargs: dict, error: type, message: str
) -> None:
    arguments = {"batch_size": 2, **kwargs}
    with pytest.raises(error, match=message):
        distkit.distributed_dataloader(list(range(10)), **arguments)


def test_a_dict_of_tensor_columns_or_a_missing_state_is_named() -> None:
    columns = {"x": torch.randn(10, 3), "y": torch.arange(10)}
    # Was: accepted, then KeyError: 1 deep in the loader's fetch.
    with pytest.raises(TypeError, match=r"dataset is a dict of tensors \('x': \(10, 3\), 'y': \(10,\)\)"):
        distkit.distributed_dataloader(columns, batch_size=4)
    loader = distkit.distributed_dataloader(list(range(10)), batch_size=2)
    # Was: "argument of type 'NoneType' is not iterable".
    with pytest.raises(TypeError, match=r"needs the dict DistributedLoader\.state_dict\(\) made, got None"):
        loader.load_state_dict(None)


def test_a_pandas_dataframe_or_series_is_named_with_the_way_to_pass_its_rows(tmp_path) -> None:
    pandas = pytest.importorskip("pandas")  # installed with the mlflow extra
    frame = pandas.DataFrame({"a": [0.0, 1.0, 2.0, 3.0], "b": [1.0, 0.0, 1.0, 0.0], "label": [0, 1, 0, 1]})
    # Was: accepted, then pandas' KeyError: 0 (a column lookup) at the first batch, 17 frames deep.
    for data, what in ((frame, "DataFrame"), (frame["a"], "Series")):
        with pytest.raises(TypeError, match=rf"dataset is a pandas {what}: as a dataset it is looked up"):
            distkit.distributed_dataloader(data, batch_size=2)
    with pytest.raises(TypeError, match=r"train_data is a pandas DataFrame: .*TensorDataset\(torch\.tensor"):
        distkit.Trainer(strategy="single", max_steps=1, default_root_dir=tmp_path).fit(
            torch.nn.Linear(2, 2),
            frame,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            loss_fn=torch.nn.functional.cross_entropy,
        )


def test_a_flag_that_is_not_a_bool_is_refused_not_taken_as_true() -> None:
    # Was: shuffle="False" shuffled, in silence.
    with pytest.raises(TypeError, match=r"shuffle must be True or False, got str 'False'"):
        distkit.distributed_sampler(list(range(10)), shuffle="False")

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    with pytest.raises(TypeError, match=r"shuffle must be True, False or None, got str 'False'"):
        distkit.distributed_dataloader(Stream(), batch_size=2, shuffle="False")


def test_a_sampler_refuses_a_dataset_without_length_or_an_iterable_one_and_names_the_loader() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(
        TypeError, match=r"map-style dataset .* IterableDataset Stream.*distributed_dataloader"
    ):
        distkit.distributed_sampler(Stream())
    assert isinstance(distkit.distributed_dataloader(Stream(), 2), distkit.StreamLoader)
    with pytest.raises(TypeError, match="generator has no __len__"):
        distkit.distributed_sampler(x for x in range(3))


def bad_input_on_two_ranks(n: int, batch_size: int, drop_last: bool) -> str:
    try:
        distkit.distributed_dataloader(list(range(n)), batch_size, drop_last=drop_last)
    except ValueError as err:
        return str(err)
    return "no error"


def test_too_small_dataset_and_empty_drop_last_split_are_rejected_on_two_ranks(ranks) -> None:
    for message in ranks.run(bad_input_on_two_ranks, 1, 1, False, world_size=2):
        assert "has 1 sample but the job has 2 ranks" in message and "at least 2 samples" in message
        assert "run at most 1 process." in message
    for message in ranks.run(bad_input_on_two_ranks, 0, 1, False, world_size=2):
        assert "the dataset is empty (0 samples), so none of the 2 ranks would get a sample" in message
        assert "at least 2 samples (one per rank)" in message
    for message in ranks.run(bad_input_on_two_ranks, 10, 8, True, world_size=2):
        assert "each of the 2 ranks gets 5 of the 10 samples" in message
        assert "batch_size <= 5 or drop_last=False" in message


def test_a_loader_or_a_tuple_of_tensors_given_as_the_dataset_is_refused_naming_what_to_pass() -> None:
    # Each was a loader of one batch: of 8 batches, or of the 2 tensors themselves.
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    for loader in (DataLoader(data, batch_size=8), distkit.distributed_dataloader(data, 8)):
        with pytest.raises(
            TypeError, match=rf"needs a dataset, got a {type(loader).__name__}: pass its dataset"
        ):
            distkit.distributed_dataloader(loader, 8)
    with pytest.raises(
        TypeError,
        match=r"dataset is a tuple of 2 tensors \(\(64, 4\), \(64,\)\).*"
        r"TensorDataset\(\*dataset\) for its 64 rows",
    ):
        distkit.distributed_dataloader(data.tensors, 8)
    assert len(distkit.distributed_dataloader(data, 8)) == 8


def test_an_empty_or_too_small_dataset_in_a_world_of_one_is_rejected_without_talking_about_ranks() -> None:
    with pytest.raises(ValueError) as loader_error:
        distkit.distributed_dataloader([], 2)
    with pytest.raises(ValueError) as sampler_error:
        distkit.distributed_sampler(torch.arange(0))
    with pytest.raises(ValueError) as drop_last_error:
        distkit.distributed_dataloader(list(range(3)), 4, drop_last=True)
    assert str(loader_error.value) == (
        "distributed_dataloader(): the dataset is empty (0 samples); pass a dataset with at least 1 sample."
    )
    assert str(sampler_error.value).startswith("distributed_sampler(): the dataset is empty (0 samples)")
    assert str(drop_last_error.value) == (
        "distributed_dataloader(): drop_last=True with batch_size=4 leaves no batch: the dataset has "
        "3 samples. Pass batch_size <= 3 or drop_last=False."
    )
    for error in (loader_error, sampler_error, drop_last_error):
        assert "rank" not in str(error.value) and "process" not in str(error.value)


def mismatched_seeds() -> str:
    try:
        distkit.distributed_dataloader(list(range(10)), 2, seed=distkit.get_rank())
    except distkit.DistkitError as err:
        return str(err)
    return "no error"


def test_ranks_with_different_seeds_are_rejected_on_every_rank(ranks) -> None:
    for rank, message in enumerate(ranks.run(mismatched_seeds, world_size=2)):
        assert message.startswith(f"[rank {rank}/2] distributed_dataloader() needs the same seed")
        assert "rank 0: seed=0; rank 1: seed=1" in message


def batch_size_one_evaluation(n: int) -> tuple[int, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = distkit.distributed_dataloader(list(range(n)), 1, evaluation=True)
    return len(loader), [str(w.message) for w in caught]


def test_batch_size_one_evaluation_with_uneven_counts_warns_about_collectives_in_the_loop(ranks) -> None:
    (len0, warned0), (len1, warned1) = ranks.run(batch_size_one_evaluation, 5, world_size=2)
    assert (len0, len1) == (3, 2)
    assert len(warned0) == 1 and "Gather once after the loop, or use batch_size >= 2" in warned0[0]
    assert warned0 == warned1
    assert ranks.run(batch_size_one_evaluation, 6, world_size=2) == [(3, []), (3, [])]


# ---------------------------------------------------------------------------------------------
# gather_for_metrics


Pair = namedtuple("Pair", ["a", "b"])


def gather_structures() -> dict[str, object]:
    rank = distkit.get_rank()
    return {
        "tensor": distkit.gather_for_metrics(torch.arange(rank + 1)),
        "scalar": distkit.gather_for_metrics(torch.tensor(float(rank))),
        "dict": distkit.gather_for_metrics({"p": torch.ones(rank, 2), "q": (torch.tensor([rank]),)}),
        "named": distkit.gather_for_metrics(Pair(torch.tensor([rank]), torch.tensor([10 + rank]))),
        "strings": distkit.gather_for_metrics([f"r{rank}"] * (rank + 1)),
        "object": distkit.gather_for_metrics({"rank": rank, "note": "x"}),
    }


def test_gather_for_metrics_concatenates_uneven_structures_in_rank_order(ranks) -> None:
    for out in ranks.run(gather_structures, world_size=2):
        assert torch.equal(out["tensor"], torch.tensor([0, 0, 1]))
        assert torch.equal(out["scalar"], torch.tensor([0.0, 1.0]))
        assert out["dict"]["p"].shape == (1, 2) and torch.equal(out["dict"]["q"][0], torch.tensor([0, 1]))
        assert isinstance(out["named"], Pair) and out["named"].b.tolist() == [10, 11]
        assert out["strings"] == ["r0", "r1", "r1"]
        assert out["object"] == [{"rank": 0, "note": "x"}, {"rank": 1, "note": "x"}]


def test_gather_for_metrics_in_a_world_of_one_returns_the_data() -> None:
    t = torch.arange(3)
    assert torch.equal(distkit.gather_for_metrics(t), t)
    assert distkit.gather_for_metrics(["a"]) == ["a"]


# ---------------------------------------------------------------------------------------------
# Profiling, pinned memory


def test_profile_of_slow_in_process_loading_suggests_workers_and_keeps_the_position() -> None:
    loader = distkit.distributed_dataloader(SlowDataset(), 4, seed=0)
    rng = torch.get_rng_state()
    profile = distkit.profile_dataloader(loader, num_batches=5)
    assert len(profile.wait_s) == 4 and len(profile.copy_s) == 4
    assert profile.loading_bound and profile.wait_ms >= 4 * 2.0  # 4 samples of >= 2 ms each
    assert "num_workers=" in profile.suggestions[0]
    assert "num_workers=" in str(profile)
    assert torch.equal(rng, torch.get_rng_state())
    untouched = distkit.distributed_dataloader(SlowDataset(), 4, seed=0)
    assert [b.tolist() for b in loader] == [b.tolist() for b in untouched]


def test_profile_accepts_a_torch_dataloader_and_needs_two_batches() -> None:
    loader = torch.utils.data.DataLoader(torch.zeros(10, 2), batch_size=5)
    profile = distkit.profile_dataloader(loader, num_batches=10)
    assert len(profile.wait_s) == 1 and profile.device == distkit.get_device()
    with pytest.raises(ValueError, match="needs at least 2 batches but the loader yielded 1"):
        distkit.profile_dataloader(torch.utils.data.DataLoader(torch.zeros(3), batch_size=5))
    with pytest.raises(ValueError, match="num_batches must be >= 2, got 1"):
        distkit.profile_dataloader(loader, num_batches=1)


def test_pin_memory_defaults_to_whether_cuda_is_there_and_types_are_torch_compatible() -> None:
    loader = distkit.distributed_dataloader(list(range(4)), 2)
    assert isinstance(loader, DistributedLoader) and loader.pin_memory is torch.cuda.is_available()
    assert isinstance(distkit.distributed_sampler(list(range(4))), DistributedSplitSampler)
    assert isinstance(distkit.distributed_sampler(list(range(4))), torch.utils.data.DistributedSampler)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pin_memory_defaults_to_on_with_cuda() -> None:
    assert distkit.distributed_dataloader(list(range(4)), 2).pin_memory is True


# ---------------------------------------------------------------------------------------------
# Learning rate


def test_scale_lr_linear_and_sqrt_rules_use_the_effective_batch() -> None:
    assert distkit.scale_lr(0.1, base_batch_size=256, batch_size=64, world_size=8) == pytest.approx(0.2)
    assert distkit.scale_lr(
        0.1, base_batch_size=32, batch_size=32, world_size=2, accumulation=2
    ) == pytest.approx(0.4)
    assert distkit.scale_lr(
        1e-3, base_batch_size=32, batch_size=32, world_size=16, rule="sqrt"
    ) == pytest.approx(4e-3)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"base_lr": 0.0}, ValueError, "base_lr must be a positive finite number, got 0.0"),
        ({"base_lr": float("nan")}, ValueError, "base_lr must be a positive finite number"),
        ({"world_size": 0}, ValueError, "world_size must be >= 1, got 0"),
        ({"accumulation": 1.5}, TypeError, "accumulation must be an int >= 1, got float 1.5"),
        ({"rule": "square"}, ValueError, "rule must be 'linear' or 'sqrt', got 'square'"),
    ],
)
def test_scale_lr_rejects_bad_input_saying_what_to_change(kwargs: dict, error: type, message: str) -> None:
    arguments = {"base_lr": 0.1, "base_batch_size": 32, "batch_size": 32, "world_size": 2, **kwargs}
    with pytest.raises(error, match=message):
        distkit.scale_lr(arguments.pop("base_lr"), **arguments)


def test_linear_warmup_ramps_to_the_target_and_checkpoints() -> None:
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.8)
    scheduler = distkit.linear_warmup(optimizer, warmup_steps=4)
    lrs = []
    for _ in range(6):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])
    restored = distkit.linear_warmup(torch.optim.SGD([param], lr=0.8), warmup_steps=4)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.get_last_lr() == pytest.approx([0.8])
    assert distkit.linear_warmup(torch.optim.SGD([param], lr=0.8), warmup_steps=0).get_last_lr() == [0.8]
    with pytest.raises(ValueError, match="warmup_steps must be >= 0, got -1"):
        distkit.linear_warmup(optimizer, warmup_steps=-1)


class NoisyTensors(torch.utils.data.TensorDataset):
    """A TensorDataset subclass that augments: it must keep its per-batch random streams."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        (x,) = super().__getitem__(i)
        return (x + torch.rand(()),)


def noisy_collate(samples: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    return torch.stack([x for (x,) in samples]) + torch.rand(len(samples))


@pytest.mark.parametrize(
    "dataset, collate_fn",
    [
        (NoisyTensors(torch.arange(8.0)), None),
        (torch.utils.data.TensorDataset(torch.arange(8.0)), noisy_collate),
        (torch.utils.data.Subset(NoisyTensors(torch.arange(8.0)), range(6)), None),
    ],
    ids=["augmenting-subclass", "random-collate", "subset-of-subclass"],
)
def test_batches_that_draw_keep_their_streams_when_in_memory_data_skips_them(dataset, collate_fn) -> None:
    # Plain in-memory data (TensorDataset, tensors, lists) draws nothing and skips the per-batch
    # stream; anything that may draw keeps it, so its batches ignore the training process's RNG.
    def batches(global_seed: int) -> list[torch.Tensor]:
        loader = distkit.distributed_dataloader(dataset, 4, seed=1, collate_fn=collate_fn)
        torch.manual_seed(global_seed)
        return [batch[0] if isinstance(batch, list) else batch for batch in loader]

    first, second = batches(0), batches(1)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not torch.equal(first[0], torch.arange(4.0))  # the noise is there

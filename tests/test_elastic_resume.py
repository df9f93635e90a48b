"""Resuming a DistributedLoader mid-epoch on another number of ranks, on real gloo groups
(docs/data.md, "Resuming on another number of ranks"): the interrupted epoch sees every sample not
yet seen exactly once (up to the new layout's padding), in an order derived from the seed, on
random streams derived for the new layout; later epochs are those of a fresh run."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import distkit
from distkit.data._split import (
    _batch_plan,
    _continued,
    _epoch_order,
    _padded,
    _per_rank_samples,
    _rank_batches,
    _rest_of_epoch,
    _seen_after,
)

N = 23  # a multiple of none of the world sizes, so padding and drop_last both come into play
BATCH = 3
SEED = 11
# DataLoader workers start from the rank's own forkserver, not by forking the rank (see
# tests/test_data.py).
WORKER_START_METHOD = "forkserver"


class Noisy(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample i is (i, noise), the noise drawn from python's, numpy's and torch's RNGs, as random
    augmentations are."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        noise = random.random() + float(np.random.rand()) + torch.rand(()).item()
        return torch.tensor([float(i), noise], dtype=torch.float64)


def run_epochs(
    drop_last: bool,
    state: dict[str, Any] | None,
    stop_after: int | None,
    epochs: int,
    noisy: bool = False,
    workers: bool = False,
) -> dict[str, Any]:
    """This rank's batches (as lists), per epoch: ``epochs`` passes after loading ``state``, or
    stopping inside the first pass after ``stop_after`` batches (at most all of them, before the
    pass ends) with the state taken there."""
    # Workers only where they are the point: each start costs two processes per rank.
    options = {"num_workers": 2, "multiprocessing_context": WORKER_START_METHOD} if workers else {}
    dataset = Noisy() if noisy else list(range(N))
    loader = distkit.distributed_dataloader(dataset, BATCH, seed=SEED, drop_last=drop_last, **options)
    if state is not None:
        loader.load_state_dict(state)
    out: dict[str, Any] = {"start": loader.state_dict()["batches_consumed"], "len": len(loader), "epochs": []}
    for _ in range(epochs):
        batches = []
        for batch in loader:
            batches.append(batch.tolist())
            if stop_after is not None and len(batches) == min(stop_after, len(loader) - out["start"]):
                out["state"] = loader.state_dict()
                break
        out["epochs"].append(batches)
        if "state" in out:
            break
    return out


def _on(ranks: Any, world_size: int, *args: Any) -> list[dict[str, Any]]:
    # A world of one runs here, without a process group, as a resumed single-process job does.
    return [run_epochs(*args)] if world_size == 1 else ranks.run(run_epochs, *args, world_size=world_size)


def _step_major(results: list[dict[str, Any]], epoch: int) -> list[Any]:
    """The samples of one epoch as the ranks handed them out: step 0 of rank 0, rank 1, ...; step 1..."""
    per_rank = [result["epochs"][epoch] for result in results]
    steps = max(len(batches) for batches in per_rank)
    return [item for step in range(steps) for batches in per_rank for item in batches[step]]


def _order(epoch: int) -> list[int]:
    """The epoch's order, which depends on the seed and epoch only (not on ranks or batch size)."""
    return _epoch_order(N, True, SEED, epoch).tolist()


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(
    ("old", "new", "stop_after"),
    # (2, 3, 99): the old ranks took their last batch, padding included: nothing is left to see.
    [(2, 1, 2), (1, 2, 2), (1, 2, 3), (2, 3, 1), (3, 2, 2), (2, 3, 99)],
)
def test_an_epoch_interrupted_on_some_ranks_finishes_on_others_with_each_unseen_sample_once(
    ranks, old: int, new: int, stop_after: int, drop_last: bool
) -> None:
    before = _on(ranks, old, drop_last, None, stop_after, 1)
    states = [result["state"] for result in before]
    assert all(state == states[0] for state in states)  # saving the main process's is enough
    after = _on(ranks, new, drop_last, states[0], None, 3)
    fresh = _on(ranks, new, drop_last, None, None, 3)

    seen, rest, order = _step_major(before, 0), _step_major(after, 0), _order(0)
    # The old ranks saw a prefix of the epoch's order (padded only if they took its last step).
    assert seen == (order + order)[: len(seen)]
    remaining = max(0, N - len(seen))
    if drop_last:
        # The rest is cut to whole batches on every new rank, as a whole epoch would be.
        used = new * ((remaining // new) // BATCH * BATCH)
        assert rest == order[N - remaining : N - remaining + used]
        assert not set(seen) & set(rest) and len(set(seen + rest)) == len(seen + rest)
    else:
        # Every sample once, except the padding that gives every new rank the same count: it
        # wraps around to the start of the epoch's order, as a whole epoch's padding does.
        padding = -remaining % new
        assert rest == (order + order)[N - remaining : N + padding]
        counts = Counter(seen + rest)
        assert sorted(counts) == list(range(N))
        repeated = len(seen) + len(rest) - N
        assert repeated < max(old, new)
        assert sorted(i for i, count in counts.items() if count > 1) == sorted(order[:repeated])
    # Every new rank hands out the same number of batches, numbered as the epoch's last ones.
    (left,) = {len(result["epochs"][0]) for result in after}
    assert all(result["start"] == result["len"] - left for result in after)
    # Later epochs follow the new world size's seeded order, as a fresh run's do.
    for resumed, started in zip(after, fresh, strict=True):
        assert resumed["epochs"][1:] == started["epochs"][1:]


def test_a_resumed_epoch_saved_again_resumes_bitwise_on_the_same_size_and_once_on_another(ranks) -> None:
    first = ranks.run(run_epochs, False, None, 1, 1, True, world_size=2)  # Noisy data
    # On one rank: the rest of the epoch, uninterrupted, and the same stopped after 2 batches.
    whole = run_epochs(False, first[0]["state"], None, 2, True)
    part = run_epochs(False, first[0]["state"], 2, 1, True)
    state = part["state"]
    assert state["resume_offset"] == 2 * BATCH and state["batches_consumed"] == part["start"] + 2
    again = run_epochs(False, state, None, 2, True)
    assert part["epochs"][0] + again["epochs"][0] == whole["epochs"][0]  # ids and random draws
    assert again["epochs"][1] == whole["epochs"][1]
    # Every batch drew from its own stream: no two batches of the interrupted epoch share draws.
    batches = [b for r in first for b in r["epochs"][0]] + whole["epochs"][0]
    assert len({batch[0][1] for batch in batches}) == len(batches)
    # The same state on 3 ranks: 2 ranks saw 6 samples, 1 rank 6 more, 3 ranks the rest.
    third = ranks.run(run_epochs, False, state, None, 1, True, world_size=3)
    ids = [int(sample[0]) for sample in _step_major(first, 0) + part["epochs"][0][0] + part["epochs"][0][1]]
    rest = [int(sample[0]) for sample in _step_major(third, 0)]
    assert ids + rest == (_order(0) + _order(0))[: N + (-(N - len(ids)) % 3)]


def test_the_rest_of_an_epoch_draws_the_same_with_and_without_workers(ranks) -> None:
    first = ranks.run(run_epochs, False, None, 2, 1, True, world_size=2)
    in_workers = run_epochs(False, first[0]["state"], None, 1, True, True)  # 2 workers
    loader = distkit.distributed_dataloader(Noisy(), BATCH, seed=SEED)  # in this process
    loader.load_state_dict(first[1]["state"])
    in_process = [batch.tolist() for batch in loader]
    assert in_process == in_workers["epochs"][0]


def test_mid_epoch_states_that_cannot_be_resumed_elsewhere_are_refused_naming_the_fix() -> None:
    evaluation = distkit.distributed_dataloader(list(range(N)), BATCH, evaluation=True)
    with pytest.raises(ValueError, match=r"world_size: saved 2, now 1\): batch 1 would hold other samples"):
        evaluation.load_state_dict({**evaluation.state_dict(), "world_size": 2, "batches_consumed": 1})
    with pytest.raises(ValueError, match="resume_offset'] is 3 but an evaluation loader has no rest"):
        evaluation.load_state_dict({**evaluation.state_dict(), "resume_offset": 3})
    loader = distkit.distributed_dataloader(list(range(N)), BATCH, seed=SEED)
    saved = {**loader.state_dict(), "world_size": 2, "batches_consumed": 1, "resume_offset": 4}
    with pytest.raises(
        ValueError, match=r"dataset_len: saved 30.*batches_consumed'\] = 0 and state\['resume_offset"
    ):
        loader.load_state_dict({**saved, "dataset_len": 30})
    with pytest.raises(
        ValueError, match=r"is 9, but on 2 rank\(s\) with state\['resume_offset'\] = 4 .* 0 and 4"
    ):
        loader.load_state_dict({**saved, "batches_consumed": 9})
    with pytest.raises(ValueError, match="resume_offset'] is 24 but the dataset has 23 samples"):
        loader.load_state_dict({**saved, "resume_offset": 24})
    loader.load_state_dict({**saved, "batches_consumed": 0, "resume_offset": 0})  # an epoch boundary
    assert loader.state_dict()["batches_consumed"] == 0 and len(list(loader)) == len(loader)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 40),
    world_sizes=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    batch_size=st.integers(1, 6),
    drop_last=st.booleans(),
    cuts=st.lists(st.one_of(st.just(1.0), st.floats(0, 1)), min_size=3, max_size=3),
)
def test_any_chain_of_world_sizes_sees_each_sample_once_and_the_same_size_changes_nothing(
    n: int, world_sizes: list[int], batch_size: int, drop_last: bool, cuts: list[float]
) -> None:
    if n < max(world_sizes) or (drop_last and n // max(world_sizes) < batch_size):
        return  # refused when the loader is made
    order = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    seen: list[int] = []
    offset = 0
    previous: tuple[int, list[list[list[int]]], int] | None = None  # world size, batches, steps
    for index, world_size in enumerate(world_sizes):
        rests = [
            _rest_of_epoch(n, world_size, rank, batch_size, drop_last=drop_last, offset=offset)
            for rank in range(world_size)
        ]
        sequence = _continued(order, offset, rests[0].total).tolist()
        batches = [[sequence[p : p + s] for p, s in rest.batches] for rest in rests]
        if offset == 0:  # a whole epoch: the usual layout
            plan = _batch_plan(n, world_size, batch_size, drop_last=drop_last, evaluation=False)
            padded = _padded(order, _per_rank_samples(n, world_size, drop_last) * world_size).tolist()
            assert batches == [
                [padded[p : p + s] for p, s in _rank_batches(plan, r)] for r in range(world_size)
            ]
        if previous is not None and previous[0] == world_size:  # the same size goes on as before
            assert batches == [rank_batches[previous[2] :] for rank_batches in previous[1]]
        last = index == len(world_sizes) - 1
        steps = len(batches[0]) if last else int(cuts[index] * len(batches[0]))
        handed = [i for step in range(steps) for rank_batches in batches for i in rank_batches[step]]
        assert handed == sequence[: len(handed)]  # the ranks saw a prefix of what was left
        seen += handed
        consumed = rests[0].skip + steps
        offset = _seen_after(n, world_size, batch_size, drop_last=drop_last, offset=offset, consumed=consumed)
        previous = (world_size, batches, steps)
    counts = Counter(seen)
    if drop_last:
        assert max(counts.values(), default=1) == 1
    else:
        assert set(counts) == set(range(n))
        # Padding repeats samples only in a layout that ran to its end; after it nothing is left.
        assert sum(counts.values()) - n < max(world_sizes)


# -- the Trainer ----------------------------------------------------------------------------------


class _IdModel(torch.nn.Module):
    """Records the sample ids of every batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        (x,) = batch
        self.seen.extend(int(i) for i in x)
        return {"loss": self.lin(x.float().unsqueeze(1) / 23).pow(2).mean()}


def _fit_ids(root: str, max_steps: int | None, strategy: str) -> tuple[list[int], list[int | None], int]:
    from distkit.trainer import Callback, ModelCheckpoint, Trainer

    totals: list[int | None] = []

    class Totals(Callback):
        def on_fit_start(self, trainer: Any) -> None:
            totals.append(trainer.total_steps)

        def on_fit_end(self, trainer: Any) -> None:
            totals.append(trainer.total_steps)

    model = _IdModel()
    trainer = Trainer(
        strategy=strategy,
        batch_size=3,
        max_epochs=1,
        max_steps=max_steps,
        default_root_dir=root,
        resume="auto",
        seed=5,
        logger=False,
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(dirpath=f"{root}/ckpt", every_n_steps=1), Totals()],
    )
    trainer.fit(
        model,
        torch.utils.data.TensorDataset(torch.arange(23)),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )
    return model.seen, totals, trainer.global_step


@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
@pytest.mark.parametrize(("before", "after", "steps"), [(2, 1, 2), (1, 2, 3)])
def test_the_trainer_resumes_mid_epoch_on_another_world_size_seeing_each_sample_once(
    ranks, tmp_path, before: int, after: int, steps: int, strategy: str
) -> None:
    # "auto" is DDP on several ranks; FSDP saves sharded checkpoints there, which load on one rank
    # into the plain model, and a one-rank checkpoint loads into the sharded model.
    root = str(tmp_path)
    first = ranks.run(_fit_ids, root, steps, strategy, world_size=before)
    second = ranks.run(_fit_ids, root, None, strategy, world_size=after)
    seen_before = [i for ids, _, _ in first for i in ids]
    seen_after = [i for ids, _, _ in second for i in ids]
    # trainer.total_steps is the steps the run really takes, from its start to its end (was: the
    # new job's steps per epoch times max_epochs, as if every epoch had run on this job's ranks).
    for _, totals, final_step in first + second:
        assert totals == [final_step, final_step], (totals, final_step)
    assert len(seen_before) == 3 * steps * before
    # The rest of the epoch, re-split over the new ranks: together, every sample exactly once.
    assert sorted(seen_before + seen_after) == list(range(23))

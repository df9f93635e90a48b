"""Peers' data behaviours ported as tests (in our words; each names its source): Accelerate's
split_between_processes on lists, tensors and nested dicts, its even_batches=False loaders, and
join_uneven_inputs-style training over uneven data (a stream no world size divides, and each
rank's own loader of another length) that ends together, without a hang."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit.testing import Ranks


def shares(inputs: Any, pad: bool) -> Any:
    return distkit.split_between_processes(inputs, pad=pad)


def test_split_between_processes_gives_contiguous_shares_of_lists_tuples_and_tensors(ranks: Ranks) -> None:
    # Accelerate's test_split_between_processes_list / _tensor: 3 items over 2 processes.
    assert ranks.run(shares, [1, 2, 3], False) == [[1, 2], [3]]
    assert ranks.run(shares, [1, 2, 3], True) == [[1, 2], [3, 3]]
    assert ranks.run(shares, ("a", "b", "c", "d", "e"), False, world_size=3) == [
        ("a", "b"),
        ("c", "d"),
        ("e",),
    ]
    tensors = ranks.run(shares, torch.arange(6).reshape(3, 2), True)
    assert [t.tolist() for t in tensors] == [[[0, 1], [2, 3]], [[4, 5], [4, 5]]]


def test_split_between_processes_splits_every_value_of_a_nested_dict_alike(ranks: Ranks) -> None:
    # Accelerate's test_split_between_processes_nested_dict.
    inputs = {"a": [1, 2, 3, 4], "b": ["w", "x", "y", "z"], "c": {"d": torch.tensor([10, 11, 12, 13])}}
    zero, one = ranks.run(shares, inputs, False)
    assert zero["a"] == [1, 2] and zero["b"] == ["w", "x"] and zero["c"]["d"].tolist() == [10, 11]
    assert one["a"] == [3, 4] and one["b"] == ["y", "z"] and one["c"]["d"].tolist() == [12, 13]


def refusal(inputs: Any) -> str:
    try:
        distkit.split_between_processes(inputs)
    except (TypeError, ValueError) as err:
        return str(err)
    return "no error"


def test_split_between_processes_refuses_what_it_cannot_split_alike(ranks: Ranks) -> None:
    assert "one length" in ranks.run(refusal, {"a": [1, 2], "b": [1]})[0]
    assert "got int" in ranks.run(refusal, 5)[0]


def uneven_evaluation(n: int, batch_size: int) -> tuple[int, list[int]]:
    loader = distkit.distributed_dataloader(torch.arange(n), batch_size, evaluation=True)
    seen = [int(x) for batch in loader for x in batch]
    return len(loader), seen


def test_an_uneven_evaluation_split_duplicates_nothing_as_even_batches_false_does(ranks: Ranks) -> None:
    # Accelerate's test_dataloader_even_batches_false: 3 samples over 2 processes, batch 1 -> the
    # processes see 2 and 1 samples, no sample twice (even_batches=True would repeat one).
    out = ranks.run(uneven_evaluation, 3, 1)
    assert sorted(out[0][1] + out[1][1]) == [0, 1, 2]
    assert [len(seen) for _, seen in out] == [2, 1]


class Numbers(torch.utils.data.IterableDataset[torch.Tensor]):
    """23 samples: a stream that no number of ranks x 4 divides."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (torch.tensor([float(i)]) for i in range(23))


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return (batch * self.w - 1.0).pow(2).mean()


def _fit(root: str, data: Any) -> tuple[int, float]:
    trainer = distkit.Trainer(
        max_epochs=2,
        batch_size=4,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=root,
        enable_checkpointing=False,
        hang_timeout_s=60,
    )
    model = Scale()
    trainer.fit(model, data, optimizer=lambda p: torch.optim.SGD(p, lr=0.001))
    return trainer.global_step, float(model.w)


def train_stream(root: str) -> tuple[int, float]:
    return _fit(root, Numbers())


def train_own_loaders(root: str) -> tuple[int, float]:
    # Each rank's own loader, of another length: 10 + 3 * rank samples in batches of 2.
    samples = torch.arange(10.0 + 3 * distkit.get_rank()).reshape(-1, 1)
    return _fit(root, torch.utils.data.DataLoader(samples, batch_size=2))


@pytest.mark.parametrize("world_size", [2, 3])
def test_training_over_data_that_does_not_split_evenly_ends_together_without_a_hang(
    ranks: Ranks, tmp_path: Path, world_size: int
) -> None:
    # Accelerate's join_uneven_inputs test trains DDP over per-process data of different lengths.
    # A stream of 23 samples over ranks of 4: every rank stops at the last whole step.
    out = ranks.run(train_stream, str(tmp_path), world_size=world_size)
    assert [step for step, _ in out] == [2 * (23 // (world_size * 4))] * world_size
    assert len({w for _, w in out}) == 1  # the same weights: every step was synced
    # Loaders of the ranks' own, 5, 7 (and 8) batches: every rank stops each epoch after 5.
    out = ranks.run(train_own_loaders, str(tmp_path), world_size=world_size)
    assert [step for step, _ in out] == [10] * world_size
    assert len({w for _, w in out}) == 1

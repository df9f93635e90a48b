"""Collectives on real gloo groups: one-collective metrics, uneven gathers, objects and flags."""

from __future__ import annotations

import math

import pytest
import torch

import distkit


def weighted_metrics() -> dict[str, float]:
    rank = distkit.get_rank()
    # Rank 0 saw 3 samples, 2 correct; rank 1 saw 7 samples, 7 correct: accuracy 9/10, not (2/3+1)/2.
    correct, seen = [(2, 3), (7, 7)][rank]
    return distkit.reduce_metrics(
        {"acc": (correct, seen), "loss": float(rank + 1), "t": torch.tensor(rank * 2.0)}
    )


def test_weighted_means_are_exact(ranks) -> None:
    for result in ranks.run(weighted_metrics, world_size=2):
        assert result == {"acc": 0.9, "loss": 1.5, "t": 1.0}
        assert list(result) == ["acc", "loss", "t"]


def reduce_ops() -> dict[str, dict[str, float]]:
    x = {"x": float(distkit.get_rank() + 1)}
    return {op: distkit.reduce_metrics(x, op=op) for op in ("sum", "mean", "max", "min")}


def test_sum_mean_max_min_over_three_ranks(ranks) -> None:
    for result in ranks.run(reduce_ops, world_size=3):
        assert result == {"sum": {"x": 6.0}, "mean": {"x": 2.0}, "max": {"x": 3.0}, "min": {"x": 1.0}}


def many_metrics(k: int) -> tuple[dict[str, float], int]:
    rank = distkit.get_rank()
    metrics = {f"m{i}": float(i * (rank + 1)) for i in range(k)}
    return distkit.reduce_metrics(metrics, op="sum"), k


def test_more_metrics_than_one_block_are_all_reduced(ranks) -> None:
    for result, k in ranks.run(many_metrics, 600, world_size=2):
        assert result == {f"m{i}": float(3 * i) for i in range(k)}


def mismatched_keys() -> str:
    metrics = {"loss": 1.0, "acc": 0.5} if distkit.get_rank() == 0 else {"loss": 1.0, "f1": (1, 2)}
    try:
        distkit.reduce_metrics(metrics)
    except distkit.DistkitError as err:
        return str(err)
    return "no error"


def test_mismatched_keys_are_rejected_on_every_rank_naming_them(ranks) -> None:
    for rank, message in enumerate(ranks.run(mismatched_keys, world_size=2)):
        assert message.startswith(f"[rank {rank}/2] reduce_metrics()")
        assert "rank 0 lacks ['f1']" in message and "rank 1 lacks ['acc']" in message


def mismatched_key_count_across_blocks() -> str:
    k = 10 if distkit.get_rank() == 0 else 700
    try:
        distkit.reduce_metrics({f"m{i}": 1.0 for i in range(k)})
    except distkit.DistkitError as err:
        return str(err)
    return "no error"


def test_key_sets_of_very_different_sizes_fail_cleanly_not_hang(ranks) -> None:
    for message in ranks.run(mismatched_key_count_across_blocks, world_size=2, timeout_s=60):
        assert "rank 0 lacks" in message


def pair_kind_mismatch() -> str:
    metrics = {"acc": (1, 2)} if distkit.get_rank() == 0 else {"acc": 0.5}
    try:
        distkit.reduce_metrics(metrics)
    except distkit.DistkitError as err:
        return str(err)
    return "no error"


def test_same_name_as_pair_and_number_is_rejected(ranks) -> None:
    for message in ranks.run(pair_kind_mismatch, world_size=2):
        assert "'acc' is a (sum, count) pair on rank(s) [0] only" in message


def uneven_gather() -> tuple[list[list[list[float]]], list[int], list[float]]:
    rank = distkit.get_rank()
    rows = torch.arange(rank * 3, dtype=torch.float32).reshape(rank, 3) if rank else torch.zeros(0, 3)
    gathered = distkit.all_gather(rows)
    scalars = distkit.all_gather(torch.tensor(float(rank)))
    return [g.tolist() for g in gathered], [g.shape[0] for g in gathered], [s.item() for s in scalars]


def test_uneven_gather_returns_each_ranks_exact_rows(ranks) -> None:
    for gathered, lengths, scalars in ranks.run(uneven_gather, world_size=3):
        assert lengths == [0, 1, 2]
        assert gathered == [[], [[0.0, 1.0, 2.0]], [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]]
        assert scalars == [0.0, 1.0, 2.0]


def gather_wrong_trailing_dim() -> str:
    try:
        distkit.all_gather(torch.zeros(2, 3 + distkit.get_rank()))
    except distkit.DistkitError as err:
        return str(err)
    return "no error"


def test_gather_with_different_trailing_dims_names_the_shapes(ranks) -> None:
    for message in ranks.run(gather_wrong_trailing_dim, world_size=2):
        assert "rank 0: torch.float32 shape (2, 3), rank 1: torch.float32 shape (2, 4)" in message


def objects_and_flags() -> dict:
    rank = distkit.get_rank()
    return {
        "gathered": distkit.all_gather_object({"r": rank}),
        "from_1": distkit.broadcast_object(f"hello from {rank}", src=1),
        "any": distkit.any_rank(rank == 1),
        "all": distkit.all_ranks(rank == 1),
        "all_true": distkit.all_ranks(True),
        "none": distkit.any_rank(False),
        "mean": distkit.all_reduce(torch.tensor([float(rank), 10.0]), op="mean").tolist(),
        "max": distkit.all_reduce(torch.tensor([rank]), op="max").tolist(),
    }


def test_object_collectives_and_flags_agree_on_every_rank(ranks) -> None:
    for result in ranks.run(objects_and_flags, world_size=2):
        assert result == {
            "gathered": [{"r": 0}, {"r": 1}],
            "from_1": "hello from 1",
            "any": True,
            "all": False,
            "all_true": True,
            "none": False,
            "mean": [0.5, 10.0],
            "max": [1],
        }


def test_world_of_one_collectives_keep_their_return_types() -> None:
    t = torch.ones(2, 2)
    assert distkit.all_reduce(t, op="mean") is t
    assert [x.shape for x in distkit.all_gather(t)] == [torch.Size([2, 2])]
    assert distkit.all_gather_object(3) == [3]
    assert distkit.broadcast_object("x") == "x"
    assert distkit.any_rank(True) is True and distkit.all_ranks(False) is False
    reduced = distkit.reduce_metrics({"a": torch.tensor(1.5), "b": (0, 0)}, op="sum")
    assert reduced["a"] == 1.5 and math.isnan(reduced["b"])


def test_bad_metric_values_say_what_to_pass() -> None:
    with pytest.raises(ValueError, match=r"metric 'x' must be a number or a one-element tensor.*\(3,\)"):
        distkit.reduce_metrics({"x": torch.zeros(3)})
    with pytest.raises(TypeError, match="metric 'x' must be a number"):
        distkit.reduce_metrics({"x": "high"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="op must be"):
        distkit.reduce_metrics({"x": 1.0}, op="avg")
    with pytest.raises(TypeError, match="op='mean' needs a floating-point tensor"):
        distkit.all_reduce(torch.tensor([1]), op="mean")

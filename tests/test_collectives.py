"""Collectives on real gloo groups: one-collective metrics, uneven gathers, objects and flags."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

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
        assert "op differs" not in message and "different order" not in message


def keys_in_rank_order() -> str:
    metrics = {"loss": 1.0, "acc": 0.5} if distkit.get_rank() == 0 else {"acc": 0.5, "loss": 1.0}
    try:
        distkit.reduce_metrics(metrics)
    except distkit.DistkitError as err:
        return str(err)
    return "no error"


def test_same_keys_in_a_different_order_are_named_as_such(ranks) -> None:
    for message in ranks.run(keys_in_rank_order, world_size=2):
        assert "rank 1 has 'acc' at position 0 where rank 0 has 'loss'" in message
        assert "lacks" not in message and "op differs" not in message


def ops_by_rank(ops: list[str], keys_by_rank: list[list[str]] | None = None) -> str:
    rank = distkit.get_rank()
    names = keys_by_rank[rank] if keys_by_rank else ["loss"]
    try:
        distkit.reduce_metrics({name: float(rank) for name in names}, op=ops[rank])
    except distkit.DistkitError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    "ops",
    [
        ["sum", "max"],  # reduced with different ReduceOps (SUM against MAX)
        ["mean", "sum"],  # the same ReduceOp, different results
        ["max", "min"],
        ["mean", "mean", "sum"],
        ["sum", "min", "sum"],
        ["max", "max", "mean"],
    ],
)
def test_op_that_differs_between_ranks_is_named_per_rank_on_every_rank(ranks, ops) -> None:
    world_size = len(ops)
    each = ", ".join(f"rank {rank} op={op!r}" for rank, op in enumerate(ops))
    messages = ranks.run(ops_by_rank, ops, world_size=world_size, timeout_s=60)
    for rank, message in enumerate(messages):
        assert message.startswith(f"[rank {rank}/{world_size}] reduce_metrics()"), message
        assert f"op differs between ranks: {each}" in message, message
        assert "Every rank must pass the same op." in message, message
        assert "different order" not in message and "lacks" not in message


def test_op_and_keys_that_both_differ_are_both_named(ranks) -> None:
    messages = ranks.run(ops_by_rank, ["sum", "max"], [["loss"], ["acc"]], world_size=2)
    for message in messages:
        assert "op differs between ranks: rank 0 op='sum', rank 1 op='max'" in message
        assert "rank 0 lacks ['acc']" in message and "rank 1 lacks ['loss']" in message


def spelled_differently(op_by_rank: list[object]) -> dict[str, float]:
    rank = distkit.get_rank()
    return distkit.reduce_metrics({"x": float(rank + 1)}, op=op_by_rank[rank])


def test_op_spellings_of_torch_and_ignite_are_the_same_op_on_every_rank(ranks) -> None:
    # Different spellings of one op must agree in the header, not raise a mismatch.
    cases = {
        "min": ["MIN", "min", dist.ReduceOp.MIN],
        "max": [dist.ReduceOp.MAX, "Max", "max"],
        "sum": ["SUM", dist.ReduceOp.SUM, "Sum"],
        "mean": ["mean", "AVG", dist.ReduceOp.AVG],
    }
    expected = {"min": 1.0, "max": 3.0, "sum": 6.0, "mean": 2.0}
    for name, spellings in cases.items():
        assert ranks.run(spelled_differently, spellings, world_size=3) == [{"x": expected[name]}] * 3


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


def test_uneven_gather_pads_every_dimension_to_the_largest_size() -> None:
    # Every rank must hand gloo the same number of elements: padding the first dimension alone
    # would make a rank of (2, 3) send 9 elements against another's 6, and gloo aborts the process
    # (SIGABRT) instead of raising. The rule is checked here, before any collective could crash.
    from distkit.collectives import _padded_shape

    # No rank is largest in every trailing dimension: a rule that keeps any one rank's trailing
    # sizes gets each case wrong.
    cases = {
        ((3, 2), (2, 3)): (3, 3),
        ((1, 4, 1), (2, 3, 2), (3, 2, 1)): (3, 4, 2),
        ((0, 5), (2, 0)): (2, 5),
        ((), ()): (),
    }
    for shapes, expected in cases.items():
        got = _padded_shape(list(shapes))
        assert got == expected, (
            f"all_gather of shapes {shapes} pads each rank's tensor to {got}, not {expected}: every "
            f"dimension must be padded to its largest size, or the ranks send different sizes"
        )


def gather_wrong_dims_or_dtype() -> list[str]:
    rank = distkit.get_rank()
    messages = []
    # Sizes may differ in every dimension, but not the number of dimensions, nor the dtype.
    for tensor in (
        torch.zeros((2, 3) if rank == 0 else (2, 3, 1)),
        torch.zeros(2, dtype=[torch.float32, torch.int64][rank]),
    ):
        try:
            distkit.all_gather(tensor)
            messages.append("no error")
        except distkit.DistkitError as err:
            messages.append(str(err))
    return messages


def test_gather_with_different_dims_or_dtypes_names_the_shapes(ranks) -> None:
    for rank, (dims, dtypes) in enumerate(ranks.run(gather_wrong_dims_or_dtype, world_size=2)):
        assert dims.startswith(
            f"[rank {rank}/2] all_gather() needs the same dtype and the same number of dimensions"
        )
        assert "rank 0: torch.float32 shape (2, 3), rank 1: torch.float32 shape (2, 3, 1)" in dims
        assert "rank 0: torch.float32 shape (2,), rank 1: torch.int64 shape (2,)" in dtypes


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


def all_reduce_spellings() -> dict[str, list[float]]:
    rank = float(distkit.get_rank() + 1)
    ops = {"MIN": "MIN", "Sum": "Sum", "avg": "avg", "PRODUCT": "PRODUCT"}
    ops |= {f"ReduceOp.{op}": getattr(dist.ReduceOp, op) for op in ("SUM", "AVG", "MAX", "PRODUCT")}
    ops["ReduceOp(MIN)"] = dist.ReduceOp(dist.ReduceOp.MIN)
    return {name: distkit.all_reduce(torch.tensor([rank]), op=op).tolist() for name, op in ops.items()}


def test_all_reduce_takes_any_case_and_reduce_op_members(ranks) -> None:
    for result in ranks.run(all_reduce_spellings, world_size=3):
        assert result == {
            "MIN": [1.0],
            "Sum": [6.0],
            "avg": [2.0],
            "PRODUCT": [6.0],
            "ReduceOp.SUM": [6.0],
            "ReduceOp.AVG": [2.0],
            "ReduceOp.MAX": [3.0],
            "ReduceOp.PRODUCT": [6.0],
            "ReduceOp(MIN)": [1.0],
        }


def all_reduce_non_tensors() -> list[str]:
    messages = []
    for value in (10, "x"):
        try:
            distkit.all_reduce(value)  # type: ignore[arg-type]
        except TypeError as err:
            messages.append(str(err))
    return messages


def test_all_reduce_of_a_non_tensor_names_the_type_and_fix_on_ranks(ranks) -> None:
    for messages in ranks.run(all_reduce_non_tensors, world_size=2):
        assert len(messages) == 2, messages
        assert messages[0].startswith("all_reduce() needs a torch.Tensor, got int: 10.")
        assert messages[1].startswith("all_reduce() needs a torch.Tensor, got str: 'x'.")
        assert "torch.tensor(value)" in messages[0] and "reduce_metrics" in messages[0]


@pytest.mark.parametrize("value", [10, "x", 2.5, [1.0, 2.0]])
def test_non_tensors_are_refused_with_the_fix_in_a_world_of_one(value) -> None:
    type_name = type(value).__name__
    with pytest.raises(
        TypeError, match=rf"all_reduce\(\) needs a torch.Tensor, got {type_name}.*torch.tensor"
    ):
        distkit.all_reduce(value)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=rf"all_gather\(\) needs a torch.Tensor, got {type_name}.*all_gather_object"
    ):
        distkit.all_gather(value)  # type: ignore[arg-type]


def test_op_names_any_case_and_reduce_op_members_in_a_world_of_one() -> None:
    assert distkit.reduce_metrics({"x": 2.0}, op="MAX") == {"x": 2.0}
    assert distkit.reduce_metrics({"x": 2.0}, op=dist.ReduceOp.AVG) == {"x": 2.0}
    assert distkit.all_reduce(torch.tensor([3]), op="Sum").tolist() == [3]
    assert distkit.all_reduce(torch.tensor([3.0]), op=dist.ReduceOp.PRODUCT).tolist() == [3.0]
    with pytest.raises(
        ValueError, match=r"reduce_metrics\(\) op must be one of .* got torch.distributed.ReduceOp.PRODUCT"
    ):
        distkit.reduce_metrics({"x": 1.0}, op=dist.ReduceOp.PRODUCT)
    with pytest.raises(
        ValueError, match=r"all_reduce\(\) op must be one of .* got torch.distributed.ReduceOp.BAND"
    ):
        distkit.all_reduce(torch.tensor([1]), op=dist.ReduceOp.BAND)
    with pytest.raises(ValueError, match=r"op must be one of 'mean', 'sum', 'max', 'min' .* got 'median'"):
        distkit.reduce_metrics({"x": 1.0}, op="median")
    with pytest.raises(TypeError, match=r"op must be a name such as 'sum' .* got int: 3"):
        distkit.all_reduce(torch.tensor([1.0]), op=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="op='mean' has no meaning for a bool tensor"):
        distkit.all_reduce(torch.tensor([True]), op=dist.ReduceOp.AVG)


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
        distkit.reduce_metrics({"x": 1.0}, op="average")
    with pytest.raises(TypeError, match="op='mean' has no meaning for a bool tensor"):
        distkit.all_reduce(torch.tensor([False]), op="mean")


def outcomes_with_a_failure_on_rank_1() -> object:
    from distkit.collectives import _outcomes

    rank = distkit.get_rank()
    failure = OSError("cannot open s3://AKIAKEY:hunter2@bucket/ckpt?token=t0k") if rank == 1 else None
    try:
        return _outcomes(failure, rank * 10)
    except OSError as err:
        return f"raised its own: {err}"


def test_outcomes_name_the_failed_ranks_to_the_others_with_credentials_masked(ranks) -> None:
    ours, theirs = ranks.run(outcomes_with_a_failure_on_rank_1, world_size=2)
    assert theirs == "raised its own: cannot open s3://AKIAKEY:hunter2@bucket/ckpt?token=t0k"
    values, failed = ours
    assert values == [0, 10]
    assert failed == {1: "OSError: cannot open s3://***@bucket/ckpt?token=***"}

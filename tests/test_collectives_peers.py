"""The peers' behavioural tests of collectives and rank decorators, ported to distkit.

torchtnt (``tests/utils/test_distributed.py``), ignite (``tests/ignite/distributed/utils``) and
Lightning (``tests/tests_fabric/utilities/test_distributed.py``, ``test_rank_zero.py``) check these
behaviours; each test names the one it ports. Written anew for distkit's API and its real gloo
ranks (the pooled ``ranks`` fixture): no launcher, no mocks of torch.distributed.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import distkit

# New in this change; imported from their modules until distkit's __init__ exports them.
from distkit.collectives import scatter_object
from distkit.runtime import local_main_process_only


@pytest.fixture
def no_group(world_of_one: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """This test process as a world of one (conftest's ``world_of_one``)."""
    return world_of_one


def _subgroup(members: list[int]) -> Any:
    # new_group is itself collective over every rank, members or not.
    return dist.new_group(ranks=members, backend="gloo")


def _block(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor whose every element says which rank made it and where it sits (no padding zeros)."""
    count = 1
    for n in shape:
        count *= n
    return (torch.arange(count) + 1000 * (rank + 1)).reshape(shape).to(dtype)


# -- all_gather with shapes that differ in every dimension ----------------------------------------


# Shapes per rank: the sizes differ in every dimension, some are empty, one rank is largest in no
# dimension, so every rank is padded somewhere.
_SHAPES = {
    "2d": [(1, 4), (2, 3), (3, 2)],
    "3d": [(1, 2, 3), (2, 3, 4), (3, 4, 5)],
    "empty": [(0, 3), (2, 0), (1, 1)],
}


def gather_every_dimension(dtype: torch.dtype) -> dict[str, list[tuple[tuple[int, ...], list[Any]]]]:
    rank = distkit.get_rank()
    out = {}
    for name, shapes in _SHAPES.items():
        gathered = distkit.all_gather(_block(rank, shapes[rank], dtype))
        assert all(t.dtype == dtype for t in gathered)
        out[name] = [(tuple(t.shape), t.tolist()) for t in gathered]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_all_gather_returns_each_ranks_exact_tensor_when_every_dimension_differs(ranks, dtype) -> None:
    """Ports torchtnt ``test_gather_uneven_multidim``, Lightning ``_test_all_gather_uneven_tensors_multidim``
    and ignite ``_test_idist_all_gather_tensors_with_shapes`` (sizes differing in all three dims)."""
    for result in ranks.run(gather_every_dimension, dtype, world_size=3):
        for name, shapes in _SHAPES.items():
            expected = [(shape, _block(r, shape, dtype).tolist()) for r, shape in enumerate(shapes)]
            assert result[name] == expected, name


def gather_on_a_group() -> tuple[list[tuple[int, ...]], list[list[Any]]]:
    rank = distkit.get_rank()
    group = _subgroup([1, 2])
    try:
        shape = (rank + 1, rank + 2, rank + 3)
        gathered = distkit.all_gather(_block(rank, shape), group=group)
    finally:
        dist.destroy_process_group(group)
    return [tuple(t.shape) for t in gathered], [t.tolist() for t in gathered]


def test_all_gather_on_a_group_gathers_its_members_and_leaves_others_alone(ranks) -> None:
    """Ports ignite ``_test_idist_all_gather_tensors_with_shapes_group``: members get the members'
    tensors in group order; a rank outside the group gets its own tensor back."""
    outside, *members = ranks.run(gather_on_a_group, world_size=3)
    assert outside == ([(1, 2, 3)], [_block(0, (1, 2, 3)).tolist()])
    for shapes, values in members:
        assert shapes == [(2, 3, 4), (3, 4, 5)]
        assert values == [_block(1, (2, 3, 4)).tolist(), _block(2, (3, 4, 5)).tolist()]


# -- group= on every collective -------------------------------------------------------------------


def reduce_on_a_group() -> dict[str, Any]:
    rank = distkit.get_rank()
    group = _subgroup([1, 2])
    try:
        return {
            "sum": distkit.all_reduce(torch.tensor([rank]), group=group).tolist(),
            "mean": distkit.all_reduce(torch.tensor([float(rank)]), op="mean", group=group).tolist(),
            "max": distkit.all_reduce(torch.tensor([rank]), op="MAX", group=group).tolist(),
            "metrics": distkit.reduce_metrics({"loss": float(rank), "acc": (rank, 4)}, group=group),
        }
    finally:
        dist.destroy_process_group(group)


def test_all_reduce_and_reduce_metrics_on_a_group_reduce_over_its_members_only(ranks) -> None:
    """Ports ignite ``_test_distrib_all_reduce_group`` (a group of ranks 1..W-1 sums to their sum),
    and extends it to ``reduce_metrics``; a rank outside the group keeps its own values."""
    outside, *members = ranks.run(reduce_on_a_group, world_size=3)
    assert outside == {"sum": [0], "mean": [0.0], "max": [0], "metrics": {"loss": 0.0, "acc": 0.0}}
    for result in members:
        # The mean divides by the group's size (2), not the job's (3).
        assert result == {"sum": [3], "mean": [1.5], "max": [2], "metrics": {"loss": 1.5, "acc": 3 / 8}}


def objects_on_a_group() -> dict[str, Any]:
    rank = distkit.get_rank()
    group = _subgroup([0, 2])
    try:
        payload = {"a": [rank + 1, torch.tensor(rank + 3)], "c": {"abcd": rank}}
        gathered = distkit.all_gather_object(payload, group=group)
        return {
            "gathered": [(g["a"][0], g["a"][1].item(), g["c"]) for g in gathered],
            "from_2": distkit.broadcast_object(f"hello from {rank}", src=2, group=group),
            "any": distkit.any_rank(rank == 2, group=group),
            "all": distkit.all_ranks(rank != 1, group=group),
            "all_false": distkit.all_ranks(rank == 2, group=group),
        }
    finally:
        dist.destroy_process_group(group)


def test_object_collectives_and_flags_on_a_group_agree_among_its_members(ranks) -> None:
    """Ports ignite ``_test_distrib_all_gather_group`` (objects holding tensors, gathered on a group;
    a rank outside it gets its own value) and extends it to broadcasts and flags."""
    member_0, outside, member_2 = ranks.run(objects_on_a_group, world_size=3)
    gathered = [(1, 3, {"abcd": 0}), (3, 5, {"abcd": 2})]
    assert (
        member_0
        == member_2
        == {
            "gathered": gathered,
            "from_2": "hello from 2",
            "any": True,
            "all": True,  # rank 1 says False, but it is not in the group
            "all_false": False,
        }
    )
    assert outside == {
        "gathered": [(2, 4, {"abcd": 1})],
        "from_2": "hello from 1",
        "any": False,
        "all": False,
        "all_false": False,
    }


def mismatch_on_a_group() -> str:
    rank = distkit.get_rank()
    group = _subgroup([1, 2])
    try:
        metrics = {"loss": 1.0} if rank == 1 else {"acc": 1.0}
        distkit.reduce_metrics(metrics, group=group)
        return "no error"
    except distkit.DistkitError as err:
        return str(err)
    finally:
        dist.destroy_process_group(group)


def test_reduce_metrics_mismatch_on_a_group_names_the_global_ranks(ranks) -> None:
    """distkit's own: a mismatch inside a group names the job's ranks, not the group's indices."""
    outside, *members = ranks.run(mismatch_on_a_group, world_size=3)
    assert outside == "no error"
    for rank, message in zip((1, 2), members, strict=True):
        assert message.startswith(f"[rank {rank}/3] reduce_metrics() on the group of ranks [1, 2] was"), (
            message
        )
        assert "rank 1 lacks ['acc']" in message and "rank 2 lacks ['loss']" in message


def barrier_on_a_group(tmp: str) -> tuple[bool, Any]:
    rank = distkit.get_rank()
    arrived = Path(tmp, "rank2-arrived")
    group = _subgroup([1, 2])
    try:
        if rank == 2:
            time.sleep(1.0)  # a rank that did not wait for rank 2 is through long before this
            arrived.touch()
        distkit.barrier(timeout_s=60, group=group)  # rank 0 is outside the group: returns at once
        seen = arrived.exists()
        if rank == 1:
            # Rank 2 never comes to this one. In a thread, so that a barrier without a deadline is
            # named by the test at once, not found by the pool's deadline a minute later.
            outcome: list[Any] = []

            def wait() -> None:
                try:
                    distkit.barrier(timeout_s=1.0, group=group)
                    outcome.append("no error")
                except distkit.CollectiveTimeoutError as err:
                    outcome.append((str(err), err.missing_ranks))

            waiter = threading.Thread(target=wait, daemon=True)
            waiter.start()
            waiter.join(20.0)
            return seen, outcome[0] if outcome else "no return within 20 s"
        return seen, None
    finally:
        dist.destroy_process_group(group)


def test_barrier_on_a_group_waits_for_its_members_and_names_the_one_that_is_late(ranks, tmp_path) -> None:
    """Ports ignite ``_test_distrib_barrier`` to a group; the deadline naming the late member is distkit's."""
    outside, (seen_1, late), (seen_2, _) = ranks.run(
        barrier_on_a_group, str(tmp_path), world_size=3, timeout_s=60
    )
    assert outside == (False, None)  # through before rank 2 arrived: it did not wait
    assert seen_1 and seen_2  # the members were through only after rank 2 arrived
    assert late != "no return within 20 s", "barrier(timeout_s=1.0, group=...) has no deadline"
    assert late != "no error", "barrier(timeout_s=1.0, group=...) passed although rank 2 never came"
    message, missing = late
    assert missing == [2]
    assert message.startswith(
        "[rank 1/3] barrier on the group of ranks [1, 2] timed out after 1 s: rank(s) [2]"
    )


def bad_group_arguments() -> list[str]:
    group = _subgroup([1, 2])
    messages = []
    try:
        for call in (
            lambda: distkit.broadcast_object("x", src=0, group=group),
            lambda: scatter_object([1, 2], src=0, group=group),
        ):
            try:
                call()
                messages.append("no error")
            except ValueError as err:
                messages.append(str(err))
    finally:
        dist.destroy_process_group(group)
    return messages


def test_a_source_outside_the_group_is_refused_on_its_members(ranks) -> None:
    """distkit's own: ``src`` is a global rank (torch's rule) and must be a member of the group."""
    outside, *members = ranks.run(bad_group_arguments, world_size=3)
    assert outside == ["no error", "no error"]  # rank 0 is outside: nothing to check, nothing sent
    for messages in members:
        assert messages[0].startswith("broadcast_object() src=0 is not a member of the group of ranks [1, 2]")
        assert messages[1].startswith("scatter_object() src=0 is not a member of the group of ranks [1, 2]")


@pytest.mark.parametrize("group", ["abc", [0, 1], 3])
def test_a_group_that_is_not_a_process_group_is_refused(no_group, group) -> None:
    """Ports ignite's ``group="abc"`` checks of ``_test_distrib_all_reduce_group`` and
    ``_test_distrib_all_gather_group``; distkit takes process groups only, made by ``new_group``."""
    calls = {
        "all_reduce": lambda: distkit.all_reduce(torch.ones(1), group=group),
        "all_gather": lambda: distkit.all_gather(torch.ones(1), group=group),
        "all_gather_object": lambda: distkit.all_gather_object(1, group=group),
        "broadcast_object": lambda: distkit.broadcast_object(1, group=group),
        "scatter_object": lambda: scatter_object([1], group=group),
        "reduce_metrics": lambda: distkit.reduce_metrics({"x": 1.0}, group=group),
        "any_rank": lambda: distkit.any_rank(True, group=group),
        "all_ranks": lambda: distkit.all_ranks(True, group=group),
        "barrier": lambda: distkit.barrier(group=group),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"{name}\(\) group must be a torch.distributed.ProcessGroup"):
            call()


# -- scatter_object ---------------------------------------------------------------------------------


def scatter(src: int) -> list[Any]:
    rank = distkit.get_rank()
    big = "x" * 100_000  # one object far larger than the others: each rank still gets its own
    objects = [1, {"shard": [2, 3]}, big] if rank == src else None
    first = scatter_object(objects, src=src)
    # The source's list may also be a tuple, and other ranks may pass anything (it is ignored).
    second = scatter_object(("a", "b", "c") if rank == src else "ignored", src=src)
    return [first if rank != 2 else len(first), second]


@pytest.mark.parametrize("src", [0, 1])
def test_scatter_object_gives_every_rank_its_own_item(ranks, src) -> None:
    """Ports torchtnt ``test_pg_wrapper_scatter_object_list_gloo`` (rank i gets item i of the
    source's list), on 3 ranks and from a source other than rank 0 too."""
    assert ranks.run(scatter, src, world_size=3) == [[1, "a"], [{"shard": [2, 3]}, "b"], [100_000, "c"]]


def scatter_invalid() -> list[str]:
    rank = distkit.get_rank()
    out = []
    for bad in ([1, 2], [1, 2, lambda: None]):  # too short; an item pickle cannot send
        try:
            scatter_object(bad if rank == 0 else None)
            out.append("no error")
        except (ValueError, TypeError, distkit.DistkitError) as err:
            out.append(f"{type(err).__name__}: {err}")
    # The ranks are still in step: the next collective pairs up as usual.
    out.append(repr(scatter_object(["a", "b", "c"] if rank == 0 else None)))
    return out


def test_scatter_object_with_an_invalid_list_raises_on_every_rank_at_once(ranks) -> None:
    """distkit's own: torch's scatter_object_list leaves the other ranks waiting in that case."""
    source, *others = ranks.run(scatter_invalid, world_size=3, timeout_s=60)
    assert source[0].startswith(
        "ValueError: scatter_object() needs one object per rank on the source rank: 3"
    )
    assert source[1].startswith("TypeError: scatter_object() cannot send item 2 (function)")
    assert source[2] == "'a'"
    for rank, messages in enumerate(others, start=1):
        assert messages[0].startswith(
            f"DistkitError: [rank {rank}/3] scatter_object(): the source rank 0 passed invalid objects, "
            f"so it raises on every rank: ValueError: scatter_object() needs one object per rank"
        )
        assert "TypeError: scatter_object() cannot send item 2" in messages[1]
        assert messages[2] == repr("abc"[rank])


def scatter_on_a_group() -> Any:
    rank = distkit.get_rank()
    group = _subgroup([1, 2])
    try:
        return scatter_object(["to 1", "to 2"] if rank == 2 else None, src=2, group=group)
    finally:
        dist.destroy_process_group(group)


def test_scatter_object_on_a_group_follows_the_groups_rank_order(ranks) -> None:
    """distkit's own (torch's ``group=`` convention): item i goes to the group's i-th rank; a rank
    outside the group gets ``None``."""
    assert ranks.run(scatter_on_a_group, world_size=3) == [None, "to 1", "to 2"]


def test_scatter_object_in_a_world_of_one_checks_its_list(no_group) -> None:
    """distkit's own: the world of one applies the same checks as a real source rank."""
    assert scatter_object([{"k": 1}]) == {"k": 1}
    with pytest.raises(ValueError, match=r"one object per rank on the source rank: 1 for 1 ranks, got 2"):
        scatter_object([1, 2])
    with pytest.raises(TypeError, match=r"objects must be a list with one object per rank.*got NoneType"):
        scatter_object(None)
    with pytest.raises(ValueError, match=r"scatter_object\(\) src must be a rank in 0..0, got 1"):
        scatter_object([1], src=1)


# -- main_process_only(rank=...), local_main_process_only --------------------------------------------


def decorated_runs() -> dict[str, Any]:
    world_size = distkit.get_world_size()
    value = torch.tensor(0)

    @distkit.main_process_only(rank=world_size - 1)
    def initialise_on_last() -> int:
        value.fill_(100)
        return 7

    @distkit.main_process_only
    def on_main() -> str:
        return "main"

    @distkit.main_process_only()
    def on_main_too() -> str:
        return "main too"

    @local_main_process_only
    def on_local_main() -> str:
        return "local main"

    returned = initialise_on_last()
    return {
        "returned": returned,
        "seen": [t.item() for t in distkit.all_gather(value)],
        "main": (on_main(), on_main_too()),
        "local": on_local_main(),
        "wrapped": initialise_on_last.__name__,
    }


def test_main_process_only_runs_on_the_chosen_rank_only(ranks) -> None:
    """Ports ignite ``_test_distrib_one_rank_only`` (the last rank initialises, the others see it
    untouched) and torchtnt ``test_rank_zero_fn_rank_zero``/``_rank_non_zero`` (others get None)."""
    results = ranks.run(decorated_runs, world_size=3)
    for rank, result in enumerate(results):
        assert result["returned"] == (7 if rank == 2 else None)
        assert result["seen"] == [0, 0, 100]
        assert result["main"] == (("main", "main too") if rank == 0 else (None, None))
        assert result["local"] == ("local main" if rank == 0 else None)  # one node: local rank == rank
        assert result["wrapped"] == "initialise_on_last"


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"RANK": "0", "LOCAL_RANK": "0"}, {"main": 1, "rank 1": None, "local": 1}),
        ({"RANK": "1", "LOCAL_RANK": "1"}, {"main": None, "rank 1": 1, "local": None}),
        (
            {"RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1"},
            {"main": None, "rank 1": 1, "local": 1},
        ),
        ({}, {"main": 1, "rank 1": ValueError, "local": 1}),
    ],
)
def test_decorators_follow_the_launchers_ranks_before_init(no_group, environ, expected) -> None:
    """Ports Lightning ``test_rank_zero_known_environment_variables``: the rank read from the
    launcher's variables decides, before any process group exists (no mocks: real variables)."""
    if environ:
        environ = {
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29999",
        } | environ
    for name, value in environ.items():
        no_group.setenv(name, value)

    def one() -> int:
        return 1

    calls = {
        "main": distkit.main_process_only(one),
        "rank 1": distkit.main_process_only(rank=1)(one),
        "local": local_main_process_only(one),
    }
    for name, call in calls.items():
        if expected[name] is ValueError:
            with pytest.raises(
                ValueError, match=r"main_process_only\(rank=1\) on .*one: this job has 1 process"
            ):
                call()
        else:
            assert call() == expected[name], name


@pytest.mark.parametrize("rank", [-1, 1.0, "0", True])
def test_decorator_ranks_that_are_not_ranks_are_refused_at_decoration(no_group, rank) -> None:
    """Ports ignite ``test_one_rank_first_asserts`` to the decorators."""
    for decorator in (distkit.main_process_only, local_main_process_only):
        with pytest.raises(ValueError, match=r"rank must be an int >= 0, got"):
            decorator(rank=rank)


def test_decorator_rank_beyond_the_job_raises_when_called(no_group) -> None:
    """Ports ignite ``test_one_rank_first_asserts``: a rank the job does not have never runs
    silently, it raises naming the job's ranks."""
    calls = (
        distkit.main_process_only(rank=3)(len),
        local_main_process_only(rank=1)(len),
    )
    with pytest.raises(
        ValueError, match=r"this job has 1 process\(es\), ranks 0..0, so no process would run it"
    ):
        calls[0]("abc")
    with pytest.raises(ValueError, match=r"this node runs 1 process\(es\), local ranks 0..0"):
        calls[1]("abc")


# -- main_process_first(rank=...) ---------------------------------------------------------------------


def first_reads(tmp: str, first: int) -> str:
    # Whoever finds no file is the one that went first (ignite's check), and the first one takes
    # its time so that a rank that did not wait for it would find no file either.
    rank = distkit.get_rank()
    path = Path(tmp, f"first{first}.txt")
    with distkit.main_process_first(rank=first, timeout_s=60):
        if rank == first:
            time.sleep(0.2)
        if path.exists():
            return f"{rank} read"
        path.write_text(str(rank))
        return f"{rank} wrote"


@pytest.mark.parametrize("first", [0, 1, 2])
def test_main_process_first_lets_the_chosen_rank_go_first(ranks, tmp_path, first) -> None:
    """Ports ignite ``test_one_rank_first`` with ``local=False`` for every rank."""
    results = ranks.run(first_reads, str(tmp_path), first, world_size=3)
    assert results == [f"{r} wrote" if r == first else f"{r} read" for r in range(3)]


def first_fails() -> str:
    try:
        with distkit.main_process_first(rank=1, timeout_s=60):
            if distkit.get_rank() == 1:
                raise FileNotFoundError("shard.bin")
        return "no error"
    except distkit.MainProcessError as err:
        return str(err).splitlines()[0]
    except FileNotFoundError as err:
        return f"own {err}"


def test_failure_of_the_rank_that_goes_first_reaches_the_others_naming_it(ranks) -> None:
    """distkit's own: the failure rules of main_process_first hold for the chosen rank."""
    failed = "first process (rank 1) failed inside main_process_first(rank=1): FileNotFoundError: shard.bin"
    assert ranks.run(first_fails, world_size=3) == [
        f"[rank 0/3] {failed}",
        "own shard.bin",
        f"[rank 2/3] {failed}",
    ]


def test_main_process_first_rank_beyond_the_job_is_refused(no_group) -> None:
    """Ports ignite ``test_one_rank_first_asserts`` (rank 100 is refused naming the valid ranks)."""
    beyond = r"main_process_first\(rank=100\) names no process: this job has 1"
    with pytest.raises(ValueError, match=beyond), distkit.main_process_first(rank=100):
        pass
    beyond_node = r"rank=1, local=True\) names no process: this node runs 1.*local ranks 0..0"
    with pytest.raises(ValueError, match=beyond_node), distkit.main_process_first(rank=1, local=True):
        pass
    not_int: Any = "0"
    with (
        pytest.raises(TypeError, match=r"rank must be an int, got str"),
        distkit.main_process_first(rank=not_int),
    ):
        pass
    with distkit.main_process_first(rank=0, local=True):
        pass


def two_nodes(tmp: str) -> dict[str, Any]:
    # Four ranks as two nodes of two: node 0 = ranks 0, 1; node 1 = ranks 2, 3.
    rank = int(os.environ["RANK"])
    os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2), GROUP_RANK=str(rank // 2))
    distkit.init("gloo")

    @local_main_process_only
    def per_node() -> int:
        return distkit.get_node_rank()

    @local_main_process_only(rank=1)
    def second_of_node() -> int:
        return rank

    path = Path(tmp, f"node{distkit.get_node_rank()}.txt")
    with distkit.main_process_first(local=True, rank=1, timeout_s=60):
        if distkit.get_local_rank() == 1:
            time.sleep(0.2)
        first = "read" if path.exists() else "wrote"
        path.touch()
    return {"per_node": per_node(), "second": second_of_node(), "first": first}


def test_local_variants_run_per_node(ranks, tmp_path) -> None:
    """Ports torchtnt ``test_local_rank_zero_fn`` (on two nodes, not one) and ignite
    ``test_one_rank_first`` with ``local=True`` (local rank 1 of each node goes first)."""
    results = ranks.run(two_nodes, str(tmp_path), world_size=4, fresh=True, init=False, timeout_s=120)
    assert [r["per_node"] for r in results] == [0, None, 1, None]
    assert [r["second"] for r in results] == [None, 1, None, 3]
    assert [r["first"] for r in results] == ["read", "wrote", "read", "wrote"]


# -- integer mean ---------------------------------------------------------------------------------


def reduce_every_dtype() -> list[tuple[str, str, Any, str, bool]]:
    rank = distkit.get_rank()
    out = []
    for dtype in (torch.int64, torch.int32, torch.float32, torch.float16):
        for op in ("max", "sum", "avg"):
            tensor = torch.tensor(rank + 1, dtype=dtype)
            result = distkit.all_reduce(tensor, op=op)
            out.append((str(dtype), op, result.item(), str(result.dtype), result is tensor))
    return out


def test_all_reduce_keeps_the_dtype_in_place_and_floors_an_integer_mean(ranks) -> None:
    """Ports Lightning ``_test_all_reduce`` (long, int, float, half; max, sum, avg; in place): 1 and
    2 average to 1 in an integer tensor, 1.5 in a float one."""
    for result in ranks.run(reduce_every_dtype, world_size=2):
        for dtype, op, value, out_dtype, in_place in result:
            integer = "int" in dtype
            expected = {"max": 2, "sum": 3, "avg": 1 if integer else 1.5}[op]
            assert (value, out_dtype, in_place) == (expected, dtype, True), (dtype, op)


def integer_means() -> dict[str, Any]:
    rank = distkit.get_rank()
    return {
        # floor, not truncation: -1, -2, -4 sum to -7, and -7 / 3 rounds down to -3 (truncation: -2).
        "negative": distkit.all_reduce(torch.tensor([-(2**rank)]), op="mean").tolist(),
        "positive": distkit.all_reduce(torch.tensor([2**rank], dtype=torch.int32), op="mean").tolist(),
        # reduce_metrics reduces ints as floats: the exact quotient.
        "metrics": distkit.reduce_metrics({"n": 2**rank, "t": torch.tensor(2**rank)}),
    }


def test_integer_mean_rounds_down_in_all_reduce_and_is_exact_in_reduce_metrics(ranks) -> None:
    """distkit's own: the rounding the docstring of all_reduce documents."""
    for result in ranks.run(integer_means, world_size=3):
        assert result == {"negative": [-3], "positive": [2], "metrics": {"n": 7 / 3, "t": 7 / 3}}


def test_integer_mean_in_a_world_of_one_is_the_value_and_bool_is_refused(no_group) -> None:
    """distkit's own: no process group, the same rules."""
    tensor = torch.tensor([5, -3])
    assert distkit.all_reduce(tensor, op="mean") is tensor and tensor.tolist() == [5, -3]
    assert distkit.reduce_metrics({"n": 3}) == {"n": 3.0}
    with pytest.raises(TypeError, match="op='mean' has no meaning for a bool tensor"):
        distkit.all_reduce(torch.tensor([True]), op="avg")


def group_member_never_comes() -> str:
    distkit.init("gloo", timeout_s=5)
    group = _subgroup([0, 1])
    if distkit.get_rank() == 1:
        return "stayed away"
    start = time.monotonic()
    try:
        distkit.all_gather_object("here", group=group)
    except distkit.CollectiveTimeoutError as err:
        return f"{time.monotonic() - start:.0f} s: {err}"
    return "no error"


def test_a_collective_on_a_group_ends_within_inits_timeout_when_a_member_stays_away(ranks) -> None:
    """distkit's own: every wait has a deadline, on the caller's groups too."""
    waited, stayed = ranks.run(group_member_never_comes, world_size=2, fresh=True, init=False, timeout_s=120)
    assert stayed == "stayed away"
    assert waited.endswith(
        "[rank 0/2] all_gather_object() on the group of ranks [0, 1] did not complete within 5 s: some "
        "rank of the group did not arrive (it waits in another collective, or is still computing). "
        "Call it on every rank of the group, in the same order; a longer wait needs "
        "distkit.init(timeout_s=...)."
    ), waited
    assert 4 <= float(waited.split(" s:")[0]) < 30


def group_barrier_without_store() -> bool:
    from distkit import runtime

    group = _subgroup([0, 1])
    rt = runtime._current()
    saved, rt.store = rt.store, None
    try:
        distkit.barrier(timeout_s=60, group=group)  # gloo's monitored barrier on the group
        return True
    finally:
        rt.store = saved
        dist.destroy_process_group(group)


def test_a_group_barrier_without_a_store_falls_back_to_a_monitored_barrier(ranks) -> None:
    """distkit's own: an adopted group whose store cannot be reached still has group barriers."""
    assert ranks.run(group_barrier_without_store, world_size=2) == [True, True]

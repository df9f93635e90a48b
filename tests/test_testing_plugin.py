"""distkit.testing: the ``ranks`` fixture and ``run_ranks`` on real gloo groups, no mocks.

Functions that run on the ranks are defined at module level: the ranks import them by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import distkit
from distkit.errors import DistkitError
from distkit.testing import RankFailedError, RankPools, Ranks, run_ranks

pytest_plugins = ["pytester"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- functions the ranks run ----------------------------------------------------------------------


def rank_times(factor: int, *, offset: int = 0) -> int:
    return dist.get_rank() * factor + offset


def all_reduce_rank() -> float:
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return value.item()


def pid() -> int:
    return os.getpid()


def master_port_and_pid() -> tuple[str, int]:
    return os.environ["MASTER_PORT"], os.getpid()


def fail_rank_1_first() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    time.sleep(0.3)
    raise RuntimeError("later failure on rank 0")


def fail_rank_1_while_rank_0_sleeps() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    time.sleep(60)


def kill_rank_1() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # gloo reports the dead peer within about 0.3 s


def return_unpicklable() -> object:
    return lambda: None


def print_hello() -> int:
    print(f"hello from rank {dist.get_rank()}")
    return 0


def send_from_rank_0_to_every_rank() -> float:
    # Uneven point-to-point traffic: rank 0 issues world_size - 1 sends, every other rank one recv.
    if dist.get_rank() == 0:
        for dst in range(1, dist.get_world_size()):
            dist.send(torch.tensor([10.0 + dst]), dst=dst)
        return 0.0
    value = torch.zeros(1)
    dist.recv(value, src=0)
    return value.item()


def monitored_barrier() -> None:
    # gloo runs it as point-to-point messages to and from rank 0: uneven counts as well.
    dist.monitored_barrier(timeout=timedelta(seconds=60))


def leave_async_all_reduce_on_rank_0_of_a_subgroup() -> None:
    subgroup = dist.new_group([0, 1])  # collective: every rank creates it
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), group=subgroup, async_op=True)  # never waited for


def launcher_view_then_init(tag: str) -> dict[str, object]:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")
    view: dict[str, object] = {key: os.environ[key] for key in keys}
    view["agent_store"] = os.environ["TORCHELASTIC_USE_AGENT_STORE"]
    view["flag"] = os.environ.get("DISTKIT_TEST_FLAG")
    view["initialized_before"] = dist.is_initialized()
    distkit.init("gloo", timeout_s=30)
    value = torch.ones(1)
    dist.all_reduce(value)
    view["sum"] = value.item()
    view["tag"] = tag
    return view


class WhoLoads(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample i is (the pid of the process that loaded it, that process's parent's pid)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([os.getpid(), os.getppid()])


# Iterators whose workers must still run when the rank is killed.
_kept_loading: list[object] = []


def start_workers_then_fail(directory: str) -> None:
    # The rank's default start method: no multiprocessing_context, as docs/testing.md advises.
    loader = torch.utils.data.DataLoader(WhoLoads(), batch_size=1, num_workers=2, persistent_workers=True)
    batches = iter(loader)
    _kept_loading.append(batches)
    workers = sorted({tuple(next(batches)[0].tolist()) for _ in range(len(loader))})
    with open(os.path.join(directory, f"rank{dist.get_rank()}.txt"), "w") as out:
        out.write(" ".join(f"{worker}:{parent}:{_parent(parent)}" for worker, parent in workers))
    raise RuntimeError(f"failing with workers {workers} running")


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped, does not). Linux."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


# -- results and the pool -------------------------------------------------------------------------


def test_results_come_back_in_rank_order_with_args_and_kwargs(ranks: Ranks) -> None:
    assert ranks.run(rank_times, 10, offset=1, world_size=3) == [1, 11, 21]
    assert ranks.run(all_reduce_rank, world_size=3) == [3.0, 3.0, 3.0]


def test_pool_is_reused_across_calls_and_rebuilt_after_a_failure(ranks: Ranks) -> None:
    first = ranks.run(pid)
    assert ranks.run(pid) == first
    with pytest.raises(RankFailedError):
        ranks.run(fail_rank_1_first)
    rebuilt = ranks.run(pid)
    assert set(rebuilt).isdisjoint(first)
    assert not any(_alive(p) for p in first)


def train_main_that_shuts_down(only_rank: int | None = None) -> float:
    """A user's training entry point as it runs under torchrun, ending with its last line."""
    distkit.init()  # already initialised in a pool rank: returns the same environment
    value = all_reduce_rank()
    if only_rank is None or dist.get_rank() == only_rank:
        distkit.shutdown()
    return value


def test_a_call_that_shuts_the_group_down_passes_and_the_next_call_gets_new_ranks(ranks: Ranks) -> None:
    """Was: the call passed and the next test, on the same pool, failed with "Default process group
    has not been initialized", far from the cause."""
    first = ranks.run(pid)
    assert ranks.run(train_main_that_shuts_down) == [1.0, 1.0]
    assert ranks.run(all_reduce_rank) == [1.0, 1.0]  # new ranks, in a group
    assert set(ranks.run(pid)).isdisjoint(first)
    assert not any(_alive(p) for p in first)
    with pytest.raises(RankFailedError) as caught:  # on some ranks only: the ranks are out of step
        ranks.run(train_main_that_shuts_down, 1)
    assert str(caught.value).startswith(
        "train_main_that_shuts_down() on 2 ranks returned, but ended the process group on rank(s) [1] "
        "only (distkit.shutdown() or torch.distributed.destroy_process_group() ran there)"
    ), caught.value
    assert ranks.run(all_reduce_rank) == [1.0, 1.0]


def test_pool_rank_that_died_while_idle_is_replaced_before_the_next_call(ranks: Ranks) -> None:
    first = ranks.run(pid)
    os.kill(first[1], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(first[1]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(ranks.run(pid)).isdisjoint(first)


def test_fresh_ranks_are_new_processes_that_exit_afterwards(ranks: Ranks) -> None:
    pooled = ranks.run(pid)
    fresh = ranks.run(pid, fresh=True)
    assert set(fresh).isdisjoint(pooled)
    assert not any(_alive(p) for p in fresh)
    assert ranks.run(pid) == pooled  # the pool was not disturbed


def test_fresh_ranks_without_init_get_launcher_env_and_custom_env(ranks: Ranks) -> None:
    views = ranks.run(
        launcher_view_then_init,
        "t1",
        world_size=2,
        fresh=True,
        init=False,
        env={"DISTKIT_TEST_FLAG": "on"},
    )
    for rank, view in enumerate(views):
        assert view == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "agent_store": "True",
            "flag": "on",
            "initialized_before": False,
            "sum": 2.0,
            "tag": "t1",
        }


def test_two_runners_at_once_use_different_ports_and_close_leaves_no_processes() -> None:
    with RankPools() as first, RankPools() as second:
        (port_a, _), (_, pid_a1) = first.run(master_port_and_pid)
        (port_b, _), (_, pid_b1) = second.run(master_port_and_pid)
        pids = [*(first.pids() or []), *(second.pids() or [])]
        assert port_a != port_b
        assert len(pids) == 4 and all(_alive(p) for p in pids)
        assert pid_a1 in pids and pid_b1 in pids
    assert not any(_alive(p) for p in pids)


def test_rank_output_is_forwarded_to_stderr_with_rank_prefix(
    ranks: Ranks, capsys: pytest.CaptureFixture[str]
) -> None:
    ranks.run(print_hello)
    err = capsys.readouterr().err
    assert "[rank 0/2] hello from rank 0" in err and "[rank 1/2] hello from rank 1" in err


@pytest.mark.skipif(sys.platform != "linux", reason="reads the process tree from /proc")
def test_dataloader_workers_come_from_the_ranks_own_forkserver_and_die_with_the_rank(
    ranks: Ranks, tmp_path
) -> None:
    pids = ranks.run(pid)
    with pytest.raises(RankFailedError, match="failing with workers"):
        ranks.run(start_workers_then_fail, str(tmp_path))
    for rank, rank_pid in enumerate(pids):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        workers = [tuple(map(int, line.split(":"))) for line in text.split()]
        server = workers[0][1]
        # Never forked from the rank, whose other threads may hold locks (docs/testing.md): from a
        # single-threaded server that the rank started.
        assert len(workers) == 2 and server != rank_pid, (rank_pid, workers)
        assert all((parent, grandparent) == (server, rank_pid) for _, parent, grandparent in workers)
        # Killed with the rank: neither the server nor its workers notice the rank's death.
        deadline = time.monotonic() + 5
        while any(_running(p) for p in [server, *(worker for worker, _, _ in workers)]):
            assert time.monotonic() < deadline, (rank_pid, workers)
            time.sleep(0.05)


# -- failures -------------------------------------------------------------------------------------


def test_rank_exception_reaches_parent_with_traceback_first_failing_rank_first(
    ranks: Ranks,
) -> None:
    with pytest.raises(RankFailedError) as info:
        ranks.run(fail_rank_1_first)
    err = info.value
    assert isinstance(err, DistkitError)
    assert [(f.rank, f.kind) for f in err.failures] == [(1, "exception"), (0, "exception")]
    message = str(err)
    assert "[rank 1/2] failed first" in message
    assert "ValueError: boom from rank 1" in message
    # The full remote traceback, pointing into this file's function.
    assert "Traceback (most recent call last)" in message
    assert "in fail_rank_1_first" in message and 'raise ValueError("boom from rank 1")' in message
    assert "[rank 0/2] RuntimeError: later failure on rank 0" in message
    assert message.index("boom from rank 1") < message.index("later failure on rank 0")


def test_ranks_still_running_after_a_failure_are_killed_after_the_grace_period() -> None:
    threads = threading.active_count()
    with RankPools(grace_s=0.5) as pools:
        pids = pools.run(pid)
        start = time.monotonic()
        with pytest.raises(RankFailedError) as info:
            pools.run(fail_rank_1_while_rank_0_sleeps, timeout_s=60)
        elapsed = time.monotonic() - start
        # Killed and reaped at once, not left for close(); no helper thread either.
        assert not any(_alive(p) for p in pids)
        assert threading.active_count() == threads
    assert elapsed < 10, elapsed
    assert [(f.rank, f.kind) for f in info.value.failures] == [(1, "exception"), (0, "killed")]
    assert "[rank 0/2] killed after rank 1 failed" in str(info.value)


def test_killed_rank_is_reported_promptly_with_its_exit_code(ranks: Ranks) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        ranks.run(kill_rank_1, timeout_s=60)
    assert time.monotonic() - start < 10  # not the 60 s deadline
    first = info.value.failures[0]
    assert (first.rank, first.kind, first.exitcode) == (1, "exit", -signal.SIGKILL)
    assert "[rank 1/2] exited with code -9 (SIGKILL)" in str(info.value)


def test_unpicklable_result_fails_naming_the_type(ranks: Ranks) -> None:
    with pytest.raises(RankFailedError, match="returned a function that cannot be pickled"):
        ranks.run(return_unpicklable)


def test_lambdas_closures_and_conflicting_options_are_rejected_with_the_fix(ranks: Ranks) -> None:
    with pytest.raises(ValueError, match=r"got a lambda.*Define it with `def` at module level"):
        ranks.run(lambda: 0)

    def nested() -> int:
        return 0

    with pytest.raises(ValueError, match="nested function or closure"):
        ranks.run(nested)
    with pytest.raises(ValueError, match="init=False needs fresh=True"):
        ranks.run(pid, init=False)
    with pytest.raises(ValueError, match="env= needs fresh=True"):
        ranks.run(pid, env={"A": "1"})
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        ranks.run(pid, world_size=0)
    # A slip of an option would go to fn (silently into a **kwargs) and the option keep its default.
    with pytest.raises(
        TypeError, match=r"run\(\) got world_sise=, which .*pid does not name: did you mean world_size=\?"
    ):
        ranks.run(pid, world_sise=3)
    with pytest.raises(TypeError, match=r"did you mean timeout_s=\?"):
        ranks.run(rank_times, 1, timeout=5)
    assert ranks.run(rank_times, 10, offset=1) == [1, 11]  # fn's own keywords still go to fn


def test_nccl_without_enough_gpus_skips_with_a_reason(ranks: Ranks) -> None:
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs; the skip path cannot be reached")
    with pytest.raises(pytest.skip.Exception, match="needs 2 CUDA devices; this machine has"):
        ranks.run(pid, backend="nccl", world_size=2)


def test_unmatched_collective_on_a_subgroup_fails_naming_rank_and_group_and_pool_is_rebuilt(
    ranks: Ranks,
) -> None:
    first = ranks.run(pid, world_size=3)
    with pytest.raises(RankFailedError) as info:
        ranks.run(leave_async_all_reduce_on_rank_0_of_a_subgroup, world_size=3)
    assert [(f.rank, f.kind) for f in info.value.failures] == [(0, "unmatched")]
    message = str(info.value)
    assert "leave_async_all_reduce_on_rank_0_of_a_subgroup() on 3 ranks returned, but left an " in message
    assert "unmatched collective behind" in message
    assert "[rank 0/3] issued 1 more operation(s) on process group" in message
    assert "of ranks [0, 1] than rank 1 in this call (1 against 0)" in message
    assert ranks.run(all_reduce_rank, world_size=3) == [3.0, 3.0, 3.0]
    assert set(ranks.run(pid, world_size=3)).isdisjoint(first)


def test_uneven_point_to_point_traffic_is_not_taken_for_an_unmatched_collective(ranks: Ranks) -> None:
    first = ranks.run(pid, world_size=3)
    for _ in range(2):  # the second time, the counts the first check settled are the baseline
        assert ranks.run(send_from_rank_0_to_every_rank, world_size=3) == [0.0, 11.0, 12.0]
        ranks.run(monitored_barrier, world_size=3)
        assert ranks.run(all_reduce_rank, world_size=3) == [3.0, 3.0, 3.0]
    assert ranks.run(pid, world_size=3) == first  # the same, healthy pool throughout


# -- inner pytest sessions: skip, hang, unmatched collectives -------------------------------------


def test_pytest_skip_on_every_rank_skips_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner_skip="""
        import pytest

        def skip_everywhere():
            pytest.skip("no widgets on this rank")

        def test_skipped(ranks):
            ranks.run(skip_everywhere, world_size=2)
        """
    )
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*no widgets on this rank*"])


def test_naming_the_plugin_again_with_p_or_pytest_plugins_changes_nothing(pytester: pytest.Pytester) -> None:
    """Was: `-p distkit.testing.plugin` or `pytest_plugins = [...]` naming it stopped pytest before
    any test with "Plugin already registered under a different name" (its entry point was `distkit`)."""
    pytester.makeconftest('pytest_plugins = ["distkit.testing.plugin"]')
    pytester.makepyfile(
        test_inner_named="""
        def world():
            import torch.distributed as dist
            return dist.get_world_size()

        def test_world(ranks):
            assert ranks.run(world, world_size=2) == [2, 2]
        """
    )
    pytester.runpytest("-p", "distkit.testing.plugin").assert_outcomes(passed=1)
    off = pytester.runpytest("-p", "no:distkit.testing.plugin", "-p", "no:cacheprovider")
    off.assert_outcomes(errors=1)  # the conftest's pytest_plugins is blocked too: no `ranks`
    off.stdout.fnmatch_lines(["*fixture 'ranks' not found*"])


def test_hung_rank_fails_only_its_test_with_every_rank_stack_and_next_test_passes(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_inner_hang="""
        import time
        import torch.distributed as dist

        def hang_on_rank_1():
            if dist.get_rank() == 1:
                time.sleep(120)
            dist.barrier()

        def world():
            return dist.get_world_size()

        def test_hangs(ranks):
            ranks.run(hang_on_rank_1, world_size=2, timeout_s=5)

        def test_next_one_gets_a_new_pool(ranks):
            assert ranks.run(world, world_size=2) == [2, 2]
        """
    )
    start = time.monotonic()
    result = pytester.runpytest()
    elapsed = time.monotonic() - start
    result.assert_outcomes(failed=1, passed=1)
    assert elapsed < 5 + 20, elapsed
    output = result.stdout.str()
    assert "RankFailedError" in output and "did not finish within 5 s (timeout_s)" in output
    assert "[rank 0/2] still running" in output and "[rank 1/2] still running" in output
    # Rank 1's stack shows where it sleeps; rank 0's shows the barrier it waits in.
    assert output.count("in hang_on_rank_1") >= 2 and "in barrier" in output


_LEFTOVERS = """
from datetime import timedelta

import torch
import torch.distributed as dist

import distkit


def async_all_reduce_on(leaving):
    if dist.get_rank() in leaving:
        dist.all_reduce(torch.ones(1), async_op=True)  # never waited for


def timed_out_wait_on_rank_0():
    if dist.get_rank() == 0:
        work = dist.all_reduce(torch.ones(1), async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=1))  # the other ranks never start it
        except RuntimeError:
            pass  # swallowed: the all_reduce stays pending


def distkit_barrier_on_rank_0():
    if dist.get_rank() == 0:
        try:
            distkit.barrier(timeout_s=1)  # the other ranks never arrive
        except distkit.CollectiveTimeoutError:
            pass


def sum_of_ranks_after_a_barrier():
    distkit.barrier(timeout_s=20)
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return value.item()


def test_leaves_a_collective_behind(ranks):
    ranks.run({call}, world_size={world_size})


def test_next_gets_clean_ranks(ranks):
    values = ranks.run(sum_of_ranks_after_a_barrier, world_size={world_size}, timeout_s=20)
    assert values == [float(sum(range({world_size})))] * {world_size}
"""


@pytest.mark.parametrize(
    ("call", "world_size", "expected"),
    [
        (
            "async_all_reduce_on, [0]",
            2,
            ["[rank 0/2] issued 1 more operation(s) on the default process group than rank 1"],
        ),
        (
            "timed_out_wait_on_rank_0",
            2,
            ["[rank 0/2] issued 1 more operation(s) on the default process group than rank 1"],
        ),
        (
            "async_all_reduce_on, [0, 2]",
            3,
            [
                "[rank 0/3] issued 1 more operation(s) on the default process group than rank 1",
                "[rank 2/3] issued 1 more operation(s) on the default process group than rank 1",
            ],
        ),
        (
            "distkit_barrier_on_rank_0",
            2,
            ["[rank 0/2] made 1 more call(s) of distkit's barrier (a store-based collective) than rank 1"],
        ),
    ],
)
def test_test_that_leaves_an_unmatched_collective_fails_naming_it_and_the_next_test_passes(
    pytester: pytest.Pytester, call: str, world_size: int, expected: list[str]
) -> None:
    pytester.makepyfile(test_inner_leftover=_LEFTOVERS.format(call=call, world_size=world_size))
    result = pytester.runpytest("-v")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        ["*::test_leaves_a_collective_behind FAILED*", "*::test_next_gets_clean_ranks PASSED*"]
    )
    output = result.stdout.str()
    assert "left an unmatched collective behind" in output
    for line in expected:
        assert line in output, line


# -- without pytest -------------------------------------------------------------------------------


def test_run_ranks_works_without_pytest_and_leaves_no_processes(tmp_path) -> None:
    script = tmp_path / "bench_like.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys

            def world_and_pid():
                import distkit
                return distkit.get_world_size(), os.getpid()

            if __name__ == "__main__":
                # Checked here, not at top level: every rank re-imports this script as a module.
                import distkit
                assert "pytest" not in sys.modules and "distkit.testing" not in sys.modules
                import distkit.testing
                assert "pytest" not in sys.modules
                results = distkit.testing.run_ranks(world_and_pid, world_size=2)
                assert [w for w, _ in results] == [2, 2], results
                assert "pytest" not in sys.modules
                print(" ".join(str(p) for _, p in results))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


def test_run_ranks_from_a_script_read_on_stdin_says_to_save_it_as_a_file(tmp_path) -> None:
    script = textwrap.dedent(
        """
        import distkit.testing

        def rank():
            import distkit
            return distkit.get_rank()

        if __name__ == "__main__":
            distkit.testing.run_ranks(rank, world_size=2, timeout_s=60)
        """
    )
    done = subprocess.run(
        [sys.executable, "-"], input=script, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    # Was: "keep its top-level code under `if __name__ == '__main__':`", which it already was.
    assert "read from stdin (`python - < script.py`), which a child cannot read again" in done.stderr


def test_run_ranks_is_the_same_call_as_the_fixture() -> None:
    assert run_ranks(rank_times, 2, world_size=2) == [0, 2]

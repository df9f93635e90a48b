"""main_process_first and run_on_main on real gloo groups: order, failure reach, deadlines, deaths."""

from __future__ import annotations

import gc
import os
import re
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import distkit
from _launch import free_port
from distkit import coordination, runtime
from distkit.testing import RankFailedError, RankPools


def _append(path: str, line: str) -> None:
    # O_APPEND writes of one short line are atomic, so ranks can share the file.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _section_keys(call: int, scope: str = "all") -> list[str]:
    prefix = f"main_first/0/{call}/{scope}"
    return [f"{prefix}/{name}" for name in ("status", "beat", "done", "leader", "site")]


# -- order and results ------------------------------------------------------------------------------


def main_goes_first(log: str) -> list[bool]:
    rank = distkit.get_rank()
    with distkit.main_process_first(timeout_s=60):
        _append(log, f"enter {rank}")
        if rank == 0:
            time.sleep(0.3)  # a follower that did not wait would enter meanwhile
        _append(log, f"exit {rank}")
    call = runtime._current().counters["main_process_first"]
    distkit.barrier(timeout_s=60)  # the follower has cleaned up by now
    return [runtime._store().check([key]) for key in _section_keys(call)]


def test_main_process_runs_the_block_before_the_others_and_leaves_no_keys(ranks, tmp_path: Path) -> None:
    log = tmp_path / "order.log"
    leftovers = ranks.run(main_goes_first, str(log), world_size=2)
    assert log.read_text().split("\n")[:2] == ["enter 0", "exit 0"]
    assert sorted(log.read_text().splitlines()) == ["enter 0", "enter 1", "exit 0", "exit 1"]
    assert leftovers == [[False] * 5, [False] * 5]


def _record_call(path: str, *, tag: str) -> dict[str, Any]:
    _append(path, f"called on rank {distkit.get_rank()}")
    return {"rank": distkit.get_rank(), "tag": tag, "values": torch.arange(3)}


def run_on_main_everywhere(path: str) -> dict[str, Any]:
    result = distkit.run_on_main(_record_call, path, tag="shared")
    result["values"] = result["values"].tolist()
    return result


def test_run_on_main_calls_once_and_returns_the_same_object_everywhere(ranks, tmp_path: Path) -> None:
    calls = tmp_path / "calls.log"
    results = ranks.run(run_on_main_everywhere, str(calls), world_size=2)
    assert results == [{"rank": 0, "tag": "shared", "values": [0, 1, 2]}] * 2
    assert calls.read_text() == "called on rank 0\n"


def _config(name: str) -> dict[str, str]:
    return {"config": name}


def sections_out_of_step(order: str) -> str:
    try:
        if order == "one rank more":
            if distkit.is_main_process():  # the slip: a collective section on one rank only
                distkit.run_on_main(_config, "warm-up")
            config = distkit.run_on_main(_config, "train")
            return f"took {config}"
        if distkit.get_rank() == 0:  # the same two sections, in the other order on rank 1
            with distkit.main_process_first(timeout_s=60):
                pass
            return f"took {distkit.run_on_main(_config, 'vocab')}"
        config = distkit.run_on_main(_config, "vocab")
        with distkit.main_process_first(timeout_s=60):
            pass
        return f"took {config}"
    except distkit.CollectiveMismatchError as err:
        assert err.missing_ranks == [0]
        return str(err)


@pytest.mark.parametrize("order", ["one rank more", "another order"])
def test_sections_made_in_another_order_or_number_are_refused_not_paired(ranks, order: str) -> None:
    # Was: rank 1 took the main process's warm-up config (or None) in silence.
    main, other = ranks.run(sections_out_of_step, order, world_size=2, fresh=True, timeout_s=60)
    assert main.startswith("took {'config': ")
    line = "run_on_main(_config) at test_coordination.py:"
    paired = "run_on_main(_config)" if order == "one rank more" else "main_process_first()"
    assert re.match(
        rf"\[rank 1/2\] this rank's {re.escape(line)}\d+ was paired with the main process \(rank 0\)'s "
        rf"{re.escape(paired)} at test_coordination\.py:\d+: the ranks made main-first sections",
        other,
    ), other


def many_sections(n: int) -> list[bool]:
    for i in range(n):
        with distkit.main_process_first(local=bool(i % 2), timeout_s=60):
            pass
        assert distkit.run_on_main(int, str(i)) == i
    last = runtime._current().counters["main_process_first"]
    distkit.barrier(timeout_s=60)
    store = runtime._store()
    return [
        store.check([key])
        for call in range(last - 2 * n + 1, last + 1)
        for scope in ("all", "node0")
        for key in _section_keys(call, scope)
    ]


def test_many_sections_in_a_row_stay_in_step_and_leave_no_keys(ranks) -> None:
    for leftovers in ranks.run(many_sections, 10, world_size=2):
        assert not any(leftovers)


# -- failures of the main process -------------------------------------------------------------------


def main_raises(local: bool) -> dict[str, Any]:
    start = time.monotonic()
    try:
        with distkit.main_process_first(local=local, timeout_s=60):
            if distkit.get_rank() == 0:
                time.sleep(0.2)
                raise FileNotFoundError("no such file: data/train.bin")
    except distkit.MainProcessError as err:
        return {
            "raised": "MainProcessError",
            "message": str(err),
            "exc_type": err.exc_type,
            "exc_message": err.exc_message,
            "traceback": err.remote_traceback,
            "elapsed": time.monotonic() - start,
        }
    except FileNotFoundError as err:
        return {"raised": "FileNotFoundError", "message": str(err)}
    return {"raised": None}


@pytest.mark.parametrize("local", [False, True])
def test_main_failure_reaches_all_ranks_within_seconds(ranks, local: bool) -> None:
    main, other = ranks.run(main_raises, local, world_size=2)
    assert main == {"raised": "FileNotFoundError", "message": "no such file: data/train.bin"}
    assert other["raised"] == "MainProcessError"
    who = "local main process of node 0 (rank 0)" if local else "main process (rank 0)"
    assert other["message"].startswith(
        f"[rank 1/2] {who} failed inside main_process_first(): "
        f"FileNotFoundError: no such file: data/train.bin"
    )
    assert (other["exc_type"], other["exc_message"]) == ("FileNotFoundError", "no such file: data/train.bin")
    assert "in main_raises" in other["traceback"] and "in main_raises" in other["message"]
    assert other["elapsed"] < 5.0


def _fail_on_main(value: int) -> int:
    raise ValueError(f"bad value {value}")


def _unpicklable() -> threading.Lock:
    return threading.Lock()


def run_on_main_failures() -> list[str]:
    seen = []
    for fn, args in ((_fail_on_main, (7,)), (_unpicklable, ())):
        try:
            distkit.run_on_main(fn, *args)
        except distkit.MainProcessError as err:
            seen.append(f"MainProcessError {err.exc_type}: {err.exc_message}")
        except (ValueError, TypeError) as err:
            seen.append(f"{type(err).__name__}: {err}")
    return seen


def test_run_on_main_errors_and_unpicklable_results_raise_on_every_rank(ranks) -> None:
    main, other = ranks.run(run_on_main_failures, world_size=2)
    assert main[0] == "ValueError: bad value 7"
    assert other[0] == "MainProcessError ValueError: bad value 7"
    assert main[1].startswith("TypeError: [rank 0/2] the result of run_on_main(_unpicklable)")
    assert other[1].startswith("MainProcessError TypeError: [rank 0/2] the result of run_on_main(")


def two_nodes(tmp: str) -> dict[str, Any]:
    # Four ranks as two nodes of two: node 0 = ranks 0, 1; node 1 = ranks 2, 3.
    rank = int(os.environ["RANK"])
    os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2), GROUP_RANK=str(rank // 2))
    distkit.init("gloo")
    log = os.path.join(tmp, f"node{distkit.get_node_rank()}.log")
    with distkit.main_process_first(local=True, timeout_s=60):
        _append(log, f"enter {rank}")
        if distkit.is_local_main_process():
            time.sleep(0.3)
        _append(log, f"exit {rank}")
    out: dict[str, Any] = {"owner": distkit.run_on_main(distkit.get_rank, local=True)}
    try:
        with distkit.main_process_first(local=True, timeout_s=60):
            if rank == 2:
                raise KeyError("missing shard")
        out["failure"] = None
    except distkit.MainProcessError as err:
        out["failure"] = str(err).splitlines()[0]
    except KeyError as err:
        out["failure"] = f"own KeyError {err}"
    return out


def test_local_sections_run_per_node_and_a_failure_stays_on_its_node(ranks, tmp_path: Path) -> None:
    results = ranks.run(two_nodes, str(tmp_path), world_size=4, fresh=True, init=False, timeout_s=120)
    for node, (leader, follower) in enumerate(((0, 1), (2, 3))):
        lines = (tmp_path / f"node{node}.log").read_text().splitlines()
        assert lines == [f"enter {leader}", f"exit {leader}", f"enter {follower}", f"exit {follower}"]
    assert [r["owner"] for r in results] == [0, 0, 2, 2]
    assert [r["failure"] for r in results[:3]] == [None, None, "own KeyError 'missing shard'"]
    assert results[3]["failure"] == (
        "[rank 3/4] local main process of node 1 (rank 2) failed inside main_process_first(): "
        "KeyError: 'missing shard'"
    )


# -- deadlines and dead main processes --------------------------------------------------------------


def _wait_for(path: Path) -> None:
    # Bounded: if the other rank never writes the marker, the test's assertions fail instead.
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def waits_time_out(tmp: str) -> list[Any]:
    out: list[Any] = []
    # 1. The main process is inside the block and stays there until the other rank gave up.
    # 2. The main process arrives only after the other rank gave up.
    for case in ("busy", "late"):
        marker = Path(tmp, case)
        if distkit.get_rank() == 0 and case == "late":
            _wait_for(marker)
        try:
            with distkit.main_process_first(timeout_s=0.5):
                if distkit.get_rank() == 0 and case == "busy":
                    _wait_for(marker)
            out.append(None)
        except distkit.CollectiveTimeoutError as err:
            marker.touch()
            out.append((str(err), err.missing_ranks, err.timeout_s))
    distkit.barrier(timeout_s=60)
    return out


def test_waiting_ranks_time_out_naming_the_main_process(ranks, tmp_path: Path) -> None:
    main, other = ranks.run(waits_time_out, str(tmp_path), world_size=2)
    assert main == [None, None]
    (busy, busy_missing, busy_timeout), (late, late_missing, _) = other
    assert busy.startswith(
        "[rank 1/2] main_process_first() timed out after 0.5 s waiting for the main process (rank 0), "
        "which is still inside the block"
    )
    assert "never entered main_process_first()" in late
    assert busy_missing == late_missing == [0] and busy_timeout == 0.5


def _fast_heartbeat() -> None:
    coordination._HEARTBEAT_INTERVAL_S = 0.1
    coordination._HEARTBEAT_STALE_S = 1.0


def main_dies_inside_block() -> None:
    _fast_heartbeat()
    with distkit.main_process_first(timeout_s=600):
        if distkit.get_rank() == 0:
            time.sleep(0.5)  # a few heartbeats first, as in a real job
            os.kill(os.getpid(), signal.SIGKILL)


def test_main_process_killed_inside_block_is_reported_in_seconds(ranks) -> None:
    # The fixture gives the other rank 3 s after the death to report, far below timeout_s=600.
    with pytest.raises(RankFailedError) as info:
        ranks.run(main_dies_inside_block, world_size=2, fresh=True, timeout_s=60)
    by_rank = {f.rank: f for f in info.value.failures}
    assert by_rank[0].exitcode == -signal.SIGKILL
    assert by_rank[1].kind == "exception", by_rank[1]
    assert by_rank[1].summary.startswith(
        "distkit.errors.DistkitError: [rank 1/2] the main process (rank 0) stopped inside "
        "main_process_first(): its heartbeat has not moved"
    )


def store_host_dies(port: int) -> None:
    # Rank 0 hosts the store itself, as with a hand-written launch (no torchrun agent).
    os.environ.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False")
    distkit.init("gloo")
    with distkit.main_process_first(timeout_s=600):
        if distkit.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def test_death_of_the_main_process_hosting_the_store_is_reported_at_once() -> None:
    # Rank 1 must report its own error after rank 0 died: its pool gives it 20 s to do so (the
    # shared pool kills the others 3 s after the first rank ends, too short on a loaded machine).
    # "At once" is the error's own promise: it comes from the lost connection, not a timeout.
    with pytest.raises(RankFailedError) as info, RankPools(grace_s=20) as pools:
        pools.run(store_host_dies, free_port(), world_size=2, fresh=True, init=False, timeout_s=60)
    by_rank = {f.rank: f for f in info.value.failures}
    assert by_rank[0].exitcode == -signal.SIGKILL
    assert by_rank[1].kind == "exception", by_rank[1]
    # Rank 0 dies inside the section, or (on a loaded machine) before rank 1 has finished init():
    # either way rank 1 says that the store's host is gone, within seconds.
    summary = by_rank[1].summary
    assert (
        "[rank 1/2] lost the connection to the job's key-value store while waiting for the main " in summary
        or "[rank 1/2] the job's key-value store stopped answering while this rank joined" in summary
    ), summary


# -- without a process group, without a store, bad arguments --------------------------------------


def test_world_of_one_just_runs_the_block(world_of_one: pytest.MonkeyPatch) -> None:
    entered = []
    with distkit.main_process_first(local=True):
        entered.append(True)
    assert entered == [True]
    assert distkit.run_on_main(sorted, [3, 1, 2]) == [1, 2, 3]
    with pytest.raises(ZeroDivisionError), distkit.main_process_first():
        _ = 1 / 0


def test_a_section_never_entered_warns_naming_the_line(world_of_one: pytest.MonkeyPatch) -> None:
    # Without `with` the call orders nothing: every rank would run the next lines at once.
    expected = r"never entered.*Write `with distkit\.main_process_first\(\):`"
    with pytest.warns(RuntimeWarning, match=expected) as caught:
        line = sys._getframe().f_lineno + 1
        distkit.main_process_first()
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]

    calls = []

    @distkit.main_process_first()
    def prepare(n: int) -> int:
        calls.append(n)
        return n * 2

    reused = distkit.main_process_first()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # entered sections and decorators do not warn
        with distkit.main_process_first():
            calls.append(0)
        assert [prepare(1), prepare(2)] == [2, 4]
        with reused:
            calls.append(3)
        with reused:
            calls.append(4)
        del reused
        gc.collect()
    assert calls == [0, 1, 2, 3, 4]


def test_multi_process_job_without_init_is_told_to_call_init(world_of_one: pytest.MonkeyPatch) -> None:
    world_of_one.setenv("RANK", "1")
    world_of_one.setenv("WORLD_SIZE", "2")
    world_of_one.setenv("MASTER_ADDR", "127.0.0.1")
    expected = r"call distkit\.init\(\) on every rank first"
    with pytest.raises(distkit.DistkitError, match=expected), distkit.main_process_first():
        pass


@pytest.mark.parametrize(
    ("timeout_s", "error"),
    [(0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), ("9", TypeError)],
)
def test_bad_timeouts_are_rejected(world_of_one: pytest.MonkeyPatch, timeout_s: Any, error: type) -> None:
    with pytest.raises(error, match="timeout_s"), distkit.main_process_first(timeout_s=timeout_s):
        pass


def sections_without_store() -> list[Any]:
    rt = runtime._current()
    saved, rt.store = rt.store, None
    out: list[Any] = []
    try:
        out.append(distkit.run_on_main(distkit.get_rank))
        try:
            with distkit.main_process_first():
                if distkit.get_rank() == 0:
                    raise OSError("disk full")
            out.append(None)
        except distkit.MainProcessError as err:
            out.append(str(err).splitlines()[0])
        except OSError as err:
            out.append(f"own {err}")
    finally:
        rt.store = saved
    return out


def test_groups_without_a_store_fall_back_to_a_gather(ranks) -> None:
    main, other = ranks.run(sections_without_store, world_size=2)
    assert main == [0, "own disk full"]
    assert other == [
        0,
        "[rank 1/2] main process (rank 0) failed inside main_process_first(): OSError: disk full",
    ]

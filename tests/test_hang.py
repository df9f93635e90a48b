"""The hang doctor (docs/debugging.md): stuck jobs reported once, naming the odd rank, its file and
line, then every rank exits; no false alarms; distkit's collectives called by some ranks only raise
at once; the known bounded waits (a taken MASTER_PORT, a rank that left, an invalid metric)."""

from __future__ import annotations

import datetime
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distkit
import distkit.trainer._loop.epoch as loop_module
import distkit.trainer._loop.evaluate as evaluate_module
import distkit.trainer.trainer as trainer_module
import hang_scenarios as scenarios
from distkit import HANG_EXIT_CODE, PEER_FAILED_EXIT_CODE
from distkit.checkpoint import CheckpointManager, ResumeState
from distkit.testing import RankFailedError, RankPools
from hang_scenarios import CASES, line_of

# Small, so that each stuck job ends in seconds; the reports must come within this + 10 s of the
# step where the job goes wrong.
HANG_S = 2.0
# The deadline of a whole stuck job (start-up, the healthy steps, the report, every rank's exit):
# generous, because a loaded machine stretches the start-up and the steps far more than the
# report (DDP's first construction alone took 5-16 s at a load average of 10-16 on 2 cores,
# against 0.9 s idle). The report's own promise is checked from the bad step, below.
JOB_DEADLINE_S = 120
HEADER = "Where each rank is:"
ROW = re.compile(r"^  ranks \[([\d, ]+)\]   ")  # a report's row: "  ranks [0, 2]   waiting in ..."
SCENARIOS = Path(scenarios.__file__).name


@pytest.fixture(scope="module")
def pools():
    # Ranks that end by themselves (the doctor's exit, a dead rank) need time to do so: the session's
    # pools kill the other ranks 3 s after the first one ends.
    with RankPools(grace_s=20) as own:
        yield own


def _line_in(path: str, text: str, *, after: str = "") -> int:
    """The one line of ``path`` holding ``text`` (after the line holding ``after``)."""
    lines = Path(path).read_text().splitlines()
    start = next(number for number, line in enumerate(lines, start=1) if after in line) if after else 0
    matches = [number for number, line in enumerate(lines, start=1) if number > start and text in line]
    return matches[0]


def _at(marker: str) -> str:
    return f"{SCENARIOS}:{line_of(marker)}"


def _trainer_at(text: str, *, after: str = "", module: Any = trainer_module) -> str:
    shown = Path(module.__file__).relative_to(Path(distkit.__file__).parent).as_posix()
    return f"distkit/{shown}:{_line_in(module.__file__, text, after=after)}"


def _expected(case: str, kind: str, world_size: int) -> list[tuple[list[int], str, str]]:
    """Per group of ranks: the ranks, what the report says they do, and where."""
    last = world_size - 1
    rest0 = list(range(1, world_size))
    rest_last = list(range(last))
    ddp = "waiting in DistributedDataParallel backward all-reduce"
    if kind == "loop":
        backward = _at("extra_batch")  # the loop's loss.backward()
        table = {
            "barrier_on_rank_0": [([0], "waiting in distkit.barrier", _at(case)), (rest0, ddp, backward)],
            "save_on_rank_0": [
                ([0], "waiting in distkit.CheckpointManager.save -> all_gather_object", _at(case)),
                (rest0, ddp, backward),
            ],
            "extra_batch": [
                ([0], ddp, backward),
                (rest0, "waiting in distkit.reduce_metrics", _at("extra_batch_other")),
            ],
            "different_order": [
                ([0], "waiting in torch.distributed.all_reduce", _at(case)),
                (rest0, "waiting in torch.distributed.broadcast", _at("different_order_other")),
            ],
            "stuck_in_user_code": [([last], "busy in user code", _at(case)), (rest_last, ddp, backward)],
            "dead_rank": [
                ([last], "gone: ", ""),
                (rest_last, "DistributedDataParallel backward all-reduce", backward),
            ],
        }
    else:
        backward = _trainer_at("backward(scaled)", module=loop_module)
        table = {
            "barrier_on_rank_0": [
                ([0], "waiting in distkit.barrier", _at("trainer_barrier_on_rank_0")),
                (rest0, ddp, backward),
            ],
            "save_on_rank_0": [
                (
                    [0],
                    "waiting in distkit.CheckpointManager.save -> all_gather_object",
                    _at("trainer_save_on_rank_0"),
                ),
                (rest0, ddp, backward),
            ],
            "extra_batch": [
                ([0], ddp, backward),
                (
                    rest0,
                    "waiting in distkit.reduce_metrics",
                    _trainer_at("reduce_metrics(local)", after="def end_epoch", module=evaluate_module),
                ),
            ],
            "different_order": [
                ([0], "waiting in distkit.all_gather_object", _at("trainer_different_order")),
                (rest0, "waiting in distkit.broadcast_object", _at("trainer_different_order_other")),
            ],
            "stuck_in_user_code": [
                ([last], "busy in user code", _at("trainer_stuck_in_user_code")),
                (rest_last, ddp, backward),
            ],
            "dead_rank": [
                ([last], "gone: ", ""),
                (rest_last, "DistributedDataParallel backward all-reduce", backward),
            ],
        }
    return table[case]


def import_before_the_watchdog() -> None:
    """Import what DDP's constructor imports on its first use, before the hang doctor starts.

    ``DistributedDataParallel(...)`` imports ``torch._dynamo`` the first time: 0.9 s on an idle
    machine here, 1.8 s with two CPU-bound processes beside the suite, 5-16 s per rank at a load
    average of 10-16, where the ranks finished it up to 2.2 s apart. The rank that finishes first
    waits in DDP's parameter broadcast meanwhile, longer than the 2-s timeout of these tests, and
    the doctor reports it as it should ("waiting in DistributedDataParallel construction" against
    "busy in torch", before any rank reached the bad step). Real jobs use timeouts of 30 s and
    more; here the import is taken out of the timed part.
    """
    import torch._dynamo  # noqa: F401


def deadlock(case: str, kind: str, run_dir: str, hang_timeout_s: float) -> str:
    import_before_the_watchdog()
    if kind == "loop":
        # As a script's top level would: an uncaught error goes to sys.excepthook (where the doctor
        # hears of a collective that failed because a rank died).
        return scenarios.run_as_a_script(scenarios.hand_loop, case, run_dir, hang_timeout_s)  # type: ignore[return-value]
    return scenarios.trainer_loop(case, run_dir, hang_timeout_s)


# The Trainer given each rank's own loader agrees on the epoch's length at set-up, so one batch
# more on rank 0 is no deadlock there (test_a_trainer_given_one_batch_more_on_rank_0_ends_together).
DEADLOCKS = [
    (case, kind)
    for case in CASES
    for kind in ("loop", "trainer")
    if (case, kind) != ("extra_batch", "trainer")
]


def one_batch_more_on_rank_0(run_dir: str) -> str:
    import_before_the_watchdog()
    return scenarios.trainer_loop("extra_batch", run_dir, HANG_S)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_trainer_given_one_batch_more_on_rank_0_ends_together(
    pools: RankPools, tmp_path: Path, capsys: pytest.CaptureFixture[str], world_size: int
) -> None:
    # The classic uneven-shards deadlock of the hand-written loop: under the Trainer every rank
    # stops the epoch at the shortest loader, says so, and nothing is reported as a hang.
    out = pools.run(
        one_batch_more_on_rank_0,
        str(tmp_path),
        world_size=world_size,
        fresh=True,
        init=False,
        env={"DISTKIT_RUN_DIR": str(tmp_path)},
        timeout_s=JOB_DEADLINE_S,
    )
    assert out == [f"rank {rank} finished at step {scenarios.BAD_STEP + 2}" for rank in range(world_size)]
    assert "every rank stops each epoch after" in capsys.readouterr().err
    assert not list(tmp_path.glob("distkit-hang-report-*.txt"))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(("case", "kind"), DEADLOCKS)
def test_each_classic_deadlock_is_reported_once_naming_rank_file_and_line_then_every_rank_exits(
    pools: RankPools,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    kind: str,
    world_size: int,
) -> None:
    run_dir = str(tmp_path)
    with pytest.raises(RankFailedError) as caught:
        pools.run(
            deadlock,
            case,
            kind,
            run_dir,
            HANG_S,
            world_size=world_size,
            fresh=True,
            init=False,
            env={"DISTKIT_RUN_DIR": run_dir},
            timeout_s=JOB_DEADLINE_S,
        )
    # Every rank ended by itself with a non-zero code: the doctor's, or the dead rank's own (the
    # ranks that only waited for a rank that died say so with theirs, docs/debugging.md).
    failures = {f.rank: f for f in caught.value.failures}
    assert sorted(failures) == list(range(world_size)), str(caught.value)
    for rank, failure in failures.items():
        assert failure.kind == "exit", str(caught.value)
        if case == "dead_rank" and rank == world_size - 1:
            assert failure.exitcode in (3, -9)
        elif case == "dead_rank":
            assert failure.exitcode == PEER_FAILED_EXIT_CODE, str(caught.value)
        else:
            assert failure.exitcode == HANG_EXIT_CODE, str(caught.value)
    # One report, from one rank, also written to the run directory, within hang_timeout_s + 10 s.
    stderr = capsys.readouterr().err
    assert stderr.count(HEADER) == 1, stderr
    files = list(tmp_path.glob("distkit-hang-report-*.txt"))
    assert len(files) == 1, files
    report = files[0].read_text()
    # Each rank that reaches the bad step notes the time there (hang_scenarios._mark): none did
    # when the report came earlier, from steps that were healthy (a false alarm).
    marks = [float(path.read_text()) for path in tmp_path.glob("bad-step-*.txt")]
    assert marks, f"the report came before any rank reached the bad step:\n{report}"
    late_s = files[0].stat().st_mtime - min(marks)
    assert late_s < HANG_S + 10, (late_s, report)
    lines = report.split("\n\n")[0].splitlines()
    table = {line: [int(r) for r in m.group(1).split(",")] for line in lines if (m := ROW.match(line))}
    for ranks, state, where in _expected(case, kind, world_size):
        if case == "dead_rank":
            # The survivors may be asked while their own collective still waits, or after it failed:
            # each one's row, grouped with whoever was in the same state at the same place.
            rows = [[line for line, group in table.items() if r in group] for r in ranks]
        else:
            rows = [[line for line, group in table.items() if group == ranks]]
        for row in rows:
            assert len(row) == 1, (ranks, report)
            assert state in row[0] and where in row[0], (state, where, report)
            assert row[0] in stderr
    odd = _expected(case, kind, world_size)[0][0][0]
    words = "ended while the others wait" if case == "dead_rank" else "not where"
    assert any(words in line and f"rank {odd} " in line for line in lines), report


# -- no false alarms ------------------------------------------------------------------------------


# How much later than the others a healthy rank arrives, as a share of the hang timeout. The
# rest of the timeout (0.8 s of 2 s) is for what the test cannot control: a loaded machine wakes
# a sleeping rank late and runs its compute slowly (a 1.6 s sleep took 1.86 s at a load average
# of 13 on 2 cores, leaving 0.11 s of the old 0.4 s). Still over FIRST_CHECK_S (1 s), so
# distkit's collectives ask where the late rank is, and must find it busy, not elsewhere.
LATE = 0.6


def uneven_but_healthy_loop(hang_timeout_s: float) -> int:
    """Steps of varying length, every wait shorter than the timeout, and long steps that compute."""
    import_before_the_watchdog()
    distkit.init("gloo", hang_timeout_s=hang_timeout_s)
    rank = distkit.get_rank()
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    # Per step, how long each rank computes before its collectives: a slow first step on every rank
    # (longer than the timeout, as torch.compile's is), then rank 0 later than the others by LATE x
    # the timeout, in DDP's all-reduce and in distkit's collectives. Rank 1's waits in step 2's
    # reduce_metrics and in step 3's all-reduce follow each other: 2 x LATE = 1.2 x the timeout in
    # all, which a watchdog that did not start again at each new collective would report.
    delays = [(1.3, 1.3), (LATE, 0.0), (0.0, LATE / 2), (LATE, 0.0)]
    for step, per_rank in enumerate(delays):
        time.sleep(per_rank[min(rank, 1)] * hang_timeout_s)
        model(torch.ones(2, 4)).sum().backward()
        if step == 2:
            time.sleep(LATE * hang_timeout_s if rank == 0 else 0.0)  # rank 0 "evaluates"
            distkit.reduce_metrics({"loss": 1.0})
            distkit.barrier()
    return len(delays)


def test_a_healthy_run_with_uneven_and_slow_steps_never_reports(pools: RankPools, tmp_path: Path) -> None:
    results = pools.run(
        uneven_but_healthy_loop,
        HANG_S,
        world_size=2,
        fresh=True,
        init=False,
        env={"DISTKIT_RUN_DIR": str(tmp_path)},
        timeout_s=JOB_DEADLINE_S,
    )
    assert results == [4, 4]
    assert not list(tmp_path.glob("distkit-hang-report-*.txt"))


class _UnevenModel(nn.Module):
    """Rank 0's steps are slower than the others' by LATE x the timeout (so rank 1's waits in
    consecutive steps add up to more than the timeout); the first is slow everywhere; rank 0's
    validation is slower too."""

    def __init__(self, hang_timeout_s: float) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.hang_timeout_s = hang_timeout_s
        self.steps = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.steps += 1
        first = self.steps == 1
        time.sleep(self.hang_timeout_s * (1.3 if first else LATE if distkit.get_rank() == 0 else 0.0))
        inputs, target = batch
        return nn.functional.cross_entropy(self(inputs), target)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, object]:
        # 4 batches: rank 0's validation ends LATE x the timeout after the others'.
        time.sleep(LATE / 4 * self.hang_timeout_s if distkit.get_rank() == 0 else 0.0)
        inputs, target = batch
        return {"val_loss": nn.functional.cross_entropy(self(inputs), target)}


def uneven_but_healthy_fit(run_dir: str, hang_timeout_s: float) -> int:
    import_before_the_watchdog()  # fit() wraps the model in DDP with the watchdog on
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    trainer = distkit.Trainer(
        strategy="ddp",
        max_epochs=1,
        batch_size=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=run_dir,
        hang_timeout_s=hang_timeout_s,
    )
    trainer.fit(_UnevenModel(hang_timeout_s), data, data, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    return trainer.global_step


def test_a_healthy_fit_with_uneven_and_slow_steps_never_reports(pools: RankPools, tmp_path: Path) -> None:
    results = pools.run(
        uneven_but_healthy_fit,
        str(tmp_path),
        HANG_S,
        world_size=2,
        fresh=True,
        init=False,
        timeout_s=JOB_DEADLINE_S,
    )
    assert results == [4, 4]
    assert not list(tmp_path.glob("distkit-hang-report-*.txt"))


# -- distkit's collectives called by some ranks only, without any watchdog -----------------------

ALONE = {
    "barrier": lambda run_dir: distkit.barrier(),
    "reduce_metrics": lambda run_dir: distkit.reduce_metrics({"loss": 1.0}),
    "all_gather_object": lambda run_dir: distkit.all_gather_object("x"),
    "broadcast_object": lambda run_dir: distkit.broadcast_object("x"),
    "all_gather": lambda run_dir: distkit.all_gather(torch.ones(2)),
    "any_rank": lambda run_dir: distkit.any_rank(True),
    "sync_buffers": lambda run_dir: distkit.sync_buffers(nn.BatchNorm1d(2)),
    "CheckpointManager.save": lambda run_dir: CheckpointManager(run_dir, overwrite=True).save(
        0, {"progress": ResumeState()}
    ),
}


def call_on_rank_0_only(helper: str, run_dir: str) -> tuple[float, str, list[int]] | None:
    distkit.init("gloo", hang_timeout_s=0)  # the watchdog off, whatever the environment says
    result = None
    if distkit.get_rank() == 0:
        start = time.monotonic()
        outcome: list[tuple[float, str, list[int]] | str] = []

        def call() -> None:
            try:
                ALONE[helper](run_dir)
                outcome.append("returned")
            except distkit.CollectiveMismatchError as err:
                outcome.append((time.monotonic() - start, str(err), err.missing_ranks))

        # In a thread: a helper that never raises is named here in 20 s, not by the pool's deadline.
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(20.0)
        assert outcome, f"{helper} on rank 0 alone raised no CollectiveMismatchError within 20 s"
        assert outcome[0] != "returned", f"{helper} on rank 0 alone returned"
        result = outcome[0]
    dist.barrier()  # the other ranks wait here, in another collective; rank 0 joins them after
    return result  # type: ignore[return-value]


@pytest.mark.parametrize("helper", sorted(ALONE))
def test_a_distkit_collective_called_on_rank_0_only_raises_at_once_naming_the_others_and_the_rule(
    pools: RankPools, tmp_path: Path, helper: str
) -> None:
    world_size = 3 if helper == "barrier" else 2
    results = pools.run(
        call_on_rank_0_only,
        helper,
        str(tmp_path),
        world_size=world_size,
        fresh=True,
        init=False,
        timeout_s=60,
    )
    assert results[1:] == [None] * (world_size - 1)
    assert results[0] is not None, "rank 0 did not raise"
    elapsed, message, missing = results[0]
    assert missing == list(range(1, world_size))
    assert elapsed < 10, elapsed  # seconds, not the process group's 10 minutes
    where = f"test_hang.py:{_line_in(__file__, 'dist.barrier()  # the other ranks wait here')}"
    assert message.startswith("[rank 0/"), message
    assert "waiting in torch.distributed.barrier" in message and where in message, message
    assert "which can never arrive" in message and "call it on every rank" in message, message
    assert helper.split(".")[-1] in message or helper in message, message


def call_with_its_own_rank_as_src(helper: str) -> tuple[float, str, list[int]] | str:
    distkit.init("gloo", hang_timeout_s=0)
    rank = distkit.get_rank()
    start = time.monotonic()
    try:
        if helper == "broadcast_object":
            distkit.broadcast_object(f"from {rank}", src=rank)  # each rank sends; none receives
        else:
            distkit.scatter_object(["a", "b"], src=rank)
    except distkit.CollectiveMismatchError as err:
        return time.monotonic() - start, str(err), err.missing_ranks
    return "returned"


@pytest.mark.parametrize("helper", ["broadcast_object", "scatter_object"])
def test_ranks_that_pass_another_src_raise_at_once_naming_each_ranks_src(
    pools: RankPools, helper: str
) -> None:
    """Was: every rank waited out the process group's timeout (10 minutes by default), then gloo's
    "Timed out waiting ... for send operation to complete", which names no rank and no cause. (With
    three ranks, two of which pass the same src, one of those gets past the call's first collective;
    it fails as soon as the others' processes end, naming their error.)"""
    results = pools.run(
        call_with_its_own_rank_as_src, helper, world_size=2, fresh=True, init=False, timeout_s=60
    )
    for rank, result in enumerate(results):
        assert result != "returned", results
        elapsed, message, missing = result
        assert elapsed < 10, elapsed  # seconds, not the process group's timeout
        assert (
            f"{helper} needs the same src on every rank, but they differ: rank 0 src=0, rank 1 src=1. "
            f"Decide the sending rank once"
        ) in message, message
        assert message.startswith(f"[rank {rank}/2] distkit.{helper}(src="), message
        assert f"is waiting in distkit.{helper}(src=" in message and "test_hang.py:" in message, message
        assert len(missing) == 1, missing


def barrier_after_a_rank_left() -> tuple[float, str] | None:
    distkit.init("gloo", hang_timeout_s=0)
    if distkit.get_rank() == 1:
        distkit.shutdown()  # as at the end of its script
        return None
    start = time.monotonic()
    try:
        distkit.barrier(timeout_s=60)
    except distkit.CollectiveMismatchError as err:
        return time.monotonic() - start, str(err)
    return time.monotonic() - start, "passed"


def test_a_barrier_after_a_rank_left_says_so_at_once(pools: RankPools) -> None:
    results = pools.run(barrier_after_a_rank_left, world_size=2, fresh=True, init=False, timeout_s=60)
    elapsed, message = results[0]
    assert "rank 1 has left the job: distkit.shutdown() ran there" in message, message
    assert elapsed < 10, elapsed


def reduce_with_a_bad_value_on_rank_1(bad: str) -> tuple[str, str, float]:
    value: object = 0.5
    if distkit.get_rank() == 1:
        value = "high" if bad == "str" else torch.tensor([1.0, 2.0])
    start = time.monotonic()
    try:
        distkit.reduce_metrics({"loss": 1.0, "acc": value})  # type: ignore[dict-item]
    except Exception as err:
        return type(err).__name__, str(err), time.monotonic() - start
    return "none", "", time.monotonic() - start


@pytest.mark.parametrize("bad", ["str", "two-element tensor"])
def test_a_metric_invalid_on_one_rank_makes_every_rank_raise_at_once(ranks, bad: str) -> None:
    (kind0, message0, elapsed0), (kind1, message1, _) = ranks.run(
        reduce_with_a_bad_value_on_rank_1, bad, timeout_s=60
    )
    assert kind1 == ("TypeError" if bad == "str" else "ValueError"), message1
    assert kind0 == "DistkitError", message0
    shown = "'high'" if bad == "str" else "[1.0, 2.0]"
    assert "invalid arguments on rank(s) [1]" in message0 and "'acc'" in message0 and shown in message0, (
        message0
    )
    assert shown in message1
    assert elapsed0 < 10


# -- MASTER_PORT taken: every rank fails within timeout_s, naming the port ---------------------


def init_and_say(timeout_s: float, hold_dir: str | None = None) -> tuple[float, str]:
    start = time.monotonic()
    try:
        distkit.init("gloo", timeout_s=timeout_s)
    except distkit.DistkitError as err:
        return time.monotonic() - start, str(err)
    if hold_dir is not None:
        # Hold the job (and its port) until the test has tried to join it, however long that takes.
        Path(hold_dir, f"joined-{distkit.get_rank()}").touch()
        _wait_for(Path(hold_dir, "release"), within_s=JOB_DEADLINE_S)
    ranks = distkit.all_gather_object(distkit.get_rank())  # this job still works
    distkit.shutdown()
    return time.monotonic() - start, f"joined {ranks}"


def _wait_for(*paths: Path, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{[str(p) for p in paths if not p.exists()]} did not appear within {within_s} s"
            )
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank_0_hosts(port: int) -> dict[str, str]:
    # The store on MASTER_PORT is rank 0's (as with hand-set variables or srun), not the launcher's.
    return {"MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "False"}


def test_a_port_held_by_another_program_fails_every_rank_within_timeout_naming_the_port(
    pools: RankPools,
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        results = pools.run(
            init_and_say, 3.0, world_size=2, fresh=True, init=False, env=_rank_0_hosts(port), timeout_s=60
        )
    for elapsed, message in results:
        assert f"MASTER_PORT={port}" in message and "torchrun --standalone" in message, message
        assert elapsed < 3.0 + 2, elapsed


def test_a_port_of_another_distkit_job_is_never_joined(pools: RankPools, tmp_path: Path) -> None:
    port = _free_port()
    first: list[object] = []
    holder = threading.Thread(
        target=lambda: first.append(
            pools.run(
                init_and_say,
                30.0,
                str(tmp_path),
                world_size=2,
                fresh=True,
                init=False,
                env=_rank_0_hosts(port),
                timeout_s=JOB_DEADLINE_S + 60,  # it holds until released, at most JOB_DEADLINE_S
            )
        )
    )
    holder.start()
    try:
        # Until both ranks of the first job have joined it; it holds its port until released.
        _wait_for(tmp_path / "joined-0", tmp_path / "joined-1", within_s=JOB_DEADLINE_S)
        for world_size, words in ((2, "is already taken"), (3, "belongs to another job")):
            results = pools.run(
                init_and_say, 30.0, world_size=world_size, fresh=True, init=False, env=_rank_0_hosts(port)
            )
            assert "is already in use" in results[0][1]
            for elapsed, message in results[1:]:
                assert f"MASTER_PORT={port}" in message and words in message, message
                assert elapsed < 5, elapsed  # at once, not after timeout_s
    finally:
        (tmp_path / "release").touch()
        holder.join(60)
    assert first and [message for _, message in first[0]] == ["joined [0, 1]"] * 2  # type: ignore[index]


# -- settings -------------------------------------------------------------------------------------


def test_hang_timeout_settings_are_checked_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="hang_timeout_s must be a number of seconds, 'auto' or None"):
        distkit.Trainer(max_steps=1, hang_timeout_s="soon")
    with pytest.raises(ValueError, match=r"hang_timeout_s must be a finite number of seconds >= 0"):
        distkit.Trainer(max_steps=1, hang_timeout_s=-1)
    monkeypatch.setenv("DISTKIT_HANG_TIMEOUT_S", "ten")
    distkit.shutdown()
    with pytest.raises(ValueError, match="DISTKIT_HANG_TIMEOUT_S='ten' is not a number of seconds"):
        distkit.init()
    monkeypatch.setenv("DISTKIT_HANG_TIMEOUT_S", "30")
    distkit.init()  # a world of one: accepted, and nothing can hang
    distkit.shutdown()


# -- a real script, launched by hand ---------------------------------------------------------------


def test_a_real_script_reports_a_dead_rank_through_its_excepthook(tmp_path: Path) -> None:
    """Two plain processes (rank 0 hosts the store, as with srun or hand-set variables): rank 1
    dies, rank 0's DDP all-reduce fails, the uncaught error reaches the doctor's excepthook."""
    port = _free_port()
    script = Path(scenarios.__file__)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "SLURM", "OMPI", "PMI"))}
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    env.update(DISTKIT_HANG_TIMEOUT_S=str(HANG_S))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), "dead_rank", "loop", str(tmp_path)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [PEER_FAILED_EXIT_CODE, 3], outputs
    assert outputs[0].count(HEADER) == 1 and HEADER not in outputs[1], outputs
    report = outputs[0][outputs[0].index("distkit: rank 1 died: its process") :]  # the cause first
    assert "ranks [1]   gone: its process" in report, report
    assert "failed in DistributedDataParallel backward all-reduce: RuntimeError" in report, report
    assert _at("extra_batch") in report, report


def test_the_doctors_tables_name_functions_where_they_are_defined() -> None:
    # The doctor tells distkit's bounded waits from hangs by (module, function). A function that
    # moved (a module that became a package, a rename) would silently turn its wait into a
    # reported hang: every entry must name the module whose file defines the function.
    import importlib

    from distkit._doctor import where as _hang_where

    tables = [*_hang_where._DISTKIT_WAITS, *_hang_where._DISTKIT_EXEMPT, *_hang_where._ENTRY_NAMES]
    for module_name, function in tables:
        target: Any = importlib.import_module(module_name)
        for part in function.split("."):
            target = getattr(target, part, None)
        assert target is not None, f"the hang doctor names {module_name}.{function}, which does not exist"
        code = target.__code__
        assert _hang_where._key(code) == (module_name, function), (
            f"{module_name}.{function} is defined in {code.co_filename}: update the hang doctor's table"
        )
    for module_name in _hang_where._TRAINER_PASSTHROUGH:
        importlib.import_module(module_name)


class NanLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * math.nan


def fit_that_raises_and_is_caught(tmp: str) -> str:
    trainer = distkit.Trainer(
        strategy="ddp",
        max_steps=5,
        batch_size=4,
        max_consecutive_nonfinite=1,  # every rank raises at the first (agreed) non-finite step
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp,
    )
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    try:
        trainer.fit(
            NanLoss(),
            data,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            loss_fn=nn.functional.cross_entropy,
        )
    except distkit.DistkitError as err:
        return type(err).__name__
    return "no error"


def late_rank_0_barrier() -> str:
    if distkit.get_rank() == 0:
        time.sleep(3.0)  # rank 1 waits and asks where rank 0 is meanwhile
    try:
        distkit.barrier(timeout_s=60)
    except distkit.CollectiveMismatchError as err:
        return str(err)
    return "passed"


def test_a_rank_that_caught_what_fit_raised_is_waited_for_not_named_the_cause(ranks, tmp_path) -> None:
    # fit() tells the other ranks "I raised" before it re-raises (so that their failures name it).
    # A caller that catches the error and goes on must not stay recorded as ending: a later
    # collective would fail at once, naming a cause that no longer exists.
    assert ranks.run(fit_that_raises_and_is_caught, str(tmp_path)) == ["DistkitError", "DistkitError"]
    assert ranks.run(late_rank_0_barrier) == ["passed", "passed"]


def test_the_context_of_a_collective_is_the_if_that_tests_the_rank_not_only_the_innermost(tmp_path) -> None:
    from distkit._doctor.where import enclosing_if

    script = tmp_path / "train.py"
    script.write_text(
        "def step(rank, step, t):\n"
        "    if rank == 0:\n"
        "        if step % 10 == 0:\n"
        "            all_reduce(t)\n"
        "    if step % 5 == 0:\n"
        "        barrier()\n"
    )
    # Was: "in `if step % 10 == 0:`", whose report gave the uneven-data hint, not "some ranks only".
    assert enclosing_if(str(script), 4) == "in `if rank == 0:`"
    assert enclosing_if(str(script), 6) == "in `if step % 5 == 0:`"  # no rank test: the innermost


def test_a_mismatch_verdict_points_at_the_if_that_tests_the_rank() -> None:
    # The rank that waits in a branch every rank takes is not the one to fix: the other rank
    # called its collective under `if distkit.is_main_process():`.
    from distkit._doctor.doctor import _where_to_move

    waiting = {"op": "distkit.barrier", "file": "train.py", "line": 7, "context": "in `if step % 2 == 1:`"}
    elsewhere = {
        "op": "distkit.all_gather_object",
        "file": "train.py",
        "line": 6,
        "context": "in `if distkit.is_main_process():`",
    }
    assert _where_to_move(waiting, {0: elsewhere}) == (
        " (rank 0's distkit.all_gather_object at train.py:6 is in `if distkit.is_main_process():`: "
        "move it out of that `if`)"
    )
    # This rank's own `if` tests the rank: it is the one to move.
    assert (
        _where_to_move(elsewhere, {1: waiting}) == " (here: move it out of `if distkit.is_main_process():`)"
    )
    # Neither tests the rank: this rank's own, as before.
    assert (
        _where_to_move(waiting, {0: {**elsewhere, "context": ""}})
        == " (here: move it out of `if step % 2 == 1:`)"
    )
    assert _where_to_move({"context": ""}, {0: {"context": ""}}) == ""


# --------------------------------------------------------------------------------------------------
# The join's second connection to the store


def _store_server(port: int) -> subprocess.Popen[bytes]:
    """A process hosting a TCPStore on ``port`` until killed, as rank 0 or a launcher does."""
    code = (
        "import datetime, time, torch.distributed as d\n"
        f"s = d.TCPStore('127.0.0.1', {port}, 2, True, timeout=datetime.timedelta(seconds=60),\n"
        "                wait_for_workers=False)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
    return server


def test_a_second_store_connection_slower_than_the_limit_is_waited_for_while_the_store_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Was: "the job's key-value store stopped answering while this rank joined" after 10 s, on a
    # machine whose name server dropped some of the reverse lookups torch's client makes as it
    # connects (5 s each, twice): the store answered all along. The limit set to 0 s here stands
    # for such a lookup: the connection is still opening when it has passed.
    from distkit._doctor import doctor

    monkeypatch.setattr(doctor, "_CLONE_S", 0.0)
    port = _free_port()
    server = _store_server(port)
    try:
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
        client.set("k", "1")
        with pytest.raises(TimeoutError, match="no second connection to the job's store within"):
            doctor._clone(client)  # no question asked: the limit alone decides
        assert doctor._clone(client, lambda: doctor._answers(client, "k")).check(["k"])
        # A store whose host died fails the question at once: no wait for the longer limit.
        server.kill()
        server.wait()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            doctor._clone(client, lambda: doctor._answers(client, "k"))
        assert time.monotonic() - started < 5.0
    finally:
        server.kill()
        server.wait()


def _doctor_of(client: dist.TCPStore) -> Any:
    """One rank of two's hang doctor, started over ``client`` as distkit.init starts it."""
    from distkit._doctor.doctor import Doctor

    doc = Doctor(store=client, rank=0, world_size=2, counters={}, helper_group=None, helper_group_name=None)
    doc.start()
    return doc


def test_the_watchdog_gets_its_store_connection_while_the_store_answers_or_says_it_runs_without_one(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # Was: the watchdog's connection, made as a Trainer's fit (or init) set a hang timeout, had the
    # plain limit, and its failure was suppressed; the watchdog then stayed idle, without a word. On
    # the machine with the slow reverse lookups about one fit in a thousand ran so. The limit set to
    # 0 s stands for such a lookup.
    from distkit._doctor import doctor

    monkeypatch.setattr(doctor, "_CLONE_S", 0.0)
    for host_ends in (False, True):
        port = _free_port()
        server = _store_server(port)
        doc = None
        try:
            client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
            doc = _doctor_of(client)
            if host_ends:  # before the first fit: the connection cannot be made, and the rank says so
                server.kill()
                server.wait()
            started = time.monotonic()
            doc.configure(30.0)
            err = capfd.readouterr().err
            if not host_ends:
                assert doc._watchdog is not None and doc._watchdog.is_alive()
                assert doc._side is not None and doc._side.check([doctor._key("proc", 0)])
                assert "hang detection" not in err
                continue
            assert time.monotonic() - started < 5.0
            assert doc._watchdog is None
            assert "[rank 0/2] distkit: the hang doctor could not open its connection to the job's" in err
            assert "runs without hang detection (hang_timeout_s=30.0)" in err
        finally:
            if doc is not None:
                doc.stop()
            server.kill()
            server.wait()

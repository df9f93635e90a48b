"""Runtime: init/shutdown, rank queries in every situation, the deadline barrier, rank-aware output."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import distkit
from _launch import launcher_free_env

SCRIPT = Path(__file__).parent / "scripts" / "report_queries.py"


@pytest.fixture
def clean_env(world_of_one: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """This test process as a world of one (conftest's ``world_of_one``)."""
    return world_of_one


def test_world_of_one_queries_before_and_after_init(clean_env: pytest.MonkeyPatch) -> None:
    assert (distkit.get_rank(), distkit.get_world_size(), distkit.is_main_process()) == (0, 1, True)
    env = distkit.init()
    assert env.launcher == "none" and not distkit.is_distributed()
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert distkit.get_device() == expected
    assert distkit.init() is env  # idempotent
    assert distkit.reduce_metrics({"a": 2, "b": (3, 4)}) == {"a": 2.0, "b": 0.75}
    distkit.barrier(timeout_s=1)
    distkit.shutdown()
    distkit.shutdown()
    assert not distkit.is_initialized()


def test_a_launched_world_of_one_gets_a_process_group_for_torch_distributed_calls(
    clean_env: pytest.MonkeyPatch,
) -> None:
    # torchrun --nproc_per_node=1 sets these: user code calls torch.distributed and wraps DDP itself.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        clean_env.setenv(name, value)
    clean_env.setenv("MASTER_PORT", str(port))
    env = distkit.init(timeout_s=30)
    assert env.launcher == "env" and torch.distributed.is_initialized()
    t = torch.ones(2, device=distkit.get_device())  # NCCL where a GPU is, gloo on CPU
    torch.distributed.all_reduce(t)
    assert t.tolist() == [1.0, 1.0] and distkit.reduce_metrics({"a": 3}) == {"a": 3.0}
    distkit.shutdown()
    assert not torch.distributed.is_initialized()


def test_init_waiting_for_a_rank_that_never_joins_names_it_and_gives_up_at_its_timeout(
    clean_env: pytest.MonkeyPatch,
) -> None:
    # Rank 1 of a 2-process job never calls init (a collective under `if is_main_process():`, a
    # script that ended early): rank 0 says which rank is missing, at its deadline, not ten minutes on.
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        clean_env.setenv(name, value)
    clean_env.setenv("MASTER_PORT", str(_free_port()))
    start = time.monotonic()
    with pytest.raises(
        distkit.CollectiveTimeoutError, match=r"rank\(s\) \[1\] of this job have not joined"
    ) as caught:
        distkit.init(timeout_s=2)
    assert caught.value.missing_ranks == [1]
    assert time.monotonic() - start < 10
    assert not torch.distributed.is_initialized()
    assert "srun" not in str(caught.value)


def test_a_slurm_rank_waiting_for_the_others_is_told_to_start_the_script_with_srun(
    clean_env: pytest.MonkeyPatch,
) -> None:
    # SLURM variables of the allocation, no job step's: a script run from the batch script itself.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in env.items():
        clean_env.setenv(name, value)
    clean_env.setenv("MASTER_PORT", str(_free_port()))
    with pytest.raises(distkit.CollectiveTimeoutError) as caught:
        distkit.init(timeout_s=1)
    assert "start the script with srun (`srun python train.py`)" in str(caught.value), caught.value


def test_a_rank_whose_store_never_comes_up_is_told_nothing_listens_there(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """Rank 1 alone: rank 0 never started. Was: "accepted the connection but did not answer ...
    another program holds the port", though nothing ever listened there."""
    port = _free_port()
    for name, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        clean_env.setenv(name, value)
    clean_env.setenv("MASTER_PORT", str(port))
    start = time.monotonic()
    with pytest.raises(distkit.DistkitError) as caught:
        distkit.init(timeout_s=2)
    message = str(caught.value)
    assert message.startswith(
        f"[rank 1/2] nothing listens at MASTER_ADDR=127.0.0.1 MASTER_PORT={port}: no store came up there "
        f"within 2 s. Rank 0 hosts it: check that rank 0 started"
    ), message
    assert "another program" not in message, message
    assert time.monotonic() - start < 10
    assert not torch.distributed.is_initialized()


def test_a_world_of_one_without_a_rendezvous_address_gets_no_process_group(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    distkit.init()
    assert distkit.is_initialized() and not torch.distributed.is_initialized()
    assert distkit.reduce_metrics({"a": 3}) == {"a": 3.0}


def test_import_has_no_side_effects() -> None:
    # torch itself imports numpy, tqdm and pynvml when they are installed; distkit must add none.
    code = (
        "import os, sys, logging, torch; before = dict(os.environ); loaded = set(sys.modules); "
        "import distkit; new = set(sys.modules) - loaded; "
        "assert dict(os.environ) == before, 'environment changed'; "
        "assert not logging.getLogger().handlers and not logging.getLogger('distkit').handlers; "
        "optional = ('pytest', 'matplotlib', 'tqdm', 'pynvml', 'fsspec', 'tensorboard', 'filelock'); "
        "heavy = sorted(m for m in new if m.split('.')[0] in optional); "
        "assert not heavy, heavy; assert not torch.cuda.is_initialized()"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_port_in_use_names_master_port_and_suggests_standalone(clean_env: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        clean_env.setenv("RANK", "0")
        clean_env.setenv("WORLD_SIZE", "2")
        clean_env.setenv("MASTER_ADDR", "127.0.0.1")
        clean_env.setenv("MASTER_PORT", str(port))
        with pytest.raises(distkit.DistkitError, match=f"MASTER_PORT={port}.*torchrun --standalone"):
            distkit.init(timeout_s=5)
    assert not distkit.is_initialized()


def test_nccl_on_a_cpu_rank_is_a_clear_error(clean_env: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the CPU-only error path cannot be reached")
    with pytest.raises(distkit.DistkitError, match="CUDA is not available"):
        distkit.init(device="cuda")


def test_a_backend_name_torch_does_not_know_is_refused_even_in_a_world_of_one(
    clean_env: pytest.MonkeyPatch,
) -> None:
    # A world of one makes no process group: "ncll" would pass until the job ran on several processes.
    with pytest.raises(
        ValueError, match=r"backend 'ncll' is not a torch.distributed backend .* Did you mean 'nccl'\?"
    ):
        distkit.init(backend="ncll")
    with pytest.raises(ValueError, match=r"backend 'tcp' is not a torch.distributed backend \(gloo, nccl"):
        distkit.init(backend="tcp")
    assert not distkit.is_initialized()


@pytest.mark.parametrize(
    "call",
    [
        lambda: distkit.init(timeout=30),
        lambda: distkit.barrier(timeout=60),  # torch's dist.barrier(timeout=...) habit
        lambda: distkit.main_process_first(timeout=5),
        lambda: distkit.save_checkpoint("unused", {}, timeout=5),
        lambda: distkit.download("unused", "unused", timeout=5),
    ],
)
def test_a_duration_without_its_s_names_the_argument_meant(
    clean_env: pytest.MonkeyPatch, call: Callable[[], object]
) -> None:
    # Python names only the unknown keyword; distkit's durations are seconds named *_s.
    with pytest.raises(
        TypeError, match=r"\(\) got an unexpected keyword argument 'timeout'\. Did you mean timeout_s="
    ):
        call()
    assert not distkit.is_initialized()


def _queries() -> dict:
    return {
        "rank": distkit.get_rank(),
        "world_size": distkit.get_world_size(),
        "local_rank": distkit.get_local_rank(),
        "local_world_size": distkit.get_local_world_size(),
        "node_rank": distkit.get_node_rank(),
        "main": distkit.is_main_process(),
        "local_main": distkit.is_local_main_process(),
        "distributed": distkit.is_distributed(),
        "device": str(distkit.get_device()),
    }


def queries_before_and_after_init() -> tuple[dict, dict, bool]:
    before = _queries()
    env = distkit.init(backend="gloo", timeout_s=30)
    after = _queries()
    same = distkit.init() is env and distkit.init(backend="gloo") is env
    return before, after, same


def test_queries_before_and_after_init_agree_on_fresh_ranks(ranks) -> None:
    results = ranks.run(queries_before_and_after_init, world_size=2, fresh=True, init=False)
    for rank, (before, after, same) in enumerate(results):
        assert before == after
        assert after == {
            "rank": rank,
            "world_size": 2,
            "local_rank": rank,
            "local_world_size": 2,
            "node_rank": 0,
            "main": rank == 0,
            "local_main": rank == 0,
            "distributed": True,
            "device": "cpu",
        }
        assert same


def reinit_with_other_settings() -> str:
    try:
        distkit.init(timeout_s=distkit.DEFAULT_TIMEOUT_S + 1234)
    except distkit.DistkitError as err:
        return str(err)
    return "no error"


def test_second_init_with_other_settings_is_a_clear_error(ranks) -> None:
    for message in ranks.run(reinit_with_other_settings, world_size=2):
        assert "already called with other settings" in message and "timeout_s" in message


def late_rank_barrier(late_rank: int, timeout_s: float) -> tuple[float, list[int] | None, str]:
    if distkit.get_rank() == late_rank:
        time.sleep(timeout_s + 2)
        # Arrive late; the others have given up, so every key but ours is already there. Arriving
        # keeps the pool in step: every rank has made the same barrier calls.
        distkit.barrier(timeout_s=timeout_s)
        return 0.0, None, ""
    start = time.monotonic()
    try:
        distkit.barrier(timeout_s=timeout_s)
    except distkit.CollectiveTimeoutError as err:
        return time.monotonic() - start, err.missing_ranks, str(err)
    return time.monotonic() - start, [], "no error"


def test_barrier_timeout_names_the_late_rank_within_timeout_plus_5s(ranks) -> None:
    results = ranks.run(late_rank_barrier, 1, 2.0, world_size=3, timeout_s=60)
    for rank in (0, 2):
        elapsed, missing, message = results[rank]
        assert missing == [1], message
        assert 2.0 <= elapsed < 2.0 + 5
        assert f"[rank {rank}/3]" in message and "rank(s) [1] did not arrive" in message


def storeless_barrier_that_rank_1_never_enters(directory: str, timeout_s: float) -> tuple[float, str] | None:
    # A group without distkit's store takes the other path: gloo's monitored barrier.
    distkit.runtime._current().store = None  # type: ignore[union-attr]  # fresh ranks: nothing after this test sees the change
    out = Path(directory) / "rank-0-is-out-of-the-barrier"
    if distkit.get_rank() == 1:
        # Rank 1 stays out of the barrier until rank 0 has come out of it. A barrier without a
        # deadline would wait forever, so after a generous bound rank 1 enters it, releasing rank 0
        # with "no error": the test then fails in seconds, naming the barrier, not at its deadline.
        bound = time.monotonic() + timeout_s + 10
        while not out.exists() and time.monotonic() < bound:
            time.sleep(0.05)
        if not out.exists():
            distkit.barrier(timeout_s=timeout_s)
        return None
    start = time.monotonic()
    try:
        distkit.barrier(timeout_s=timeout_s)
        outcome = "no error"
    except distkit.CollectiveTimeoutError as err:
        outcome = str(err)
    elapsed = time.monotonic() - start
    out.touch()
    return elapsed, outcome


def test_a_barrier_without_a_store_raises_within_its_deadline_naming_the_absent_rank(ranks, tmp_path) -> None:
    results = ranks.run(
        storeless_barrier_that_rank_1_never_enters, str(tmp_path), 2.0, world_size=2, fresh=True, timeout_s=60
    )
    elapsed, message = results[0]
    assert message.startswith("[rank 0/2] barrier timed out after 2 s"), (elapsed, message)
    assert "Ranks 1 failed to pass monitoredBarrier in 2000 ms" in message, message  # torch names it
    assert 2.0 <= elapsed < 2.0 + 5, elapsed  # the error path only: seconds past the deadline, not more


def many_barriers(n: int) -> int:
    for _ in range(n):
        distkit.barrier(timeout_s=30)
    return n


def test_barriers_in_sequence_all_pass(ranks) -> None:
    assert ranks.run(many_barriers, 50, world_size=2) == [50, 50]


def rank_aware_output() -> tuple[str, list[str], object]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        distkit.rank_zero_print("hello", distkit.get_rank())
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.getMessage()}|{record.rank}|{record.world_size}")

    logger = logging.getLogger("distkit.test.output")
    logger.setLevel(logging.INFO)
    handler = Keep()
    logger.addHandler(handler)
    try:
        distkit.get_logger("distkit.test.output").info("step %d", 7)
        distkit.get_logger("distkit.test.output", main_process_only=True).info("main only")
    finally:
        logger.removeHandler(handler)

    @distkit.main_process_only
    def answer() -> int:
        return 42

    return out.getvalue(), records, answer()


def test_print_logger_and_main_process_only_are_rank_aware(ranks) -> None:
    (out0, logs0, ans0), (out1, logs1, ans1) = ranks.run(rank_aware_output, world_size=2)
    assert out0 == "hello 0\n" and out1 == ""
    assert logs0 == ["[rank 0/2] step 7|0|2", "[rank 0/2] main only|0|2"]
    assert logs1 == ["[rank 1/2] step 7|1|2"]
    assert (ans0, ans1) == (42, None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher_free_env() -> dict[str, str]:
    return launcher_free_env()


def _read_views(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def test_queries_under_torchrun_standalone(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(SCRIPT),
        str(tmp_path),
    ]
    subprocess.run(cmd, check=True, timeout=180, env=_launcher_free_env(), capture_output=True)
    for rank, view in enumerate(_read_views(tmp_path, 2)):
        assert view["before_init"] == {"rank": rank, "world_size": 2}
        assert view["launcher"] == "torchrun"
        assert (view["rank"], view["local_rank"], view["node_rank"]) == (rank, rank, 0)
        assert view["is_main_process"] == (rank == 0) and view["ranks_seen"] == [0, 1]
        assert view["mean"] == 0.5


def test_two_node_job_from_two_torchrun_agents_on_loopback(tmp_path: Path) -> None:
    port = _free_port()
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=distkit-two-node",
                "--local-addr=127.0.0.1",
                str(SCRIPT),
                str(tmp_path),
            ],
            env=_launcher_free_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for node in (0, 1)
    ]
    for agent in agents:
        out, _ = agent.communicate(timeout=180)
        assert agent.returncode == 0, out.decode(errors="replace")[-3000:]
    views = _read_views(tmp_path, 2)
    # c10d rendezvous may give either agent node rank 0; ranks must follow node ranks.
    for view in views:
        assert view["world_size"] == 2 and view["local_world_size"] == 1 and view["local_rank"] == 0
        assert view["node_rank"] == view["rank"]
        assert view["is_local_main_process"] and view["is_main_process"] == (view["rank"] == 0)
        assert view["ranks_seen"] == [0, 1] and view["mean"] == 0.5

"""An async checkpoint that fails after the script stopped looking (issue 22, point 4): the failure is
printed with the rank, the step, the path, the cause and what to do, and the process exits non-zero.

Each test runs a real script in a fresh interpreter (a world of one) whose background save fails
with a real EFBIG from write(2): RLIMIT_FSIZE is lowered to 1 MiB before an 8 MiB save, which needs
no privileges and fails the same way as root (Python ignores SIGXFSZ, so the kernel returns the
error instead of killing the process).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import distkit
from _launch import launcher_free_env

# Step 1 (64 KiB) commits; step 2 (8 MiB) is saved in the background under a 1 MiB file-size limit
# and fails. How the script then ends is its first argument.
_SCRIPT = textwrap.dedent(
    """
    import resource
    import sys

    import torch

    import distkit

    directory, ending = sys.argv[1], sys.argv[2]
    if ending == "two-ranks":
        distkit.init("gloo")


    def train() -> distkit.CheckpointManager:
        manager = distkit.CheckpointManager(directory, async_save=True, keep_last=None)
        manager.save(1, {"w": torch.ones(16384)})
        manager.wait()
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # rank 0 writes a full checkpoint
        manager.save(2, {"w": torch.ones(2 << 20)})  # in flight when the script ends
        print("SAVE STARTED", flush=True)
        return manager


    if ending == "dropped":
        train()  # the manager is a local of train(): garbage once its writer thread ends
    else:
        manager = train()
    if ending == "raise":
        raise RuntimeError("the training loop crashed")
    if ending == "exit-0":
        sys.exit(0)
    print("SCRIPT ENDED", flush=True)
    """
)


def run_script(tmp_path: Path, ending: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    # A world of one whatever launched pytest; "two-ranks" launches its own world of two.
    env = launcher_free_env()
    launch = [sys.executable]
    if ending == "two-ranks":
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return subprocess.run(
        [*launch, str(script), str(tmp_path / "ckpts"), ending],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def assert_reports_the_failed_save(
    done: subprocess.CompletedProcess[str], tmp_path: Path, *, world_size: int = 1
) -> None:
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "SAVE STARTED" in done.stdout, output
    step_2 = tmp_path / "ckpts" / "step_000000002"
    assert (
        f"distkit: [rank 0/{world_size}] the background save of step 2 to {step_2} failed and nothing "
        f"waited for it before the process ended: OSError: "
    ) in done.stderr, output
    assert "EFBIG (File too large) while writing checkpoint" in done.stderr, output
    assert f"Step 2 was not saved; the checkpoints committed before it in {step_2.parent} are" in done.stderr
    assert "call manager.wait() (or close()) before the script ends" in done.stderr, output
    assert "this process exits with status 1" in done.stderr, output
    # Step 1 is intact and is what a resume picks.
    manager = distkit.CheckpointManager(tmp_path / "ckpts")
    assert manager.latest() == str(tmp_path / "ckpts" / "step_000000001")


@pytest.mark.parametrize("ending", ["end", "exit-0", "dropped"])
def test_an_async_save_that_fails_at_exit_is_reported_and_the_exit_code_is_1(
    tmp_path: Path, ending: str
) -> None:
    # "end": the script falls off its end; "exit-0": it calls sys.exit(0); "dropped": the manager
    # was a local of a function that returned, so only the save itself is left at exit.
    done = run_script(tmp_path, ending)
    assert done.returncode == 1, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert_reports_the_failed_save(done, tmp_path)
    if ending == "end":
        assert "SCRIPT ENDED" in done.stdout
    assert done.stderr.count("the background save of step 2") == 1, done.stderr


def test_a_script_that_raises_with_a_failing_save_in_flight_shows_both_errors_and_exits_1(
    tmp_path: Path,
) -> None:
    done = run_script(tmp_path, "raise")
    assert done.returncode == 1, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "RuntimeError: the training loop crashed" in done.stderr, done.stderr
    assert_reports_the_failed_save(done, tmp_path)
    # The script's own error first (the traceback), then the save's.
    assert done.stderr.index("the training loop crashed") < done.stderr.index("background save of step 2")


def test_two_ranks_whose_async_save_fails_at_exit_end_with_rank_0_failed_and_torchrun_nonzero(
    tmp_path: Path,
) -> None:
    done = run_script(tmp_path, "two-ranks")
    assert done.returncode != 0, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert_reports_the_failed_save(done, tmp_path, world_size=2)
    # torchrun names rank 0 and its exit status 1 as the root cause (it may have stopped rank 1 with
    # SIGTERM meanwhile); rank 1 wrote nothing, so it reports nothing.
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)\n\s+exitcode\s+: 1 ", done.stderr), done.stderr
    assert "[rank 1/2] the background save" not in done.stderr


def test_an_async_save_that_succeeds_at_exit_keeps_exit_code_0(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys

            import torch

            import distkit

            manager = distkit.CheckpointManager(sys.argv[1], async_save=True)
            manager.save(1, {"w": torch.ones(2 << 20)})  # in flight when the script ends
            """
        )
    )
    env = launcher_free_env()
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpts")],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "background save" not in done.stderr
    assert distkit.CheckpointManager(tmp_path / "ckpts").latest() == str(
        tmp_path / "ckpts" / "step_000000001"
    )

"""Launcher environment parsing: every launcher, and the errors for inconsistent values."""

from __future__ import annotations

import pytest

from distkit.env import LaunchEnv, detect_env, expand_slurm_nodelist


def test_no_launcher_is_a_world_of_one() -> None:
    assert detect_env({}) == LaunchEnv("none", 0, 1, 0, 1, 0, None, None)


def test_torchrun_variables_are_read_including_node_rank_and_agent_store() -> None:
    env = detect_env(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "node0",
            "MASTER_PORT": "29400",
            "TORCHELASTIC_RUN_ID": "abc",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )
    assert env == LaunchEnv("torchrun", 5, 8, 1, 4, 1, "node0", 29400, agent_store=True)
    assert env.is_distributed and env.num_nodes == 2


def test_hand_set_variables_as_under_mp_spawn_default_to_one_node() -> None:
    env = detect_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    assert (env.launcher, env.local_rank, env.local_world_size, env.node_rank) == ("env", 1, 2, 0)
    assert env.master_port == 29500


def test_rank_not_below_world_size_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"RANK=2 is outside 0\.\.1 \(WORLD_SIZE=2\)"):
        detect_env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})


def test_missing_master_addr_for_a_multi_process_job_says_how_to_fix() -> None:
    with pytest.raises(ValueError, match=r"MASTER_ADDR is not set.*torchrun --standalone"):
        detect_env({"RANK": "0", "WORLD_SIZE": "2"})


def test_non_integer_variable_is_named() -> None:
    with pytest.raises(ValueError, match="WORLD_SIZE must be an integer, got 'two'"):
        detect_env({"RANK": "0", "WORLD_SIZE": "two"})


def test_local_rank_outside_local_world_size_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 is outside 0\.\.1"):
        detect_env(
            {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h"}
        )


def test_open_mpi_variables_are_read() -> None:
    env = detect_env(
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_ADDR": "head",
            "MASTER_PORT": "1234",
        }
    )
    assert env == LaunchEnv("openmpi", 3, 4, 1, 2, 1, "head", 1234)


def test_open_mpi_without_master_addr_suggests_mpirun_x() -> None:
    with pytest.raises(ValueError, match="mpirun -x MASTER_ADDR"):
        detect_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})


def test_mpich_and_intel_mpi_variables_are_read() -> None:
    env = detect_env(
        {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h"}
    )
    assert env == LaunchEnv("mpich", 2, 4, 0, 2, 1, "h", 29500)


def test_slurm_variables_give_master_from_nodelist_and_port_from_job_id() -> None:
    env = detect_env(
        {
            "SLURM_PROCID": "3",
            "SLURM_NTASKS": "4",
            "SLURM_NODEID": "1",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS_PER_NODE": "2(x2)",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_JOB_ID": "123456",
        }
    )
    assert env == LaunchEnv("slurm", 3, 4, 1, 2, 1, "gpu07", 15000 + 123456 % 10000)


def test_slurm_master_addr_and_port_from_the_environment_take_precedence() -> None:
    env = detect_env(
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "a,b",
            "MASTER_ADDR": "b",
            "MASTER_PORT": "4000",
        }
    )
    assert (env.master_addr, env.master_port) == ("b", 4000)


def test_slurm_batch_script_without_srun_is_one_process_when_step_says_so() -> None:
    env = detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "1"})
    assert env.world_size == 1 and env.master_addr is None


def test_slurm_errors_name_the_job_steps_variables_when_those_were_read() -> None:
    """Was: "(SLURM_NTASKS=1)" for a value read from SLURM_STEP_NUM_TASKS, and SLURM_NTASKS_PER_NODE
    for one read from SLURM_STEP_TASKS_PER_NODE."""
    base = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "a"}
    with pytest.raises(ValueError, match=r"SLURM_PROCID=1 is outside 0\.\.0 \(SLURM_STEP_NUM_TASKS=1\)"):
        detect_env({**base, "SLURM_STEP_NUM_TASKS": "1"})
    with pytest.raises(ValueError, match=r"SLURM_STEP_TASKS_PER_NODE=8 must be in 1\.\.SLURM_NTASKS=4"):
        detect_env({**base, "SLURM_STEP_TASKS_PER_NODE": "8", "SLURM_NTASKS_PER_NODE": "4"})
    with pytest.raises(ValueError, match=r"malformed SLURM_STEP_TASKS_PER_NODE '2\(x'"):
        detect_env({**base, "SLURM_STEP_TASKS_PER_NODE": "2(x"})


def test_torchrun_inside_slurm_reads_as_torchrun() -> None:
    env = detect_env(
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}
    )
    assert env.launcher == "env" and env.rank == 1


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("rack[1-2]-n[3-4]", ["rack1-n3", "rack1-n4", "rack2-n3", "rack2-n4"]),
        ("x[1],y[002-003]", ["x1", "y002", "y003"]),
    ],
)
def test_slurm_nodelist_brackets_expand(nodelist: str, hosts: list[str]) -> None:
    assert expand_slurm_nodelist(nodelist) == hosts


def test_malformed_slurm_nodelist_is_rejected() -> None:
    with pytest.raises(ValueError, match="malformed"):
        expand_slurm_nodelist("gpu[01-x]")

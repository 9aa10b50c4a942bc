"""Slurm without torchrun: ``srun python scripts/train.py CONFIG`` (allenai/OLMo#641).

The end-to-end tests start the processes themselves with the variables srun gives each task, since neither
srun nor scontrol exists here; the launch environment is otherwise read exactly as under a real srun.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmo.data import read_data_indices
from olmo.exceptions import OLMoError
from olmo.testing import free_port, run_train, tiny_config_dict, write_byte_memmap, write_config
from olmo.util.launch import expand_hostlist, launch_env

TRAIN = Path(__file__).resolve().parents[2] / "scripts" / "train.py"
LAUNCHER_PREFIXES = ("SLURM_", "MASTER_", "TORCHELASTIC_")
TORCHRUN_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_byte_memmap(root / "a.npy", 30_000)
    return [str(root / "a.npy")]


def _clean_environ() -> dict[str, str]:
    """This test process's environment without any launcher's variables (the suite may itself run under one)."""
    return {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith(LAUNCHER_PREFIXES)}


def _start_task(config: Path, task_env: dict[str, str]) -> subprocess.Popen:
    env = {**_clean_environ(), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", **task_env}
    return subprocess.Popen(
        [sys.executable, str(TRAIN), str(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(processes: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """Wait for every process (killing them all if one hangs); return their stderr."""
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout)[1])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return outputs


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train/CrossEntropyLoss"] for line in lines]


def test_two_srun_tasks_train_like_one_process(tmp_path, corpus):
    single = write_config(tmp_path / "one/c.yaml", tiny_config_dict(tmp_path / "one/run", corpus, max_duration=5))
    assert run_train(single) == 0
    config = write_config(tmp_path / "two/c.yaml", tiny_config_dict(tmp_path / "two/run", corpus, max_duration=5))
    port = str(free_port())
    tasks = [
        _start_task(
            config,
            {
                "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank),
                "SLURM_NTASKS": "2",
                "SLURM_JOB_ID": "4242",
                "SLURM_STEP_ID": "0",
                # Hosts that do not exist: MASTER_ADDR, when set, must win over the node list.
                "SLURM_JOB_NODELIST": "gpu-node[07-08]",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for rank in range(2)
    ]
    stderr = _finish(tasks)
    for task, err in zip(tasks, stderr):
        assert task.returncode == 0, err[-4000:]
    assert "Launched by Slurm's srun without torchrun" in stderr[0] and "rank 0 of 2" in stderr[0]
    assert f"rendezvous at 127.0.0.1:{port} (host: MASTER_ADDR; port: MASTER_PORT)" in stderr[0]
    assert "World size 2; device batch 4" in stderr[0]
    np.testing.assert_allclose(_losses(tmp_path / "two/run"), _losses(tmp_path / "one/run"), rtol=1e-5)
    # Each task read its own half of every batch, by its Slurm rank.
    indices = read_data_indices(tmp_path / "two/run")
    assert sorted(indices) == [1, 2, 3, 4, 5] and all(sorted(ranks) == [0, 1] for ranks in indices.values())


def test_config_validation_sees_the_slurm_world_size_before_any_rendezvous(tmp_path, corpus):
    # 4 instances cannot split into micro-batches of 4 over 2 ranks; validation must say so at once (the
    # other task never starts, so reaching the rendezvous would hang instead).
    cfg = tiny_config_dict(tmp_path / "run", corpus, global_train_batch_size=4)
    task = _start_task(
        write_config(tmp_path / "c.yaml", cfg),
        {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[1-2]"},
    )
    (err,) = _finish([task], timeout=120)
    assert task.returncode != 0
    assert "OLMoConfigurationError" in err and "world size (2)" in err, err[-3000:]
    assert "Traceback" not in err


def test_salloc_shell_without_srun_is_one_paragraph_error(tmp_path, corpus):
    task = _start_task(
        write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", corpus)),
        {"SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[1-2]"},
    )
    (err,) = _finish([task], timeout=120)
    assert task.returncode != 0
    message = err.strip()
    assert message.startswith("OLMoCliError: SLURM_NTASKS=2 is set but SLURM_PROCID is not"), err[-3000:]
    assert "\n" not in message and "srun python scripts/train.py" in message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("gpu5", ["gpu5"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("a-1,b[2],c[3-3].ib", ["a-1", "b2", "c3.ib"]),
        (" n[1-2] ", ["n1", "n2"]),
    ],
)
def test_hostlist_expands_like_scontrol_show_hostnames(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    "hostlist, reason",
    [
        ("", "empty host name"),
        ("a,,b", "empty host name"),
        ("node[01-", "without its ']'"),
        ("node]1", "without its '['"),
        ("node[[1]]", "inside brackets"),
        ("node[]", "not a number or a range"),
        ("node[a-c]", "not a number or a range"),
        ("node[1-2-3]", "not a number or a range"),
        ("node[5-3]", "runs backwards"),
    ],
)
def test_malformed_hostlists_are_refused(hostlist, reason):
    with pytest.raises(ValueError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        expand_hostlist(hostlist)


SRUN_TASK = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NODEID": "1"}


def test_slurm_variables_give_rank_world_size_and_rendezvous():
    launch = launch_env({**SRUN_TASK, "SLURM_JOB_NODELIST": "gpu[12-13]", "SLURM_JOB_ID": "123456"})
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("slurm", 3, 4, 1)
    assert (launch.master_addr, launch.master_port) == ("gpu12", 10000 + 123456 % 20000)
    # The step's node list wins over the job's: task 0 runs on the step's first node.
    assert (
        launch_env({**SRUN_TASK, "SLURM_JOB_NODELIST": "a[1-4]", "SLURM_STEP_NODELIST": "a[3-4]"}).master_addr
        == "a3"
    )
    assert launch_env({**SRUN_TASK, "SLURM_NODELIST": "b7"}).master_addr == "b7"
    # MASTER_ADDR / MASTER_PORT from the environment win; a node list is then not needed.
    explicit = launch_env({**SRUN_TASK, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "6000"})
    assert (explicit.master_addr, explicit.master_port) == ("10.0.0.5", 6000)
    # Tasks per node, compressed: nodes 0 and 1 run 2 tasks, node 2 runs 1.
    uneven = launch_env({**SRUN_TASK, "SLURM_NTASKS": "5", "MASTER_ADDR": "h", "SLURM_TASKS_PER_NODE": "2(x2),1"})
    assert uneven.local_world_size == 2
    assert launch_env({**SRUN_TASK, "MASTER_ADDR": "h"}).local_world_size == 4  # unknown: one node


def test_torchrun_variables_win_over_slurm_ones():
    launch = launch_env(
        {
            **SRUN_TASK,
            "SLURM_JOB_NODELIST": "gpu[1-2]",
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29400",
        }
    )
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("torchrun", 1, 2, 1)
    assert (launch.master_addr, launch.master_port) == ("127.0.0.1", 29400)


@pytest.mark.parametrize(
    "environ",
    [{}, {"SLURM_NTASKS": "1"}, {"SLURM_PROCID": "0"}, {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}],
    ids=["no launcher", "one task", "batch script", "srun -n 1"],
)
def test_one_process_needs_no_rendezvous(environ):
    launch = launch_env(environ)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master_addr) == (0, 1, 0, None)


@pytest.mark.parametrize(
    "environ, names",
    [
        ({"SLURM_NTASKS": "2"}, ["SLURM_NTASKS=2", "SLURM_PROCID is not", "srun python scripts/train.py"]),
        ({"SLURM_PROCID": "1"}, ["SLURM_PROCID=1", "below SLURM_NTASKS (1)"]),
        ({**SRUN_TASK, "SLURM_PROCID": "4"}, ["SLURM_PROCID=4", "below SLURM_NTASKS (4)"]),
        ({**SRUN_TASK, "SLURM_NTASKS": "four"}, ["SLURM_NTASKS='four'", "whole number"]),
        ({**SRUN_TASK, "SLURM_LOCALID": None}, ["SLURM_LOCALID is not set", "srun sets it"]),
        (SRUN_TASK, ["MASTER_ADDR", "SLURM_JOB_NODELIST", "scontrol show hostnames"]),
        ({**SRUN_TASK, "SLURM_JOB_NODELIST": "node[01-"}, ["SLURM_JOB_NODELIST='node[01-'", "Set MASTER_ADDR"]),
        ({**SRUN_TASK, "MASTER_ADDR": "h", "MASTER_PORT": "x"}, ["MASTER_PORT='x'", "free TCP port"]),
        (
            {**SRUN_TASK, "MASTER_ADDR": "h", "SLURM_TASKS_PER_NODE": "2(x"},
            ["SLURM_TASKS_PER_NODE='2(x'", "tasks-per-node"],
        ),
        ({"WORLD_SIZE": "2", "RANK": "0"}, ["WORLD_SIZE=2", "MASTER_ADDR is not set", "torchrun"]),
        ({"WORLD_SIZE": "2", "RANK": "2"}, ["RANK=2", "below WORLD_SIZE (2)"]),
    ],
    ids=[
        "salloc shell",
        "procid without ntasks",
        "procid too large",
        "ntasks not a number",
        "no localid",
        "no node list",
        "bad node list",
        "bad port",
        "bad tasks per node",
        "torchrun without master",
        "torchrun rank too large",
    ],
)
def test_misconfigured_launch_is_one_paragraph_naming_the_variable_and_fix(environ, names):
    environ = {k: v for k, v in environ.items() if v is not None}
    with pytest.raises(OLMoError) as info:
        launch_env(environ)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message

"""Where this process sits, as its launcher described it in the environment: torchrun's variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or, without them, Slurm's
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, the node list). One process otherwise.

Imports neither torch nor anything else heavy: logging setup and config validation read the rank before
any process group exists. :func:`olmo.distributed.init_distributed` starts the group from :func:`launch_env`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from ..exceptions import OLMoCliError

__all__ = ["LaunchEnv", "launch_env", "expand_hostlist", "env_rank", "env_world_size"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# The step's node list first: a step may run on part of the job's nodes, and task 0 runs on the step's first.
_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_WHOLE_NUMBER = re.compile(r"\s*[0-9]+\s*")
_HOST_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TASK_COUNTS = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
_TORCHRUN_FIX = (
    "torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT together: launch with torchrun, or "
    "unset all of them to run one process (or to let srun's SLURM_* variables apply)."
)
_SLURM_FIX = (
    "Start one process per task with srun (`srun python scripts/train.py CONFIG ...` in an sbatch script or an "
    "salloc shell), launch with torchrun instead, or unset SLURM_NTASKS and SLURM_PROCID to run one process."
)
_MASTER_FIX = (
    "Set MASTER_ADDR to the host of task 0 before srun, e.g. "
    '`export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)` in the sbatch script.'
)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits, as its launcher described it in the environment (see :func:`launch_env`).

    :param launcher: ``"torchrun"``, ``"slurm"`` (tasks started by srun, no torchrun) or ``"none"`` (one process).
    :param local_world_size: processes on this node (hybrid sharding replicates across nodes).
    :param master_addr: host of rank 0's rendezvous store; None for one process.
    :param source: which variables gave the rendezvous address, for the startup log.
    :param warning: something in the environment that may make the launch hang, for the startup log.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    source: str = ""
    warning: Optional[str] = None

    def describe(self) -> str:
        """One line for the startup log: the launcher whose variables were used, and what they said."""
        if self.launcher == "none":
            return "No torchrun or Slurm task variables: training in one process."
        by = "torchrun" if self.launcher == "torchrun" else "Slurm's srun without torchrun (SLURM_* variables)"
        line = (
            f"Launched by {by}: rank {self.rank} of {self.world_size}, local rank {self.local_rank} of "
            f"{self.local_world_size}"
        )
        if self.master_addr is None:
            return line + "."
        return f"{line}; rendezvous at {self.master_addr}:{self.master_port} ({self.source})."


def launch_env(environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Rank, world size, local rank and rendezvous address of this process, from its launcher's variables.

    torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) always win. Without
    them, a task started by Slurm's ``srun`` takes ``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURM_LOCALID``; its
    rendezvous host is ``MASTER_ADDR`` when set, else the first host of ``SLURM_STEP_NODELIST``,
    ``SLURM_JOB_NODELIST`` or ``SLURM_NODELIST``, and its port ``MASTER_PORT`` when set, else
    ``10000 + SLURM_JOB_ID mod 20000`` (so two jobs sharing a node differ). With neither: one process.
    Everything that needs the rank (logging, validation, data checks, the process group) asks this function,
    so they always agree.

    :param environ: the variables to read; ``os.environ`` by default.
    :raises OLMoCliError: for variables that cannot describe a working launch, naming the variable and the fix.
    """
    env = os.environ if environ is None else environ
    if any(name in env for name in _TORCHRUN_VARS):
        return _torchrun_env(env)
    if "SLURM_NTASKS" in env or "SLURM_PROCID" in env:
        return _slurm_env(env)
    return LaunchEnv("none", rank=0, world_size=1, local_rank=0, local_world_size=1)


def env_rank() -> int:
    """This process's global rank from its launcher's variables (0 for one process); see :func:`launch_env`."""
    return launch_env().rank


def env_world_size() -> int:
    """The number of processes the launcher started (1 without one); see :func:`launch_env`."""
    return launch_env().world_size


def _env_int(env: Mapping[str, str], name: str, fix: str, default: Optional[int] = None, minimum: int = 0) -> int:
    """The whole number in ``env[name]``, or ``default`` when unset (an error when there is no default)."""
    text = env.get(name)
    if text is None:
        if default is None:
            raise OLMoCliError(f"{name} is not set. {fix}")
        return default
    value = int(text) if _WHOLE_NUMBER.fullmatch(text) else -1
    if value < minimum:
        raise OLMoCliError(f"{name}={text!r} is not a whole number of at least {minimum}. {fix}")
    return value


def _check_below(name: str, value: int, bound_name: str, bound: int, fix: str) -> None:
    if value >= bound:
        raise OLMoCliError(f"{name}={value} must be below {bound_name} ({bound}). {fix}")


def _torchrun_env(env: Mapping[str, str]) -> LaunchEnv:
    world_size = _env_int(env, "WORLD_SIZE", _TORCHRUN_FIX, default=1, minimum=1)
    rank = _env_int(env, "RANK", _TORCHRUN_FIX, default=0)
    _check_below("RANK", rank, "WORLD_SIZE", world_size, _TORCHRUN_FIX)
    local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", _TORCHRUN_FIX, default=world_size, minimum=1)
    local_rank = _env_int(env, "LOCAL_RANK", _TORCHRUN_FIX, default=0)
    _check_below("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size, _TORCHRUN_FIX)
    if world_size == 1:
        return LaunchEnv("torchrun", rank, world_size, local_rank, local_world_size)
    if not env.get("MASTER_ADDR"):
        raise OLMoCliError(f"WORLD_SIZE={world_size} but MASTER_ADDR is not set. {_TORCHRUN_FIX}")
    port = _env_int(env, "MASTER_PORT", _TORCHRUN_FIX, minimum=1)
    addr = env["MASTER_ADDR"]
    return LaunchEnv("torchrun", rank, world_size, local_rank, local_world_size, addr, port, "MASTER_ADDR/PORT")


def _slurm_env(env: Mapping[str, str]) -> LaunchEnv:
    world_size = _env_int(env, "SLURM_NTASKS", _SLURM_FIX, default=1, minimum=1)
    if world_size == 1:
        # One task: the batch script's own process, or `srun -n 1`; no rendezvous.
        _check_below("SLURM_PROCID", _env_int(env, "SLURM_PROCID", _SLURM_FIX, 0), "SLURM_NTASKS", 1, _SLURM_FIX)
        return LaunchEnv("slurm", rank=0, world_size=1, local_rank=0, local_world_size=1)
    if "SLURM_PROCID" not in env:
        raise OLMoCliError(
            f"SLURM_NTASKS={world_size} is set but SLURM_PROCID is not, so this process is not one of the tasks "
            f"srun starts (it was run directly, e.g. from an salloc shell). {_SLURM_FIX}"
        )
    rank = _env_int(env, "SLURM_PROCID", _SLURM_FIX)
    _check_below("SLURM_PROCID", rank, "SLURM_NTASKS", world_size, _SLURM_FIX)
    local_world_size = _slurm_tasks_on_this_node(env, world_size)
    local_rank = _env_int(env, "SLURM_LOCALID", f"srun sets it for every task. {_SLURM_FIX}")
    _check_below("SLURM_LOCALID", local_rank, "the number of tasks on this node", local_world_size, _SLURM_FIX)
    addr, addr_source = env.get("MASTER_ADDR"), "MASTER_ADDR"
    if not addr:
        addr, addr_source = _first_slurm_host(env, world_size)
    if "MASTER_PORT" in env:
        port_fix = "Set MASTER_PORT to a free TCP port, the same for every task, or unset it."
        port, port_source = _env_int(env, "MASTER_PORT", port_fix, minimum=1), "MASTER_PORT"
    else:
        job_id = _env_int(env, "SLURM_JOB_ID", _SLURM_FIX, default=19500)  # without a job id, torch's usual 29500
        port, port_source = 10000 + job_id % 20000, "10000 + SLURM_JOB_ID mod 20000"
    warning = None
    if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        warning = (
            f"SLURM_STEP_ID is not set: if this process is the sbatch script's own (python run directly rather "
            f"than through srun), the other {world_size - 1} rank(s) never start and the rendezvous waits until "
            f"distributed_timeout_minutes. {_SLURM_FIX}"
        )
    source = f"host: {addr_source}; port: {port_source}"
    return LaunchEnv("slurm", rank, world_size, local_rank, local_world_size, addr, port, source, warning)


def _slurm_tasks_on_this_node(env: Mapping[str, str], world_size: int) -> int:
    """This node's entry of Slurm's tasks-per-node list (``4(x2),3``: 4, 4 and 3 tasks on nodes 0, 1, 2)."""
    name = next((n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(n)), None)
    if name is None:
        return world_size
    counts: list[int] = []
    for item in env[name].split(","):
        match = _TASK_COUNTS.fullmatch(item.strip())
        if match is None:
            raise OLMoCliError(
                f"{name}={env[name]!r} is not a Slurm tasks-per-node list like '4(x2),3'. {_SLURM_FIX}"
            )
        counts += [int(match[1])] * int(match[2] or 1)
    node = _env_int(env, "SLURM_NODEID", _SLURM_FIX, default=0)
    _check_below("SLURM_NODEID", node, f"the number of nodes in {name}", len(counts), _SLURM_FIX)
    return counts[node]


def _first_slurm_host(env: Mapping[str, str], world_size: int) -> tuple[str, str]:
    """The first host of the node list, and a phrase naming the variable it came from."""
    for name in _NODELIST_VARS:
        if env.get(name):
            try:
                return expand_hostlist(env[name])[0], f"the first host of {name}"
            except ValueError as e:
                raise OLMoCliError(
                    f"{name}={env[name]!r} is not a Slurm host list ({e}), so the host of rank 0 is unknown. "
                    f"{_MASTER_FIX}"
                ) from None
    raise OLMoCliError(
        f"SLURM_NTASKS={world_size} but neither MASTER_ADDR nor a node list (SLURM_JOB_NODELIST or SLURM_NODELIST) "
        f"is set, so the host of rank 0 is unknown. {_MASTER_FIX}"
    )


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm's compressed host list, in order: ``node[01-03,07],gpu5`` gives node01, node02, node03,
    node07 and gpu5. A range keeps the zero padding of its first number; several brackets in one name
    (``r[1-2]n[1-2]``) give every combination, the last bracket varying fastest.

    :raises ValueError: unbalanced or nested brackets, an empty name, or a bracket item that is not ``N`` or
        ``N-M`` with N <= M.
    """
    hosts: list[str] = []
    for entry in _split_outside_brackets(hostlist.strip()):
        if not entry:
            raise ValueError("an empty host name")
        names = [""]
        # Split on bracket groups: even parts are literal text, odd parts a bracket's contents.
        for i, part in enumerate(re.split(r"\[([^\]]*)\]", entry)):
            options = _expand_ranges(part) if i % 2 else [part]
            names = [name + option for name in names for option in options]
        hosts.extend(names)
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    entries, start, inside = [], 0, False
    for i, char in enumerate(text):
        if char == "[":
            if inside:
                raise ValueError("a '[' inside brackets")
            inside = True
        elif char == "]":
            if not inside:
                raise ValueError("a ']' without its '['")
            inside = False
        elif char == "," and not inside:
            entries.append(text[start:i])
            start = i + 1
    if inside:
        raise ValueError("a '[' without its ']'")
    return entries + [text[start:]]


def _expand_ranges(text: str) -> list[str]:
    out: list[str] = []
    for item in text.split(","):
        match = _HOST_RANGE.fullmatch(item)
        if match is None:
            raise ValueError(f"'[{text}]' holds {item!r}, not a number or a range like 01-03")
        first, last = int(match[1]), int(match[2] or match[1])
        if last < first:
            raise ValueError(f"the range {item!r} runs backwards")
        out.extend(str(n).zfill(len(match[1])) for n in range(first, last + 1))
    return out

"""Launcher detection: who started this process, and what is its place in the job.

`detect()` is a pure function over a mapping (default `os.environ`). It tries torchrun first
(torchrun can run inside a SLURM job, and then its variables describe the workers), then SLURM
with one task per rank (srun), then a plain single process. It never writes the environment and
does not import torch, so the doctor and the launch helpers can use it cheaply.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Mapping

from ..errors import UserError

TORCHRUN, SLURM, ENV, SINGLE = "torchrun", "slurm", "env", "single"


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. World size 1 when nothing launched us."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = SINGLE
    job_id: str | None = None
    restart_count: int = 0
    hosts: tuple[str, ...] = ()
    batch_job_id: str | None = None  # the scheduler's job (SLURM_JOB_ID) around us, whatever started the ranks
    requeue_id: str | None = None  # what `scontrol requeue` takes for this job: ARRAYID_TASKID for an array task
    cpus_on_node: int | None = None  # CPUs the scheduler allocated on this node (None: not said)
    gpus_on_node: int | None = None  # GPUs the scheduler allocated on this node (None: not said)

    @property
    def launched(self) -> bool:
        """Started by a launcher (torchrun, srun, ...), not as a plain `python` process."""
        return self.launcher != SINGLE

    @property
    def requeue_command(self) -> tuple[str, ...] | None:
        """The command that puts this job back in its scheduler's queue (None: no scheduler requeues it)."""
        return ("scontrol", "requeue", self.requeue_id) if self.requeue_id else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as `gpu[01-03,07],cpu5` into every host name, in order."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        if item:
            hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if not match:
        return [item]
    head, tail = item[: match.start()], item[match.end():]
    names = []
    for rng in match.group(1).split(","):
        lo, _, hi = rng.partition("-")
        if not hi:
            names.append(lo)
            continue
        width = len(lo)  # zero padding is kept: gpu[01-03] -> gpu01, gpu02, gpu03
        names.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return [head + name + rest for name in names for rest in _expand_one(tail)]


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Parse SLURM_TASKS_PER_NODE, e.g. `2(x3),1`, and return the count for node `node_id`."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise UserError(f"cannot parse SLURM_TASKS_PER_NODE={tasks_per_node!r}",
                            "check the sbatch/srun task options")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[min(node_id, len(counts) - 1)]


# The whole job's polling of the rendezvous store, per helper thread kind (fail-fast, watchdog), in
# operations per second. A TCPStore is one server thread: measured here it serves some 50,000-90,000
# operations per second, and rendezvous, checkpoint commits and failure posts share it.
STORE_OPS_PER_S = 2000.0


def poll_period(world_size: int, base_s: float, ops_per_poll: int, environ: Mapping[str, str] | None = None) -> float:
    """How often each rank's helper thread may poll the store: `base_s`, or longer once the job's
    `world_size * ops_per_poll / period` would pass DDP_KIT_STORE_OPS_PER_S (default 2000), so the
    store's load stays bounded at any world size (the latencies that depend on it grow instead)."""
    environ = os.environ if environ is None else environ
    try:
        budget = float(environ.get("DDP_KIT_STORE_OPS_PER_S") or STORE_OPS_PER_S)
    except ValueError:
        raise UserError(f"DDP_KIT_STORE_OPS_PER_S={environ.get('DDP_KIT_STORE_OPS_PER_S')!r} is not a number",
                        "set it to the store operations per second the job may spend on polling, e.g. 2000") from None
    return max(base_s, world_size * ops_per_poll / max(budget, 1e-3))


def slurm_port(job_id: str) -> int:
    """A port every task of one job derives alike, spread over jobs so that two do not collide."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 15000 + int(digits[-4:]) % 10000


def _int(environ: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = environ.get(key)
    if raw is None or raw == "":
        if default is None:
            raise UserError(f"{key} is not set", "launch with torchrun or srun, or unset the partial launcher variables")
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"{key}={raw!r} is not an integer", f"unset or fix {key}") from None


def detect(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Return this process's DistEnv from `environ` (default os.environ)."""
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in environ or ("RANK" in environ and "LOCAL_RANK" in environ):
        env = _from_torchrun(environ)
    elif "RANK" in environ and "WORLD_SIZE" in environ:
        env = _from_env_vars(environ)
    elif "SLURM_JOB_ID" in environ and _slurm_step(environ):
        env = _from_slurm(environ)
    else:
        env = _single(environ)
    _check(env)
    return replace(env, batch_job_id=environ.get("SLURM_JOB_ID"), requeue_id=requeue_target(environ),
                   cpus_on_node=_count(environ, "SLURM_CPUS_ON_NODE"), gpus_on_node=_count(environ, "SLURM_GPUS_ON_NODE"))


def requeue_target(environ: Mapping[str, str]) -> str | None:
    """`ARRAYID_TASKID` for an array task: one task's SLURM_JOB_ID can equal the array's own id, and
    `scontrol requeue <array id>` would requeue every task of the array."""
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    return environ.get("SLURM_JOB_ID")


def _count(environ: Mapping[str, str], key: str) -> int | None:
    raw = environ.get(key, "")
    return int(raw) if raw.isdigit() else None


def _slurm_step(environ: Mapping[str, str]) -> bool:
    """True inside an srun step; the batch script itself (and salloc's shell) is not one."""
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    return step is not None and step not in ("batch", "extern", "interactive", "4294967294", "4294967290")


def _from_torchrun(environ: Mapping[str, str]) -> DistEnv:
    world = _int(environ, "WORLD_SIZE")
    local_world = _int(environ, "LOCAL_WORLD_SIZE", 1)
    return DistEnv(
        rank=_int(environ, "RANK"),
        local_rank=_int(environ, "LOCAL_RANK"),
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(environ, "GROUP_RANK", 0),
        num_nodes=_int(environ, "GROUP_WORLD_SIZE", max(1, world // max(1, local_world))),
        master_addr=environ.get("MASTER_ADDR"),
        master_port=_int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else None,
        launcher=TORCHRUN,
        job_id=environ.get("TORCHELASTIC_RUN_ID") or environ.get("SLURM_JOB_ID"),
        restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
    )


def _from_env_vars(environ: Mapping[str, str]) -> DistEnv:
    """Hand-set env:// variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), e.g. by a script."""
    world = _int(environ, "WORLD_SIZE")
    local_world = _int(environ, "LOCAL_WORLD_SIZE", world)
    return DistEnv(
        rank=_int(environ, "RANK"),
        local_rank=_int(environ, "LOCAL_RANK", _int(environ, "RANK") % max(1, local_world)),
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(environ, "RANK") // max(1, local_world),
        num_nodes=max(1, world // max(1, local_world)),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT", 29500),
        launcher=ENV,
    )


def _from_slurm(environ: Mapping[str, str]) -> DistEnv:
    job_id = environ["SLURM_JOB_ID"]  # unique per array task too (SLURM_ARRAY_JOB_ID is shared by all tasks)
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", "")
    hosts = tuple(expand_nodelist(nodelist)) if nodelist else ()
    node_id = _int(environ, "SLURM_NODEID", 0)
    tasks_per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    world = _int(environ, "SLURM_STEP_NUM_TASKS", _int(environ, "SLURM_NTASKS", 1))
    local_world = _tasks_on_node(tasks_per_node, node_id) if tasks_per_node else world
    return DistEnv(
        rank=_int(environ, "SLURM_PROCID"),
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        world_size=world,
        local_world_size=local_world,
        node_rank=node_id,
        num_nodes=_int(environ, "SLURM_STEP_NUM_NODES", _int(environ, "SLURM_JOB_NUM_NODES", max(1, len(hosts)))),
        # A user-set MASTER_ADDR/PORT wins: clusters with a separate fabric name need it.
        master_addr=environ.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else slurm_port(job_id),
        launcher=SLURM,
        job_id=environ["SLURM_JOB_ID"],
        restart_count=_int(environ, "SLURM_RESTART_COUNT", 0),
        hosts=hosts,
    )


def _single(environ: Mapping[str, str]) -> DistEnv:
    ntasks = environ.get("SLURM_NTASKS")
    if "SLURM_JOB_ID" in environ and ntasks and ntasks.isdigit() and int(ntasks) > 1:
        raise UserError(
            f"SLURM allocated {ntasks} tasks but this process was not started by srun, so it would train alone",
            "prepend `srun` to the command (or use slurm/torchrun.sbatch, which runs torchrun once per node)")
    if "WORLD_SIZE" in environ and environ["WORLD_SIZE"] not in ("", "1"):
        raise UserError(f"WORLD_SIZE={environ['WORLD_SIZE']} is set but RANK is not",
                        "launch with torchrun, or unset WORLD_SIZE for a single-process run")
    return DistEnv(job_id=environ.get("SLURM_JOB_ID"))


def _check(env: DistEnv) -> None:
    if env.world_size < 1:
        raise UserError(f"world size {env.world_size} from {env.launcher} is not positive", "check the launcher's task count")
    if not 0 <= env.rank < env.world_size:
        raise UserError(f"rank {env.rank} is outside world size {env.world_size} ({env.launcher})",
                        "the launcher variables disagree; relaunch with torchrun or srun instead of setting them by hand")
    if not 0 <= env.local_rank < max(env.local_world_size, 1):
        raise UserError(f"local rank {env.local_rank} is outside local world size {env.local_world_size} ({env.launcher})",
                        "check --ntasks-per-node / --nproc_per_node")
    if env.world_size > 1 and not env.master_addr:
        raise UserError(f"{env.launcher} gave world size {env.world_size} but no master address",
                        "set MASTER_ADDR to the first node's host name")

"""SLURM: ranks started by srun (one task per rank), and the facts of the batch job around any launcher.

Two roles. `detect` reads an srun step's task variables (SLURM_PROCID, SLURM_LOCALID, ...), host list
included (`node[1-3,7]` fully expanded). `around` adds what the allocation says whatever started the
ranks (torchrun inside a batch job too): the job id, how to requeue it, the node's CPUs and GPUs.
"""
from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from dataclasses import replace

from ..errors import UserError
from .base import DistEnv, count_var, int_var

NAME = "slurm"
# What the doctor's summary shows of a SLURM job.
SHOWN = ("SLURM_JOB_ID", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_PER_NODE",
         "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_PROCID")


def detect(environ: Mapping[str, str]) -> DistEnv | None:
    """This task's place inside an srun step, or None outside one. A batch script with several tasks
    allocated but no srun is refused: each task would train alone."""
    if "SLURM_JOB_ID" not in environ:
        return None
    if _typed_into_pty_shell(environ):
        # One process, typed at a prompt: it can train alone, and the step's other tasks will
        # never join it. torchrun typed there is detected before SLURM and is unaffected.
        return DistEnv(notes=(
            f"started from the shell of an `srun --pty` step (SLURM job {environ['SLURM_JOB_ID']} "
            f"'{environ.get('SLURM_JOB_NAME')}', {environ.get('SLURM_STEP_NUM_TASKS') or environ.get('SLURM_NTASKS', '?')} "
            "tasks), not by srun: training as one process; for every task run `srun --overlap python ...` (or torchrun) "
            "from this shell",))
    if not _in_step(environ):
        ntasks = environ.get("SLURM_NTASKS")
        if ntasks and ntasks.isdigit() and int(ntasks) > 1:
            raise UserError(
                f"SLURM allocated {ntasks} tasks but this process was not started by srun, so it would train alone",
                "prepend `srun` to the command (or use slurm/torchrun.sbatch, which runs torchrun once per node)")
        return None
    job_id = environ["SLURM_JOB_ID"]  # unique per array task too (SLURM_ARRAY_JOB_ID is shared by all tasks)
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", "")
    hosts = tuple(expand_nodelist(nodelist)) if nodelist else ()
    node_id = int_var(environ, "SLURM_NODEID", 0)
    world = int_var(environ, "SLURM_STEP_NUM_TASKS", int_var(environ, "SLURM_NTASKS", 1))
    # the job's nodes (SLURM_NNODES is the older name of SLURM_JOB_NUM_NODES), else the host list's
    job_nodes = int_var(environ, "SLURM_JOB_NUM_NODES", int_var(environ, "SLURM_NNODES", max(1, len(hosts))))
    return DistEnv(
        rank=int_var(environ, "SLURM_PROCID"),
        local_rank=int_var(environ, "SLURM_LOCALID", 0),
        world_size=world,
        local_world_size=tasks_per_node(environ, node_id) or world,
        node_rank=node_id,
        num_nodes=int_var(environ, "SLURM_STEP_NUM_NODES", job_nodes),
        # A user-set MASTER_ADDR/PORT wins: clusters with a separate fabric name need it.
        master_addr=environ.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1"),
        master_port=int_var(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else slurm_port(job_id),
        launcher=NAME,
        job_id=job_id,
        restart_count=int_var(environ, "SLURM_RESTART_COUNT", 0),
        hosts=hosts,
        scheduler_binds_gpus=True,  # srun --gpu-bind / --gpus-per-task show each task its own GPU
    )


def around(env: DistEnv, environ: Mapping[str, str]) -> DistEnv:
    """`env` plus what the SLURM allocation around this process says (unchanged outside a SLURM job)."""
    job_id = environ.get("SLURM_JOB_ID")
    target = requeue_target(environ)
    env = replace(env, job_id=env.job_id or job_id, batch_job_id=job_id, requeue_id=target,
                  requeue_command=("scontrol", "requeue", target) if target else None,
                  # the templates' --signal=USR2@120: the warning that asks for the requeue
                  preempt_signal=signal.SIGUSR2 if target else env.preempt_signal,
                  cpus_on_node=count_var(environ, "SLURM_CPUS_ON_NODE"),
                  gpus_on_node=count_var(environ, "SLURM_GPUS_ON_NODE"))
    if not job_id:
        return env
    listed = environ.get("SLURM_STEP_GPUS") or environ.get("SLURM_JOB_GPUS")
    return replace(env, scheduler="SLURM", gpu_ids=tuple(listed.split(",")) if listed else (),
                   tasks_per_node=count_var(environ, "SLURM_NTASKS_PER_NODE") if environ.get("SLURM_STEP_ID") else None)


def check_gpus(env: DistEnv, visible: int, environ: Mapping[str, str]) -> list[str]:
    """The srun layout against the GPUs this task sees: refuse one that mis-assigns GPUs; return
    warnings (said by each node's local rank 0) about an allocation that does not show."""
    warnings = []
    if env.gpus_on_node is not None and env.gpus_on_node != visible and env.local_rank == 0:
        warnings.append(f"[node {env.node_rank}] SLURM allocated {env.gpus_on_node} GPU(s) but {visible} are visible "
                        f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    if env.local_world_size != visible and visible != 1:
        raise UserError(f"{env.local_world_size} task(s) on node {env.node_rank} but {visible} GPU(s) visible: the srun "
                        f"layout needs one task per GPU", f"use --ntasks-per-node={visible} (equal to --gpus-per-node)",
                        rank=env.rank if env.local_rank == 0 else None)
    return warnings


def requeue_target(environ: Mapping[str, str]) -> str | None:
    """`ARRAYID_TASKID` for an array task: one task's SLURM_JOB_ID can equal the array's own id, and
    `scontrol requeue <array id>` would requeue every task of the array."""
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    return environ.get("SLURM_JOB_ID")


def slurm_port(job_id: str) -> int:
    """A port every task of one job derives alike, spread over jobs so that two do not collide."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 15000 + int(digits[-4:]) % 10000


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as `gpu[01-03,07],cpu5` into every host name, in order; a list
    that is not one (`n[1-,4]`, `n[3-1]`, `n[1-2`) is refused by name. Blanks separate names as
    commas do (`alpha beta`, `alpha, host[5-9]`, `1.2.3.[089, 100-110]`: Lightning parses these)."""
    text = re.sub(r"\s*,\s*", ",", nodelist.strip())  # a blank beside a comma is part of that separator
    if not re.fullmatch(_NODELIST, text) or any(
            int(lo) > int(hi) for lo, hi in re.findall(r"(\d+)-(\d+)", "".join(re.findall(r"\[[^\]]*\]", text)))):
        raise UserError(f"cannot parse the SLURM node list {nodelist!r}",
                        "check SLURM_JOB_NODELIST / SLURM_STEP_NODELIST (expected e.g. gpu[01-04,07],cpu5)")
    hosts: list[str] = []
    for item in _split_top_level(text):
        hosts.extend(_expand_one(item))
    return hosts


# A host list as SLURM writes it: names joined by commas (or blanks), each of plain parts and
# bracketed ranges (`01-03`) or numbers, no empty or open range, no bracket left open.
_RANGES = r"\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\]"
_NAME = rf"(?:[^\[\],\s]|{_RANGES})+"
_NODELIST = rf"{_NAME}(?:(?:,|\s+){_NAME})*"


def _split_top_level(text: str) -> list[str]:
    """The names of a checked host list: split at commas and blanks outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif (ch == "," or ch.isspace()) and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [part for part in parts if part]


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


def tasks_per_node(environ: Mapping[str, str], node_id: int) -> int | None:
    """The tasks on node `node_id` as the step, the job or `--ntasks-per-node` (SLURM_NTASKS_PER_NODE,
    all that some batch scripts show) says; None when none of them is set."""
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        if environ.get(key):
            return tasks_on_node(environ[key], node_id, key)
    return None


def tasks_on_node(tasks_per_node: str, node_id: int, key: str = "SLURM_TASKS_PER_NODE") -> int:
    """Parse SLURM_TASKS_PER_NODE, e.g. `2(x3),1`, and return the count for node `node_id`."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise UserError(f"cannot parse {key}={tasks_per_node!r}", "check the sbatch/srun task options")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[min(node_id, len(counts) - 1)]


# The job names of a job whose first step is an interactive shell: `srun --pty bash` names its job
# after the command; salloc names its own "interactive" (src/salloc/opt.c).
_SHELLS = frozenset({"bash", "sh", "zsh", "fish", "ksh", "tcsh", "csh", "dash", "interactive"})


def _typed_into_pty_shell(environ: Mapping[str, str]) -> bool:
    """True for a command typed into the shell that `srun --pty bash` started in task 0.

    A real step and that shell show the same task variables (rank 0 of the step's tasks), so three
    marks together tell them apart: the step has a pseudo-terminal (srun --pty exports
    SLURM_PTY_PORT), the job is named after a shell (or salloc's "interactive"), and it is the job's
    first step, the one `srun --pty` itself made. `srun --overlap python ...` typed in that shell is a
    later step (and its tasks inherit SLURM_PTY_PORT), so it stays a real step; so does `srun python`
    in a batch script, which has no pseudo-terminal.
    """
    return (bool(environ.get("SLURM_PTY_PORT")) and environ.get("SLURM_JOB_NAME") in _SHELLS
            and environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID")) == "0")


def _in_step(environ: Mapping[str, str]) -> bool:
    """True inside an srun step; the batch script itself (and salloc's shell) is not one."""
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    return step is not None and step not in ("batch", "extern", "interactive", "4294967294", "4294967290")

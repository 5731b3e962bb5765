"""IBM Spectrum LSF: ranks started by jsrun (LSF's Job Step Manager), and the facts of an LSF job around
any launcher (jsrun, mpirun, torchrun, a plain process).

What is read, and who sets it (IBM Spectrum LSF 10.1 docs, "Environment variables set for job execution",
and the jsrun(1) page of IBM Job Step Manager; Lightning's LSFEnvironment reads the same five names):

| variable | set by | read as |
|---|---|---|
| `LSB_JOBID` | LSF, in every job | the job id; the port (`10000 + id % 1000`, Lightning's choice, kept so the same job meets on the same port) |
| `LSB_JOBINDEX` | LSF, in an array element (0 otherwise) | the requeue target `ID[INDEX]`: `brequeue ID` would requeue every element |
| `LSB_DJOB_RANKFILE` | LSF: the path of the job's rank file, one host name per line (a host once per slot) | the compute hosts: its first line is the launch node, where the batch script runs and jsrun starts no task; master = the first compute host, node rank = this host's place among them |
| `JSM_NAMESPACE_RANK`, `JSM_NAMESPACE_SIZE`, `JSM_NAMESPACE_LOCAL_RANK` | jsrun, in every task | rank, world size, local rank (jsrun's mark: SIZE and LOCAL_RANK, as Lightning asks) |
| `JSM_NAMESPACE_LOCAL_SIZE` | jsrun | the tasks on this node; when unset, at least `world / nodes` and more than the local rank |

jsrun sets Open MPI's OMPI_COMM_WORLD_* too (it is Spectrum MPI's launcher): this file is tried before
mpi.py. Preemption: LSF sends SIGUSR2 at the run limit (`bsub -W`), and ahead of it with the warning
action of lsf/ddp_kit.bsub (`-wa USR2 -wt 2`); rank 0 then runs `brequeue` for this job (IBM's brequeue(1):
kills the running job and queues it again under the same id).
"""
from __future__ import annotations

import ipaddress
import re
import signal
from collections.abc import Mapping
from dataclasses import replace

from ..errors import UserError
from .base import DistEnv, int_var
from .facts import facts_of

NAME = "lsf"
SHOWN = ("LSB_JOBID", "LSB_JOBINDEX", "LSB_DJOB_RANKFILE", "LSB_DJOB_NUMPROC", "JSM_NAMESPACE_RANK",
         "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_LOCAL_SIZE")
RANKFILE = "LSB_DJOB_RANKFILE"
_TASK_VARS = ("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK")


def detect(environ: Mapping[str, str]) -> DistEnv | None:
    """This jsrun task's place, or None when jsrun did not start it (no JSM_NAMESPACE_SIZE and
    JSM_NAMESPACE_LOCAL_RANK), or when torch's RANK was set inside the task (env_vars.py reads it)."""
    if "JSM_NAMESPACE_SIZE" not in environ or "JSM_NAMESPACE_LOCAL_RANK" not in environ or "RANK" in environ:
        return None
    missing = [key for key in _TASK_VARS if not environ.get(key)]
    if missing:
        raise UserError(f"jsrun's JSM_NAMESPACE_SIZE is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                        "not", "start the tasks with jsrun, which sets them all, or unset the JSM_NAMESPACE_* variables")
    rank, world = int_var(environ, "JSM_NAMESPACE_RANK"), int_var(environ, "JSM_NAMESPACE_SIZE")
    local_rank = int_var(environ, "JSM_NAMESPACE_LOCAL_RANK")
    hosts = compute_hosts(environ)
    if not hosts and world > 1 and not environ.get("MASTER_ADDR"):
        raise UserError(f"jsrun started {world} tasks but {RANKFILE} is {'empty' if RANKFILE in environ else 'not set'}, "
                        "so the first compute host (the master) is unknown",
                        "run jsrun inside an LSF job (bsub), or pass MASTER_ADDR and MASTER_PORT to the tasks "
                        "(jsrun -E MASTER_ADDR=<first compute host> -E MASTER_PORT=29500 ...)")
    local_world, node, nodes = _layout(environ, rank, local_rank, world, hosts)
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node,
        num_nodes=nodes,
        # A user-set MASTER_ADDR/PORT wins: clusters with a separate fabric name need it.
        master_addr=environ.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1"),
        master_port=(int_var(environ, "MASTER_PORT") if environ.get("MASTER_PORT")
                     else lsf_port(environ) if world > 1 or environ.get("LSB_JOBID") else None),
        launcher=NAME,
        job_id=environ.get("LSB_JOBID") or None,
        hosts=hosts,
        scheduler_binds_gpus=True,  # a resource set (jsrun -g 1) shows each task its own GPU
    )


def around(env: DistEnv, environ: Mapping[str, str]) -> DistEnv:
    """`env` plus what the LSF job around this process says (unchanged outside an LSF job)."""
    job_id = environ.get("LSB_JOBID")
    if not job_id:
        return env
    index = environ.get("LSB_JOBINDEX", "")
    target = f"{job_id}[{index}]" if index not in ("", "0") else job_id
    return replace(env, scheduler="LSF", job_id=env.job_id or job_id, batch_job_id=job_id, requeue_id=target,
                   requeue_command=("brequeue", target), preempt_signal=signal.SIGUSR2)


def _layout(environ: Mapping[str, str], rank: int, local_rank: int, world: int,
            hosts: tuple[str, ...]) -> tuple[int, int, int]:
    """(local_world_size, node_rank, num_nodes): the node from this host's place in the rank file, else
    from the ranks below this node's (jsrun fills a node's resource sets before the next)."""
    stated = int_var(environ, "JSM_NAMESPACE_LOCAL_SIZE", 0)
    if hosts:
        node, nodes = _node_of(hosts, facts_of(environ).hostname()), len(hosts)
        local_world = stated or world // nodes
    else:
        local_world = stated or world
        node, nodes = max(0, rank - local_rank) // max(1, local_world), -(-world // max(1, local_world))
    # taken as given, not refused, when the variables disagree (Lightning's own test: rank 3 as local
    # rank 1 of a 4-task job on 4 hosts)
    return max(local_world, local_rank + 1), node, nodes


def lsf_port(environ: Mapping[str, str]) -> int:
    """The port every task of one job derives alike from LSB_JOBID; refused without it."""
    digits = re.sub(r"\D", "", environ.get("LSB_JOBID", ""))
    if not digits:
        raise UserError("jsrun started this task but LSB_JOBID is not set, so no port can be derived for the job",
                        "run jsrun inside an LSF job (bsub), or pass MASTER_PORT to the tasks (jsrun -E MASTER_PORT=29500)")
    return 10000 + int(digits) % 1000


def compute_hosts(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The distinct compute hosts of the job's rank file, in its order: every line but the first (the
    launch node), or the one host a one-line file names. Unreadable: refused in one line."""
    path = environ.get(RANKFILE, "")
    if not path:
        return ()
    try:
        lines = [line.strip() for line in facts_of(environ).read_file(path).splitlines() if line.strip()]
    except OSError as exc:
        raise UserError(f"cannot read {RANKFILE}={path}: {exc.strerror or exc}",
                        "the rank file is LSF's own: run the tasks with jsrun inside the job, on its hosts") from None
    return tuple(dict.fromkeys(lines[1:] if len(lines) > 1 else lines))


def _node_of(hosts: tuple[str, ...], me: str) -> int:
    """This host's place among the compute hosts; a short name matches its full name (n1 = n1.cluster)."""
    for i, host in enumerate(hosts):
        if _same_host(host, me):
            return i
    raise UserError(f"this host ({me}) is not among the compute hosts of {RANKFILE} ({', '.join(hosts[:4])}"
                    f"{', ...' if len(hosts) > 4 else ''}; its first line, the launch node, runs no task)",
                    "start the tasks with jsrun from the job's batch script")


def _same_host(a: str, b: str) -> bool:
    if a == b:
        return True
    if _is_address(a) or _is_address(b):
        return False  # 10.0.0.1 is not 10.0.0.2 however the dots split them
    return a.split(".")[0] == b.split(".")[0]


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True

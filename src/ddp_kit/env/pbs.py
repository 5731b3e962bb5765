"""PBS (PBS Professional, OpenPBS, Torque): the facts of a PBS job around whatever started the ranks.

PBS starts one process, the batch script; the ranks come from a launcher run inside the job: mpirun
(mpi.py; an Open MPI built with PBS's TM interface starts its ranks on the hosts of $PBS_NODEFILE) or
torchrun (torchrun.py), e.g. one per node under mpirun as pbs/ddp_kit.qsub does. PBS's own `pbsdsh`
is no launcher here: the PBS_TASKNUM, PBS_NODENUM and PBS_VNODENUM it sets in a task are set in the
batch script itself too (task 1 on node 0), so a pbsdsh task on the first node cannot be told from a
plain `python` typed in the script.

| variable | set by | read as |
|---|---|---|
| `PBS_JOBID` | every PBS, in every job (a subjob's own id, `123[4].server`) | the job id; `qrerun` target |
| `PBS_NODEFILE` | every PBS: the path of a file naming the job's hosts, one line per slot (Torque: per core; PBS Pro: per MPI process of a chunk) | the hosts, distinct, in order (read only where it exists: on the first host, and on others where PBS copies it) |
| `NCPUS` (PBS Pro), `PBS_NUM_PPN` (Torque) | PBS, per host | CPUs allocated on this node |
| `PBS_NUM_NODES` (Torque), `PBS_NP` | Torque | shown by the doctor |

Preemption and requeue: PBS sends SIGTERM at the walltime and on `qdel`, then SIGKILL after the
queue's kill_delay; a preempted job that is rerunnable (`qsub -r y`) is requeued by the server
itself. No signal comes ahead of the walltime: pbs/ddp_kit.qsub sends SIGUSR2 to its launcher 120 s
before it, and on SIGUSR2 rank 0 runs `qrerun $PBS_JOBID`, which PBS Pro, OpenPBS and Torque allow
only with Manager or Operator privilege (their qrerun(1B) and the server's rerun request): without
it the job still checkpoints and exits 75, and the same script submitted again resumes. SIGTERM
checkpoints and exits without a requeue where the ranks are given the time (torchrun's agents pass it
on; Open MPI's mpirun kills its ranks a second after passing it on, hence the warning ahead).
"""
from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import replace

from .base import DistEnv, count_var
from .facts import facts_of

NAME = "pbs"
SHOWN = ("PBS_JOBID", "PBS_NODEFILE", "PBS_NUM_NODES", "PBS_NUM_PPN", "PBS_NP", "NCPUS")


def around(env: DistEnv, environ: Mapping[str, str]) -> DistEnv:
    """`env` plus what the PBS job around this process says (unchanged outside a PBS job)."""
    job_id = environ.get("PBS_JOBID")
    if not job_id:
        return env
    return replace(env, scheduler="PBS", job_id=env.job_id or job_id, batch_job_id=job_id, requeue_id=job_id,
                   requeue_command=("qrerun", job_id), preempt_signal=signal.SIGUSR2,
                   hosts=env.hosts or job_hosts(environ),
                   cpus_on_node=count_var(environ, "NCPUS") or count_var(environ, "PBS_NUM_PPN") or env.cpus_on_node)


def job_hosts(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The job's hosts from $PBS_NODEFILE, each once, in its order; () where the file is not readable
    (a host other than the first, where PBS does not copy it)."""
    path = environ.get("PBS_NODEFILE", "")
    if not path:
        return ()
    try:
        text = facts_of(environ).read_file(path)
    except OSError:
        return ()
    return tuple(dict.fromkeys(line.strip() for line in text.splitlines() if line.strip()))

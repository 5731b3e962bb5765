"""Launcher detection: who started this process, and what is its place in the job.

`detect()` is a pure function over a mapping (default `os.environ`): it asks each launcher of
`LAUNCHERS` in turn, takes the first that recognises the process, checks the numbers, and adds the
facts of the scheduler allocation around it. It never writes the environment and does not import
torch, so the doctor and the launch helpers can use it cheaply.

One file per launcher, each with `NAME` and a pure `detect(environ) -> DistEnv | None` (None: not
this launcher), and optionally `check_gpus(env, visible, environ)` for its own GPU layout rules and
`SHOWN`, the variables of its own that the doctor's summary shows. `environ` is a `Facts` (facts.py):
the environment as a Mapping, plus this host's name and the files a scheduler names, read only when
a launcher asks (`facts_of(environ).read_file(...)`); a plain dict still works for every launcher
that reads only variables.
A new launcher is a new file plus one line in `LAUNCHERS`; nothing outside this package compares
`DistEnv.launcher` or `DistEnv.engine` to a name: the rest asks DistEnv's neutral facts. An engine's
file (a Kubernetes operator, Ray Train) is a launcher when the engine itself gave the ranks, and an
`around` in SCHEDULERS that names the engine when torchrun ran inside it. docs/engines.md tabulates
what each engine sets and what is derived from it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from . import (
    env_vars,
    grace,
    kubeflow_trainer,
    lsf,
    mpi,
    pbs,
    pod,
    pytorchjob,
    ray_train,
    replicas,
    single,
    slurm,
    torchrun,
    volcano,
)
from .base import DistEnv, check_place
from .facts import Facts, facts_of
from .polling import STORE_OPS_PER_S, poll_period
from .slurm import expand_nodelist, requeue_target, slurm_port

# Tried in this order; the first that recognises the process wins.
# - Ray Train first: its workers carry torch's RANK and LOCAL_RANK as a torchrun worker does, and
#   only Ray's own marks (RAY_RAYLET_PID, NODE_RANK, no TORCHELASTIC_RUN_ID) tell them apart.
# - torchrun before everything else: it can run inside a SLURM job (one srun task per node, or the
#   batch script) and inside an operator's pod, and then its variables describe the workers while
#   the scheduler's or the operator's describe the one process that started torchrun.
# - jsrun (LSF) and the MPI launchers next: they start every rank themselves, also inside an operator's
#   pod or a SLURM allocation (whose srun then started mpirun's daemons, not the ranks); jsrun sets Open
#   MPI's variables too, so lsf before mpi. Both step aside where torch's RANK was set inside the task.
# - The operators (Trainer v2, Volcano, PyTorchJob) before the hand-set env:// variables: they set
#   exactly those variables, but one process per pod, which the env:// reading would put on one node.
#   Volcano before PyTorchJob: its pytorch plugin sets PyTorchJob's four variables in a pod too.
# - Hand-set env:// variables before SLURM, for torchrun's reason (a script, or submitit, may start
#   or describe its ranks inside an allocation).
# - `single` last: it always answers.
LAUNCHERS = (ray_train, torchrun, lsf, mpi, kubeflow_trainer, volcano, pytorchjob, env_vars, slurm, single)

# What may surround any launcher, each adding its facts (`around`): the SLURM allocation, the LSF and
# PBS jobs (after SLURM, whose step clears the requeue outside its own jobs), the Kubernetes operator
# that made the pod (the named operators before the plain pod, which names only what none of them
# named), the grace period the templates state, and the replica group of a fault-tolerant launch.
SCHEDULERS = (slurm, lsf, pbs, kubeflow_trainer, volcano, pytorchjob, pod, grace, replicas)

_BY_NAME = {launcher.NAME: launcher for launcher in LAUNCHERS}

__all__ = ["DistEnv", "Facts", "LAUNCHERS", "STORE_OPS_PER_S", "allocation", "check_gpus", "detect", "expand_nodelist",
           "facts_of", "poll_period", "requeue_target", "shown_variables", "slurm_port"]


def detect(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Return this process's DistEnv from `environ` (default os.environ; a `Facts` to give the host
    name and the scheduler's files as well, e.g. fakes in a test)."""
    facts = facts_of(environ)
    env = next(found for found in (launcher.detect(facts) for launcher in LAUNCHERS) if found is not None)
    check_place(env)
    return _around(env, facts)


def allocation(environ: Mapping[str, str] | None = None) -> DistEnv:
    """What the schedulers around this process say (job, GPUs and tasks on the node, requeue, ...)
    over a plain process's place: for the doctor, which reports the allocation also when detect()
    refuses the launcher's variables."""
    return _around(DistEnv(), facts_of(environ))


def _around(env: DistEnv, facts: Facts) -> DistEnv:
    for scheduler in SCHEDULERS:
        env = scheduler.around(env, facts)
    return env


def shown_variables() -> tuple[str, ...]:
    """The launchers' and schedulers' own variables worth showing in a report (each file's SHOWN)."""
    return tuple(dict.fromkeys(key for module in (*LAUNCHERS, *SCHEDULERS) for key in getattr(module, "SHOWN", ())))


def check_gpus(env: DistEnv, visible: int, environ: Mapping[str, str] | None = None) -> list[str]:
    """The launcher's own rules for its tasks and the `visible` GPUs: raises UserError for a layout
    that would mis-assign GPUs; returns warnings to print (none for a launcher without rules)."""
    rules = getattr(_BY_NAME.get(env.launcher), "check_gpus", None)
    return rules(env, visible, os.environ if environ is None else environ) if rules else []

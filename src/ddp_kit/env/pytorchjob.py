"""PyTorchJob (Kubeflow training-operator v1): one pod per replica (Master 0, Worker 0..n-1).

What the operator sets, from kubeflow/training-operator pkg/controller.v1/pytorch/envvar.go
(setPodEnv) and master.go: MASTER_ADDR=`<job>-master-0` (the Master's Service), MASTER_PORT (the
container port named pytorchjob-port, 23456 by default), RANK = the pod's index (Master 0, Worker i
is i + 1), WORLD_SIZE = replicas x nprocPerNode, and for torchrun PET_NPROC_PER_NODE, PET_NODE_RANK
(= RANK) and PET_NNODES (replicas; a range like 1:4 and PET_RDZV_* with an elasticPolicy), and
PET_MASTER_ADDR and PET_MASTER_PORT (= MASTER_*) as well: all from v1.7, which added nprocPerNode
(training-operator #1840). Operators before nprocPerNode (v1.6 and older) set only MASTER_ADDR,
MASTER_PORT, WORLD_SIZE and RANK.

Marks: PET_NODE_RANK or PET_NNODES in a pod that is not Trainer v2's (kubeflow_trainer.mine), or,
for the older operators, a pod (pod.in_pod) with RANK and WORLD_SIZE but no LOCAL_RANK. Three layouts:
  (a) one process per pod: local rank 0 of 1, node rank = RANK, nodes = WORLD_SIZE (the env://
      reading would take local rank = RANK and look for GPU RANK in a one-GPU pod);
  (b) torchrun in each pod: torchrun's own variables win (torchrun.py); `around` names the engine;
  (c) PET_NPROC_PER_NODE > 1 without torchrun: RANK counts pods but WORLD_SIZE processes, so the
      ranks would collide: refused, saying to run under torchrun. So is an elastic job without it.
Volcano's pytorch plugin sets the same four variables in a pod; volcano.py is tried first.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ..errors import UserError
from . import kubeflow_trainer
from .base import DistEnv, int_var
from .pod import ENGINE as POD_ENGINE
from .pod import in_pod, one_process_per_pod, procs_per_pod, refuse_without_torchrun

NAME = "pytorchjob"
ENGINE = "PyTorchJob"


def _marked(environ: Mapping[str, str]) -> bool:
    return ("PET_NODE_RANK" in environ or "PET_NNODES" in environ) and not kubeflow_trainer.mine(environ)


def detect(environ: Mapping[str, str]) -> DistEnv | None:
    """This pod's place when its command runs without torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" in environ or "LOCAL_RANK" in environ:
        return None
    marked = _marked(environ)
    if not marked and not (in_pod(environ) and "RANK" in environ and "WORLD_SIZE" in environ):
        return None
    if marked and (":" in environ.get("PET_NNODES", "") or "PET_RDZV_ENDPOINT" in environ):
        raise UserError(f"this PyTorchJob is elastic (PET_NNODES={environ.get('PET_NNODES')}) but the process was not "
                        "started by torchrun, which runs its rendezvous",
                        "start the command under torchrun: `torchrun train.py ...` (it reads the PET_* variables)")
    if "RANK" not in environ:
        raise UserError("this PyTorchJob sets no RANK (the operator sets RANK and WORLD_SIZE only when the job has a "
                        "Master replica) and the process was not started by torchrun",
                        "add a Master replica to the PyTorchJob, or start the command under torchrun")
    nproc = procs_per_pod(environ)
    if isinstance(nproc, int) and nproc > 1:
        refuse_without_torchrun(ENGINE, nproc)
    # auto/gpu/cpu: the operator counts one process per pod in WORLD_SIZE, which is what runs here.
    master = environ.get("MASTER_ADDR")
    named = marked or (master or "").endswith("-master-0")
    return one_process_per_pod(int_var(environ, "RANK"), int_var(environ, "WORLD_SIZE"), master,
                               int_var(environ, "MASTER_PORT", 23456), NAME, ENGINE if named else POD_ENGINE)


def around(env: DistEnv, environ: Mapping[str, str]) -> DistEnv:
    """Name the engine whatever started the ranks (torchrun in the pod, in layout b)."""
    return replace(env, engine=env.engine or ENGINE, restarted_by_engine=True) if _marked(environ) else env

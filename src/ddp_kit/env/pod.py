"""What every Kubernetes pod shows, and the one-process-per-pod layout the operators share. Not a
launcher: the operators' files (kubeflow_trainer, pytorchjob, volcano) use it.

The kubelet puts the API server's Service into every container of every pod as KUBERNETES_SERVICE_HOST,
KUBERNETES_PORT, ... (pkg/kubelet/envvars), whatever created the pod: either tells a pod apart from a
host (Lightning's KubeflowEnvironment asks KUBERNETES_PORT). `around` names a pod that no
operator's file names ("Kubernetes") and marks it as restarted by the engine: in a pod nothing but
Kubernetes (its restart policy, the Job's podFailurePolicy, an operator) restarts the process.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ..errors import UserError
from .base import DistEnv

NAME = "kubernetes"
ENGINE = "Kubernetes"


def in_pod(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("KUBERNETES_SERVICE_HOST") or environ.get("KUBERNETES_PORT"))


def around(env: DistEnv, environ: Mapping[str, str]) -> DistEnv:
    """`env` as a pod's process: restarted by Kubernetes, named after it when no operator was."""
    if not in_pod(environ):
        return env
    return replace(env, engine=env.engine or ENGINE, restarted_by_engine=True)


def one_process_per_pod(rank: int, world: int, master_addr: str | None, master_port: int, launcher: str,
                        engine: str) -> DistEnv:
    """The pod is the node and its one process the rank: local rank 0 of 1, node = rank."""
    return DistEnv(rank=rank, local_rank=0, world_size=world, local_world_size=1, node_rank=rank, num_nodes=world,
                   master_addr=master_addr, master_port=master_port, launcher=launcher, engine=engine,
                   restarted_by_engine=True)


def procs_per_pod(environ: Mapping[str, str]) -> int | str:
    """PET_NPROC_PER_NODE as a number, or as the operator wrote it ("auto", "gpu", "cpu": counted by
    torchrun on the node); 1 when unset."""
    raw = environ.get("PET_NPROC_PER_NODE") or "1"
    return int(raw) if raw.isdigit() else raw


def refuse_without_torchrun(engine: str, nproc: int | str) -> None:
    """Several processes per pod were asked for but this one was not started by torchrun: the
    operator's RANK counts pods while WORLD_SIZE counts processes, so the ranks would collide."""
    raise UserError(f"{engine} asks for {nproc} processes per pod (PET_NPROC_PER_NODE={nproc}) but this process was "
                    "not started by torchrun, so its rank and world size would not match",
                    "start the command under torchrun: `torchrun --nproc_per_node=$PET_NPROC_PER_NODE train.py ...` "
                    "(it reads the other PET_* variables itself)")

"""Kubeflow Trainer v2 (TrainJob on a JobSet): one pod per node, the command normally under torchrun.

What the operator sets, from kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go
(EnforceMLPolicy): PET_NNODES (numNodes), PET_NPROC_PER_NODE (a number or auto/cpu/gpu),
PET_NODE_RANK (the Indexed Job's completion index, through the downward API), PET_MASTER_ADDR
(`<trainjob>-node-0-0.<trainjob>`, the JobSet's headless Service) and PET_MASTER_PORT (29500).
The mark is PET_MASTER_ADDR in JobSet's pod naming (`<jobset>-<replicatedJob>-<job>-<pod>.<subdomain>`)
or JOB_COMPLETION_INDEX (the Job controller's, in every Indexed Job pod): PyTorchJob v1 sets the same
PET_* names (PET_MASTER_ADDR too, since v1.7), but its master is `<job>-master-0` and its pods are no Job's.

Under torchrun (the usual case) the torchrun file reads the workers' variables and `around` only
names the engine. Without torchrun, one process per pod (PET_NPROC_PER_NODE=1) is read here: rank =
node rank = PET_NODE_RANK, world = PET_NNODES; more than one per pod is refused (say torchrun).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace

from .base import DistEnv, int_var
from .pod import one_process_per_pod, procs_per_pod, refuse_without_torchrun

NAME = "trainer"
ENGINE = "Kubeflow Trainer v2"


_JOBSET_HOST = re.compile(r".+-\d+-\d+\..+")


def mine(environ: Mapping[str, str]) -> bool:
    """True in a Trainer v2 pod (also under torchrun, whose MASTER_ADDR then sits beside the PET_*)."""
    addr = environ.get("PET_MASTER_ADDR", "")
    return bool(addr) and "PET_NNODES" in environ and bool(_JOBSET_HOST.fullmatch(addr) or "JOB_COMPLETION_INDEX" in environ)


def detect(environ: Mapping[str, str]) -> DistEnv | None:
    """This pod's place when the trainer command runs without torchrun, else None."""
    if not mine(environ) or "TORCHELASTIC_RUN_ID" in environ:
        return None
    nproc = procs_per_pod(environ)
    if nproc != 1:
        refuse_without_torchrun(ENGINE, nproc)
    return one_process_per_pod(int_var(environ, "PET_NODE_RANK"), int_var(environ, "PET_NNODES"),
                               environ["PET_MASTER_ADDR"], int_var(environ, "PET_MASTER_PORT", 29500), NAME, ENGINE)


def around(env: DistEnv, environ: Mapping[str, str]) -> DistEnv:
    """Name the engine whatever started the ranks (torchrun in the pod, usually)."""
    return replace(env, engine=ENGINE, restarted_by_engine=True) if mine(environ) else env

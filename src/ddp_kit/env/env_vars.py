"""env:// variables set by something other than torchrun: a user's own script that starts the ranks
itself (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or a tool that exports torch's variables into
the tasks it was given, e.g. submitit inside an srun step (RANK, LOCAL_RANK, WORLD_SIZE, ...).

Nobody met the peers before us here: rank 0 hosts the store at MASTER_ADDR:MASTER_PORT.
"""
from __future__ import annotations

from collections.abc import Mapping

from .base import DistEnv, int_var, node_layout
from .slurm import tasks_per_node

NAME = "env"


def detect(environ: Mapping[str, str]) -> DistEnv | None:
    """This process's place from RANK with WORLD_SIZE (or LOCAL_RANK: then a missing WORLD_SIZE is
    refused), or None when RANK is not set."""
    if "RANK" not in environ or ("WORLD_SIZE" not in environ and "LOCAL_RANK" not in environ):
        return None
    rank = int_var(environ, "RANK")
    world = int_var(environ, "WORLD_SIZE")
    task = _srun_task(environ, rank)
    if "LOCAL_RANK" in environ or task:
        local_rank = int_var(environ, "LOCAL_RANK", task[0] if task else 0)
        local_world, node, nodes = node_layout(environ, rank, local_rank, world, *(task[1:] if task else ()))
    else:  # by hand, no local variables: every rank on this one node
        local_world = int_var(environ, "LOCAL_WORLD_SIZE", world)
        local_rank, node = rank % max(1, local_world), rank // max(1, local_world)
        nodes = max(1, world // max(1, local_world))
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node,
        num_nodes=nodes,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int_var(environ, "MASTER_PORT", 29500),
        launcher=NAME,
        # The ranks are srun's tasks (submitit): srun --gpu-bind may show each its own GPU.
        scheduler_binds_gpus=task is not None,
    )


def _srun_task(environ: Mapping[str, str], rank: int) -> tuple[int, int, int | None] | None:
    """(local id, node id, tasks on the node) when the ranks are the tasks of an srun step (as
    submitit exports them: RANK equals SLURM_PROCID), else None. submitit sets no GROUP_RANK, so the
    node comes from SLURM_NODEID; GROUP_RANK, where set, still wins."""
    if environ.get("SLURM_PROCID") != str(rank) or not environ.get("SLURM_NODEID", "").isdigit():
        return None
    node = int(environ["SLURM_NODEID"])
    return int_var(environ, "SLURM_LOCALID", 0), node, tasks_per_node(environ, node)

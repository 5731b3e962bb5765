"""torchrun (torch.distributed.run, torchelastic): its agent starts the workers of a node and sets
RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, ... and TORCHELASTIC_RUN_ID in each worker's environment.

TORCHELASTIC_RUN_ID is the mark: every torchrun since torch 1.9 sets it (to "none" without
--rdzv_id). The same torch variables without it come from another tool (submitit, Ray Train, an
operator, a user's script), whose launcher met no peers before us: env_vars.py or an engine's file
reads them.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..errors import UserError
from .base import DistEnv, int_var, node_layout

NAME = "torchrun"
_WORKER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")  # what torchrun sets in every worker it starts


def detect(environ: Mapping[str, str]) -> DistEnv | None:
    """This worker's place, or None when torchrun did not start it."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    missing = [key for key in _WORKER_VARS if not environ.get(key)]
    if missing:  # torch's own test (is_torchelastic_launched) asks TORCHELASTIC_RUN_ID alone
        raise UserError(f"TORCHELASTIC_RUN_ID (torchrun's mark) is set but {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} not",
                        "start the script with torchrun, which sets them all, or unset TORCHELASTIC_RUN_ID")
    rank, local_rank, world = int_var(environ, "RANK"), int_var(environ, "LOCAL_RANK"), int_var(environ, "WORLD_SIZE")
    local_world, node, nodes = node_layout(environ, rank, local_rank, world)
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node,
        num_nodes=nodes,
        master_addr=environ.get("MASTER_ADDR"),
        master_port=int_var(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else None,
        launcher=NAME,
        job_id=environ.get("TORCHELASTIC_RUN_ID") or None,  # inside a batch job, the scheduler's id fills in (env/__init__)
        restart_count=int_var(environ, "TORCHELASTIC_RESTART_COUNT", 0),
        # The agent shares its own rendezvous TCPStore with the workers when it says so.
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        sets_omp_threads=True,  # with several workers per node, when the user set no OMP_NUM_THREADS
        rendezvous_by_launcher=True,  # the agents met at MASTER_ADDR:MASTER_PORT before starting us
    )

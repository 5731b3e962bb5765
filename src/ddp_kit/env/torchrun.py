"""torchrun (torch.distributed.run, torchelastic): its agent starts the workers of a node and sets
RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, ... in each worker's environment."""
from __future__ import annotations

from collections.abc import Mapping

from .base import DistEnv, int_var

NAME = "torchrun"


def detect(environ: Mapping[str, str]) -> DistEnv | None:
    """This worker's place, or None when torchrun did not start it."""
    if "TORCHELASTIC_RUN_ID" not in environ and not ("RANK" in environ and "LOCAL_RANK" in environ):
        return None
    world = int_var(environ, "WORLD_SIZE")
    local_world = int_var(environ, "LOCAL_WORLD_SIZE", 1)
    return DistEnv(
        rank=int_var(environ, "RANK"),
        local_rank=int_var(environ, "LOCAL_RANK"),
        world_size=world,
        local_world_size=local_world,
        node_rank=int_var(environ, "GROUP_RANK", 0),
        num_nodes=int_var(environ, "GROUP_WORLD_SIZE", max(1, world // max(1, local_world))),
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

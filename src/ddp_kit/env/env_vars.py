"""Hand-set env:// variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), e.g. by a user's own script
that starts the ranks itself."""
from __future__ import annotations

from collections.abc import Mapping

from .base import DistEnv, int_var

NAME = "env"


def detect(environ: Mapping[str, str]) -> DistEnv | None:
    """This process's place from RANK and WORLD_SIZE, or None when they are not both set."""
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    rank = int_var(environ, "RANK")
    world = int_var(environ, "WORLD_SIZE")
    local_world = int_var(environ, "LOCAL_WORLD_SIZE", world)
    return DistEnv(
        rank=rank,
        local_rank=int_var(environ, "LOCAL_RANK", rank % max(1, local_world)),
        world_size=world,
        local_world_size=local_world,
        node_rank=rank // max(1, local_world),
        num_nodes=max(1, world // max(1, local_world)),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int_var(environ, "MASTER_PORT", 29500),
        launcher=NAME,
    )

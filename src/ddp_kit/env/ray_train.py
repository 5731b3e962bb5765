"""Ray Train (TorchTrainer): Ray's workers run the training function; Ray created the process group.

What Ray sets, from ray-project/ray python/ray/train/torch/config.py (_TorchBackend.on_start and
_set_torch_distributed_env_vars): MASTER_ADDR and MASTER_PORT (rank 0 worker's address and a free
port, for the default init_method "env"), then RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and
NODE_RANK, and it calls init_process_group itself before the user's function runs (ddp_kit adopts
that group, adopt.py). The mark that tells it from torchrun: the raylet starts every worker process
with RAY_RAYLET_PID (and RAY_JOB_ID) in its environment (src/ray/raylet/worker_pool.cc,
kEnvVarKeyRayletPid), torchrun's TORCHELASTIC_RUN_ID is absent, and torchrun never sets NODE_RANK.
torchrun started inside a Ray task is torchrun's (TORCHELASTIC_RUN_ID).

GPUs: Ray gives each worker its GPUs through CUDA_VISIBLE_DEVICES. By default the torch backend
shares a node's workers' GPUs with all of them (share_cuda_visible_devices), its workers sorted by
GPU id so that local rank i holds the i-th; without sharing, a worker sees only its own, which it
owns: `scheduler_binds_gpus` says so. Restarts are Ray's (FailureConfig): `restarted_by_engine`.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..errors import UserError
from .base import DistEnv, int_var

NAME = "ray"
ENGINE = "Ray Train"


def detect(environ: Mapping[str, str]) -> DistEnv | None:
    """This worker's place, or None outside a Ray Train worker."""
    if "RAY_RAYLET_PID" not in environ or "NODE_RANK" not in environ or "TORCHELASTIC_RUN_ID" in environ:
        return None
    rank, world = int_var(environ, "RANK"), int_var(environ, "WORLD_SIZE")
    local_world, node = int_var(environ, "LOCAL_WORLD_SIZE"), int_var(environ, "NODE_RANK")
    if world > 1 and not environ.get("MASTER_ADDR"):
        raise UserError(f"Ray Train gave world size {world} but no MASTER_ADDR (TorchConfig init_method 'tcp'?)",
                        "use Ray's default TorchConfig(init_method=\"env\"), which sets MASTER_ADDR and MASTER_PORT")
    return DistEnv(
        rank=rank,
        local_rank=int_var(environ, "LOCAL_RANK"),
        world_size=world,
        local_world_size=local_world,
        node_rank=node,
        num_nodes=max(node + 1, -(-world // max(1, local_world))),  # Ray does not say; nodes may differ in size
        master_addr=environ.get("MASTER_ADDR"),
        master_port=int_var(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else None,
        launcher=NAME,
        engine=ENGINE,
        job_id=environ.get("RAY_JOB_ID") or None,  # the driver's job: a restarted worker keeps it
        scheduler_binds_gpus=True,
        rendezvous_by_launcher=True,  # Ray's workers met at MASTER_ADDR:MASTER_PORT before our code runs
        restarted_by_engine=True,
        device_hint=environ.get("ACCELERATE_TORCH_DEVICE") or None,  # set with the ranks (config.py)
    )


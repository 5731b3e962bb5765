"""The CPU-checkable decisions of the GPU path (issue 13): backend for a shared GPU, loader workers per rank,
kernel switches, checkpoint RNG state. The GPU-only code itself is in test_cuda.py."""
import sys

import pytest
import torch

from conftest import ok, read_json, run_cmd
from ddp_kit.checkpoint import rng_state, set_rng_state
from ddp_kit.staging import snapshot
from ddp_kit.dist import choose_backend
from ddp_kit.env import DistEnv
from ddp_kit.errors import UserError
from ddp_kit.resources import loader_workers


def test_a_shared_gpu_gets_gloo_and_nccl_is_refused_in_one_line():
    gpu = torch.device("cuda", 0)  # only a device object: nothing runs on it
    assert choose_backend(gpu, "auto") == "nccl"
    assert choose_backend(gpu, "auto", shared_gpu=True) == "gloo"
    with pytest.raises(UserError, match="NCCL refuses"):
        choose_backend(gpu, "nccl", shared_gpu=True)


def test_loader_workers_from_the_cpus_per_rank():
    assert loader_workers(DistEnv(local_world_size=8), torch.device("cpu"), cpus_visible=64) == 0
    assert loader_workers(DistEnv(local_world_size=8), torch.device("cuda", 0), cpus_visible=64) == 7
    assert loader_workers(DistEnv(local_world_size=2), torch.device("cuda", 0), cpus_visible=64) == 8  # capped
    assert loader_workers(DistEnv(local_world_size=4, cpus_on_node=8), torch.device("cuda", 0), cpus_visible=64) == 1
    assert loader_workers(DistEnv(local_world_size=4), torch.device("cuda", 0), cpus_visible=2) == 0


def test_cpu_snapshot_and_rng_state_round_trip():
    state = {"w": torch.randn(3, 2), "nested": [torch.arange(4), {"x": torch.ones(())}], "n": 3}
    copy, host = snapshot(state)
    assert host is None  # no GPU tensors: no page-locked buffer
    assert torch.equal(copy["w"], state["w"]) and copy["w"].data_ptr() != state["w"].data_ptr()
    assert copy["n"] == 3 and torch.equal(copy["nested"][0], state["nested"][0])
    saved = rng_state()
    a = torch.rand(3)
    set_rng_state(saved)
    assert torch.equal(torch.rand(3), a) and "cuda_own" not in saved


def test_deterministic_run_trains_the_same_weights(tmp_path):
    """--deterministic true turns on torch's deterministic algorithms (and cuDNN's on a GPU); on CPU the
    default kernels are deterministic already, so the weights must not change."""
    shas = []
    for flag in ("false", "true"):
        ok(run_cmd([sys.executable, "-m", "ddp_kit.train", "--epochs", "1", "--progress", "false", "--deterministic", flag,
                    "--run_dir", str(tmp_path / flag)]))
        shas.append(read_json(tmp_path / flag / "summary.json")["param_sha256"])
    assert shas[0] == shas[1]

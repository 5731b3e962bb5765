"""GPU-only paths (NCCL, bf16 on CUDA, the OOM report). Skipped without CUDA; they run on a GPU machine."""
import os
import sys

import pytest
import torch

from conftest import ok, read_json, run_cmd, torchrun

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def gpus(n=None):
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
    return {"CUDA_VISIBLE_DEVICES": visible if n is None else ",".join(visible.split(",")[:n])}


def test_one_gpu_bf16(tmp_path):
    ok(run_cmd([sys.executable, "-m", "ddp_kit.train", "--epochs", "3", "--amp", "bf16", "--device", "cuda",
                "--progress", "false", "--run_dir", str(tmp_path)], env=gpus(1)))
    s = read_json(tmp_path / "summary.json")
    assert s["device"] == "cuda:0" and s["backend"] == "nccl" and s["eval_accuracy"] > 0.9


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_nccl(tmp_path):
    ok(torchrun(["-m", "ddp_kit.train", "--epochs", "3", "--progress", "false", "--run_dir", str(tmp_path)], nproc=2,
                env=gpus(2)))
    s = read_json(tmp_path / "summary.json")
    assert s["backend"] == "nccl" and s["world_size"] == 2 and s["eval_samples"] == 360


def test_oom_prints_memory_report_and_advice(tmp_path):
    res = run_cmd([sys.executable, "-m", "ddp_kit.train", "--model", "resnet18", "--dataset", "synthetic",
                   "--synthetic_size", "4096", "--batch_size", "4096", "--epochs", "1", "--device", "cuda",
                   "--progress", "false", "--run_dir", str(tmp_path)], env=gpus(1))
    if res.returncode == 0:
        pytest.skip("this GPU fits the batch; no OOM to report")
    assert "out of GPU memory" in res.stderr and "--grad_accum" in res.stderr

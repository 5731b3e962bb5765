"""The CPU-checkable decisions of the GPU path (issue 13): backend for a shared GPU, loader workers per rank,
kernel switches, checkpoint RNG state, the optimizer's fused choice over FSDP shards, emulated bf16, the OOM
report's memory cap. The GPU-only code itself is in test_cuda.py."""
import sys

import pytest
import torch

from conftest import ok, read_json, run_cmd
from ddp_kit.checkpoint.checkpointer import rng_state, set_rng_state
from ddp_kit.checkpoint.staging import snapshot
from ddp_kit.dist import choose_backend
from ddp_kit.dist.resources import loader_workers
from ddp_kit.env import DistEnv
from ddp_kit.errors import UserError


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


@pytest.mark.integration
def test_deterministic_run_trains_the_same_weights(tmp_path):
    """--deterministic true turns on torch's deterministic algorithms (and cuDNN's on a GPU); on CPU the
    default kernels are deterministic already, so the weights must not change."""
    shas = []
    for flag in ("false", "true"):
        ok(run_cmd([sys.executable, "-m", "ddp_kit.train", "--epochs", "1", "--progress", "false", "--deterministic", flag,
                    "--run_dir", str(tmp_path / flag)]))
        shas.append(read_json(tmp_path / flag / "summary.json")["param_sha256"])
    assert shas[0] == shas[1]


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_the_jobs_optimizer_steps_over_fsdp_shards_as_on_cuda(one_rank_group, name):
    """The optimizer the job builds for a CUDA run, over FSDP's DTensors: they are CPU DTensors here
    (the only stand-in for the GPU is device_type="cuda"), and DTensor dispatches the same ops, so
    SGD(fused=True), whose aten._fused_sgd_ has no sharding rule, fails here as it does on CUDA."""
    from torch import nn

    from ddp_kit.parallel.fsdp import shard
    from ddp_kit.train.job import build_optimizer

    model = shard(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.device("cpu"), 1)
    params = list(model.parameters())
    opt = build_optimizer(name, params, "cuda", lr=0.1, momentum=0.9, weight_decay=0.01)
    before = [p.detach().full_tensor().clone() for p in params]
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert all(not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, params))
    assert opt.defaults.get("fused") is (True if name == "adamw" else None)


def test_fused_only_where_it_works():
    from ddp_kit.train.job import optimizer_options

    assert optimizer_options("adamw", "cuda", sharded=True) == {"fused": True}  # DTensor has _fused_adamw_
    assert optimizer_options("adamw", "cuda", sharded=False) == {"fused": True}
    assert optimizer_options("sgd", "cuda", sharded=False) == {"fused": True}  # DDP: plain tensors
    assert optimizer_options("sgd", "cuda", sharded=True) == {}  # torch's default: foreach on CUDA
    assert optimizer_options("sgd", "cpu", sharded=False) == optimizer_options("adamw", "cpu", sharded=True) == {}


@pytest.mark.parametrize("capability,native", [((7, 5), False), ((7, 0), None)])  # None: torch without the keyword
def test_emulated_bf16_is_a_warning_naming_the_gpu_and_the_fix(capability, native):
    from ddp_kit.parallel.wrap import bf16_warning

    line = bf16_warning("Tesla T4", capability, native, supported=True)
    assert "Tesla T4" in line and f"sm_{capability[0]}{capability[1]}" in line and "emulated" in line
    assert "amp fp16" in line and "amp off" in line and "\n" not in line


def test_native_bf16_says_nothing_and_no_bf16_is_refused():
    from ddp_kit.parallel.wrap import bf16_warning

    assert bf16_warning("NVIDIA H100 80GB HBM3", (9, 0), True, supported=True) is None
    assert bf16_warning("NVIDIA A100-SXM4-40GB", (8, 0), None, supported=True) is None
    assert bf16_warning("AMD Instinct MI300X", (9, 4), True, supported=True) is None  # ROCm: native by torch's word
    with pytest.raises(UserError, match="no bf16 support"):
        bf16_warning("Tesla K80", (3, 7), False, supported=False)


@pytest.mark.parametrize("is_main", [True, False])
def test_check_amp_warns_once_on_the_main_rank(monkeypatch, capsys, is_main):
    """The GPU's facts are the test double (no GPU here): a T4, where torch accepts bf16 by emulation."""
    import ddp_kit.parallel.precision as wrap

    monkeypatch.setattr(wrap, "_bf16_facts", lambda device: ("Tesla T4", (7, 5), False, True))
    wrap.check_amp("bf16", torch.device("cuda", 0), is_main=is_main)  # not refused
    err = capsys.readouterr().err
    assert err.count("ddp_kit: warning: amp=bf16 on Tesla T4") == (1 if is_main else 0), err


def test_oom_report_names_the_per_process_cap_when_one_is_set():
    from ddp_kit.doctor import describe_oom

    capped = describe_oom("cuda:0", 60.1, 62.0, 63.5, 140.0, 0.5, micro_batch=32, global_batch=256, grad_accum=1, amp="off")
    assert "of this process's cap of 70.00 GiB (memory fraction 0.5 of the card's 140.00 GiB)" in capped[0], capped
    for fraction in (1.0, None):  # no cap, or a torch that cannot tell: the card's memory, named as such
        line = describe_oom("cuda:0", 1.0, 2.0, 3.0, 140.0, fraction, 32, 256, 1, "bf16")[0]
        assert "of the card's 140.00 GiB" in line and "cap" not in line, line


@pytest.mark.parametrize("torch_tells", [True, False])
def test_oom_report_reads_the_cap_where_torch_exposes_it(monkeypatch, torch_tells):
    """torch.cuda's memory figures are the test double (no GPU here); get_per_process_memory_fraction
    is absent from some torch versions, and then the report keeps the card's total."""
    from types import SimpleNamespace

    from ddp_kit.doctor import oom_report

    gib = 2**30
    for fn, value in {"memory_allocated": 30 * gib, "memory_reserved": 31 * gib, "max_memory_allocated": 32 * gib}.items():
        monkeypatch.setattr(torch.cuda, fn, lambda device=None, v=value: v)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=80 * gib))
    if torch_tells:
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.4, raising=False)
    else:
        monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
    line = oom_report(torch.device("cuda", 0), 16, 128, 2, "off")[0]
    assert "peak 32.00 GiB" in line
    assert ("cap of 32.00 GiB (memory fraction 0.4 of the card's 80.00 GiB)" if torch_tells else "of the card's 80.00 GiB") in line, line


def test_a_cuda_error_gets_the_doctors_findings_by_default_and_the_scripts_notes_when_given(tmp_path, capsys):
    """The failure policy (reliability/failures.py) imports no doctor: ddp_kit.init hands it the doctor's
    findings, and run.explain_cuda_errors replaces them. The CUDA error is a plain RuntimeError with
    CUDA's text (no GPU here); the handler only reads the message."""
    import ddp_kit
    from ddp_kit.doctor import findings_for_error
    from ddp_kit.reliability.failures import handle

    with ddp_kit.init(run_dir=str(tmp_path / "r"), hang_timeout_s=0) as run:
        boundary = run._boundary
        assert boundary.cuda_notes is findings_for_error
        run.explain_cuda_errors(lambda err: [f"micro-batch note for {type(err).__name__}"])
        cuda = RuntimeError("CUDA error: an illegal memory access was encountered")
        handle(cuda, run.ctx, 3, "forward/backward", str(tmp_path), notes=boundary.cuda_notes)
        handle(ValueError("not a GPU problem"), run.ctx, 3, "forward/backward", str(tmp_path), notes=boundary.cuda_notes)
    err = capsys.readouterr().err
    assert err.count("micro-batch note for RuntimeError") == 1, err
    assert "failed at step 3 in forward/backward: ValueError: not a GPU problem" in err

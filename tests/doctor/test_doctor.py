"""Doctor diagnoses from fact snapshots of broken machines (pure functions), plus real runs on this machine."""
import copy
import json
import sys

import pytest

from conftest import run_cmd, torchrun
from ddp_kit.doctor.checks import (
    FAIL,
    OK,
    SKIP,
    WARN,
    allocated_gpus,
    bf16,
    cuda_availability,
    diagnose,
    driver_version,
    exit_code,
    gpu_arch,
    gpu_memory_taken,
    limits,
    local_rank_fits,
    master,
    mig,
    nccl,
    shm,
    versions,
    visible_devices,
)
from ddp_kit.doctor.facts import allocation, layout

H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total_mb": 81559.0, "memory_used_mb": 4.0, "capability": "9.0"}
GOOD = {
    "os": "Linux", "python": "3.11.7",
    "torch": {"version": "2.14.1+cu130", "cuda": "13.0", "hip": None, "cudnn": 92400, "nccl": "2.30.7",
              "nccl_available": True, "cuda_available": True, "cuda_error": None, "device_count": 8,
              "arch_list": ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"],
              "gpus": [{**H100, "memory_free_mb": 80000.0, "bf16": True}] * 8, "import_error": None,
              "torchvision": "0.29.1+cu130", "torchvision_error": None},
    "nvidia": {"present": True, "driver": "580.82.07", "driver_cuda": "13.0", "gpus": [H100] * 8},
    "nvidia_device_files": [f"nvidia{i}" for i in range(8)],
    "env": {}, "layout": {"launcher": "torchrun", "rank": 3, "local_rank": 3, "world_size": 8, "local_world_size": 8,
                          "master_addr": "node1", "master_port": 29500, "error": None},
    "master": {"addr": None}, "shm_bytes": 64 * 2**30, "nofile_limit": 65536, "disk_free_bytes": 500 * 2**30, "run_dir": ".",
}


def broken(**changes):
    """GOOD with dotted-path changes, e.g. broken(**{"torch.cuda": None})."""
    f = copy.deepcopy(GOOD)
    for path, value in changes.items():
        *head, last = path.split(".")
        node = f
        for k in head:
            node = node[k]
        node[last] = value
    return f


def test_healthy_machine_is_all_ok():
    findings = diagnose(GOOD, amp="bf16")
    assert {f.status for f in findings} <= {OK, SKIP}, [f for f in findings if f.status not in (OK, SKIP)]
    assert exit_code(findings) == 0


def test_cpu_only_wheel_on_gpu_machine():
    f = broken(**{"torch.cuda": None, "torch.cuda_available": False, "torch.device_count": 0, "torch.gpus": [],
                  "torch.version": "2.14.1+cpu", "torch.arch_list": []})
    r = cuda_availability(f)
    assert r.status == FAIL and "CPU-only build" in r.message and "index-url" in r.fix


def test_no_driver_explains_why_cuda_is_unavailable():
    f = broken(**{"torch.cuda_available": False, "torch.device_count": 0, "torch.gpus": [], "nvidia.present": False,
                  "nvidia.gpus": [], "nvidia.driver": None, "nvidia_device_files": []})
    r = cuda_availability(f)
    assert r.status == WARN and "no NVIDIA driver" in r.message


@pytest.mark.parametrize("driver,status", [("470.82.01", FAIL), ("575.51.03", FAIL), ("580.65.06", OK)])
def test_driver_too_old_for_cuda_runtime(driver, status):
    r = driver_version(broken(**{"nvidia.driver": driver, "torch.cuda_available": status == OK}))
    assert r.status == status, r
    if status == FAIL:
        assert "too old" in r.message and "580" in r.fix


def test_forward_compatible_driver_where_cuda_works_is_not_a_failure():
    r = driver_version(broken(**{"nvidia.driver": "535.104.05"}))  # CUDA 13 runtime, CUDA works: cuda-compat
    assert r.status == WARN and "forward compatibility" in r.message, r


def test_mig_mode_is_named():
    f = broken(**{"nvidia.gpus": [{**H100, "mig": True}] + [H100] * 7})
    r = mig(f)
    assert r.status == WARN and "GPU 0" in r.message and "NCCL" in r.message
    assert mig(GOOD).status == OK


def test_gpu_in_use_judged_for_visible_gpus_in_cuda_order():
    smi = [{**H100, "uuid": f"u{i}"} for i in range(4)]
    smi[2] = {**smi[2], "memory_used_mb": 40000.0}  # busy, but this process does not see it
    seen = [{**GOOD["torch"]["gpus"][0], "uuid": u} for u in ("u3", "u1")]
    f = broken(**{"nvidia.gpus": smi, "torch.gpus": seen, "torch.device_count": 2})
    assert gpu_memory_taken(f).status == OK
    f = broken(**{"nvidia.gpus": smi, "torch.gpus": [{**seen[0], "uuid": "u2"}], "torch.device_count": 1})
    r = gpu_memory_taken(f)  # CUDA's GPU 0 is nvidia-smi's GPU 2
    assert r.status == WARN and "GPU 0 (nvidia-smi GPU 2)" in r.message, r
    f = broken(**{"nvidia.gpus": smi, "torch.gpus": [], "torch.cuda_available": False, "env": {"CUDA_VISIBLE_DEVICES": "0,1"}})
    assert gpu_memory_taken(f).status == OK


def test_driver_minor_version_compat_warns():
    r = driver_version(broken(**{"torch.cuda": "12.8", "nvidia.driver": "535.104.05"}))
    assert r.status == WARN and "minor-version" in r.message


def test_cuda_visible_devices_hides_all():
    f = broken(**{"env": {"CUDA_VISIBLE_DEVICES": ""}, "torch.cuda_available": False, "torch.device_count": 0})
    assert visible_devices(f).status == FAIL
    assert cuda_availability(f).status == FAIL and "hides them all" in cuda_availability(f).message
    f = broken(**{"env": {"CUDA_VISIBLE_DEVICES": "-1"}, "torch.cuda_available": False, "torch.device_count": 0})
    assert visible_devices(f).status == FAIL


def test_gpu_arch_missing_sm120_class():
    blackwell = {"name": "NVIDIA GeForce RTX 5090", "memory_total_mb": 32000.0, "memory_used_mb": 0.0, "capability": "12.0"}
    f = broken(**{"torch.arch_list": ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"],
                  "torch.gpus": [{**blackwell, "bf16": True}]})
    r = gpu_arch(f)
    assert r.status == FAIL and "sm_120" in r.message
    # the same GPU with PTX for an older arch can JIT: not a failure
    f["torch"]["arch_list"].append("compute_90")
    assert gpu_arch(f).status == OK
    # binary compatibility within a major: sm_80 code runs on sm_86
    ampere = {"name": "A10", "capability": "8.6", "bf16": True}
    assert gpu_arch(broken(**{"torch.arch_list": ["sm_80"], "torch.gpus": [ampere]})).status == OK


def test_nccl_missing_in_cuda_build():
    assert nccl(broken(**{"torch.nccl_available": False})).status == FAIL


def test_local_rank_beyond_visible_gpus():
    f = broken(**{"torch.device_count": 2, "layout.local_rank": 3, "layout.local_world_size": 4})
    r = local_rank_fits(f)
    assert r.status == FAIL and "LOCAL_RANK 3" in r.message


def test_slurm_gpus_disagree_with_visible():
    """The allocation comes from the detected environment (env/slurm.py), not from the doctor's own reading."""
    f = broken(**{"allocation": allocation({"SLURM_JOB_ID": "1", "SLURM_GPUS_ON_NODE": "4"}), "torch.device_count": 8})
    r = allocated_gpus(f)
    assert r.status == WARN and r.name == "SLURM GPU allocation" and "SLURM allocated 4 GPU(s)" in r.message
    f = broken(**{"allocation": allocation({"SLURM_JOB_ID": "1", "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "4",
                                            "SLURM_STEP_ID": "0"})})
    r = allocated_gpus(f)
    assert r.status == WARN and "ntasks-per-node" in r.fix
    # GPUs listed by id where the count is not given; a batch script (no step) is not held to one task per GPU
    f = broken(**{"allocation": allocation({"SLURM_JOB_ID": "1", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7",
                                            "SLURM_NTASKS_PER_NODE": "1"})})
    assert allocated_gpus(f).status == OK
    # outside a scheduler, and with a refused launcher variable (the allocation is still reported)
    r = allocated_gpus(broken(**{"allocation": allocation({})}))
    assert (r.status, r.name, r.message) == (SKIP, "SLURM GPU allocation", "not in a SLURM job with GPUs")
    refused = {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "8", "SLURM_GPUS_ON_NODE": "4"}  # 8 tasks, no srun
    assert layout(refused)["error"] and allocated_gpus(broken(**{"allocation": allocation(refused)})).status == WARN


def test_bf16_on_pre_ampere():
    v100 = {"name": "Tesla V100", "capability": "7.0", "bf16": False, "memory_total_mb": 16000.0}
    assert bf16(broken(**{"torch.gpus": [v100]}), amp="bf16").status == FAIL
    assert bf16(GOOD, amp="bf16").status == OK


@pytest.mark.parametrize("size,status", [(64 * 2**20, FAIL), (512 * 2**20, WARN), (8 * 2**30, OK)])
def test_shm_size(size, status):
    assert shm(broken(shm_bytes=size)).status == status


def test_master_addr_and_port():
    assert master(broken(master={"addr": "no-such-host", "port": 29500, "resolves": False})).status == FAIL
    assert master(broken(master={"addr": "localhost", "port": 29500, "resolves": True, "local": True,
                                 "port_in_use": True})).status == WARN


def test_gpu_memory_taken_by_others():
    busy = {**H100, "memory_used_mb": 40000.0}
    r = gpu_memory_taken(broken(**{"nvidia.gpus": [busy] + [H100] * 7}))
    assert r.status == WARN and "GPU 0" in r.message


def test_torchvision_mismatch():
    f = broken(**{"torch.torchvision_error": "RuntimeError: operator torchvision::nms does not exist",
                  "torch.version": "2.13.0+cpu"})
    r = versions(f)
    assert r.status == FAIL and "0.28" in r.message
    assert versions(broken(**{"torch.torchvision": "0.27.0"})).status == WARN


def test_low_disk_and_open_files():
    assert limits(broken(disk_free_bytes=2**20)).status == FAIL
    assert limits(broken(nofile_limit=1024)).status == WARN


def test_exit_codes():
    assert exit_code(diagnose(broken(**{"torch.nccl_available": False}))) == 2
    assert exit_code(diagnose(broken(nofile_limit=1024))) == 1


@pytest.mark.integration
def test_doctor_runs_here_and_explains_cuda():
    res = run_cmd([sys.executable, "-m", "ddp_kit.doctor", "--json"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode in (0, 1, 2)
    data = json.loads(res.stdout)
    cuda = [f for f in data["findings"] if f["name"] == "CUDA available"][0]
    import torch

    if not torch.cuda.is_available():
        assert cuda["status"] in (WARN, FAIL) and ("no NVIDIA driver" in cuda["message"] or "CPU-only" in cuda["message"]
                                                   or "hides" in cuda["message"])
    table = run_cmd([sys.executable, "-m", "ddp_kit.doctor"])
    assert "CUDA available" in table.stdout and table.returncode == res.returncode


@pytest.mark.integration
def test_doctor_json_with_active_checks_is_pure_json_on_stdout():
    """--json --comm and --json --memory (real processes, run side by side): stdout parses as JSON
    even though the active checks start a process group, whose startup line goes to stderr."""
    from concurrent.futures import ThreadPoolExecutor

    doctor = [sys.executable, "-m", "ddp_kit.doctor", "--json"]
    cmds = {"comm": doctor + ["--comm", "--comm_max_mb", "0.004"], "memory": doctor + ["--memory"]}
    with ThreadPoolExecutor(2) as pool:
        runs = {k: pool.submit(run_cmd, c, env={"CUDA_VISIBLE_DEVICES": ""}) for k, c in cmds.items()}
        results = {k: f.result() for k, f in runs.items()}
    for kind, res in results.items():
        assert res.returncode in (0, 1, 2), res.stderr[-2000:]
        data = json.loads(res.stdout)
        assert kind in data and "findings" in data, sorted(data)
        assert "intra-op thread" in res.stderr  # said, on the other stream
    assert results["comm"].stdout and json.loads(results["comm"].stdout)["comm"]["world_size"] == 1


@pytest.mark.integration
def test_doctor_comm_under_torchrun():
    res = torchrun(["-m", "ddp_kit.doctor", "--comm", "--comm_max_mb", "1"], nproc=2)
    assert res.returncode in (0, 1), res.stderr[-2000:]
    assert "all_reduce (gloo, 2 ranks" in res.stdout and "busbw" in res.stdout
    assert res.stdout.count("ddp_kit doctor") == 1  # printed once, by rank 0


def test_mig_instances_in_cuda_visible_devices():
    f = broken(**{"env": {"CUDA_VISIBLE_DEVICES": "MIG-4f1e2d3c-aaaa-bbbb-cccc-000000000001"}, "torch.gpus": []})
    assert mig(f).status == WARN and "MIG instances" in mig(f).message
    assert gpu_memory_taken(f).status == SKIP

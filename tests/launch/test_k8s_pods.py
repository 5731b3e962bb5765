"""Kubernetes pods as real processes: one network namespace, hostname and hosts file per pod (tests/netns.py),
and exactly the environment the operator puts into the pod's container. Nothing here talks to a
Kubernetes API: the operators' part that matters to a training process is its environment, its
DNS names, SIGTERM then SIGKILL at eviction, and a restart that reruns the pod's command.

Environments, from the operators' sources:
- Kubeflow Trainer v2 (kubeflow/trainer, pkg/runtime/framework/plugins/torch/torch.go): the
  container runs torchrun with PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the Indexed Job's
  completion index) and PET_MASTER_ADDR=<job>-node-0-0.<job>, PET_MASTER_PORT=29500.
- PyTorchJob v1 (kubeflow/training-operator, pkg/controller.v1/pytorch/envvar.go), one process per
  pod: MASTER_ADDR=<job>-master-0, MASTER_PORT, WORLD_SIZE = replicas x nprocPerNode (1 here), RANK =
  the pod's index (master 0, worker i -> i+1), PYTHONUNBUFFERED=1.
Every pod also has KUBERNETES_SERVICE_HOST/PORT (the API server's Service), which nothing here reaches.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import netns
from conftest import REFERENCE_2_EPOCHS, ROOT, proc_env, read_json

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not netns.AVAILABLE, reason="needs root, iproute2 and unshare")]
JOB = "ddpk"
K8S = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "PYTHONUNBUFFERED": "1"}
TRAIN = [sys.executable, "-m", "ddp_kit.train", *REFERENCE_2_EPOCHS, "--hang_timeout_s", "60"]


def start(host: netns.Host, argv: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(host.command(*argv), cwd=ROOT, env=proc_env({**K8S, **env}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def pytorchjob_env(rank: int) -> dict:
    return {"MASTER_ADDR": f"{JOB}-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": str(rank)}


def show(procs, outs) -> str:
    return "\n=====\n".join(f"exit {p.returncode}\n{o[-3000:]}" for p, o in zip(procs, outs))


def test_trainer_v2_torchrun_per_pod_trains_the_same_weights(tmp_path, reference_summary):
    ref = reference_summary(2, REFERENCE_2_EPOCHS)
    names = [f"{JOB}-node-0-0", f"{JOB}-node-0-1"]
    with netns.hosts(names, subnet="10.232.0", hosts_entries={f"{JOB}-node-0-0.{JOB}": "10.232.0.1"}) as pods:
        procs = [start(pod, [sys.executable, "-m", "torch.distributed.run", *TRAIN[1:], "--run_dir", str(tmp_path)],
                       {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(i),
                        "PET_MASTER_ADDR": f"{JOB}-node-0-0.{JOB}", "PET_MASTER_PORT": "29500",
                        "JOB_COMPLETION_INDEX": str(i)})
                 for i, pod in enumerate(pods)]
        outs = netns.finish(procs)
    assert all(p.returncode == 0 for p in procs), show(procs, outs)
    assert read_json(tmp_path / "summary.json")["param_sha256"] == ref["param_sha256"]
    line = next(ln for ln in outs[0].splitlines() if "rank(s) (" in ln)
    assert "Trainer" in line, line  # the startup line names the engine


def test_pytorchjob_one_process_per_pod_waits_for_a_master_name_that_appears_late(tmp_path, reference_summary):
    """The worker pod starts before the master's name resolves (the Service's DNS record lags): it
    waits, says so once, and the job trains the same weights as torchrun's."""
    ref = reference_summary(2, REFERENCE_2_EPOCHS)
    with netns.hosts([f"{JOB}-master-0", f"{JOB}-worker-0"], subnet="10.232.1") as (master, worker):
        full = worker.hosts_file.read_text()
        worker.hosts_file.write_text("".join(ln + "\n" for ln in full.splitlines() if f"{JOB}-master-0" not in ln))
        worker_proc = start(worker, [*TRAIN, "--run_dir", str(tmp_path)], pytorchjob_env(1))
        # The name appears once the worker has waited for it a while (it says so once, after 5 s),
        # or after 60 s: written in place, so the pod's bind-mounted /etc/hosts shows it.
        said, lines = threading.Event(), []

        def follow():
            for line in worker_proc.stdout:
                lines.append(line)
                if "waiting for master host" in line:
                    said.set()
            said.set()

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        said.wait(60)
        worker.hosts_file.write_text(full)
        master_proc = start(master, [*TRAIN, "--run_dir", str(tmp_path)], pytorchjob_env(0))
        procs = [master_proc, worker_proc]
        outs = netns.finish([master_proc])
        worker_proc.wait(timeout=120)
        reader.join(timeout=10)
        outs.append("".join(lines))
    assert all(p.returncode == 0 for p in procs), show(procs, outs)
    waited = [ln for ln in outs[1].splitlines() if "waiting for master host" in ln]
    assert len(waited) == 1 and f"{JOB}-master-0" in waited[0], outs[1][-3000:]
    assert read_json(tmp_path / "summary.json")["param_sha256"] == ref["param_sha256"]


def test_a_master_name_that_never_resolves_is_one_line_at_init_timeout(tmp_path):
    with netns.hosts([f"{JOB}-worker-0"], subnet="10.232.2") as (worker,):
        t0 = time.monotonic()
        procs = [start(worker, [*TRAIN, "--run_dir", str(tmp_path), "--init_timeout_s", "6"], pytorchjob_env(1))]
        outs = netns.finish(procs, timeout=120)
        took = time.monotonic() - t0
    assert procs[0].returncode == 2, show(procs, outs)
    errors = [ln for ln in outs[0].splitlines() if ln.startswith("ddp_kit: error:")]
    assert len(errors) == 1 and f"{JOB}-master-0" in errors[0] and "init_timeout_s 6s" in errors[0], outs[0][-3000:]
    assert "Traceback" not in outs[0] and "socket.cpp" not in outs[0], outs[0][-3000:]
    assert took < 60, took  # the bound (6 s) plus the process's start, not the default 600 s


def test_eviction_sigterm_checkpoints_exits_75_and_restarted_pods_resume_bit_identical(tmp_path, reference_summary):
    """kubelet's eviction: SIGTERM to one pod's process, SIGKILL after terminationGracePeriodSeconds.
    Every rank checkpoints and exits 75 within the grace period; the checkpoint's time is in the
    metrics; the restarted pods (the same commands) resume to the uninterrupted run's weights."""
    ref = reference_summary(2, REFERENCE_2_EPOCHS)
    grace = 30
    slow = ["--inject", "slow:rank=0:step=1:ms=100"]  # time to act mid-run; changes no weight
    env = {"DDP_KIT_GRACE_PERIOD_S": str(grace)}
    with netns.hosts([f"{JOB}-master-0", f"{JOB}-worker-0"], subnet="10.232.3") as pods:
        procs = [start(pod, [*TRAIN, "--run_dir", str(tmp_path), *slow], {**pytorchjob_env(i), **env})
                 for i, pod in enumerate(pods)]
        metrics = tmp_path / "metrics.jsonl"
        end = time.monotonic() + 120
        while time.monotonic() < end and all(p.poll() is None for p in procs):
            if metrics.exists() and any(json.loads(ln).get("step", 0) >= 10 for ln in metrics.read_text().splitlines() if ln):
                break
            time.sleep(0.1)
        os.kill(procs[1].pid, signal.SIGTERM)  # the worker pod's container process (python, exec'd)
        sigterm = time.monotonic()
        killer = threading.Timer(grace, lambda: [os.killpg(p.pid, signal.SIGKILL) for p in procs if p.poll() is None])
        killer.start()
        try:
            outs = netns.finish(procs, timeout=grace + 30)
        finally:
            killer.cancel()
        took = time.monotonic() - sigterm
        assert [p.returncode for p in procs] == [75, 75] and took < grace, show(procs, outs)
        stop = [ln for ln in outs[0].splitlines() if "preempted by SIGTERM" in ln]
        assert len(stop) == 1 and "checkpoint saved in" in stop[0], outs[0][-3000:]
        records = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln]
        saves = [r for r in records if r.get("event") == "checkpoint"]
        assert saves and all(0 < r["commit_s"] < grace for r in saves), saves
        restarted = [start(pod, [*TRAIN, "--run_dir", str(tmp_path)], {**pytorchjob_env(i), **env})
                     for i, pod in enumerate(pods)]
        outs = netns.finish(restarted)
    assert all(p.returncode == 0 for p in restarted), show(restarted, outs)
    assert "resumed from" in outs[0]
    assert read_json(tmp_path / "summary.json")["param_sha256"] == ref["param_sha256"]

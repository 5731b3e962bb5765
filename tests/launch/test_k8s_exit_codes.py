"""The codes a PyTorchJob sees (restartPolicy ExitCode: 128-255 retryable, 1-127 permanent; kubeflow/training-operator
pkg/util/train/train_util.go IsRetryableExitCode). The rendered pod command, run for real: pod.sh runs torchrun,
torchrun runs each rank through rank.sh, ddp_kit's reference job fails at step 6 on every attempt. The first
attempt's failure is retryable and must reach the operator as 193 (>= 128: the pod is recreated); the second,
the same exception at the same step, is deterministic and must stay 2 (the job fails). The engine's restart
of the pod is played by running the same command again."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, proc_env
from procs import outcome

pytestmark = [pytest.mark.integration]


def _pytorchjob_command(tmp_path) -> list[str]:
    from ddp_kit.launch.k8s import K8sJob, render_k8s

    job = K8sJob(engine="pytorchjob", layout="torchrun", nodes=1, nproc_per_node=2, gpus_per_node=None, image="x",
                 pvc="ckpt", run_dir=str(tmp_path / "r"), mount_path=str(tmp_path), grace_period_s=30, name="t",
                 namespace=None, port=29500, max_restarts=3, max_preemptions=20, train_args=())
    (doc,) = [d for d in yaml.safe_load_all(render_k8s(job, "test")) if d and d.get("kind") == "PyTorchJob"]
    (container,) = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    return container["command"]


def test_a_retryable_failure_reaches_a_pytorchjob_as_193_and_a_deterministic_one_as_2(tmp_path):
    command = _pytorchjob_command(tmp_path)
    assert command[-2:] == ["203", "192"]
    run = tmp_path / "r"
    pod = [*command, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--no-python", "sh",
           "-c", (ROOT / "src/ddp_kit/launch/templates/k8s/rank.sh").read_text(), "ddp_kit-rank",
           sys.executable, "-m", "ddp_kit.train", "--progress", "false", "--run_dir", str(run), "--max_steps", "30",
           "--ckpt_every", "4", "--inject", "raise:rank=1:step=6:always=1"]
    env = proc_env({"DDP_KIT_PREEMPT_MARK": str(tmp_path / "mark")})

    def once() -> tuple[int, str]:
        return outcome(subprocess.Popen(pod, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, start_new_session=True), 150)

    (first, out1), (second, out2) = once(), once()
    assert (first, second) == (193, 2), (out1[-2000:], out2[-3000:])
    assert "exit 1 is retryable" in out1 and "exiting 193" in out1
    ends = [r for r in map(json.loads, (run / "attempts.jsonl").read_text().splitlines()) if r["event"] == "end"]
    assert [(e["verdict"], e["retryable"]) for e in ends] == [("program_error", True), ("program_error", False)]

"""Both SLURM templates on a real 2-node SLURM cluster started by the tests: 2 nodes x 2 ranks (gloo on CPU),
preemption (USR2 -> checkpoint -> requeue -> resume) for both layouts and one array task, and layout mistakes."""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

import slurm_cluster
from conftest import REFERENCE_3_EPOCHS, ROOT, read_json

pytestmark = [pytest.mark.integration, pytest.mark.skipif(slurm_cluster.available() is not None,
                                                   reason=f"no SLURM here: {slurm_cluster.available()}")]

ARGS = [*REFERENCE_3_EPOCHS, "--hang_timeout_s", "60"]  # epochs 3, a checkpoint every 5 steps
# Slows rank 0 (on the first attempt only) so that a signal can land mid-run; weights are unaffected.
# 250 ms: the 56 steps after step 10 take 14 s, for scancel, the batch script's trap and the ranks' stop
# check on a loaded machine (at 120 ms, 6.7 s: the job could end first). A whole slowed attempt is ~17 s
# of steps: --time=5 and the 300 s waits below cover it.
SLOW = ["--inject", "slow:rank=0:step=1:ms=250"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm"), nodes=2, cpus=4).start()
    yield c
    c.stop()


@pytest.fixture(autouse=True)
def _clean_queue(request):
    """After each test, no job of it is left holding the nodes: a test that failed (or timed out)
    mid-job would otherwise leave every later test PENDING behind it, and fail them too."""
    yield
    if "cluster" in request.fixturenames:
        left = request.getfixturevalue("cluster").cancel_all()
        if left:
            print(f"cancelled jobs left by {request.node.name}: {left}")


@pytest.fixture(scope="module")
def reference(reference_summary):
    """The same job as 4 ranks of torchrun on one node: what every SLURM run must reproduce (the run
    test_multinode compares against too: one run of it per session)."""
    return reference_summary(4, REFERENCE_3_EPOCHS)


def submit(cluster, template, run_dir, *extra_args, sbatch=(), nproc=2, env=None, unset=()):
    out = Path(run_dir).parent / f"{Path(run_dir).name}-%j.out"
    args = ["--nodes=2", "--time=5", f"--output={out}", "--chdir", str(ROOT), *sbatch, str(ROOT / "slurm" / template),
            *ARGS, "--run_dir", str(run_dir), *extra_args]
    if template == "srun.sbatch":
        args.insert(0, f"--ntasks-per-node={nproc}")
    env = {"PYTHON": sys.executable, "NPROC_PER_NODE": str(nproc), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           **(env or {})}
    return cluster.sbatch(args, env={k: v for k, v in env.items() if k not in unset}, unset=unset)


def output(run_dir, job_id) -> str:
    p = Path(run_dir).parent / f"{Path(run_dir).name}-{job_id}.out"
    return p.read_text(errors="replace") if p.exists() else ""


def describe(cluster, jobs: dict, out_dirs: dict) -> str:
    """Why a job ended as it did: each task's state, reason, exit code, restarts and the tail of its
    output, so that a failure in CI can be diagnosed from the log alone."""
    lines = []
    for key, job in jobs.items():
        info = cluster.job(job)
        fields = " ".join(f"{k}={info.get(k)}" for k in ("JobId", "ArrayTaskId", "JobState", "Reason", "ExitCode",
                                                           "Restarts", "RunTime"))
        tail = output(out_dirs[key], info.get("JobId", job))[-2500:]
        lines.append(f"--- {job}: {fields}\n{tail}")
    return "\n".join(lines)


def warn_job(cluster, job: str, run_dir, attempts: int = 3) -> None:
    """Send the preemption warning as `scancel --signal=USR2 --full` and confirm that it arrived.

    Once in a full-module run the signal was seen by no process of the job; so resend (at most
    `attempts` times) until the batch script's trap reports it, and a lost delivery is retried rather
    than mistaken for our bug. `job` may be an array task (`ARRAY_TASK`): its output file is named by
    the task's own JobId."""
    job_id = cluster.job(job).get("JobId", job)
    for _ in range(attempts):
        cluster.run(["scancel", "--signal=USR2", "--full", job])
        end = time.monotonic() + 5
        while time.monotonic() < end:
            if "got SIGUSR2" in output(run_dir, job_id) or cluster.job(job).get("JobState") != "RUNNING":
                return
            time.sleep(0.2)
    raise AssertionError(f"USR2 never reached job {job} in {attempts} tries: {cluster.job(job)}")


def release_requeued(cluster, job: str, timeout: float = 120) -> None:
    """SLURM holds a requeued batch job for ~2 minutes (BeginTime) before it may start again; a test
    need not wait that out: once the requeue has happened, make it eligible soon, as an admin could.

    Not `StartTime=now`: that restarted the job within the second its old credential was revoked,
    and slurmd refused it ("Job credential revoked", the job FAILED with exit 1 and no output;
    1 in 10 runs). slurmd compares the new credential's creation time, in whole seconds, with the
    revocation time, so the restart must begin a few seconds later. This is SLURM's own timing."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        info = cluster.job(job)
        if int(info.get("Restarts", 0)) >= 1 and info.get("JobState") == "PENDING":
            cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now+3"], check=False)
            return
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
            return
        time.sleep(0.2)
    raise TimeoutError(f"job {job} was not requeued: {cluster.job(job)}")


def wait_step(cluster, job: str, run_dir: Path, step: int, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < end:
        if metrics.exists():
            steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines() if line.strip()]
            if steps and max(steps) >= step:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{run_dir} never reached step {step}:\n{cluster.describe(job)}")


@pytest.mark.parametrize("template", ["srun.sbatch", "torchrun.sbatch"])
def test_template_2_nodes_x_2_ranks(cluster, reference, tmp_path, template):
    """OMP_NUM_THREADS left unset: torchrun sets 1 for its workers, srun sets nothing, and ddp_kit picks the
    threads per rank by one rule under both (and says so), so both layouts train the reference's weights."""
    run_dir = tmp_path / "run"
    job = submit(cluster, template, run_dir, unset=("OMP_NUM_THREADS",))
    info = cluster.wait_job(job, timeout=240)
    text = output(run_dir, job)
    assert info["JobState"] == "COMPLETED", describe(cluster, {0: job}, {0: run_dir})
    summary = read_json(run_dir / "summary.json")
    assert summary["world_size"] == 4 and summary["eval_samples"] == 360
    assert summary["param_sha256_all_ranks_equal"] is True
    assert summary["param_sha256"] == reference["param_sha256"], text
    threads = [ln for ln in text.splitlines() if "intra-op thread" in ln]
    assert len(threads) == 1, threads  # said once, by rank 0


@pytest.mark.timeout(600)  # up to 120 s to step 10, the requeue, then a whole run
@pytest.mark.parametrize("template", ["srun.sbatch", "torchrun.sbatch"])
def test_preemption_checkpoint_requeue_resume(cluster, reference, tmp_path, template):
    run_dir = tmp_path / "run"
    job = submit(cluster, template, run_dir, *SLOW)
    wait_step(cluster, job, run_dir, 10)
    warn_job(cluster, job, run_dir)
    release_requeued(cluster, job)
    info = cluster.wait_job(job, timeout=300)
    text = output(run_dir, job)
    assert info["JobState"] == "COMPLETED", text
    assert int(info.get("Restarts", 0)) == 1, info
    assert "preempted by SIGUSR2" in text and "requeueing the job" in text, text
    summary = read_json(run_dir / "summary.json")
    assert summary["resumed_from_step"] is not None and summary["resumed_from_step"] >= 10
    assert summary["param_sha256"] == reference["param_sha256"]


@pytest.mark.timeout(600)
def test_preemption_array_task_requeues_only_itself(cluster, reference, tmp_path):
    base = tmp_path / "sweep_{array_task}"
    job = submit(cluster, "srun.sbatch", base, *SLOW, sbatch=["--array=0-1"])
    tasks = {i: f"{job}_{i}" for i in range(2)}
    wait_step(cluster, tasks[1], tmp_path / "sweep_1", 10)
    warn_job(cluster, tasks[1], base)
    release_requeued(cluster, tasks[1])
    infos = {i: cluster.wait_job(t, timeout=300) for i, t in tasks.items()}
    why = describe(cluster, tasks, {i: base for i in tasks})
    assert all(info["JobState"] == "COMPLETED" for info in infos.values()), why
    assert int(infos[0].get("Restarts", 0)) == 0 and int(infos[1].get("Restarts", 0)) == 1, why
    for i in range(2):
        summary = read_json(tmp_path / f"sweep_{i}" / "summary.json")
        assert summary["param_sha256"] == reference["param_sha256"]
    assert read_json(tmp_path / "sweep_1" / "summary.json")["resumed_from_step"] is not None
    assert read_json(tmp_path / "sweep_0" / "summary.json")["resumed_from_step"] is None


def test_mistake_many_tasks_without_srun(cluster, tmp_path):
    out = tmp_path / "o-%j.out"
    job = cluster.sbatch(["--nodes=1", "--ntasks=2", "--time=2", f"--output={out}", "--chdir", str(ROOT),
                          "--wrap", f"{sys.executable} -m ddp_kit.train --run_dir {tmp_path / 'r'}"],
                         env={"CUDA_VISIBLE_DEVICES": ""})
    info = cluster.wait_job(job, timeout=120)
    text = (tmp_path / f"o-{job}.out").read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"].startswith("2:"), (info, text)
    lines = [line for line in text.splitlines() if line.startswith("ddp_kit: error:")]
    assert len(lines) == 1 and "srun" in lines[0] and "Traceback" not in text


def test_mistake_unresolvable_master(cluster, tmp_path):
    run_dir = tmp_path / "run"
    # A name that does not resolve is retried quietly until init_timeout_s (it may be a DNS record
    # that appears late, reach.py): a short bound, below the one "waiting" line's 5 s.
    job = submit(cluster, "srun.sbatch", run_dir, "--init_timeout_s", "4", env={"MASTER_ADDR": "no-such-host.invalid"})
    info = cluster.wait_job(job, timeout=120)
    text = output(run_dir, job)
    assert info["JobState"] == "FAILED", text
    said = [line for line in text.splitlines() if "does not resolve" in line]
    # At most once per node, naming it. Each node gives up init_timeout_s after its own start, and the first
    # to exit ends the step (srun --kill-on-bad-exit): the other node may be stopped before it says so.
    nodes = [match.group(1) for line in said for match in [re.search(r"from (node\d)", line)] if match]
    assert said and len(nodes) == len(said) == len(set(nodes)), text
    assert all("no-such-host.invalid" in line for line in said), text
    assert "Traceback" not in text and "socket.cpp" not in text, text  # no retries against a name that cannot resolve


def _wrap_job(cluster, tmp_path, script: str) -> tuple[dict, str]:
    out = tmp_path / "o-%j.out"
    job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=2", "--time=3", f"--output={out}", "--chdir", str(ROOT),
                          "--wrap", script], env={"PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
                                                  "NL": str(cluster.node_local)})
    t0 = time.monotonic()
    info = cluster.wait_job(job, timeout=180)
    info["took_s"] = time.monotonic() - t0
    return info, (tmp_path / f"o-{job}.out").read_text(errors="replace")


def test_config_file_on_one_node_only(cluster, tmp_path):
    """The config file exists on node1's local disk only: node2's ranks say they cannot read it, and
    node1's ranks stop within seconds naming them instead of waiting in the rendezvous."""
    info, text = _wrap_job(cluster, tmp_path, f'echo "epochs: 1" > "$NL/c.yaml" && srun "$PYTHON" -m ddp_kit.train "$NL/c.yaml" '
                                              f'--run_dir {tmp_path / "run"} --progress false --init_timeout_s 120')
    errs = [ln for ln in text.splitlines() if ln.startswith("ddp_kit: error:")]
    assert info["JobState"] == "FAILED" and info["took_s"] < 60, (info, text)
    assert errs and all("node2]" in ln and "not found" in ln for ln in errs), text
    assert "stopping: rank 2 on node2" in text or "stopping: rank 3 on node2" in text, text


def test_run_dir_not_shared_between_nodes(cluster, tmp_path):
    """run_dir on each node's local disk: refused at startup in one line, before any training step."""
    info, text = _wrap_job(cluster, tmp_path, 'srun "$PYTHON" -m ddp_kit.train --run_dir "$NL/run" --progress false '
                                              '--epochs 1')
    errs = [ln for ln in text.splitlines() if ln.startswith("ddp_kit: error:")]
    assert info["JobState"] == "FAILED" and len(errs) == 1, text
    assert "is not one shared folder" in errs[0] and "node2" in errs[0] and "Traceback" not in text, text
    assert "step 1" not in text and "done:" not in text


def test_a_node_the_health_gate_fails_is_excluded_at_the_requeue(cluster, tmp_path):
    """node1's node-local folder turned read-only (in its mount namespace only) and the checkpoints asked there:
    the gate fails on node1 before step 1, the job requeues itself without node1 and finishes on node2."""
    import subprocess

    node_local, ckpt = cluster.node_local, cluster.node_local / "gate-ckpt"
    node1 = str(cluster.pids["slurmd.node1"])
    subprocess.run(["nsenter", "-t", node1, "-m", "mount", "-o", "remount,ro", str(node_local)], check=True, timeout=30)
    try:
        run_dir = tmp_path / "run"
        job = submit(cluster, "srun.sbatch", run_dir, "--ckpt_dir", str(ckpt), sbatch=["--nodes=1"])
        release_requeued(cluster, job)
        info = cluster.wait_job(job, timeout=300)
    finally:
        subprocess.run(["nsenter", "-t", node1, "-m", "mount", "-o", "remount,rw", str(node_local)], timeout=30)
    text = output(run_dir, job)
    assert info["JobState"] == "COMPLETED" and info.get("NodeList") == "node2", (info, text)
    records = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    ends = [r for r in records if r.get("event") == "end"]
    assert info.get("ExcNodeList") == "node1" and int(info.get("Restarts", 0)) == 1, info
    assert "health check failed on node1: checkpoints" in text and "requeued without node1" in text and "requeued the job without node1" in text, text
    assert "(hint: fix or drain the host, then rerun)" in text, text
    assert [e["verdict"] for e in ends] == ["infrastructure", "finished"] and ends[0]["host"] == "node1", records
    assert [r["left_out"] for r in records if r.get("event") == "excluded"] == [
        {"node1": "health gate: checkpoints"}], records
    assert not [r for r in records if r.get("event") == "first_step" and r.get("attempt") == 1], records

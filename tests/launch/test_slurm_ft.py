"""slurm/ft.sbatch on a real 2-node SLURM cluster started by the test (gloo on CPU): one replica group per node,
torchft's lighthouse on the first node, started by the job itself. A SIGKILL of group 1's worker on node2
must cost neither the job nor group 0: the launcher restarts group 1 as a new srun step on node2, it
recovers the weights live from group 0, and the job completes with both groups' weights identical."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

import slurm_cluster
from conftest import ROOT, read_json

pytest.importorskip("torchft")
pytestmark = [pytest.mark.integration, pytest.mark.skipif(slurm_cluster.available() is not None,
                                                   reason=f"no SLURM here: {slurm_cluster.available()}")]

# A stable step time (weights unaffected), so that the kill lands mid-run and group 0 is still training when
# the restarted group 1 joins: the restart (a new srun step, torch's imports) took ~9 s on 2 idle cores, and
# 290 steps of 200 ms after the kill leave ~58 s, room for a restart several times slower on a loaded CI
# machine (at 80 ms, ~23 s: group 0 could finish before group 1 recovered).
TRAIN = ["--max_steps", "300", "--log_every", "5", "--ckpt_every", "5", "--inject", "slow:rank=0:step=1:ms=200"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm"), nodes=2, cpus=4).start()
    yield c
    c.stop()  # cancels a job a failed test left running, too


def records(group_dir: Path) -> list[dict]:
    path = group_dir / "metrics.jsonl"
    out = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            out.append(json.loads(line))
        except ValueError:  # the line being written
            pass
    return out


def wait_step(cluster, job: str, group_dir: Path, step: int, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(r.get("event") == "train" and r["step"] >= step for r in records(group_dir)):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{group_dir} never reached step {step}:\n{cluster.describe(job)}")


def group_workers(job: str, group: int) -> list[int]:
    """PIDs of `python -m ddp_kit.train` processes of replica group `group` of this test's job (its
    SLURM_JOB_ID in their environment), not their rank shims."""
    needles = {f"DDP_KIT_REPLICA_GROUP={group}".encode(), f"SLURM_JOB_ID={job}".encode()}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = set((entry / "environ").read_bytes().split(b"\0"))
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if needles <= env and cmd[1:3] == [b"-m", b"ddp_kit.train"]:
            found.append(int(entry.name))
    return found


def test_a_lost_group_on_node2_is_restarted_by_the_job_and_recovers_live(cluster, tmp_path):
    run_dir = tmp_path / "run"
    # --chdir: the launcher keeps its groups' stop marks in the job's folder (shared by the nodes).
    # --time=4: above what the waits below allow (start-up to step 10, then ~60 s of steps), so that a slow
    # job fails on their clear message, not on SLURM's time limit.
    job = cluster.sbatch(["--nodes=2", "--time=4", f"--output={tmp_path}/ft-%j.out", "--chdir", str(tmp_path),
                          str(ROOT / "slurm" / "ft.sbatch"), *TRAIN, "--run_dir", str(run_dir)],
                         env={"PYTHON": sys.executable, "NPROC_PER_NODE": "1", "OMP_NUM_THREADS": "1",
                              "CUDA_VISIBLE_DEVICES": ""})
    wait_step(cluster, job, run_dir / "replica_1", 10, timeout=90)  # two nodes' start-up, torch imports, a lighthouse
    victims = group_workers(job, 1)
    assert len(victims) == 1, (victims, cluster.describe(job))
    # group 1 runs on the job's second node: the worker lives in node2's namespace
    assert os.readlink(f"/proc/{victims[0]}/ns/uts") == cluster.uts["node2"], cluster.describe(job)
    os.kill(victims[0], signal.SIGKILL)
    info = cluster.wait_job(job, timeout=150)  # ~58 s of steps left after the kill, and the restart
    text = (tmp_path / f"ft-{job}.out").read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", cluster.describe(job)
    assert "lighthouse at http://node1:" in text, text[-3000:]
    assert text.count("replica group 1 failed") == 1 and "replica group 0 failed" not in text, text[-5000:]
    assert "replica group 1 recovered live from group 0" in text, text[-5000:]
    recovery = [r for r in records(run_dir / "replica_1") if r.get("event") == "recovery"]
    assert len(recovery) == 1 and recovery[0]["source_group"] == 0 and recovery[0]["step"] >= 10, recovery
    hosts = {g: {rank["host"] for r in records(run_dir / f"replica_{g}") if r.get("event") == "train"
                 for rank in r["ranks"]} for g in (0, 1)}
    assert hosts == {0: {"node1"}, 1: {"node2"}}, hosts  # one group per node, the restart on its own node
    s0, s1 = read_json(run_dir / "replica_0" / "summary.json"), read_json(run_dir / "replica_1" / "summary.json")
    assert s0["steps"] == s1["steps"] == 300, (s0, s1)
    assert s0["param_sha256"] == s1["param_sha256"], (s0, s1)

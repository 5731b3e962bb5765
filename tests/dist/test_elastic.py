"""Growing an elastic job: launch/torchrun.sh with NNODES=1:2 on two torchrun agents on this machine
(loopback, c10d rendezvous on the first), the second started while the first trains. torchrun stops
the first node's workers (SIGTERM: ddp_kit checkpoints and exits 75) and restarts the job on both
nodes, resumed from that checkpoint. With torch's shared rendezvous store (torch 2.6 to 2.15) the
second round never completed: both agents timed out after 60 s and exited 1 (README, "Growing an
elastic job")."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, proc_env, read_json

pytestmark = [pytest.mark.integration]

MAX_STEPS = 400
# The first attempt trains slowly (150 ms a step on rank 0, a first-attempt-only fault), so that the
# second node joins mid-run on a loaded machine; the resumed attempt runs at full speed.
ARGS = ["--max_steps", str(MAX_STEPS), "--log_every", "1", "--ckpt_every", "1000", "--progress", "false",
        "--eval_every_epoch", "false", "--inject", "slow:rank=0:step=1:ms=150", "--hang_timeout_s", "60"]


def agent(run_dir: Path, port: int, log: Path) -> subprocess.Popen:
    env = proc_env({"NNODES": "1:2", "NPROC_PER_NODE": "1", "RDZV_HOST": "127.0.0.1", "RDZV_PORT": str(port),
                    "RDZV_ID": "grow", "PYTHON": sys.executable,
                    "RDZV_CONF": "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"})
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the launch script's own choice is under test
    with open(log, "w") as out:
        return subprocess.Popen(["bash", str(ROOT / "launch" / "torchrun.sh"), *ARGS, "--run_dir", str(run_dir)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (torchrun starts its workers in sessions of their own, out of
    reach of a kill of the agent's process group)."""
    parent = {}
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, ppid in parent.items() if ppid in frontier]
        tree += frontier
    return tree


def kill_tree(p: subprocess.Popen) -> None:
    for pid in descendants(p.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def train_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []  # a line still being written is left out
    return [r for r in map(json.loads, filter(None, lines)) if r.get("event") == "train"]


def start_first_node(tmp_path: Path) -> tuple[Path, int, subprocess.Popen]:
    """The first agent, once its rank has trained a few steps. free_port's number can be taken before
    torchrun binds it: one retry, on another port."""
    for attempt in range(2):
        run_dir, port = tmp_path / f"run{attempt}", free_port()
        first = agent(run_dir, port, tmp_path / f"node1_{attempt}.log")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and first.poll() is None and len(train_steps(run_dir)) < 5:
            time.sleep(0.2)
        if len(train_steps(run_dir)) >= 5:
            return run_dir, port, first
        kill_tree(first)
        first.wait()
    pytest.fail(f"the first node did not train\n{(tmp_path / 'node1_1.log').read_text()[-3000:]}")


def test_a_node_that_joins_grows_the_job_which_resumes_where_it_stopped(tmp_path):
    run_dir, port, first = start_first_node(tmp_path)
    procs = [first, agent(run_dir, port, tmp_path / "node2.log")]
    deadline = time.monotonic() + 90
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
                p.wait()
    logs = sorted(tmp_path.glob("node*.log"))
    outs = "\n=====\n".join(f"{log.name}:\n{log.read_text()[-3000:]}" for log in logs)
    assert [p.returncode for p in procs] == [0, 0], outs

    summary = read_json(run_dir / "summary.json")
    stopped = summary["resumed_from_step"]
    assert summary["world_size"] == 2 and summary["steps"] == MAX_STEPS, summary
    assert stopped and 5 <= stopped < MAX_STEPS, summary  # resumed from the checkpoint of the stop, not from 0
    attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    attempts = [a for a in attempts if a["event"] in ("start", "end")]  # the run ledger's other lines aside
    assert [(a["event"], a.get("outcome")) for a in attempts] == [("start", None), ("end", "preempted"),
                                                                 ("start", None), ("end", "done")], attempts
    assert attempts[1]["step"] == stopped and attempts[2]["latest"] == stopped, attempts

    steps = [r["step"] for r in train_steps(run_dir)]
    assert stopped in steps, f"step {stopped}, the one the stop came after, has no record (logged: ...{steps[stopped - 3:stopped + 2]})"
    assert steps == list(range(1, MAX_STEPS + 1)), "each step logged once, in order"
    world = {r["step"]: len(r["ranks"]) for r in train_steps(run_dir)}
    assert {world[s] for s in steps if s <= stopped} == {1} and {world[s] for s in steps if s > stopped} == {2}

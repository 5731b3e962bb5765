"""A node replaced whole rejoins: two torchrun agents as two hosts (network namespaces, tests/netns.py),
c10d rendezvous on nodea, launch/torchrun.sh (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), MAX_RESTARTS=2 and
the memory tier on, each node with its own memory folder. Node B is lost as a whole (every process in
its namespace SIGKILLed, its memory folder removed) and a fresh agent starts the same command there.

torchrun counts restarts per agent (TORCHELASTIC_RESTART_COUNT, pytorch/pytorch#108158): the survivor's
rank is at attempt 1, the fresh node's at attempt 0. ddp_kit named its rendezvous keys after that count,
so the two ranks looked for each other under different keys, each waited init_timeout_s and failed, at
every restart. Keyed by the rendezvous round, the job resumes from the copy of node B's state that node A
holds and ends bit-identical to an uninterrupted run.

The same counts apart, elastically: a node joins a job whose first node torchrun restarted once (two agents
on loopback, NNODES=1:2, as tests/dist/test_elastic.py)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import netns
from conftest import REFERENCE_2_EPOCHS, ROOT, proc_env, read_json

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not netns.AVAILABLE, reason="needs root, iproute2 and unshare")]

# A durable checkpoint every 10 steps, a memory copy every 3 (later flags win over the reference's);
# the first attempt is slowed (rank 0 only, 250 ms a step: a fault of the first attempt only) so that
# the kill lands mid-run; the resumed attempt runs at full speed. A bound on the rendezvous short
# enough that today's failure (every rank waits it out, at each restart) ends within the test's bound.
ARGS = [*REFERENCE_2_EPOCHS, "--ckpt_every", "10", "--mem_ckpt_every", "3", "--inject", "slow:rank=0:step=1:ms=250",
        "--init_timeout_s", "45", "--hang_timeout_s", "60"]


@pytest.fixture
def hosts():
    with netns.hosts(["nodea", "nodeb"], subnet="10.232.0") as made:
        yield {h.name: h for h in made}


def agent(host: netns.Host, nproc: int, run_dir: Path, mem: Path, log: Path) -> subprocess.Popen:
    env = proc_env({"NNODES": "2", "NPROC_PER_NODE": str(nproc), "RDZV_HOST": "nodea", "RDZV_PORT": "29513",
                    "RDZV_ID": "replaced", "MAX_RESTARTS": "2", "PYTHON": sys.executable, "DDP_KIT_MEM_DIR": str(mem),
                    "RDZV_CONF": "join_timeout=90,keep_alive_interval=1,keep_alive_max_attempt=2"})
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # launch/torchrun.sh sets it, as README asks
    with open(log, "a") as out:
        return subprocess.Popen(host.command("bash", str(ROOT / "launch" / "torchrun.sh"), *ARGS,
                                             "--run_dir", str(run_dir)),
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def peer_copy_step(mem: Path, rank: int) -> int:
    """The newest complete copy of `rank`'s state a node holds (0: none)."""
    steps = [0]
    for manifest in mem.rglob("manifest.json") if mem.exists() else ():
        if not manifest.parent.name.startswith(f"peer-r{rank}-"):
            continue
        try:
            steps.append(int(json.loads(manifest.read_text())["step"]))
        except (OSError, ValueError, KeyError):
            continue  # being written
    return max(steps)


def lose(host: netns.Host) -> None:
    """Every process of the host: its agent and its workers (they run in sessions of their own)."""
    for _ in range(3):  # a process may fork while we kill
        pids = subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.2)


# 2 ranks a node (1 a node was checked too, and costs the suite its time): the survivor's ranks 0, 1 and
# the fresh node's ranks 2, 3 meet, and each of the lost node's ranks resumes from its own peer copy.
@pytest.mark.parametrize("nproc", [2])
def test_a_node_replaced_whole_rejoins_and_the_job_ends_bit_identical(hosts, tmp_path, reference_summary, nproc):
    ref = reference_summary(2 * nproc, REFERENCE_2_EPOCHS)
    run_dir, mem_a, mem_b = tmp_path / "run", tmp_path / "mem_a", tmp_path / "mem_b"
    logs = {"a": tmp_path / "nodea.log", "b1": tmp_path / "nodeb_lost.log", "b2": tmp_path / "nodeb_fresh.log"}
    first_a = agent(hosts["nodea"], nproc, run_dir, mem_a, logs["a"])
    lost_b = agent(hosts["nodeb"], nproc, run_dir, mem_b, logs["b1"])
    procs = [first_a, lost_b]

    def said() -> str:
        return "\n=====\n".join(f"{name}:\n{path.read_text()[-4000:]}" for name, path in logs.items() if path.exists())

    try:
        deadline = time.monotonic() + 120
        def held() -> int:  # the newest step node A holds a copy of for every rank of node B
            return min(peer_copy_step(mem_a, rank) for rank in range(nproc, 2 * nproc))

        while time.monotonic() < deadline and first_a.poll() is None and held() < 6:
            time.sleep(0.2)
        assert held() >= 6, f"node A never held a copy of node B's state\n{said()}"
        lose(hosts["nodeb"])
        shutil.rmtree(mem_b, ignore_errors=True)  # the node's memory goes with it
        fresh_b = agent(hosts["nodeb"], nproc, run_dir, mem_b, logs["b2"])
        procs.append(fresh_b)
        for p in (first_a, fresh_b):
            p.wait(timeout=max(1.0, deadline + 120 - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                lose(hosts["nodea"])
                lose(hosts["nodeb"])
                p.wait()
    assert (first_a.returncode, fresh_b.returncode) == (0, 0), said()
    summary = read_json(run_dir / "summary.json")
    resumed = summary["resumed_from_step"]
    assert resumed and resumed >= 6, summary
    assert "resumed from the peer copy on node 0" in logs["a"].read_text(), said()
    assert summary["param_sha256"] == ref["param_sha256"]


# ---- a node joins an elastic job whose first node torchrun restarted: agents at counts 1 and 0 ----
GROW_STEPS = 600
# Rank 0 kills itself at step 3 of the first attempt (torchrun restarts node 1: its count is 1), and
# trains 120 ms a step on every attempt, so that node 2 joins mid-run on a loaded machine: 600 steps are
# 72 s, longer than node 2's start-up (bash, torchrun, a torch import, the rendezvous) on 2 busy cores
# (at 40 ms, 24 s: node 1 could finish alone first).
GROW_ARGS = ["--max_steps", str(GROW_STEPS), "--epochs", "30", "--log_every", "1", "--ckpt_every", "1000", "--progress", "false",
             "--eval_every_epoch", "false", "--inject", "kill:rank=0:step=3,slow:rank=0:step=1:ms=120:always=1",
             "--hang_timeout_s", "60", "--init_timeout_s", "30"]


def local_agent(run_dir: Path, port: int, log: Path) -> subprocess.Popen:
    env = proc_env({"NNODES": "1:2", "NPROC_PER_NODE": "1", "RDZV_HOST": "127.0.0.1", "RDZV_PORT": str(port),
                    "RDZV_ID": "grow_after_restart", "MAX_RESTARTS": "1", "PYTHON": sys.executable,
                    "RDZV_CONF": "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"})
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    with open(log, "w") as out:
        return subprocess.Popen(["bash", str(ROOT / "launch" / "torchrun.sh"), *GROW_ARGS, "--run_dir", str(run_dir)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def starts(run_dir: Path) -> int:
    path = run_dir / "attempts.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return sum(1 for line in lines if line and json.loads(line).get("event") == "start")


def kill_session(p: subprocess.Popen) -> None:
    """The agent and its workers: torchrun starts each worker in a session of its own, so every process
    whose parent chain leads to the agent."""
    parent = {}
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    tree, frontier = [p.pid], [p.pid]
    while frontier:
        frontier = [child for child, ppid in parent.items() if ppid in frontier]
        tree += frontier
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_node_joins_after_torchrun_restarted_the_first(tmp_path):
    """torchrun counts restarts per agent: the first node's worker is at 1 after its restart, the
    joining node's at 0, and the job grows anyway. Keys named after the count never met."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    first = local_agent(run_dir, port, tmp_path / "node1.log")
    procs = [first]
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline and first.poll() is None and starts(run_dir) < 2:
            time.sleep(0.2)
        assert starts(run_dir) == 2, "node 1 was not restarted\n" + (tmp_path / "node1.log").read_text()[-3000:]
        procs.append(local_agent(run_dir, port, tmp_path / "node2.log"))
        for p in procs:  # up to 72 s of steps after the join, and the re-rendezvous: 150 s on a loaded machine
            p.wait(timeout=max(1.0, deadline + 150 - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                kill_session(p)
                p.wait()
    outs = "\n=====\n".join(f"{log.name}:\n{log.read_text()[-3000:]}" for log in sorted(tmp_path.glob("node*.log")))
    assert [p.returncode for p in procs] == [0, 0], outs
    summary = read_json(run_dir / "summary.json")
    assert summary["world_size"] == 2 and summary["steps"] == GROW_STEPS and summary["resumed_from_step"], summary

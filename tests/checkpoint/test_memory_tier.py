"""The memory tier with real processes: a SIGKILLed worker resumes from its node's memory, a lost node
from the copy its peer node holds, both lost from the durable tier; a damaged copy is refused in one
line and the next one is used; every recovery is bit-identical to an uninterrupted run.

Two "nodes" are two torchrun agents on loopback (static rendezvous), one rank each, each with its
own memory folder (DDP_KIT_MEM_DIR): on one machine /dev/shm is shared, so the folders stand for two
hosts' memories. Wiping a folder is losing that node's memory."""
import json
import shutil
import socket
import subprocess
import sys

import pytest

from conftest import REFERENCE_2_EPOCHS, ROOT, ok, proc_env, read_json, run_cmd, torchrun
from procs import outcome

pytestmark = pytest.mark.integration

# A durable checkpoint every 10 steps, a memory copy every 3: a kill at step 14 finds step 12 in memory.
TIERS = ["--ckpt_every", "10", "--mem_ckpt_every", "3"]
ARGS = [*REFERENCE_2_EPOCHS, *TIERS]  # later flags win: the reference's weights, other checkpoint steps
# The step-12 copy must be sealed and sent before the kill: the steps after it are slowed to 100 ms.
KILL = "slow:rank=0:step=12:ms=100,kill:rank=1:step=14"


def copies(mem) -> dict[str, int]:
    """{"own-r0-s1": 12, ...}: the complete copies (those with a manifest) in a node's memory folder."""
    return {m.parent.name: json.loads(m.read_text())["step"] for m in mem.glob("*/*/manifest.json")}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # fsdp: each rank's copy holds its shards
def test_killed_worker_resumes_from_its_nodes_memory(tmp_path, reference_summary, strategy):
    mem = tmp_path / "shm"
    res = torchrun(["-m", "ddp_kit.train", *ARGS, "--strategy", strategy, "--inject", KILL, "--run_dir", str(tmp_path / "run")],
                   extra=["--max-restarts=1"], env={"DDP_KIT_MEM_DIR": str(mem)})
    ok(res)
    assert "resumed from the memory tier" in res.stdout and "of step 12" in res.stdout, res.stdout
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["resumed_from_step"] == 12
    reference = REFERENCE_2_EPOCHS if strategy == "ddp" else (*REFERENCE_2_EPOCHS, "--strategy", strategy)
    assert summary["param_sha256"] == reference_summary(2, reference)["param_sha256"]
    # A clean end frees the node's memory: nothing of the job is left but the node's identity.
    assert [p.name for p in mem.iterdir()] == ["node_id"]
    status = json.loads(run_cmd([sys.executable, "-m", "ddp_kit.status", str(tmp_path / "run"), "--json"]).stdout)
    assert status["spared"] == {"memory": 2}  # the durable step 10 -> 12
    assert status["attempts"][1]["resumed_tier"] == "memory"


def test_damaged_copy_is_refused_and_the_next_used(tmp_path, reference_summary):
    """A flipped byte in rank 1's newest copy: named once, and both ranks take the step before it."""
    mem, run = tmp_path / "shm", tmp_path / "run"
    env = {"DDP_KIT_MEM_DIR": str(mem)}
    res = torchrun(["-m", "ddp_kit.train", *ARGS, "--inject", KILL, "--run_dir", str(run)], env=env)
    assert res.returncode != 0
    newest = list(mem.glob("*/own-r1-*"))
    folder = max(newest, key=lambda f: json.loads((f / "manifest.json").read_text())["step"])
    data = bytearray((folder / "data.bin").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "data.bin").write_bytes(bytes(data))
    res = ok(torchrun(["-m", "ddp_kit.train", *ARGS, "--run_dir", str(run)], env=env))
    refused = [line for line in res.stdout.splitlines() if "is not usable" in line]
    assert len(refused) == 1 and "sha256" in refused[0] and folder.name in refused[0], res.stdout
    summary = read_json(run / "summary.json")
    assert summary["resumed_from_step"] == 10  # step 9 in memory is older than the durable step 10
    assert summary["param_sha256"] == reference_summary(2, REFERENCE_2_EPOCHS)["param_sha256"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(tmp_path, *extra) -> list[tuple[int, str]]:
    """One attempt of the job on two loopback "nodes" of one rank each; (exit code, output) of each agent."""
    port = _free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1",
               "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "ddp_kit.train", *ARGS,
               "--run_dir", str(tmp_path / "run"), *extra]
        env = proc_env({"DDP_KIT_MEM_DIR": str(tmp_path / f"node{node}")})
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    return [outcome(p, timeout=120) for p in procs]


@pytest.mark.parametrize("lost", ["node1", "both"])
def test_lost_node_resumes_from_the_peer_copy(tmp_path, reference_summary, lost):
    first = two_nodes(tmp_path, "--inject", KILL)
    assert all(code != 0 for code, _ in first), first
    # Each node holds its own step 12 and the other's: rank 1's state lives on in node 0's memory.
    assert copies(tmp_path / "node0").get("peer-r1-s1") == 12, copies(tmp_path / "node0")
    for node in (["node1"] if lost == "node1" else ["node0", "node1"]):
        shutil.rmtree(tmp_path / node)  # the node is gone with its memory; the restart gets a fresh one
    second = two_nodes(tmp_path)
    assert all(code == 0 for code, _ in second), second
    said = second[0][1]
    summary = read_json(tmp_path / "run" / "summary.json")
    if lost == "node1":
        assert "resumed from the peer copy on node 0 of step 12" in said, said
        assert summary["resumed_from_step"] == 12
    else:
        assert "resumed from" in said and "checkpoints/step_10" in said, said
        assert summary["resumed_from_step"] == 10
    assert summary["param_sha256"] == reference_summary(2, REFERENCE_2_EPOCHS)["param_sha256"]

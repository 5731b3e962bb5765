"""The memory tier keeps the durable path's promises, with real processes (issue 44, items 1-5):
a root another user can write into is refused; a new run at the same place never resumes an old run's
copy; a step resumed from memory at the end is saved durably; a job in another pid namespace keeps its
copies; a peer copy one node cannot take costs one warning, not a stalled job."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from test_memory_tier import ARGS, KILL, copies, two_nodes

from conftest import REFERENCE_2_EPOCHS, ROOT, ok, proc_env, read_json, run_cmd, torchrun
from procs import outcome

pytestmark = pytest.mark.integration


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's workers: each in a session of its own)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant a folder as another user")
def test_a_root_planted_by_another_user_is_refused(tmp_path):
    """Another user made the tier's folder first and put a copy of step 1000 in it: the job refuses the
    folder in one line, and trains nothing from it."""
    planted = tmp_path / "shm"
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    os.chown(planted, 65534, 65534)
    res = run_cmd([sys.executable, "-m", "ddp_kit.train", *ARGS, "--run_dir", str(tmp_path / "run")],
                  env={"DDP_KIT_MEM_DIR": str(planted)})
    assert res.returncode == 2, res.stderr[-3000:]
    said = [line for line in res.stderr.splitlines() if "ddp_kit: error:" in line]
    assert len(said) == 1 and "is not yours alone" in said[0] and "belongs to user 65534" in said[0], res.stderr[-3000:]


def test_a_new_run_at_the_same_place_never_resumes_the_old_runs_copy(tmp_path, reference_summary):
    """A run killed at step 14 leaves step 12 in memory; the user deletes its run folder and starts the
    same command: a new run, from step 0, and the old run's copies are freed."""
    mem, run = tmp_path / "shm", tmp_path / "run"
    env = {"DDP_KIT_MEM_DIR": str(mem)}
    first = torchrun(["-m", "ddp_kit.train", *ARGS, "--inject", KILL, "--run_dir", str(run)], env=env)
    assert first.returncode != 0 and 12 in copies(mem).values(), (copies(mem), first.stderr[-2000:])
    shutil.rmtree(run)
    again = ok(torchrun(["-m", "ddp_kit.train", *ARGS, "--run_dir", str(run)], env=env))
    assert "resumed from" not in again.stdout, again.stdout
    assert read_json(run / "summary.json")["resumed_from_step"] is None
    assert read_json(run / "summary.json")["param_sha256"] == reference_summary(2, REFERENCE_2_EPOCHS)["param_sha256"]
    assert [p.name for p in mem.iterdir()] == ["node_id"]  # the old run's folder went with the new run's start
    # the loop's waits for the tier are in the ledger's log windows (status books them as checkpoint time)
    windows = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines() if '"progress"' in line]
    assert any(w.get("mem_s", 0) > 0 for w in windows), windows


def test_the_final_step_resumed_from_memory_is_saved_durably(tmp_path, reference_summary):
    """Killed after the memory copy of the last step (44) and during the final durable save: the
    restart resumes step 44 from memory, has nothing left to train, and still saves step 44 durably."""
    mem, run = tmp_path / "shm", tmp_path / "run"
    env = proc_env({"DDP_KIT_MEM_DIR": str(mem)})
    args = [*REFERENCE_2_EPOCHS, "--ckpt_every", "0", "--mem_ckpt_every", "4", "--run_dir", str(run)]
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              "-m", "ddp_kit.train", *args, "--debug_ckpt_delay_s", "30"],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        end = time.monotonic() + 120
        while sorted(copies(mem).values()).count(44) < 2 and agent.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        assert sorted(copies(mem).values()).count(44) == 2, copies(mem)
        for pid in _children(agent.pid):
            os.kill(pid, 9)  # the workers, in the final save's delayed write
    finally:
        code, out = outcome(agent, timeout=60)
    assert code != 0 and not (run / "checkpoints" / "step_44").exists(), out[-2000:]
    res = ok(torchrun(["-m", "ddp_kit.train", *args], env={"DDP_KIT_MEM_DIR": str(mem)}))
    assert "nothing left to train" in res.stdout and "of step 44" in res.stdout, res.stdout
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_44"
    ok(run_cmd([sys.executable, "-m", "ddp_kit.checkpoint", "export", str(run), str(tmp_path / "weights.safetensors"),
                "--step", "latest"]))
    assert read_json(run / "summary.json")["param_sha256"] == reference_summary(2, REFERENCE_2_EPOCHS)["param_sha256"]


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
def test_a_job_in_another_pid_namespace_keeps_its_copies(tmp_path):
    """Job A runs; job B starts on the same tmpfs from another pid namespace (a container sharing
    /dev/shm), where none of A's pids exist: B must not take A's folder for abandoned."""
    mem = tmp_path / "shm"
    env = proc_env({"DDP_KIT_MEM_DIR": str(mem)})
    # 44 steps of 1.5 s (66 s): A outlives B, a whole 44-step job started (torch import included) on a
    # loaded 2-core machine; at 0.4 s a step A could end first.
    a = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "ddp_kit.train", *ARGS, "--inject", "slow:rank=0:step=1:ms=1500",
                          "--run_dir", str(tmp_path / "a")],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        end = time.monotonic() + 120
        while not copies(mem) and a.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        folders = [p for p in mem.iterdir() if p.is_dir()]
        assert len(folders) == 1, (folders, a.poll())
        made = os.stat(folders[0]).st_ino  # A's next save would make a removed folder anew: the inode tells
        b = run_cmd(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "ddp_kit.train",
                     *ARGS, "--run_dir", str(tmp_path / "b")], env={"DDP_KIT_MEM_DIR": str(mem)})
        ok(b)
        assert a.poll() is None, "job A ended before job B did: slow it down further"
        assert os.stat(folders[0]).st_ino == made, f"job B removed the live job A's copies\n{b.stdout[-2000:]}"
    finally:
        code, out = outcome(a, timeout=180)  # A's 66 s of steps and its saves, with room for a loaded machine
    assert code == 0, out[-3000:]
    assert "lost its copy" not in out, out[-3000:]


def test_a_peer_copy_one_node_cannot_take_costs_one_warning(tmp_path, reference_summary):
    """Node 1 cannot open the slot for node 0's copy (its place is taken: as a full tmpfs would): each
    such copy is lost with one warning on node 1, and neither node waits for the other."""
    from ddp_kit.checkpoint.memory_tier import job_key

    run = tmp_path / "run"
    run.mkdir()
    (run / ".run_id").write_text("ab" * 16)  # the run's identity, known ahead: so is its folder's name
    folder = tmp_path / "node1" / job_key(os.path.realpath(run / "checkpoints"), "ab" * 16)
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "node1", 0o700)
    (folder / "peer-r0-s0").write_text("in the way")
    start = time.monotonic()
    result = two_nodes(tmp_path)
    took = time.monotonic() - start
    assert all(code == 0 for code, _ in result), result
    warned = [line for line in result[1][1].splitlines() if "lost the peer copy from rank 0" in line]
    assert len(warned) == 1, result[1][1][-3000:]
    assert took < 100, f"{took:.0f}s: a side waited for a copy that never came"
    assert read_json(run / "summary.json")["param_sha256"] == reference_summary(2, REFERENCE_2_EPOCHS)["param_sha256"]


def test_latest_never_names_a_step_only_memory_holds(tmp_path, reference_summary):
    """Resumed from memory at step 12 (durable: 10), the attempt dies again before any durable save: `latest`
    still names step_10, which exists, and the next attempt resumes step 12 from memory again."""
    mem, run = tmp_path / "shm", tmp_path / "run"
    env = {"DDP_KIT_MEM_DIR": str(mem)}
    first = torchrun(["-m", "ddp_kit.train", *ARGS, "--inject", KILL, "--run_dir", str(run)], env=env)
    assert first.returncode != 0
    again = torchrun(["-m", "ddp_kit.train", *ARGS, "--inject", "kill:rank=1:step=13:always=1", "--run_dir", str(run)],
                     env=env)
    assert again.returncode != 0 and "of step 12" in again.stdout, again.stdout[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_10"
    last = ok(torchrun(["-m", "ddp_kit.train", *ARGS, "--run_dir", str(run)], env=env))
    assert "of step 12" in last.stdout, last.stdout[-3000:]
    summary = read_json(run / "summary.json")
    assert summary["resumed_from_step"] == 12
    assert summary["param_sha256"] == reference_summary(2, REFERENCE_2_EPOCHS)["param_sha256"]

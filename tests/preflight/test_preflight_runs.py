"""The gate in real processes on one host: `python -m ddp_kit.doctor --preflight` alone (under torchrun, with
--json; and a folder that cannot be made), and the ledger's memory where the launcher cannot leave a host out
(a warning, and the run goes on)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import sys

import pytest

from conftest import ok, run_cmd, torchrun

pytestmark = pytest.mark.integration


def test_doctor_preflight_under_torchrun_prints_json_and_says_healthy(tmp_path):
    res = ok(torchrun(["-m", "ddp_kit.doctor", "--preflight", "--json", "--run_dir", str(tmp_path / "run"),
                       "--shm_mb", "1"], nproc=2))
    report = json.loads(res.stdout)
    assert report["healthy"] is True and report["mode"] == "quick", report
    checks = {r["check"]: r for r in report["results"]}
    assert checks["run_dir"]["ok"] and checks["shm"]["ok"] and checks["gpu_matmul"]["ok"], checks
    assert checks["gpu_health"].get("skipped") and checks["network"].get("skipped"), checks  # no GPU; one host
    assert list(report["hosts"]) == [socket.gethostname()] and report["seconds"] > 0, report


def test_doctor_preflight_names_a_folder_it_cannot_make_and_exits_2(tmp_path):
    (tmp_path / "file").write_text("x")
    res = run_cmd([sys.executable, "-m", "ddp_kit.doctor", "--preflight", "--mode", "thorough", "--run_dir",
                   str(tmp_path / "run"), "--ckpt_dir", str(tmp_path / "file" / "ck")])
    assert res.returncode == 2, res.stdout + res.stderr
    fails = [line for line in res.stdout.splitlines() if "[FAIL]" in line]
    assert len(fails) == 1 and "checkpoints" in fails[0] and "is not a folder" in fails[0], res.stdout
    assert f"unhealthy: {socket.gethostname()}" in res.stdout and "(thorough)" in res.stdout, res.stdout


def test_a_host_failed_twice_is_a_warning_where_it_cannot_be_left_out(tmp_path):
    """Two infrastructure ends naming this host, in this launch (DDP_KIT_LAUNCH_ID): a single process cannot
    leave its own host, so it warns once and trains."""
    run_dir, host = tmp_path / "run", socket.gethostname()
    run_dir.mkdir()
    lines = []
    for n in (1, 2):
        lines += [{"event": "start", "t": 1000.0 + n, "attempt": n, "launch": "DDP_KIT_LAUNCH_ID t1", "hosts": [host], "latest": None},
                  {"event": "end", "t": 1000.5 + n, "attempt": n, "exit": 1, "outcome": "failed", "step": 0,
                   "verdict": "infrastructure", "retryable": True, "host": host, "cause": f"ECC error {n}",
                   "error": "RuntimeError: CUDA error: uncorrectable ECC error encountered"}]
    (run_dir / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    res = ok(run_cmd([sys.executable, "-m", "ddp_kit.train", "--run_dir", str(run_dir), "--max_steps", "4",
                      "--progress", "false"], env={"DDP_KIT_LAUNCH_ID": "t1"}))
    warned = [line for line in res.stderr.splitlines() if "ended 2 attempts of this launch" in line]
    assert len(warned) == 1 and "ECC error 1" in warned[0] and f"kubectl cordon {host}" in warned[0], res.stderr
    gate = [r for r in map(json.loads, (run_dir / "attempts.jsonl").read_text().splitlines()) if r["event"] == "health"]
    assert len(gate) == 1 and gate[0]["per_host"][host]["ok"] and gate[0]["attempt"] == 3, gate


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="mounts a tmpfs in a mount namespace")
def test_a_first_start_names_a_tmpfs_without_room_for_the_state_before_step_1(tmp_path):
    """No checkpoint yet, the memory tier on, its tmpfs 3 MiB: the probe's megabyte fits, two copies of the
    reference MLP (hidden 4096: 1.2 MiB of parameters) with AdamW's moments (7 MiB) do not. Named at run.resume,
    before step 1, exit 1."""
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    train = shlex.join([sys.executable, "-m", "ddp_kit.train", "--run_dir", str(run_dir), "--max_steps", "4",
                        "--model_args", '{"hidden": 4096}', "--mem_ckpt_every", "2", "--progress", "false"])
    res = run_cmd(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   f"mount -t tmpfs -o size=3m,mode=0700 tmpfs {shm} && exec {train}"], env={"DDP_KIT_MEM_DIR": str(shm)})
    assert res.returncode == 1, res.stdout + res.stderr
    named = [line for line in res.stderr.splitlines() if "health check failed on" in line]
    assert len(named) == 1 and ": shm (" in named[0] and "memory tier's copies" in named[0], res.stderr
    records = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records if r["event"] in ("health", "first_step")] == ["health", "health"], records
    assert [r["verdict"] for r in records if r["event"] == "end"] == ["infrastructure"], records

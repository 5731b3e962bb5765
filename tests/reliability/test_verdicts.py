"""One verdict per attempt in the run ledger (run_dir/attempts.jsonl), with the documented exit code,
for faults made with real processes: signals, an exception in the loop, bad input, a hang, a lost rank,
and an exception that repeats at the same step under torchrun --max-restarts.

Not made here (say so, do not fake): out of memory needs a GPU to be the real thing (the classification
of torch's OutOfMemoryError is in tests/reliability/test_verdicts_unit.py); a full disk needs a filesystem of its own."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, proc_env
from procs import outcome

pytestmark = [pytest.mark.integration]

TRAIN = [sys.executable, "-m", "ddp_kit.train", "--progress", "false", "--log_every", "5"]


def ledger(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "attempts.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def ends(run_dir: Path) -> list[dict]:
    return [r for r in ledger(run_dir) if r["event"] == "end"]


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=proc_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(p: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    return outcome(p, timeout)


def wait_step(run_dir: Path, step: int, p: subprocess.Popen, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    path = run_dir / "attempts.jsonl"
    while time.monotonic() < end and p.poll() is None:
        if path.exists() and any(r["event"] == "progress" and r["step"] >= step for r in ledger(run_dir)):
            return
        time.sleep(0.05)
    code, out = finish(p, 5) if p.poll() is not None else (None, "")
    pytest.fail(f"never reached step {step} (exit {code})\n{out[-4000:]}")


@pytest.mark.parametrize("sig, code, verdict", [(signal.SIGTERM, 75, "preempted"), (signal.SIGUSR2, 75, "preempted"),
                                                (signal.SIGINT, 130, "interrupted")])
def test_a_stop_signal_is_its_verdict_and_exit_code(tmp_path, sig, code, verdict):
    run = tmp_path / "r"
    p = start([*TRAIN, "--run_dir", str(run), "--max_steps", "100000", "--epochs", "100000",
               "--inject", "slow:rank=0:step=1:ms=5"])
    wait_step(run, 10, p)
    os.kill(p.pid, sig)
    rc, out = finish(p)
    assert rc == code, out[-3000:]
    (end,) = ends(run)
    assert (end["verdict"], end["exit"], end["retryable"]) == (verdict, code, verdict == "preempted"), end


def test_an_exception_in_the_loop_is_a_program_error_with_rank_and_step(tmp_path):
    run = tmp_path / "r"
    rc, out = finish(start([*TRAIN, "--run_dir", str(run), "--max_steps", "30", "--inject", "raise:rank=0:step=7"]))
    assert rc == 1, out[-3000:]
    (end,) = ends(run)
    assert (end["verdict"], end["retryable"], end["rank"], end["step"]) == ("program_error", True, 0, 7), end
    assert "injected fault" in end["cause"] and end["host"]


def test_bad_input_is_a_user_error_not_retryable(tmp_path):
    run = tmp_path / "r"
    rc, out = finish(start([*TRAIN, "--run_dir", str(run), "--dataset", "mnist", "--data_root", str(tmp_path / "none")]))
    assert rc == 2, out[-3000:]
    (end,) = ends(run)
    assert (end["verdict"], end["retryable"], end["exit"]) == ("user_error", False, 2), end


def test_a_hang_is_written_by_the_watchdog_with_the_stall(tmp_path):
    run = tmp_path / "r"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "ddp_kit.train",
           "--progress", "false", "--log_every", "5", "--run_dir", str(run), "--max_steps", "200",
           "--hang_timeout_s", "3", "--inject", "hang:rank=1:step=8"]
    rc, out = finish(start(cmd), timeout=150)
    assert rc != 0, out[-3000:]
    (end,) = ends(run)
    assert (end["verdict"], end["exit"], end["retryable"]) == ("hang", 3, True), end
    assert end["stalled_s"] >= 3, end


def test_a_killed_rank_is_a_lost_peer_on_rank_0_and_a_killed_attempt_leaves_its_step(tmp_path):
    run = tmp_path / "r"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "ddp_kit.train",
           "--progress", "false", "--log_every", "5", "--run_dir", str(run), "--max_steps", "200",
           "--inject", "kill:rank=1:step=9"]
    rc, out = finish(start(cmd), timeout=150)
    assert rc != 0, out[-3000:]
    (end,) = ends(run)
    assert (end["verdict"], end["retryable"]) == ("lost_peer", True), (end, out[-3000:])
    # Rank 0 itself SIGKILLed: no end line; the next attempt's start says where it was.
    run2 = tmp_path / "r2"
    rc, out = finish(start([*TRAIN, "--run_dir", str(run2), "--max_steps", "30", "--ckpt_every", "4",
                            "--inject", "kill:rank=0:step=11"]))
    assert rc == -signal.SIGKILL, out[-3000:]
    assert ends(run2) == []
    rc, out = finish(start([*TRAIN, "--run_dir", str(run2), "--max_steps", "30", "--ckpt_every", "4"]))
    assert rc == 0, out[-3000:]
    second = [r for r in ledger(run2) if r["event"] == "start"][1]
    assert second["killed_before"]["step"] in (10, 11), second  # after step 10's boundary, in step 11
    assert [r for r in ledger(run2) if r["event"] == "resume"][-1]["step"] == 8


def test_the_same_exception_at_the_same_step_stops_at_the_second_attempt_under_torchrun_restarts(tmp_path):
    run = tmp_path / "r"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "5",
           "--monitor-interval", "0.5", "-m", "ddp_kit.train", "--progress", "false", "--log_every", "5",
           "--run_dir", str(run), "--max_steps", "30", "--ckpt_every", "4",
           "--inject", "raise:rank=1:step=6:always=1"]
    rc, out = finish(start(cmd), timeout=240)
    assert rc != 0, out[-3000:]
    records = ledger(run)
    starts = [r for r in records if r["event"] == "start"]
    first, second = ends(run)
    assert len(starts) == 2, out[-4000:]  # every later restart is refused before it trains
    assert (first["verdict"], first["retryable"], first["exit"], first["rank"]) == ("program_error", True, 1, 1), first
    assert (second["verdict"], second["retryable"], second["exit"]) == ("program_error", False, 2), second
    refused = [r for r in records if r["event"] == "refused"]
    assert refused and all(r["why"] == "deterministic" for r in refused), records[-3:]
    assert "deterministic" in out and "not retrying, exiting with 2" in out


def test_a_deterministic_failure_leaves_a_torchrun_pod_with_exit_2(tmp_path):
    """The Kubernetes torchrun-per-pod layout: pod.sh runs torchrun, torchrun runs each rank through
    rank.sh, and torchrun turns any failed worker into its own exit 1; the pod must still end 2 (the
    templates' "do not retry") at the attempt that repeats the failure. The engine's restart of the pod
    is played by running the same pod command again."""
    from ddp_kit.launch.k8s import _script

    run = tmp_path / "r"
    pod = ["sh", "-c", _script("pod.sh"), "ddp_kit-pod", "75", "0", sys.executable, "-m", "torch.distributed.run",
           "--nproc_per_node", "2", "--no-python", "sh", "-c", _script("rank.sh"), "ddp_kit-rank",
           sys.executable, "-m", "ddp_kit.train", "--progress", "false", "--run_dir", str(run), "--max_steps", "30",
           "--ckpt_every", "4", "--inject", "raise:rank=1:step=6:always=1"]
    env = {"DDP_KIT_PREEMPT_MARK": str(tmp_path / "mark")}
    first, out1 = finish(start(pod, env), timeout=150)
    second, out2 = finish(start(pod, env), timeout=150)
    assert (first, second) == (1, 2), (out1[-2000:], out2[-3000:])
    assert "exiting 2 so that the engine does not restart this pod" in out2
    assert [e["retryable"] for e in ends(run)] == [True, False]

"""Fault-tolerant data parallelism (strategy ft) with real processes: `python -m ddp_kit.launch ft`
starts torchft's lighthouse and one torchrun per replica group on loopback (gloo, CPU); the tests kill
a group's worker by PID (a process of this test: found by the launcher's group token in its
environment) and read what each group wrote (run_dir/replica_<g>/metrics.jsonl, summary.json)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, kill_marked, proc_env, read_json, run_cmd

pytest.importorskip("torchft")
pytestmark = [pytest.mark.integration]

SLOW = ["--inject", "slow:rank=0:step=1:ms=40"]  # a stable step time, so that a kill lands mid-run


def launch(run_dir: Path, groups: int, nproc: int, *train: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ddp_kit.launch", "ft", "--groups", str(groups), "--nproc_per_node", str(nproc),
           "--", "--run_dir", str(run_dir), *train]
    return subprocess.Popen(cmd, cwd=ROOT, env=proc_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(p: subprocess.Popen, timeout: float = 240) -> tuple[str, str]:
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        kill_marked(p)
        out, err = p.communicate()
        pytest.fail(f"timed out after {timeout}s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}")


def abandon(p: subprocess.Popen) -> None:
    """A failed test's launch: every process of it killed, and what it printed shown."""
    kill_marked(p)
    os.killpg(p.pid, signal.SIGKILL)
    out, err = p.communicate()
    print((out + err)[-6000:])


def records(run_dir: Path, group: int) -> list[dict]:
    path = run_dir / f"replica_{group}" / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # the line being written
            pass
    return out


def wait_step(run_dir: Path, group: int, step: int, p: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and p.poll() is None:
        if any(r.get("event") == "train" and r["step"] >= step for r in records(run_dir, group)):
            return
        time.sleep(0.1)
    out, err = (p.communicate() if p.poll() is not None else ("", ""))
    pytest.fail(f"group {group} never reached step {step} (exit {p.poll()})\n{err[-4000:]}")


def workers(launcher: subprocess.Popen, group: int) -> dict[int, int]:
    """{group rank: pid} of the ddp_kit workers of `group`'s first start, by the launcher's token."""
    token = f"DDP_KIT_FT_GROUP_TOKEN={launcher.pid}-{group}-0".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if token in env and cmd[1:3] == [b"-m", b"ddp_kit.train"]:  # the worker, not its rank shim (sh -c ...)
            rank = next((int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"RANK=")), None)
            if rank is not None:
                found[rank] = int(entry.name)
    return found


def kill_worker(launcher: subprocess.Popen, group: int, rank: int) -> None:
    end = time.monotonic() + 20
    while time.monotonic() < end:
        pids = workers(launcher, group)
        if rank in pids:
            os.kill(pids[rank], signal.SIGKILL)
            return
        time.sleep(0.1)
    pytest.fail(f"no worker of group {group} rank {rank} found")


def events(run_dir: Path, group: int, kind: str) -> list[dict]:
    return [r for r in records(run_dir, group) if r.get("event") == kind]


def stop_after_recovery(p: subprocess.Popen, run_dir: Path, more: int = 10, timeout: float = 180) -> tuple[str, str, int]:
    """Wait until group 1 has recovered and trained `more` steps beside group 0, then SIGTERM the
    launcher: both groups stop after one agreed step and save it. (A run of fixed length could end
    before a restart under load; this does not depend on how fast either side is.) Returns the output
    and the step they stopped at."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and p.poll() is None:
        rec = events(run_dir, 1, "recovery")
        if rec and any(r.get("event") == "train" and r["time"] > rec[-1]["time"] and r["step"] >= rec[-1]["step"] + more
                       for r in records(run_dir, 1)):
            break
        time.sleep(0.2)
    else:
        out, err = finish(p, timeout=5) if p.poll() is not None else ("", "")
        kill_marked(p)
        pytest.fail(f"group 1 never recovered and trained {more} steps (launcher exit {p.poll()})\n{(out + err)[-6000:]}")
    os.kill(p.pid, signal.SIGTERM)  # the launcher we started: it forwards to every group
    out, err = finish(p)
    # the two groups' lines may interleave on one line of the launcher's stderr
    stops = re.findall(r"preempted by SIGTERM after step (\d+):", out + err)
    assert p.returncode == 75 and len(stops) == 2 and len(set(stops)) == 1, (out + err)[-5000:]
    return out, err, int(stops[0])


def same_weights(run_dir: Path, step: int, groups: int = 2) -> None:
    import torch

    a, *others = (torch.load(run_dir / f"replica_{g}" / "checkpoints" / f"step_{step}" / "model.pt", weights_only=True)
                  for g in range(groups))
    for b in others:
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"the groups' weights differ at step {step}"


def check_survived_and_recovered(run_dir: Path, out: str, err: str, step: int) -> None:
    text = out + err
    assert text.count("replica group 1 failed") == 1 and "replica group 0 failed" not in text, text[-5000:]
    # the restarted group took the state live although it had checkpoints of its own (ckpt_every 5)
    assert "replica group 1 recovered live from group 0" in text and "(no checkpoint read)" in text, text[-5000:]
    assert "resumed from" not in text
    rec = events(run_dir, 1, "recovery")
    assert len(rec) == 1 and rec[0]["source_group"] == 0 and rec[0]["seconds"] < 30, rec
    assert [a for a in map(json.loads, (run_dir / "replica_1" / "attempts.jsonl").read_text().splitlines())
            if a["event"] == "start"][-1]["latest"] is not None, "group 1 had a checkpoint it could have read"
    # the survivor: one quorum without group 1, at most one discarded step, never a step counted twice
    lost = [e for e in events(run_dir, 0, "quorum") if e["participants"] < e["was"]]
    assert lost, records(run_dir, 0)[-20:]
    discarded = events(run_dir, 0, "step_discarded")
    assert len(discarded) <= 1, discarded
    steps = [r["step"] for r in events(run_dir, 0, "train")]
    assert steps == sorted(set(steps)), steps
    back = [e for e in events(run_dir, 0, "quorum") if e["participants"] > e["was"]]
    assert back, "group 1 never rejoined the survivor's quorum"
    same_weights(run_dir, step)
    print(f"survivor pauses: {events(run_dir, 0, 'replica_pause')}; recovery: {rec}; stopped at {step}")


def test_a_lost_group_of_one_rank_does_not_stop_the_other_and_recovers_live(tmp_path):
    run_dir = tmp_path / "run"
    p = launch(run_dir, 2, 1, "--max_steps", "100000", "--epochs", "100000", "--log_every", "5", "--ckpt_every", "5",
               *SLOW)
    wait_step(run_dir, 1, 10, p)
    kill_worker(p, group=1, rank=0)
    out, err, step = stop_after_recovery(p, run_dir)
    check_survived_and_recovered(run_dir, out, err, step)


def test_a_lost_rank_ends_its_own_group_of_two_which_recovers_live(tmp_path):
    run_dir = tmp_path / "run"
    p = launch(run_dir, 2, 2, "--max_steps", "100000", "--epochs", "100000", "--log_every", "5", "--ckpt_every", "5",
               *SLOW)
    wait_step(run_dir, 1, 10, p)
    kill_worker(p, group=1, rank=1)  # not the group's rank 0: its rank 0 must stop too, and only its group
    out, err, step = stop_after_recovery(p, run_dir)
    check_survived_and_recovered(run_dir, out, err, step)


def test_sigterm_stops_every_group_at_one_step_and_the_rerun_is_bit_identical(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = launch(ref_dir, 2, 1, "--max_steps", "120", "--log_every", "10")
    _, err = finish(ref)
    assert ref.returncode == 0, err[-4000:]
    reference = read_json(ref_dir / "replica_0" / "summary.json")["param_sha256"]
    assert read_json(ref_dir / "replica_1" / "summary.json")["param_sha256"] == reference

    p = launch(run_dir, 2, 1, "--max_steps", "120", "--log_every", "10", *SLOW)
    wait_step(run_dir, 1, 20, p)
    os.kill(p.pid, signal.SIGTERM)  # the launcher we started: it forwards to every group
    _, err = finish(p)
    assert p.returncode == 75, err[-4000:]
    stops = re.findall(r"preempted by SIGTERM after step (\d+):", err)
    assert len(stops) == 2 and len(set(stops)) == 1, stops  # both groups, the same step
    step = int(stops[0])
    assert step < 120
    for g in (0, 1):
        assert (run_dir / f"replica_{g}" / "checkpoints" / f"step_{step}").is_dir()

    again = launch(run_dir, 2, 1, "--max_steps", "120", "--log_every", "10")
    out, err = finish(again)
    err = out + err
    assert again.returncode == 0, err[-4000:]
    assert err.count(f"(step {step}, epoch") == 2, err[-3000:]  # each group from its own checkpoint
    for g in (0, 1):
        assert read_json(run_dir / f"replica_{g}" / "summary.json")["param_sha256"] == reference


def test_an_unreachable_lighthouse_is_one_line_at_startup():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    res = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                   "-m", "ddp_kit.train", "--strategy", "ft", "--max_steps", "5"],
                  env={"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "DDP_KIT_REPLICA_GROUP": "0",
                       "DDP_KIT_REPLICA_GROUPS": "2", "DDP_KIT_FT_CONNECT_TIMEOUT_S": "2"}, timeout=120)
    errors = [line for line in res.stderr.splitlines() if line.startswith("ddp_kit: error:")]
    assert res.returncode != 0
    assert len(errors) == 1 and f"could not join the lighthouse at http://127.0.0.1:{port}" in errors[0], res.stderr[-3000:]
    assert "ddp_kit/parallel/ft.py" not in res.stderr  # no traceback of ours (torchrun prints its own)


def test_your_own_script_under_ft_survives_a_lost_group(tmp_path):
    """examples/ft/train_ft.py: a plain loop (no run.step) with the optimizer handed to run.prepare."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddp_kit.launch", "ft", "--groups", "2", "--script", "examples/ft/train_ft.py",
           "--", str(run_dir), "100000"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=proc_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    wait_step(run_dir, 1, 10, p)
    token = f"DDP_KIT_FT_GROUP_TOKEN={p.pid}-1-0".encode()
    victims = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _is_worker(e, token, b"train_ft.py")]
    assert victims, "no worker of group 1 found"
    os.kill(victims[0], signal.SIGKILL)
    out, err, step = stop_after_recovery(p, run_dir, more=20)
    assert "replica group 1 recovered live from group 0" in out + err, (out + err)[-8000:]
    same_weights(run_dir, step)


def _is_worker(entry: Path, token: bytes, script: bytes) -> bool:
    try:
        env = (entry / "environ").read_bytes().split(b"\0")
        cmd = (entry / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return token in env and len(cmd) > 1 and cmd[1].endswith(script)


def launch_script(script: str, *args: str, flags: tuple[str, ...] = (), groups: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ddp_kit.launch", "ft", "--groups", str(groups), "--script", script, *flags, "--", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=proc_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def starts(run_dir: Path, group: int) -> list[dict]:
    path = run_dir / f"replica_{group}" / "attempts.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [a for a in map(json.loads, lines) if a["event"] == "start"]


def alive(launcher: subprocess.Popen, group: int, start: int) -> bool:
    token = f"DDP_KIT_FT_GROUP_TOKEN={launcher.pid}-{group}-{start}".encode()
    return any(e.name.isdigit() and _is_worker(e, token, b"ft_loop.py") for e in Path("/proc").iterdir())


def test_a_restarted_group_waits_for_a_running_group_that_is_busy(tmp_path):
    """Group 0 stops asking for quorums (an eval, a synchronous checkpoint) while group 1 is restarted:
    group 1's first quorum waits for it, longer than the ~11 s it once waited before exiting 1."""
    run_dir = tmp_path / "run"
    p = launch_script("tests/helpers/ft_loop.py", str(run_dir), "100000", flags=("--max_restarts", "1"))
    try:
        wait_step(run_dir, 1, 10, p)
        (run_dir / "busy").write_text("")
        end = time.monotonic() + 30
        while not (run_dir / "busy_since").exists() and time.monotonic() < end:
            time.sleep(0.1)
        assert (run_dir / "busy_since").exists(), "group 0 never got busy"
        token = f"DDP_KIT_FT_GROUP_TOKEN={p.pid}-1-0".encode()
        victims = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _is_worker(e, token, b"ft_loop.py")]
        assert victims, "no worker of group 1 found"
        os.kill(victims[0], signal.SIGKILL)
        end = time.monotonic() + 60
        while len(starts(run_dir, 1)) < 2 and time.monotonic() < end:
            time.sleep(0.2)
        assert len(starts(run_dir, 1)) == 2, "group 1 was not restarted"
        end = time.monotonic() + 25  # the restarted group asks for its first quorum while group 0 is still busy
        while time.monotonic() < end:
            ended = [a for a in map(json.loads, (run_dir / "replica_1" / "attempts.jsonl").read_text().splitlines())
                     if a["event"] == "end"]
            assert alive(p, 1, 1) and not ended, f"the restarted group 1 gave up while group 0 was busy: {ended}"
            time.sleep(0.5)
    except BaseException:
        abandon(p)
        raise
    finally:
        (run_dir / "busy").unlink(missing_ok=True)  # group 0 goes on
    out, err, _ = stop_after_recovery(p, run_dir, more=5)
    assert (out + err).count("replica group 1 failed") == 1, (out + err)[-5000:]
    assert "replica group 1 recovered live from group 0" in out + err, (out + err)[-5000:]


def marked(launcher: subprocess.Popen, what: str) -> list[int]:
    token = f"DDP_KIT_FT_GROUP_TOKEN={launcher.pid}-{what}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and token in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def train_steps(run_dir: Path, group: int) -> list[int]:
    return [r["step"] for r in events(run_dir, group, "train")]


def test_a_lost_lighthouse_is_brought_back_and_the_groups_go_on(tmp_path):
    """SIGKILL the lighthouse under 3 groups: the launcher starts it again on the same port, and the groups
    go on (a new lighthouse numbers its quorums from 1 again: the groups' ids must not collide)."""
    run_dir = tmp_path / "run"
    p = launch_script("tests/helpers/ft_loop.py", str(run_dir), "100000", groups=3)
    try:
        for g in range(3):
            wait_step(run_dir, g, 20, p)
        house = marked(p, "lighthouse")
        assert len(house) == 1, house
        os.kill(house[0], signal.SIGKILL)
        killed_at = max(train_steps(run_dir, g)[-1] for g in range(3))
        end = time.monotonic() + 60  # a step's quorum used to wait out its 60 s timeout, then every group failed
        while time.monotonic() < end and p.poll() is None:
            if all(train_steps(run_dir, g)[-1] >= killed_at + 20 for g in range(3)):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the groups did not go on after the lighthouse was lost (at step {killed_at}): "
                        f"{[train_steps(run_dir, g)[-3:] for g in range(3)]}")
        assert len(marked(p, "lighthouse")) == 1
    except BaseException:
        abandon(p)
        raise
    os.kill(p.pid, signal.SIGTERM)
    out, err = finish(p)
    text = out + err
    stops = re.findall(r"preempted by SIGTERM after step (\d+):", text)
    assert p.returncode == 75 and len(stops) == 3 and len(set(stops)) == 1, text[-5000:]
    assert "failed" not in text, text[-5000:]
    said = [line for line in text.splitlines() if "lighthouse" in line and "exited" in line]
    assert len(said) == 1 and "restarted it on the same port" in said[0], text[-5000:]
    same_weights(run_dir, int(stops[0]), groups=3)
    print(f"after the lighthouse was lost: {[events(run_dir, g, 'replica_pause') for g in range(3)]}")


def test_a_group_back_after_the_job_was_finished_claims_no_result(tmp_path):
    """Group 1 is killed halfway and comes back (as its script makes sure) only after group 0 finished
    the job: it must not train the rest alone from its own checkpoint and report other weights as done."""
    run_dir = tmp_path / "run"
    p = launch_script("tests/helpers/ft_loop.py", str(run_dir), "60", "late", flags=("--restart_delay_s", "0"))
    wait_step(run_dir, 1, 30, p)
    token = f"DDP_KIT_FT_GROUP_TOKEN={p.pid}-1-0".encode()
    victims = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _is_worker(e, token, b"ft_loop.py")]
    assert victims, "no worker of group 1 found"
    os.kill(victims[0], signal.SIGKILL)
    out, err = finish(p, timeout=120)
    text = out + err
    assert p.returncode == 0, text[-5000:]
    assert read_json(run_dir / "replica_0" / "summary.json")["steps"] == 60
    assert len(starts(run_dir, 1)) == 2, text[-5000:]  # it did come back
    claimed = run_dir / "replica_1" / "summary.json"
    assert not claimed.exists(), f"group 1 claims a result: {read_json(claimed)}\n{text[-3000:]}"
    assert "replica group 1 ends without a result: replica group 0 finished the job at step 60" in text, text[-5000:]
    assert "the job was finished by replica group 0 at step 60" in text, text[-5000:]


def test_with_three_groups_a_late_one_is_waited_for_not_left_out(tmp_path):
    """Group 2 asks for two quorums 2.5 s after the others (a slower evaluation): the lighthouse's join
    timeout (half the quorum timeout) waits for it; a 1 s one left it out, to take the whole state live."""
    run_dir = tmp_path / "run"
    p = launch_script("tests/helpers/ft_loop.py", str(run_dir), "30", "slow", groups=3)
    out, err = finish(p, timeout=150)
    text = out + err
    assert p.returncode == 0, text[-5000:]
    assert events(run_dir, 2, "recovery") == [], text[-3000:]
    for g in (0, 1):
        assert [e for e in events(run_dir, g, "quorum") if e["participants"] < e["was"]] == [], events(run_dir, g, "quorum")
    digests = {read_json(run_dir / f"replica_{g}" / "summary.json")["param_sha256"] for g in range(3)}
    assert len(digests) == 1
    assert "join timeout 30000 ms" in text

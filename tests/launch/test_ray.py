"""Ray Train, for real: a local Ray cluster (started here, 2 CPUs, loopback) runs examples/ray/ with
TorchTrainer and 2 CPU workers.

Ray's contract, from Ray 2.60's sources: ray/train/torch/config.py (`_TorchBackend.on_start`,
`_setup_torch_process_group`) creates the default process group (gloo without GPUs, env://, the
MASTER_* of worker 0) and sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and NODE_RANK before
the function runs; ray/train/v2/_internal/execution/worker_group/thread_runner.py runs the function
in a thread of the worker actor; FailureConfig(max_failures) starts the whole worker group again
after a worker dies; ray/train/v2/api/train_fn_utils.py (`report`) is a barrier every worker calls.

- uninterrupted: the run's weights digest (summary.json, rank 0), 2 ranks agreeing;
- a worker SIGKILLed mid-run: Ray restarts the group, ddp_kit resumes from run_dir, the same digest;
- a run_dir the workers do not share (each its own tmpfs at the same path): refused in one line.

Skipped when Ray is not installed (`pip install 'ddp_kit[ray]'`; the test extra has it).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy
import pytest

from conftest import HELPERS, ROOT, proc_env, read_json, run_cmd
from ddp_kit.integrations.ray import flatten, reporter

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (pip install 'ddp_kit[ray]')")

EXAMPLE = ROOT / "examples" / "ray" / "train_ray.py"
STEPS = 2 * (1797 // 64)  # 2 epochs of sklearn's digits, global batch 64, drop_last
KILL = {"rank": 1, "step": 15}  # after the checkpoint at step 10 (ckpt_every 10), before the one at 20


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module (Ray's start-up is the slow part). Its processes are the
    helper's children; closing its stdin shuts down exactly those, and its process group is killed
    if it does not exit."""
    # Short: Ray's socket paths live under it and must fit in 107 bytes.
    temp = Path(tempfile.mkdtemp(prefix="ddpk-ray-", dir="/tmp"))
    env = proc_env({"RAY_DISABLE_USAGE_STATS": "1",
                    # Ray's token auth (on by default since 2.5x) with a token of ours, not one in ~/.ray
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                    # Loopback only: with this off, Ray takes 127.0.0.1 as the node's address (its
                    # single-machine mode, ray/_private/services.py get_node_ip_address)
                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                    # a dead worker is noticed within half a second (default 2 s)
                    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"})
    log = open(temp / "cluster.log", "w")
    p = subprocess.Popen([sys.executable, str(HELPERS / "ray_cluster.py"), str(temp), "2"], stdin=subprocess.PIPE,
                         stdout=log, stderr=subprocess.STDOUT, env=env, cwd=temp, start_new_session=True)
    started = time.monotonic()
    while not (temp / "address").exists():
        if p.poll() is not None or time.monotonic() - started > 90:
            os.killpg(p.pid, signal.SIGKILL) if p.poll() is None else None
            pytest.fail(f"the Ray cluster did not start:\n{(temp / 'cluster.log').read_text()[-3000:]}")
        time.sleep(0.2)
    print(f"Ray cluster up in {time.monotonic() - started:.1f}s")
    env["RAY_ADDRESS"] = (temp / "address").read_text()
    try:
        yield env
    finally:
        p.stdin.close()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for pid in in_session(p.pid):  # what ray.shutdown() left behind: the helper's session, by PID
            os.kill(pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def in_session(sid: int) -> list[int]:
    """The live processes of session `sid` (ours: started with start_new_session). Ray's workers set a
    process group of their own, so the session, not the group, holds everything the cluster started."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def train_ray(env: dict, run_dir: Path, *args: str, script: Path = EXAMPLE, extra: dict | None = None,
              timeout: float = 240) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    res = run_cmd([sys.executable, str(script), "--run_dir", str(run_dir), *args], timeout=timeout,
                  env={**env, **(extra or {})})
    print(f"{script.name} {' '.join(args)}: exit {res.returncode} in {time.monotonic() - t0:.1f}s")
    (run_dir.parent / f"{run_dir.name}.log").write_text(output(res))  # kept with pytest's temp folders
    return res


def output(res: subprocess.CompletedProcess) -> str:
    return res.stdout + res.stderr


def worker_line(line: str) -> tuple[str, str]:
    """`(RayTrainWorker pid=N) text` as Ray's driver shows a worker's line -> ("N", "text")."""
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)  # Ray colours the prefix
    m = re.match(r"\((\w+) pid=(\d+)(?:, ip=[^)]*)?\) (.*)", line)
    return (m.group(2), m.group(3)) if m else ("", line)


def train_records(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines()) if r["event"] == "train"]


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ray") / "uninterrupted"
    res = train_ray(ray_cluster, run_dir, "--max_failures", "0")
    assert res.returncode == 0, output(res)[-6000:]
    return run_dir, res


@pytest.mark.integration
@needs_ray
def test_uninterrupted(uninterrupted):
    run_dir, res = uninterrupted
    summary = read_json(run_dir / "summary.json")
    assert summary["world_size"] == 2 and summary["steps"] == STEPS
    assert summary["param_sha256_all_ranks_equal"] is True
    assert summary["resumed_from_step"] is None
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "train"] == list(range(5, STEPS + 1, 5)) + [STEPS]
    # Every record reached Ray from every worker (ray.train.report, a barrier): the example's callback
    # in Ray's controller logged each report with rank 0's numbers.
    reported = [json.loads(x) for x in (run_dir.parent / "uninterrupted-ray.reported.jsonl").read_text().splitlines()]
    train = [r for r in records if r["event"] == "train"]
    assert [r["workers"] for r in reported] == [2] * len(train)
    assert [(r["step"], r["loss"]) for r in reported] == [(r["step"], r["loss"]) for r in train]
    assert "ranks" not in reported[0] and "event" not in reported[0]  # numbers only (lists and strings stay out)


@pytest.mark.integration
@needs_ray
def test_killed_worker_is_restarted_and_resumes_bit_identically(ray_cluster, uninterrupted, tmp_path):
    reference, _ = uninterrupted
    run_dir = tmp_path / "killed"
    res = train_ray(ray_cluster, run_dir, "--max_failures", "2",
                    extra={"TRAIN_RAY_KILL": f"rank={KILL['rank']}:step={KILL['step']}"})
    assert res.returncode == 0, output(res)[-6000:]
    summary = read_json(run_dir / "summary.json")
    assert summary["resumed_from_step"] == 10, summary  # the restarted group resumed from run_dir
    assert summary["steps"] == STEPS
    assert summary["param_sha256"] == read_json(reference / "summary.json")["param_sha256"]
    # The records are the uninterrupted run's, loss for loss; the first attempt's record past the
    # checkpoint it resumed from was moved aside (boundary/run_writer.py, supersede).
    assert train_records(run_dir / "metrics.jsonl") == train_records(reference / "metrics.jsonl")
    (superseded,) = (run_dir / "archive").glob("*/metrics.jsonl")
    assert [r["step"] for r in map(json.loads, superseded.read_text().splitlines())] == [KILL["step"]]


@pytest.mark.integration
@needs_ray
def test_run_dir_the_workers_do_not_share_is_refused(ray_cluster, tmp_path):
    run_dir = tmp_path / "local"
    res = train_ray(ray_cluster, run_dir, "--max_failures", "0", script=HELPERS / "ray_private_disk.py")
    if res.returncode == 77:
        pytest.skip(res.stdout.strip())
    assert res.returncode == 1, output(res)[-6000:]
    # Once for the job (by one worker), not once per worker. Ray's driver shows each line of a worker
    # twice (its print patch tees the worker's print to Ray's logger too), so lines count by the worker.
    lines = {worker_line(x) for x in output(res).splitlines() if "ddp_kit: error:" in x}
    assert len(lines) == 1, output(res)[-6000:]
    (worker, line), = lines
    assert "is not one shared folder: rank 1" in line and "hint: put run_dir on storage every node mounts" in line
    assert list(run_dir.iterdir()) == []  # the workers' tmpfs stayed theirs: no mount leaked to this namespace


# ---- the unit tier: what the reporter sends, and that it stays away without Ray ---------------------


def test_flatten_keeps_numbers_only():
    record = {"event": "train", "step": 10, "epoch": 0, "loss": 1.5, "lr": 3e-3, "finite": True,
              "ranks": [{"rank": 0, "step_s": 0.1}], "rank_summary": {"step_s": {"max": 0.2, "slowest": 1}, "host": "n1"}}
    assert flatten(record) == {"step": 10, "epoch": 0, "loss": 1.5, "lr": 3e-3,
                               "rank_summary/step_s/max": 0.2, "rank_summary/step_s/slowest": 1}
    # NumPy scalars (a script's own metrics) become plain numbers, which Ray's report takes
    assert flatten({"a": numpy.float32(0.5), "b": numpy.int64(3)}) == {"a": 0.5, "b": 3}
    assert [type(v) for v in flatten({"a": numpy.float32(0.5), "b": numpy.int64(3)}).values()] == [float, int]


def test_no_reporter_outside_a_ray_train_worker():
    # This process is no Ray worker: no callback, and Ray is not imported to find that out.
    had_ray = "ray" in sys.modules
    assert reporter() is None
    assert ("ray" in sys.modules) == had_ray
    # A stand-in for an imported ray.train that has no Train context here (a driver): no callback either.
    assert reporter({"ray.train": object()}) is None

"""Checkpoints with real processes: exact resume after kills, corrupt and partial checkpoints, elastic world size."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, ok, proc_env, read_json, run_cmd, torchrun

# 2 epochs of 22 steps: a checkpoint every 5 steps puts resumes mid-epoch.
BASE = ["--epochs", "2", "--ckpt_every", "5", "--progress", "false", "--log_every", "5"]


def train_args(run_dir, *extra):
    return ["-m", "ddp_kit.train", *BASE, "--run_dir", str(run_dir), *extra]


def job(run_dir, nproc, *extra, restarts=0, expect_ok=True):
    if nproc == 1:
        res = run_cmd([sys.executable, *train_args(run_dir, *extra)])
    else:
        res = torchrun(train_args(run_dir, *extra), nproc=nproc, extra=[f"--max-restarts={restarts}"])
    return ok(res) if expect_ok else res


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs at world sizes 1 and 2: the param_sha256 every recovery must reproduce."""
    d = tmp_path_factory.mktemp("ref")
    job(d / "w1", 1)
    job(d / "w2", 2)
    job(d / "w4", 4)
    return {n: read_json(d / f"w{n}" / "summary.json") for n in (1, 2, 4)}


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2, 4])  # 4: the ring all-reduce's sum order depends on DDP's bucket layout
def test_kill_whole_job_then_rerun_is_bit_identical(tmp_path, reference, nproc):
    res = job(tmp_path, nproc, "--inject", "kill:rank=0:step=13", expect_ok=False)
    assert res.returncode != 0
    assert (tmp_path / "checkpoints" / "step_10").is_dir() and not (tmp_path / "summary.json").exists()
    res = job(tmp_path, nproc)
    assert "resumed from" in res.stdout and "step 10" in res.stdout
    summary = read_json(tmp_path / "summary.json")
    assert summary["resumed_from_step"] == 10
    assert summary["param_sha256"] == reference[nproc]["param_sha256"]


@pytest.mark.slow
def test_kill_one_worker_torchrun_restarts_and_matches(tmp_path, reference):
    res = job(tmp_path, 2, "--inject", "kill:rank=1:step=13", restarts=1)
    summary = read_json(tmp_path / "summary.json")
    assert summary["resumed_from_step"] == 10, res.stdout
    assert summary["param_sha256"] == reference[2]["param_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_newest_falls_back(tmp_path, reference, damage):
    job(tmp_path, 1, "--inject", "kill:rank=0:step=21", expect_ok=False)
    newest = tmp_path / "checkpoints" / "step_20" / "model.pt"
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    else:
        newest.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    res = job(tmp_path, 1)
    warnings = [line for line in (res.stdout + res.stderr).splitlines() if "step_20 is not usable" in line]
    assert len(warnings) == 1, res.stdout
    assert "resumed from" in res.stdout and "step 15" in res.stdout
    assert read_json(tmp_path / "summary.json")["param_sha256"] == reference[1]["param_sha256"]


@pytest.mark.slow
def test_kill_during_save_never_picks_partial(tmp_path, reference):
    """Saving is slowed so that a SIGKILL lands inside a save; the half-written folder is ignored."""
    cmd = [sys.executable, *train_args(tmp_path, "--debug_ckpt_delay_s", "1.5")]
    p = subprocess.Popen(cmd, cwd=ROOT, env=proc_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    deadline = time.time() + 60
    ckpts = tmp_path / "checkpoints"
    try:
        while time.time() < deadline:  # wait for the second save to be in flight
            if (ckpts / "step_5").is_dir() and (ckpts / ".tmp_step_10").is_dir():
                break
            time.sleep(0.05)
        else:
            pytest.fail("never saw the save of step 10 in flight")
        time.sleep(0.3)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert not (ckpts / "step_10").exists()
    res = job(tmp_path, 1)
    assert "step 5" in res.stdout and "resumed from" in res.stdout
    assert read_json(tmp_path / "summary.json")["param_sha256"] == reference[1]["param_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_change_world_size(tmp_path, reference, before, after):
    job(tmp_path, before, "--inject", "kill:rank=0:step=16", expect_ok=False)
    res = job(tmp_path, after)
    assert f"written by {before} rank(s), resumed on {after}" in res.stdout
    summary = read_json(tmp_path / "summary.json")
    assert summary["steps"] == reference[after]["steps"] and summary["world_size"] == after
    assert summary["eval_samples"] == 360
    assert abs(summary["eval_accuracy"] - reference[after]["eval_accuracy"]) <= 0.02


@pytest.mark.slow
def test_async_save_same_result_and_retention(tmp_path, reference):
    job(tmp_path, 2, "--async_ckpt", "true", "--keep_last", "2")
    summary = read_json(tmp_path / "summary.json")
    assert summary["param_sha256"] == reference[2]["param_sha256"]
    steps = sorted(int(p.name[5:]) for p in (tmp_path / "checkpoints").glob("step_*"))
    assert steps == [40, 44]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_44"


@pytest.mark.slow
def test_resume_never_and_explicit_path(tmp_path, reference):
    job(tmp_path, 1, "--inject", "kill:rank=0:step=11", expect_ok=False)
    res = job(tmp_path, 1, "--resume", str(tmp_path / "checkpoints" / "step_5"))
    assert "resumed from" in res.stdout and "step 5" in res.stdout
    res = job(tmp_path, 1, "--resume", "never")
    assert "resumed" not in res.stdout
    assert read_json(tmp_path / "summary.json")["param_sha256"] == reference[1]["param_sha256"]
    bad = run_cmd([sys.executable, *train_args(tmp_path, "--resume", str(tmp_path / "nope"))])
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr
    half = tmp_path / "checkpoints" / "half"
    half.mkdir()
    bad = run_cmd([sys.executable, *train_args(tmp_path, "--resume", str(half))])
    assert bad.returncode == 2 and "cannot be resumed: no manifest" in bad.stderr and "Traceback" not in bad.stderr


# A constant LR: a resume that changes max_steps then computes exactly what an uninterrupted run does.
CONST = ("--keep_last", "0", "--lr_schedule", "constant")


@pytest.fixture(scope="module")
def constant_lr_reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("const")
    job(d, 1, *CONST)
    return read_json(d / "summary.json")


@pytest.mark.slow
@pytest.mark.parametrize("restart", ["never", "older"])
def test_auto_resume_follows_latest_not_the_highest_step(tmp_path, constant_lr_reference, restart):
    """A run abandoned at step 20 (by --resume never, or by resuming from its step 5) must not be
    picked up again by the next crash's auto-resume: `latest` wins, higher steps are archived."""
    const = CONST
    run = tmp_path / "run"
    job(run, 1, *const, "--inject", "kill:rank=0:step=21", expect_ok=False)  # leaves step_5 .. step_20
    if restart == "never":  # a fresh start that crashes at step 13
        job(run, 1, *const, "--resume", "never", "--inject", "kill:rank=0:step=13", expect_ok=False)
        own = 10
    else:  # a resume from step_10 that stops at step 17 (faults do not fire in a resumed run)
        job(run, 1, *const, "--resume", str(run / "checkpoints" / "step_10"), "--max_steps", "17")
        own = 17
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{own}"
    assert not (ckpts / "step_20").exists() and list((run / "archive").glob("*/step_20")), \
        sorted(p.name for p in ckpts.iterdir())
    res = job(run, 1, *const)  # auto: continues the restarted run, not the abandoned step 20
    assert f"checkpoints/step_{own} " in res.stdout, res.stdout
    assert read_json(run / "summary.json")["param_sha256"] == constant_lr_reference["param_sha256"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["event"] == "train"]
    assert steps == sorted(set(steps)), f"metrics.jsonl repeats steps after a resume: {steps}"


def test_checkpoint_cli_list_and_export(tmp_path):
    ok(run_cmd([sys.executable, *train_args(tmp_path, "--max_steps", "10")]))
    (tmp_path / "checkpoints" / "step_10" / "rank0.pt").write_bytes(b"junk")
    res = ok(run_cmd([sys.executable, "-m", "ddp_kit.checkpoint", "list", str(tmp_path)]))
    lines = res.stdout.splitlines()
    assert "INVALID" in lines[1] and "step_10" in lines[1] and "valid" in lines[2] and "step_5" in lines[2]
    out = tmp_path / "weights.pt"
    ok(run_cmd([sys.executable, "-m", "ddp_kit.checkpoint", "export", str(tmp_path), "--out", str(out)]))
    import torch

    state = torch.load(out, weights_only=True)
    assert set(state) == {"1.weight", "1.bias", "3.weight", "3.bias"}

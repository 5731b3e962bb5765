"""Experiment trackers with real processes and real stores: a real MLflow tracking server on loopback
(its sqlite backend), W&B in offline mode (its run files read back), TensorBoard's event files read
back (tracker_stores.py). A run killed, restarted, preempted and rerun is one tracker run in each,
every step logged at most once and with an uninterrupted run's values; a server down at start or
gone mid-run is one warning, and the run finishes with exit 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from conftest import REFERENCE_2_EPOCHS, ROOT, kill_marked, ok, proc_env, read_json, run_cmd, torchrun
from tracker_stores import Proxy, free_port, mlflow_server, tb_scalars, wandb_runs

pytestmark = pytest.mark.integration  # every test here starts real processes
pytest.importorskip("mlflow")
pytest.importorskip("wandb")
pytest.importorskip("tensorboard")

ALL = ["--trackers", "tensorboard,mlflow,wandb"]
# MLflow's own retries (7, backoff 2 s) outlast the hub's 30 s give-up, which test_trackers_unit.py covers alone
FAIL_FAST = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
FAIL_FAST_AFTER_ONE_RETRY = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


@pytest.fixture(scope="module")
def mlflow(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


def tracking_env(uri: str, experiment: str) -> dict[str, str]:
    return {"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": experiment, "WANDB_MODE": "offline",
            "WANDB_PROJECT": "ddp_kit_tests"}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def wait_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            if any(r.get("event") == "train" and r["step"] >= step for r in metrics(run_dir)):
                return
        except (OSError, ValueError):  # not there yet, or a line being written
            pass
        time.sleep(0.1)
    out, err = proc.communicate() if proc.poll() is not None else ("", "")
    pytest.fail(f"never reached step {step} (exit {proc.poll()})\n{err[-3000:]}")


def check_series(tool: str, series: list[tuple[int, float]], expected: dict[int, float], rel: float) -> None:
    """Each step once, in increasing order, every expected step there, with the expected value."""
    steps = [s for s, _ in series]
    assert steps == sorted(set(steps)), f"{tool}: steps logged twice or out of order: {steps}"
    assert set(steps) == set(expected), f"{tool}: logged {steps}, an uninterrupted run logs {sorted(expected)}"
    for step, value in series:
        assert value == pytest.approx(expected[step], rel=rel), f"{tool}: step {step}: {value} != {expected[step]}"


def warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if "warning" in line.lower()]


def test_one_tracker_run_across_a_torchrun_restart_and_a_preemption(tmp_path, mlflow, reference_summary):
    reference = metrics(reference_summary.folder(2, REFERENCE_2_EPOCHS))  # uninterrupted, 2 ranks, no trackers
    run_dir = tmp_path / "run"
    env = tracking_env(mlflow.uri, "restarts")
    job = ["-m", "ddp_kit.train", *REFERENCE_2_EPOCHS, "--run_dir", str(run_dir), *ALL]
    # Attempt 1: rank 1 is SIGKILLed at step 13; torchrun restarts both ranks, which resume from step_10. The
    # restarted attempt's checkpoints are slowed (a test hook that changes no weights), so that the SIGTERM
    # lands mid-run: the ranks stop at the next agreed step (a multiple of 10), save it and exit 75.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           *job, "--inject", "kill:rank=1:step=13", "--debug_ckpt_delay_s", "0.3"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=proc_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        wait_step(run_dir, 20, p)  # only the restarted attempt gets past step 13
        os.kill(p.pid, signal.SIGTERM)  # the torchrun agent we started
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert "resumed from" in out and "preempted by SIGTERM" in err, (out + err)[-4000:]
    rerun = ok(torchrun(job, nproc=2, env=env))  # preempted, then the same command again
    assert "resumed from" in rerun.stdout
    summary = read_json(run_dir / "summary.json")
    assert summary["steps"] == 44 and summary["resumed_from_step"] >= 20

    train = {r["step"]: r for r in reference if r["event"] == "train"}
    evals = {r["step"]: r for r in reference if r["event"] == "eval"}
    loss, lr = {s: r["loss"] for s, r in train.items()}, {s: r["lr"] for s, r in train.items()}
    eval_loss = {s: r["eval_loss"] for s, r in evals.items()}

    # TensorBoard: one log dir (none archived); the steps each resume replays are purged and written again
    tb = tb_scalars(run_dir / "tb")
    assert not list(run_dir.glob("archive/*/tb"))
    check_series("tensorboard", tb["train/loss"], loss, rel=1e-6)  # TensorBoard keeps float32
    check_series("tensorboard", tb["eval/eval_loss"], eval_loss, rel=1e-6)

    # MLflow: one run in the experiment, finished; each step once
    runs = mlflow.runs("restarts")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.params["epochs"] == "2"
    check_series("mlflow", mlflow.history(run.info.run_id, "train/loss"), loss, rel=1e-12)
    check_series("mlflow", mlflow.history(run.info.run_id, "train/lr"), lr, rel=1e-12)
    check_series("mlflow", mlflow.history(run.info.run_id, "eval/eval_loss"), eval_loss, rel=1e-12)

    # W&B: every attempt wrote a file of the same run id
    wb = wandb_runs(run_dir / "wandb")
    assert len(wb) == 1, list(wb)
    (wb_run,) = wb.values()
    assert len(wb_run.files) == 3, wb_run.files  # the killed attempt, its restart, the rerun
    check_series("wandb", [(row["_step"], row["train/loss"]) for row in wb_run.history if "train/loss" in row],
                 loss, rel=1e-12)
    check_series("wandb", [(row["_step"], row["eval/eval_loss"]) for row in wb_run.history if "eval/eval_loss" in row],
                 eval_loss, rel=1e-12)

    # the ids are kept in the run folder and in every checkpoint (a resume elsewhere continues them)
    ledger = read_json(run_dir / "trackers.json")
    assert ledger["mlflow"]["run_id"] == run.info.run_id and ledger["wandb"]["run_id"] == wb_run.run_id
    meta = read_json(run_dir / "checkpoints" / "step_44" / "meta.json")
    assert meta["trackers"]["mlflow"]["run_id"] == run.info.run_id
    assert meta["trackers"]["wandb"]["run_id"] == wb_run.run_id
    assert not warnings(rerun.stdout + rerun.stderr)


def test_resume_never_starts_new_tracker_runs(tmp_path, mlflow):
    run_dir = tmp_path / "run"
    env = tracking_env(mlflow.uri, "never")
    job = [sys.executable, "-m", "ddp_kit.train", "--epochs", "1", "--log_every", "5", "--ckpt_every", "10",
           "--progress", "false", "--run_dir", str(run_dir), "--trackers", "tensorboard,mlflow,wandb"]
    ok(run_cmd(job, env=env))
    first = read_json(run_dir / "trackers.json")
    again = ok(run_cmd([*job, "--resume", "never"], env=env))
    second = read_json(run_dir / "trackers.json")
    assert not warnings(again.stdout + again.stderr)
    assert first["mlflow"]["run_id"] != second["mlflow"]["run_id"] and first["wandb"]["run_id"] != second["wandb"]["run_id"]
    assert len(mlflow.runs("never")) == 2 and len(wandb_runs(run_dir / "wandb")) == 2
    assert [s for s, _ in tb_scalars(run_dir / "tb")["train/loss"]] == [5, 10, 15, 20, 22]  # the new run only
    assert list((run_dir / "archive").glob("*/tb")), "the first run's event files were not moved aside"


def test_a_tracker_server_down_at_start_is_one_warning(tmp_path):
    run_dir = tmp_path / "run"
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there: every request is refused
    took = time.monotonic()
    res = ok(run_cmd([sys.executable, "-m", "ddp_kit.train", "--epochs", "1", "--log_every", "5", "--ckpt_every", "10",
                      "--progress", "false", "--run_dir", str(run_dir), "--trackers", "mlflow,tensorboard"],
                     env={"MLFLOW_TRACKING_URI": down, **FAIL_FAST}, timeout=120))
    took = time.monotonic() - took
    said = warnings(res.stdout + res.stderr)
    assert len(said) == 1 and "tracker mlflow" in said[0] and down in said[0], res.stdout + res.stderr
    assert read_json(run_dir / "summary.json")["steps"] == 22
    assert [s for s, _ in tb_scalars(run_dir / "tb")["train/loss"]] == [5, 10, 15, 20, 22]  # the others go on
    print(f"{took:.1f}s; {said[0]}")


def test_a_tracker_server_gone_mid_run_is_one_warning(tmp_path, mlflow):
    run_dir = tmp_path / "run"
    proxy = Proxy((urlparse(mlflow.uri).hostname, urlparse(mlflow.uri).port))
    cmd = [sys.executable, "-m", "ddp_kit.train", "--epochs", "2", "--log_every", "2", "--ckpt_every", "10",
           "--progress", "false", "--run_dir", str(run_dir), "--trackers", "mlflow",
           "--inject", "slow:rank=0:step=1:ms=150"]
    env = proc_env({**tracking_env(proxy.uri, "gone"), **FAIL_FAST_AFTER_ONE_RETRY})
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        end = time.monotonic() + 90
        while time.monotonic() < end and p.poll() is None:  # the server has taken some steps: take it away
            if (run_dir / "trackers.json").exists() and read_json(run_dir / "trackers.json").get("mlflow", {}).get(
                    "logged_step", -1) >= 6:
                break
            time.sleep(0.1)
        proxy.close()
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        proxy.close()
    assert p.returncode == 0, (out + err)[-4000:]
    said = warnings(out + err)
    assert len(said) == 1 and "tracker mlflow" in said[0], out + err
    assert read_json(run_dir / "summary.json")["steps"] == 44
    (run,) = mlflow.runs("gone")
    steps = [s for s, _ in mlflow.history(run.info.run_id, "train/loss")]
    assert steps and steps == sorted(set(steps)) and steps[-1] < 44, steps  # what reached it, each once
    print(said[0])


def ft_workers(launcher: subprocess.Popen, group: int) -> list[int]:
    """The ddp_kit workers of `group`'s first start under `python -m ddp_kit.launch ft`, by the launcher's
    token in their environment (torchrun puts them in sessions of their own, out of reach of a killpg)."""
    token = f"DDP_KIT_FT_GROUP_TOKEN={launcher.pid}-{group}-0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and token in (entry / "environ").read_bytes().split(b"\0") and \
                    (entry / "cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"ddp_kit.train"]:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_under_ft_the_logging_group_lost_and_recovered_live_continues_its_tracker_runs(tmp_path, mlflow):
    pytest.importorskip("torchft")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddp_kit.launch", "ft", "--groups", "2", "--nproc_per_node", "1", "--",
           "--run_dir", str(run_dir), "--max_steps", "100000", "--epochs", "100000", "--log_every", "5",
           "--ckpt_every", "5", "--progress", "false", "--inject", "slow:rank=0:step=1:ms=40", *ALL]
    p = subprocess.Popen(cmd, cwd=ROOT, env=proc_env(tracking_env(mlflow.uri, "ft")), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    group0 = run_dir / "replica_0"
    try:
        wait_step(group0, 10, p, timeout=150)
        end = time.monotonic() + 20
        while not (pids := ft_workers(p, 0)) and time.monotonic() < end:
            time.sleep(0.1)
        assert pids, "no worker of group 0 found"
        os.kill(pids[0], signal.SIGKILL)  # group 0's only rank: the one that logs to the trackers
        end = time.monotonic() + 150
        while time.monotonic() < end and p.poll() is None:  # recovered live from group 1, and 10 steps on
            recs = [r for r in metrics(group0) if r.get("event") == "recovery"]
            if recs and any(r.get("event") == "train" and r["step"] >= recs[-1]["step"] + 10 for r in metrics(group0)):
                break
            time.sleep(0.2)
        else:
            pytest.fail("group 0 never recovered and trained on")
        os.kill(p.pid, signal.SIGTERM)  # the launcher we started: it forwards to every group
        out, err = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            kill_marked(p)
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 75, (out + err)[-4000:]
    assert "replica group 0 recovered live from group 1" in out + err

    trained = sorted(r["step"] for r in metrics(group0) if r.get("event") == "train")
    runs = mlflow.runs("ft")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    series = {"mlflow": [s for s, _ in mlflow.history(runs[0].info.run_id, "train/loss")],
              "tensorboard": [s for s, _ in tb_scalars(group0 / "tb")["train/loss"]]}
    wb = wandb_runs(group0 / "wandb")
    assert len(wb) == 1, wb  # the lost attempt's (if its W&B had started before the kill) and its restart's
    series["wandb"] = [row["_step"] for run in wb.values() for row in run.history if "train/loss" in row]
    for tool, steps in series.items():
        assert steps == sorted(set(steps)) and set(steps) <= set(trained), f"{tool}: {steps}"
        assert steps[-1] == trained[-1], f"{tool} stops at {steps[-1]}, group 0 at {trained[-1]}"
    group1 = run_dir / "replica_1"
    assert not (group1 / "trackers.json").exists() and not (group1 / "tb").exists() and not (group1 / "wandb").exists()
    assert read_json(group0 / "trackers.json")["mlflow"]["run_id"] == runs[0].info.run_id

"""Shared helpers: run real processes (python / torchrun on CPU with gloo), always bounded in time."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# Imported before any test: torch's first import runs `ldconfig -p` in a subprocess (its CUDA
# library finder), which the unit tier would otherwise refuse in whichever test imports torch first.
import torch  # noqa: F401

# Likewise matplotlib (the report's picture): its first import on a machine builds the font cache with
# `fc-list` in a subprocess (a fresh CI machine: whichever unit test draws first would be refused).
try:
    import matplotlib.font_manager  # noqa: F401
except ImportError:
    pass

ROOT = Path(__file__).resolve().parents[1]
HELPERS = Path(__file__).resolve().parent / "helpers"


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def _unit_tier_starts_no_process(request, monkeypatch):
    """The unit tier (`-m "not integration"`) is what a developer runs on every change, in under two
    minutes: a test there that starts a process (a subprocess, torchrun, a forked loader worker) is
    refused at the call, naming the test, instead of quietly making the tier slow."""
    if request.node.get_closest_marker("integration") is not None:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} is in the unit tier but starts a process: "
                             "mark it @pytest.mark.integration (or keep it in-process)")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    monkeypatch.setattr(os, "posix_spawnp", refuse)


def proc_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""})
    env.update(extra or {})
    return env


def run_cmd(cmd: list[str], timeout: float = 180, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` in its own session; on timeout kill that whole process group (ours, by PID) and fail."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=proc_env(env),
                         cwd=cwd or ROOT, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def torchrun(args: list[str], nproc: int = 2, timeout: float = 180, env: dict | None = None, extra: list[str] = ()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *extra, *args]
    return run_cmd(cmd, timeout=timeout, env=env)


def since_ranks_met(run_dir: Path, res: subprocess.CompletedProcess | None = None, marker: str = "config.yaml") -> float:
    """Seconds from the ranks' meeting to now (the job has ended): timed from a file rank 0 writes once
    the ranks have met and before the model is built (config.yaml; .lock for a script that passes no
    config to ddp_kit.init), not from the launch. Process start
    and torch's import take from 6 s on an idle machine to over 20 s when the other test worker is
    busy, and that is not what a bound on a watchdog or a fail-fast is about."""
    import time
    started = Path(run_dir) / marker
    assert started.exists(), f"the ranks never met\n{res.stderr[-3000:] if res else ''}"
    took = time.time() - started.stat().st_mtime
    print(f"{took:.1f}s from the ranks' meeting ({marker}) to the end of the job")
    return took


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def ok(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"
    return res


@pytest.fixture
def one_rank_group():
    """A 1-process gloo group on an in-memory store (no port, no launcher; DCP and FSDP need a
    group), destroyed after the test."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        tdist.destroy_process_group()


# The uninterrupted `python -m ddp_kit.train` runs that recoveries and other layouts must reproduce
# (param_sha256). The flags of a run that do not change its weights (hang timeouts, where it runs)
# are left out, so that files comparing against the same job share one run of it.
REFERENCE_2_EPOCHS = ("--epochs", "2", "--ckpt_every", "5", "--progress", "false", "--log_every", "5")
REFERENCE_3_EPOCHS = ("--epochs", "3", "--ckpt_every", "5", "--progress", "false", "--log_every", "5")


@pytest.fixture(scope="session")
def reference_summary(tmp_path_factory):
    """`reference_summary(nproc, args)`: summary.json of `python -m ddp_kit.train *args` on `nproc` ranks
    (torchrun above 1), run once per test session and shared by every xdist worker of it: the first
    to ask runs it under a file lock, the others wait for it and read its summary.
    `reference_summary.folder(nproc, args)`: that run's folder (its metrics.jsonl)."""
    import fcntl
    import hashlib
    import shutil

    base = tmp_path_factory.getbasetemp()
    # under xdist each worker's basetemp is one folder of the session's; alone, the session's own
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = root / "shared_references"
    root.mkdir(exist_ok=True)

    def folder(nproc: int, args=REFERENCE_2_EPOCHS) -> Path:
        key = hashlib.sha256(repr((nproc, tuple(args))).encode()).hexdigest()[:12]
        run_dir = root / f"w{nproc}_{key}"
        with open(root / f"w{nproc}_{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the run fails
            if not (run_dir / "summary.json").exists():
                shutil.rmtree(run_dir, ignore_errors=True)  # a failed earlier attempt leaves no stale state
                cmd = ["-m", "ddp_kit.train", *args, "--run_dir", str(run_dir)]
                ok(run_cmd([sys.executable, *cmd], timeout=240) if nproc == 1 else torchrun(cmd, nproc=nproc, timeout=240))
        return run_dir

    def get(nproc: int, args=REFERENCE_2_EPOCHS) -> dict:
        return read_json(folder(nproc, args) / "summary.json")

    get.folder = folder  # the run folder itself (its metrics.jsonl: what an uninterrupted run logs)
    return get


def kill_marked(launcher: subprocess.Popen) -> None:
    """SIGKILL every process this launcher started (its token in their environment): torchrun puts
    its workers in sessions of their own, out of reach of a killpg."""
    prefix = f"DDP_KIT_FT_GROUP_TOKEN={launcher.pid}-".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and any(v.startswith(prefix) for v in (entry / "environ").read_bytes().split(b"\0")):
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            continue

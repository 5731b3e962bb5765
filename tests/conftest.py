"""Shared helpers: run real processes (python / torchrun on CPU with gloo), always bounded in time."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HELPERS = Path(__file__).resolve().parent / "helpers"


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

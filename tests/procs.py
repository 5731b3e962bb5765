"""Helpers the test folders share: waiting on real processes and reading what they printed, and Runs
without a process group (loaders need only a rank and a world size)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch

# 44 steps; SIGTERM lands after step 10 and the ranks agree on it every 10 steps. No timed checkpoint
# before the end: the one the test finds is the stop's own.
ARGS = ["-m", "ddp_kit.train", "--epochs", "2", "--log_every", "5", "--ckpt_every", "100", "--progress", "false"]


def workers(stderr: str) -> str:
    """stderr without torchrun's own report (the agent's traceback for failed or signalled workers,
    which workers cannot suppress; README says so)."""
    for marker in ("ChildFailedError", "SignalException"):  # torchrun's report of failed or signalled workers
        cut = stderr.find(marker)
        if cut >= 0:
            start = stderr.rfind("Traceback (most recent call last):", 0, cut)
            stderr = stderr[:start] if start >= 0 else stderr[:cut]
    return stderr


def errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("ddp_kit: error:")]


def wait_for(cond, proc: subprocess.Popen, timeout: float = 90, what: str = "") -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if cond():
            return
        time.sleep(0.05)
    out, err = proc.communicate(timeout=30) if proc.poll() is not None else ("", "")
    pytest.fail(f"never saw {what} (exit {proc.poll()})\n{out[-2000:]}\n{err[-3000:]}")


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def outcome(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    """(exit code, stdout + stderr) of `proc`; past `timeout` its whole session is killed (ours, by PID)
    and the test fails showing what it printed."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s\n{(out + err)[-5000:]}")
    return proc.returncode, out + err


def wait_step(run_dir, step, proc, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        m = run_dir / "metrics.jsonl"
        if m.exists() and any(json.loads(line).get("step", 0) >= step for line in m.read_text().splitlines() if line):
            return
        time.sleep(0.1)
    pytest.fail(f"never reached step {step}")


def runs_without_group(world=2, seed=0):
    """One Run per rank, without a process group: loaders need only rank and world size."""
    from ddp_kit.api import Run
    from ddp_kit.boundary.core import StepBoundary
    from ddp_kit.boundary.policy import Policy
    from ddp_kit.dist import DistContext
    from ddp_kit.env import DistEnv
    from ddp_kit.reliability.preemption import PreemptFlag
    from ddp_kit.reliability.progress import Progress

    ctxs = [DistContext(DistEnv(rank=r, world_size=world), torch.device("cpu"), "gloo") for r in range(world)]
    return [Run(c, None, StepBoundary(c, Policy(hang_timeout_s=0), Progress(), PreemptFlag()), True, seed) for c in ctxs]

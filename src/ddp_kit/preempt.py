"""Preemption: a warning signal becomes "finish this step, checkpoint, requeue (SLURM), exit".

SLURM sends USR2 ahead of the time limit when a template asks (`--signal=USR2@120`; NCCL may
swallow USR1); outside SLURM, SIGTERM does the same minus the requeue. The handler only sets a
flag. Every `check_every` steps the ranks all-reduce it, so they all stop after the same step.
"""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Mapping

import torch
import torch.distributed as tdist

from .dist import DistContext

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"
SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class Preempted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class PreemptFlag:
    """Records the first warning signal; installs and restores its handlers (main thread only)."""

    def __init__(self):
        self.signum = 0
        self._previous: dict[int, object] = {}

    def install(self) -> "PreemptFlag":
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. the API used from a thread): no preemption handling
                pass
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = self.signum or signum

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()


def agreed_signal(ctx: DistContext, flag: PreemptFlag) -> int:
    """The signal any rank received (0 if none), identical on every rank."""
    if ctx.world_size == 1:
        return flag.signum
    t = torch.tensor([flag.signum], dtype=torch.int64, device=ctx.device if ctx.backend == "nccl" else "cpu")
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return int(t.item())


def requeue_target(environ: Mapping[str, str]) -> str | None:
    """`ARRAYID_TASKID` for an array task: one task's SLURM_JOB_ID can equal the array's own id, and
    `scontrol requeue <array id>` would requeue every task of the array."""
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    return environ.get("SLURM_JOB_ID")


def requeue(environ: Mapping[str, str] | None = None) -> str:
    """Requeue this SLURM job; for an array task, only that task."""
    environ = os.environ if environ is None else environ
    job = requeue_target(environ)
    if not job:
        return "not a SLURM job: not requeued; run the same command again to resume"
    try:
        res = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not requeue job {job}: {exc} (is scontrol on PATH in the job?)"
    if res.returncode != 0:
        return f"scontrol requeue {job} failed: {res.stderr.strip() or res.stdout.strip()} (is the job --requeue?)"
    return f"job {job} requeued"

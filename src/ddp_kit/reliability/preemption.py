"""Preemption and Ctrl-C: a stop signal becomes "finish this step, checkpoint, (requeue,) exit".

The environment names its own preemption warning (`DistEnv.preempt_signal`: USR2 in a SLURM job,
whose templates ask for it ahead of the time limit, `--signal=USR2@120`; SIGTERM elsewhere) and its
requeue command; that signal checkpoints, requeues and exits (`requeues`), any other stop signal
does the same minus the requeue. Ctrl-C (SIGINT) does the same and exits 130; a second Ctrl-C (a
second or more after the first, since torchrun forwards the terminal's own SIGINT once more) exits
at once. The handler only sets a flag. The ranks all-reduce
it at step boundaries, so they all stop after the same step.

Before step 1 there is nothing worth saving, and the main thread may sit in a rendezvous or a C++
call for minutes without running Python signal handlers; so a helper thread woken through
`signal.set_wakeup_fd` ends the process at once (exit 75, or 130 for Ctrl-C) during startup.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as tdist

from ..dist import DistContext
from ..env import DistEnv
from ..exit_codes import EXIT_INTERRUPTED, EXIT_PREEMPTED
from ..hooks import STOP_PRIORITY

SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)  # every DistEnv.preempt_signal among them
SAME_PRESS_S = 1.0  # SIGINTs closer than this are one Ctrl-C (the terminal's and torchrun's copy)


def exit_code(signum: int) -> int:
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED


class PreemptFlag:
    """Records the first stop signal; installs and restores its handlers (main thread only).

    `startup` stays True until the training loop takes over (`started()`); `where()` returns
    (current step, last checkpointed step) for the line printed on an immediate exit."""

    def __init__(self, rank: int = 0, where: Callable[[], tuple[int, int | None]] | None = None):
        self.signum = 0
        self.at = 0.0  # time.monotonic() of the first stop signal (the grace period runs from it)
        self.rank = rank
        self.startup = True
        self.closing = False  # the process is already ending on an error of its own
        self.where = where or (lambda: (0, None))
        self._first_int = 0.0
        self._previous: dict[int, object] = {}
        self._wakeup: tuple[int, int] | None = None
        self._old_wakeup = -1

    def install(self) -> PreemptFlag:
        if threading.current_thread() is not threading.main_thread():
            return self  # e.g. the API used from a thread: no signal handling
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._wakeup = (r, w)
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(r,), name="ddp_kit-signals", daemon=True).start()
        return self

    def started(self) -> None:
        self.startup = False

    def _handle(self, signum, frame) -> None:
        pass  # the watcher thread records it: it runs even while the main thread is blocked in C++

    def _watch(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                data = b""
            if not data:  # restore() closed the write end
                os.close(fd)
                return
            for signum in data:
                if signum in SIGNALS:
                    self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        if self.closing:
            return
        now = time.monotonic()
        if signum == signal.SIGINT:
            if self._first_int and now - self._first_int > SAME_PRESS_S:
                self._exit_now(signum, "a second Ctrl-C")
            self._first_int = self._first_int or now
        self.at = self.at if self.signum else now
        self.signum = self.signum or signum
        if self.startup:
            self._exit_now(signum, "before step 1")

    def _exit_now(self, signum: int, why: str) -> None:
        step, saved = self.where()
        if self.rank == 0:
            last = f"last checkpoint step {saved}" if saved is not None and saved >= 0 else "no checkpoint from this run"
            print(f"ddp_kit: {'interrupted' if signum == signal.SIGINT else 'preempted'} by {signal.Signals(signum).name} "
                  f"({why}) at step {step}; {last}; rerun the same command to resume; exiting with {exit_code(signum)}",
                  file=sys.stderr, flush=True)
        os._exit(exit_code(signum))

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            os.close(self._wakeup[1])  # the watcher sees end-of-file, closes the read end and returns
            self._wakeup = None


PRIORITY = STOP_PRIORITY  # when ranks received different signals, the one that asks for the most wins


def agree_stop(ctx: DistContext, flag: PreemptFlag, also: int = 0) -> tuple[int, int]:
    """(the signal any rank received or 0, the largest `also` any rank said), identical on every rank:
    one all-reduce carries both, so a timed checkpoint costs no collective of its own."""
    if ctx.world_size == 1:
        return flag.signum, also
    return agree_stop_later(ctx, flag, also)()


def agree_stop_later(ctx: DistContext, flag: PreemptFlag, also: int = 0) -> Callable[[], tuple[int, int]]:
    """agree_stop sent now, read when the returned function is called (every rank calls it at the
    same point of the loop). The all-reduce goes out without waiting (async_op), so a rank that
    would wait here for the slowest one, and on a busy core for the scheduler to wake it again,
    reads a result that arrived while it computed. World size > 1."""
    t = torch.tensor([PRIORITY.index(flag.signum), int(also)], dtype=torch.int64, device=ctx.control_device)
    work = tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=ctx.control_group, async_op=True)

    def result() -> tuple[int, int]:
        work.wait()
        prio, most = t.tolist()
        return int(PRIORITY[prio]), int(most)
    return result


def requeues(signum: int, env: DistEnv) -> bool:
    """True when `signum` is the environment's preemption warning and its scheduler can requeue the job."""
    return signum == env.preempt_signal and env.requeue_command is not None


def requeue(command: tuple[str, ...] | None) -> str:
    """Run the scheduler's requeue command for this job (DistEnv.requeue_command; None: not requeueable)."""
    if not command:
        return "no scheduler to requeue this job: run the same command again to resume"
    shown = " ".join(command)
    try:
        res = subprocess.run(list(command), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not run {shown}: {exc} (is {command[0]} on PATH in the job?)"
    if res.returncode != 0:
        allowed = {"scontrol": "sbatch --requeue?", "brequeue": "bsub -r, or an LSF admin's rights?",
                   "qrerun": "qsub -r y, and PBS manager or operator rights?"}.get(Path(command[0]).name, "its scheduler's setting?")
        return f"{shown} failed: {res.stderr.strip() or res.stdout.strip()} (is the job requeueable: {allowed})"
    return f"requeued ({shown})"

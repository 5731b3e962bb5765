"""A stop signal (preemption, Ctrl-C): the ranks agree on it every preempt_check_every steps,
then checkpoint, requeue where the launcher can, and exit 75 (130 for Ctrl-C) together."""
from __future__ import annotations

import signal
import sys
import time
from typing import Any

from ..dist.collectives import barrier
from ..parallel import ft_steps
from ..reliability.preemption import agree_stop, exit_code, requeue
from . import grace_period

# The StepBoundary (boundary.py) whose part this is; not imported, so that the parts sit below it.
Boundary = Any


def stop_if_signalled(b: Boundary) -> bool:
    """The ranks agree on any stop signal so far (acted on: this never returns) and on whether a
    timed checkpoint is due (returned)."""
    due = (b.ctx.is_main and bool(b.state) and b.policy.ckpt_every_s > 0 and b.rd is not None
           and time.monotonic() - b.last_save_t >= b.policy.ckpt_every_s)
    with b.collective("preemption check"):
        signum, due = agree_stop(b.ctx, b.flag, due)
        signum, due = ft_steps.agree_stop(b, signum, due)  # every replica group alike
    if signum:
        stop(b, signum)
    return due


def stop(b: Boundary, signum: int) -> None:
    """Checkpoint, requeue under SLURM (USR2), and exit 75 (130 for Ctrl-C), all ranks together."""
    if b.policy.log_every and b.done > b.records.last_log[1]:
        b.log()  # the steps since the last record, as at a clean end: the resume starts after them
    saved = bool(b.state) and b.rd is not None
    took = time.monotonic()
    if saved:
        b.save()
        b.progress.enter("checkpoint")  # an async save may still be writing: a slow phase, not a hang
        b.checkpointer().wait()
        grace_period.note_timings(b)
    took = time.monotonic() - took
    # Replica groups (strategy ft): every group has saved before anyone requeues (requeueing ends the
    # job), and one group requeues it.
    ft_steps.agree_stop(b, signum)
    wants_requeue = (signum == signal.SIGUSR2 and b.ctx.env.requeue_command is not None
                     and (b.replica is None or b.replica.leads()))
    code = exit_code(signum)
    if b.ctx.is_main:
        # Printed before the requeue: SLURM ends this job the moment it requeues it.
        what = "interrupted" if signum == signal.SIGINT else "preempted"
        kept = (f"checkpoint saved in {took:.1f}s" if saved else "no checkpoint (no run_dir)" if b.rd is None
                else "no checkpoint (nothing registered with run.resume)")
        print(f"ddp_kit: {what} by {signal.Signals(signum).name} after step {b.done}: {kept}; "
              f"{'requeueing the job' if wants_requeue else 'rerun the same command to resume'}; "
              f"exiting with {code}", file=sys.stderr, flush=True)
        if wants_requeue:
            print(f"ddp_kit: {requeue(b.ctx.env.requeue_command)}", file=sys.stderr, flush=True)
    # No rank exits before the requeue is done: under `srun --kill-on-bad-exit` the first rank
    # to exit non-zero gets every other task (and rank 0's scontrol) killed.
    barrier(b.ctx)
    b.stopped = True
    b.exit_code = code
    raise SystemExit(code)

"""A stop signal (preemption, Ctrl-C): the ranks agree on it every preempt_check_every steps (the
all-reduce sent a step ahead, read at the check), then checkpoint, requeue where the launcher can,
and exit 75 (130 for Ctrl-C) together."""
from __future__ import annotations

import signal
import sys
import time
from typing import TYPE_CHECKING, NoReturn

from ..dist.collectives import barrier
from ..options import AUTO
from ..reliability.preemption import agree_stop, agree_stop_later, exit_code, requeue, requeues

if TYPE_CHECKING:  # the core imports its parts: they name what they use of it (protocol.py), not the core
    from .protocol import Boundary



def signalled(b: Boundary, fresh: bool = False) -> tuple[int, int]:
    """The ranks agree on any stop signal so far and on which timed checkpoint is due (rank 0's
    clocks): (the signal to stop on, 0 for none; the due tier's level, 0 for none: see _due). Collective, every preempt_check_every steps.
    What start_ahead sent is read here; without it (the first check, one at world size 1, a second
    one at the same step, as after a save), or `fresh` (a check an epoch's last step owed, made after
    the epoch's end work: a signal during an eval counts now), the ranks agree on the spot."""
    ahead, b.stop_ahead = b.stop_ahead, None
    with b.collective("preemption check"):
        sent = ahead() if ahead is not None else None  # every rank sent it: read it, counted or not
        signum, due = sent if sent is not None and not fresh else agree_stop(b.ctx, b.flag, _due(b))
        for hook in b.hooks:  # strategy ft: every replica group alike
            signum, due = hook.agree_stop(b, signum, due)
    return signum, due


def start_ahead(b: Boundary) -> None:
    """At the end of the step before a check step: send that check's agreement now, so that at the
    check no rank waits for the others (their part arrived while it computed the step). A signal
    that lands in between is acted on one check later, as one landing just after the check would be.
    One in flight at a time (an epoch's last step may owe its check to the next batch)."""
    if b.ctx.world_size > 1 and b.stop_ahead is None:
        b.stop_ahead = agree_stop_later(b.ctx, b.flag, _due(b))


def _due(b: Boundary) -> int:
    """The tier a clock says is due on rank 0, as a level the all-reduce's MAX keeps: len(tiers) - its index
    (the durable tier, first, ranks highest: its save supersedes the others' at one step); 0: none. The
    clocks: ckpt_every_s for the durable tier, and any hook's (services/cadence.py: the auto intervals)."""
    if not (b.ctx.is_main and b.state and b.rd is not None):
        return 0
    due = {hook_due for hook in b.hooks for hook_due in hook.timed_due(b)}
    if (b.policy.ckpt_every_s > 0 and b.policy.ckpt_every != AUTO
            and time.monotonic() - b.steps.last_save_t >= b.policy.ckpt_every_s):
        due.add(b.tiers[0].name)
    return next((len(b.tiers) - i for i, t in enumerate(b.tiers) if t.name in due), 0)


def due_tier(b: Boundary, level: int) -> str | None:
    """The tier a stop check's level names (see _due)."""
    return b.tiers[len(b.tiers) - level].name if 0 < level <= len(b.tiers) else None


def leave(b: Boundary, signum: int, saved: bool, took: float) -> NoReturn:
    """After the core's checkpoint (`saved`, in `took` seconds): requeue where the launcher can, and
    exit 75 (130 for Ctrl-C), all ranks together."""
    # Replica groups (strategy ft): every group has saved before anyone requeues (requeueing ends the
    # job), and one group requeues it.
    for hook in b.hooks:
        hook.agree_stop(b, signum, 0)
    wants_requeue = requeues(signum, b.ctx.env) and all([hook.may_requeue(b) for hook in b.hooks])
    code = exit_code(signum)
    if b.ctx.is_main:
        # Printed before the requeue: SLURM ends this job the moment it requeues it.
        what = "interrupted" if signum == signal.SIGINT else "preempted"
        kept = (f"checkpoint saved in {took:.1f}s" if saved else "no checkpoint (no run_dir)" if b.rd is None
                else "no checkpoint (nothing registered with run.resume)")
        print(f"ddp_kit: {what} by {signal.Signals(signum).name} after step {b.steps.done}: {kept}; "
              f"{'requeueing the job' if wants_requeue else 'rerun the same command to resume'}; "
              f"exiting with {code}", file=sys.stderr, flush=True)
        if wants_requeue:
            print(f"ddp_kit: {requeue(b.ctx.env.requeue_command)}", file=sys.stderr, flush=True)
    # No rank exits before the requeue is done: under `srun --kill-on-bad-exit` the first rank
    # to exit non-zero gets every other task (and rank 0's scontrol) killed.
    barrier(b.ctx)
    b.steps.stopped = True
    b.steps.exit_code = code
    raise SystemExit(code)

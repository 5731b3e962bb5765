"""Does a checkpoint fit in the preemption grace period?

Kubernetes evicts a pod with SIGTERM and kills it with SIGKILL `terminationGracePeriodSeconds`
later (30 s by default); a spot reclaim or a SLURM preemption gives a similar window. ddp_kit's
answer to SIGTERM is a checkpoint and exit 75, which is worth something only if the checkpoint
commits inside that window. So every committed checkpoint's time is written to metrics.jsonl
(event "checkpoint": the loop's blocked seconds and the seconds to commit), and, when the
launcher states its grace period (DDP_KIT_GRACE_PERIOD_S, set by the Kubernetes templates), the
last measured time is compared with it at startup (from the previous attempt's metrics) and after
each checkpoint: a warning, once per run, says when it does not fit. What the grace period has left
after the stop's checkpoint bounds the trackers' close (close_budget_s): the end line is written first.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the core imports its parts: they name what they use of it (protocol.py), not the core
    from .protocol import Boundary

# The stop is agreed on at the next preemption check (a few steps) before the save starts: the
# checkpoint itself may use this share of the grace period.
SHARE = 0.75
_TAIL_BYTES = 256 * 1024  # the end of metrics.jsonl holds the last checkpoint's record
# Without DDP_KIT_GRACE_PERIOD_S: Kubernetes' default terminationGracePeriodSeconds, and torchrun's
# shutdown timeout for its workers after it forwards a signal.
ASSUMED_GRACE_S = 30.0
# Kept for what follows the trackers' close after a stop signal: the process group's teardown, the exit.
TEARDOWN_S = 3.0



def note_timings(b: Boundary) -> None:
    """Write the checkpoints committed since the last call to metrics.jsonl; warn (once) when one
    would not fit the grace period."""
    ckpt = b.checkpointer_if_open()
    if ckpt is None:
        return
    for timing in ckpt.take_timings():
        b.steps.last_ckpt_s = timing["commit_s"]
        if b.ctx.is_main:
            b.write({"event": "checkpoint", **timing})
        check(b, timing["commit_s"], "the last checkpoint")


def check(b: Boundary, seconds: float, which: str) -> None:
    grace = b.ctx.env.grace_period_s
    if not grace or seconds <= SHARE * grace or b.steps.grace_warned:
        return
    b.steps.grace_warned = True
    b.say(f"ddp_kit: warning: {which} took {seconds:.1f}s to commit, more than {SHARE:.0%} of the {grace:g}s grace "
          f"period (DDP_KIT_GRACE_PERIOD_S): after a SIGTERM the SIGKILL may come before the checkpoint commits; raise "
          f"the grace period (terminationGracePeriodSeconds), or make checkpoints smaller or async (async_ckpt)")


def check_at_start(b: Boundary) -> None:
    """Compare the previous attempt's last checkpoint time (from its metrics.jsonl) with the grace
    period; rank 0 reads, since only it says anything."""
    if not (b.ctx.is_main and b.ctx.env.grace_period_s and b.rd is not None):
        return
    seconds = last_commit_s(b.rd.metrics)
    if seconds is not None:
        check(b, seconds, "the previous attempt's last checkpoint")


def last_commit_s(metrics: Path) -> float | None:
    """commit_s of the last "checkpoint" record of a metrics.jsonl; None when there is none."""
    try:
        with open(metrics, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - _TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if '"checkpoint"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "checkpoint" and isinstance(record.get("commit_s"), (int, float)):
            return float(record["commit_s"])
    return None


def close_budget_s(b: Boundary, bound_s: float) -> float:
    """How long the trackers may take to close (at most `bound_s`): after a stop signal, what the grace
    period has left once the teardown is kept, so that a slow tracker never costs the exit code (75)
    nor the end line to the SIGKILL that ends the grace period."""
    if not b.flag.signum or not b.flag.at:
        return bound_s
    grace = b.ctx.env.grace_period_s or ASSUMED_GRACE_S
    left = grace - (time.monotonic() - b.flag.at) - TEARDOWN_S
    return max(0.0, min(bound_s, left))

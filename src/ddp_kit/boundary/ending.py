"""How an attempt's training ends: cleanly (the final checkpoint, the last record, summary.json) or on
a stop signal every rank agreed on (a checkpoint, then stopping.leave: requeue and exit 75).

Either checkpoint is what the next attempt resumes from, on every rank: before it the weights are compared
across ranks as a sync check does (sync_check_every > 0), unless this step's check did already, with the same
fix (sync_fix). At a stop a rollback goes back in process and the stop saves what it restored; at the clean end
the loop is over and nothing can be trained again here, so the final checkpoint is refused (rollback.check)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, NoReturn

from ..dist.collectives import broadcast_object
from . import agreement, grace_period, stopping

if TYPE_CHECKING:  # the core imports its parts: they name what they use of it (protocol.py), not the core
    from .protocol import Boundary


def finish(b: Boundary) -> None:
    """At a clean end: a final checkpoint (if anything is registered and this step is not saved), the
    last metrics record and the summary."""
    if b.steps.stopped or b.steps.failed:
        return
    b.steps.finishing = True
    b.flush()
    if b.rd is not None and b.steps.resumed_from is not None and b.steps.done == b.steps.resumed_from:
        b.say(f"ddp_kit: nothing left to train: this run resumed at step {b.steps.done} (epoch {b.epoch}), where "
          f"it had already finished; to start afresh pass resume='never' (--resume never; the old "
          f"checkpoints move to {b.rd.archive}/) or a new run_dir, or raise the epochs/steps to go on")
    if b.policy.log_every and b.steps.done > b.records.last_log[1]:
        b.log()  # the last steps since the last record: the picture and the summary end where the run did
    if b.state and b.rd is not None and not (b.steps.stopped or b.steps.failed):
        _compared(b)
        b.save()
    # Rank 0's word: a script may write its summary on rank 0 only, and the default one is collective.
    if b.rd is not None and not broadcast_object(b.ctx, b.records.summary_written if b.ctx.is_main else None):
        b.write_summary(b.records.default_summary(b))
    b.may_report()  # strategy ft without a summary (no run folder): the result is recorded all the same


def stop(b: Boundary, signum: int) -> NoReturn:
    """Checkpoint, requeue where the launcher can, and exit 75 (130 for Ctrl-C), all ranks together."""
    if b.policy.log_every and b.steps.done > b.records.last_log[1]:
        b.log()  # the steps since the last record, as at a clean end: the resume starts after them
    saved = bool(b.state) and b.rd is not None
    took = time.monotonic()
    if saved:
        _compared(b)  # diverged: rolled back to the last agreed step (then saved, if only the memory tier held it), or raised
        b.save()
        b.progress.enter("checkpoint")  # an async save may still be writing: a slow phase, not a hang
        b.checkpointer().wait()
        grace_period.note_timings(b)
    stopping.leave(b, signum, saved, time.monotonic() - took)


def _compared(b: Boundary) -> None:
    """Before the checkpoint an attempt ends on: the weights compared across ranks (one checksum pass), unless
    the ranks were last known to agree at this very step (its sync check passed, or it was restored)."""
    if b.policy.sync_check_every and b.steps.synced != b.steps.done:
        agreement.compare_weights(b, b.steps.done)

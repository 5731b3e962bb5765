"""A process that ends on an error: the failure policy's words and exit code, and the attempt's verdict
(a failure that repeats the previous attempt's, at the same step, is deterministic: exit 2, no retry)."""
from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

from ..dist.failfast import posted_failure
from ..env.facts import host_name
from ..exit_codes import EXIT_USER_ERROR
from ..reliability.failures import handle
from ..reliability.verdicts import deterministic, of_failure, repeats

if TYPE_CHECKING:  # the core imports its parts: they name what they use of it (protocol.py), not the core
    from .protocol import Boundary


def fail(b: Boundary, err: BaseException) -> int:
    """This process ends on `err`: say what the failure policy says, return the exit code."""
    b.steps.failed = True
    b.ctx.failing.set()
    if b.ctx.failfast is not None:
        b.ctx.failfast.quiet()
    b.flag.closing = True  # torchrun's SIGTERM to the survivors is not a preemption
    step = b.progress.step
    found: list[str] = []
    code = handle(err, b.ctx, step, b.progress.phase, b.hang_dir,
                  hang_declared=b.watchdog.aborting.is_set(), notes=b.cuda_notes, found=found)
    verdict = of_failure(code, err, posted_failure(b.ctx.store), b.ctx.rank, host_name(), step)
    if found and verdict.name == "lost_peer":  # the peer that vanished, named, is the cause
        verdict = dataclasses.replace(verdict, cause=found[0].removeprefix("ddp_kit: "))
    if repeats(verdict, b.previous_end):
        verdict, code = deterministic(verdict), EXIT_USER_ERROR
        if verdict.rank == b.ctx.rank or b.ctx.is_main and verdict.rank is None:
            print(f"ddp_kit: error: {verdict.cause}: not retrying, exiting with {code} (hint: {verdict.fix})",
                  file=sys.stderr, flush=True)
    b.verdict, b.steps.exit_code = verdict, code
    return code

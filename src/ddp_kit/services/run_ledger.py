"""The run ledger as a service: run_dir/attempts.jsonl, one JSON object a line, appended with one write
each, so a kill leaves at most one cut line (readers skip it).

At the attempt's start (collective) it refuses a crash loop or a deterministic failure and records the
start (boundary/attempts.py: the rule and the start and end lines); during the attempt rank 0 copies the
events the boundary already has (first step, resume, each log window, checkpoints, evaluation passes,
strategy ft's pauses, discards and recoveries, a rollback after a sync check's vote), never a line per step; at the end, the end line with the
verdict, also when the watchdog declares a hang or another rank's failure stops this one. `python -m
ddp_kit.status` reads the whole."""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ..exit_codes import EXIT_HANG, EXIT_USER_ERROR
from ..hooks import Boundary, StepHooks
from ..options import Option
from ..service_registry import Service

# metrics.jsonl events the ledger keeps a line of (their time is the run's, not the step's)
COPIED = {"checkpoint": ("step", "blocking_s", "commit_s"), "replica_pause": ("step", "paused_s"),
          "step_discarded": ("step",), "recovery": ("step", "seconds")}

OPTIONS = (
    Option("max_failed_attempts", 3, key="max_failed_attempts", resumable=True,
           help="Under a restarter (Kubernetes, Ray, torchrun --max-restarts, a SLURM requeue): stop with exit 2 when this many attempts in a row failed without a new checkpoint; preemptions do not count (0: no limit)."),
)


class RunLedger(StepHooks):
    """Rank 0's lines of one attempt in the run ledger (the attempt's number is known once it started)."""

    def __init__(self, path: Any = None, attempt: int = 0):
        self.path, self.attempt = path, attempt

    def started(self, b: Boundary) -> None:
        from ..boundary import attempts

        bb: Any = b
        bb.attempt = attempts.begin(bb, bb.resources.leftover)  # a crash loop or a deterministic failure stops here
        if bb.attempt and bb.rd is not None:  # rank 0: the lines of this attempt
            self.path, self.attempt = bb.rd.path / attempts.FILE, bb.attempt
            bb.watchdog.on_hang = lambda stalled_s: _hung(bb, stalled_s)
            if b.ctx.failfast is not None:
                b.ctx.failfast.on_stop = lambda posted: _peer_failed(bb, posted)

    def _line(self, event: str, **fields: Any) -> None:
        from ..boundary.attempts import append

        try:
            append(self.path, {"event": event, "t": round(time.time(), 3), "attempt": self.attempt, **fields})
        except OSError:
            pass  # a full or lost disk is the checkpoint's and the metrics' problem to report, not the ledger's

    def event(self, b: Boundary, record: dict[str, Any]) -> None:
        if not self.attempt:
            return
        kind = record.get("event")
        if kind in COPIED:
            self._line(str(kind), **{k: record[k] for k in COPIED[kind] if k in record})
        elif kind in ("first_step", "resume", "eval_pass", "progress", "health", "excluded", "cadence", "rollback",
                      "replay"):
            fields = {k: v for k, v in record.items() if k != "event"}
            self._line("eval" if kind == "eval_pass" else str(kind), **fields)

    def ending(self, b: Boundary, code: int) -> None:
        from ..boundary import attempts
        from ..reliability.verdicts import of_stop

        bb: Any = b
        attempts.record_end(bb, code, bb.verdict or of_stop(code, b.steps.done))


def _peer_failed(b: Any, posted: dict[str, Any]) -> int | None:
    """Rank 0, stopped by another rank's failure: the end line names that failure; the same one at the
    same step as the previous attempt's ends this one with exit 2 too."""
    from ..boundary import attempts
    from ..env.facts import host_name
    from ..reliability.verdicts import deterministic, of_failure, repeats

    error = RuntimeError(str(posted.get("error", "")))
    verdict = of_failure(1, error, posted, b.ctx.rank, host_name(), b.progress.step)
    code = None
    if repeats(verdict, b.previous_end):
        verdict, code = deterministic(verdict), EXIT_USER_ERROR
    attempts.record_end(b, code or 1, verdict)
    return code


def _hung(b: Any, stalled_s: float) -> None:
    from ..boundary import attempts
    from ..reliability.verdicts import Verdict

    step = b.progress.step
    attempts.record_end(b, EXIT_HANG, Verdict("hang", True, f"no progress for {stalled_s:.0f}s at step {step} in "
                                              f"{b.progress.phase} (stacks in {b.hang_dir})",
                                              "read the hang report; a restart resumes from the last checkpoint",
                                              rank=0, step=step), stalled_s=round(stalled_s, 3))


def make(b: Any, settings: Mapping[str, Any]) -> RunLedger:
    return RunLedger()


SERVICE = Service("ledger", OPTIONS, make)

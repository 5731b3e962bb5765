"""The run ledger's lines written during an attempt (rank 0): first step, resume, each log window,
checkpoints, evaluation passes and strategy ft's pauses, discards and recoveries. It is a hook set
(hooks.StepHooks) fed by the events the boundary already has; it never writes per step. The start
and end lines, and the crash-loop rule over them, are attempts.py's; `python -m ddp_kit.status`
reads the whole (ddp_kit/ledger.py).

The ledger is run_dir/attempts.jsonl: one JSON object a line, appended with one write each, so a
kill leaves at most one cut line (readers skip it)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..hooks import Boundary, StepHooks

# metrics.jsonl events the ledger keeps a line of (their time is the run's, not the step's)
COPIED = {"checkpoint": ("step", "blocking_s", "commit_s"), "replica_pause": ("step", "paused_s"),
          "step_discarded": ("step",), "recovery": ("step", "seconds")}


def append(path: Path, record: dict[str, Any]) -> None:
    """One line, one write: a kill cuts at most this line."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class RunLedger(StepHooks):
    """Rank 0's lines of one attempt in the run ledger."""

    def __init__(self, path: Path, attempt: int):
        self.path, self.attempt = path, attempt

    def _line(self, event: str, **fields: Any) -> None:
        try:
            append(self.path, {"event": event, "t": round(time.time(), 3), "attempt": self.attempt, **fields})
        except OSError:
            pass  # a full or lost disk is the checkpoint's and the metrics' problem to report, not the ledger's

    def event(self, b: Boundary, record: dict[str, Any]) -> None:
        kind = record.get("event")
        if kind in COPIED:
            self._line(str(kind), **{k: record[k] for k in COPIED[kind] if k in record})
        elif kind in ("first_step", "resume", "eval_pass", "progress"):
            fields = {k: v for k, v in record.items() if k != "event"}
            self._line("eval" if kind == "eval_pass" else str(kind), **fields)

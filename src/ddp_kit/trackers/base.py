"""What one tracker is: the three calls a tool gets (open, log, close), what it is told at open,
and the scalars a metrics.jsonl record becomes. No tool and no torch is imported here."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Opening:
    """What a tracker is told when an attempt of the run opens it."""

    run_dir: Path | None  # the run folder (None: the run has none)
    name: str  # a display name for a new tracker run: the run folder's name
    run_id: str | None  # the tracker run to continue (every earlier attempt logged there); None: start a new one
    # The step this attempt resumed from (0: from the start): it computes every later step again.
    rewind_to: int = 0
    config: dict[str, Any] = field(default_factory=dict)  # the run's config (init(config=...)); {} without one
    facts: dict[str, Any] = field(default_factory=dict)  # versions, world size, strategy, backend, device

    @property
    def archive(self) -> Path | None:
        """Where files of an abandoned tracker run go (the run folder's archive/, as metrics.jsonl's)."""
        return None if self.run_dir is None else self.run_dir / "archive"


class Tracker:
    """One experiment tracker, driven by rank 0 from one thread of its own (hub.py), so a slow or
    unreachable tool never stalls training. Any exception is that tracker's end for this attempt:
    one warning, and the run goes on without it.

    A subclass sets `package` (its import name: when missing, init refuses in one line naming
    `extra`) and decides how a resumed attempt avoids logging a step twice: `rewinds=True`, the tool
    drops what it holds after `rewind_to` (TensorBoard's purge) and every record is logged again;
    otherwise the hub skips the records of steps an earlier attempt logged already (W&B and MLflow
    keep every point they were sent)."""

    package: str = ""
    extra: str = ""
    rewinds: bool = False
    needs_run_dir: bool = False  # writes into the run folder (refused in one line without one)
    location: str = ""  # where it logs (a URL, a folder), named in its one warning; set by open, early

    def new_run_id(self) -> str | None:
        """An id for a new tracker run, chosen before the tool is called, for a tool that takes one: it
        goes into trackers.json first, so an attempt killed during a slow open leaves no second run."""
        return None

    def open(self, opening: Opening) -> str:
        """Start or continue the tracker run; returns its id (kept in trackers.json and checkpoints)."""
        raise NotImplementedError

    def log(self, step: int, scalars: dict[str, float], wall_time: float) -> None:
        raise NotImplementedError

    def close(self, exit_code: int) -> None:
        """The attempt ends: 0 finished, 75 preempted (the run goes on later), other: failed."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl record, named `<event>/<key>` (event "train" when the record
    names none), plus each rank's own time and peak memory; step, epoch and time are not values."""
    event = record.get("event", "train")
    out = {f"{event}/{key}": float(value) for key, value in record.items()
           if isinstance(value, (int, float)) and key not in ("step", "epoch", "time")}
    for r in record.get("ranks", ()):
        if isinstance(r, dict) and "rank" in r:
            if isinstance(r.get("local_s"), (int, float)):
                out[f"ranks/local_ms/rank{r['rank']}"] = r["local_s"] * 1e3
            if isinstance(r.get("peak_mem_mb"), (int, float)):
                out[f"ranks/peak_mem_mb/rank{r['rank']}"] = float(r["peak_mem_mb"])
    return out

"""The run ledger's records as the run's account reads them (run_account.py): run_dir/attempts.jsonl's lines
parsed and checked (a line cut by a kill, or damaged, is skipped and counted), grouped by attempt, and
run_dir/config.yaml's max_steps. No torch, as run_account.py."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard


def read(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The ledger's records (an object with a string "event" and a numeric "t", each field of the type
    its writer gives it: see _sound), and how many lines were skipped (a line cut by a kill, or damaged).
    Raises OSError when the file cannot be read."""
    records, bad = [], 0
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if _sound(r):
                records.append(r)
            else:
                bad += 1
    return records, bad


def max_steps_of(run_dir: Path) -> int | None:
    """config.yaml's max_steps, when the run has one (the reference job writes it; a script may not)."""
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    except Exception:  # no config, not YAML, no PyYAML: no ETA, nothing worse
        return None
    v = cfg.get("max_steps") if isinstance(cfg, dict) else None
    return int(v) if _num(v) and v > 0 else None


def _num(v: Any) -> TypeGuard[float]:
    # compared, not math.isfinite: an int beyond a float's range (JSON holds any) would raise OverflowError
    return isinstance(v, (int, float)) and not isinstance(v, bool) and -BIGGEST <= v <= BIGGEST


# What a sound line holds: the writers' fields (boundary/attempts.py, RunLedger) with their types.
BIGGEST = 1e15  # no count or second the writers put in the ledger comes near; NaN and inf fail the comparison
_LATEST_T = 1e11  # a unix time past this (the year 5138) is no clock's
_NUMBERS = frozenset({"t", "launched_t", "step", "steps", "window_s", "blocking_s", "commit_s", "seconds", "paused_s",
                      "stalled_s", "latest", "attempt", "exit", "rank", "world_size", "restart_count", "durable_step",
                      "slowest_rank", "to", "lost", "agreed"})
_TEXTS = frozenset({"verdict", "cause", "fix", "engine", "host", "from", "tier", "phase", "why", "outcome", "error",
                    "slowest_host"})


def _sound(r: Any) -> bool:
    """Whether a parsed line is a record status can use as it is; a damaged one is skipped and counted,
    whatever it holds (a number too big for a float, a time no clock shows, a field of another type)."""
    if not isinstance(r, dict) or not isinstance(r.get("event"), str):
        return False
    if not (_num(r.get("t")) and 0 <= r["t"] < _LATEST_T):
        return False
    if "launched_t" in r and r["launched_t"] is not None and not (_num(r["launched_t"]) and 0 <= r["launched_t"] < _LATEST_T):
        return False
    for k, v in r.items():
        if v is None:
            continue
        if (k in _NUMBERS and not _num(v)) or (k in _TEXTS and not isinstance(v, str)):
            return False
        if k == "retryable" and not isinstance(v, bool):
            return False
        if k == "hosts" and not (isinstance(v, list) and all(isinstance(h, str) for h in v)):
            return False
        if k == "killed_before" and not isinstance(v, dict):
            return False
    return _bounded(r)


def _bounded(v: Any, depth: int = 0) -> bool:
    """No number anywhere in `v` (nested too) outside what a float holds comfortably."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return True
    if isinstance(v, (int, float)):
        return _num(v)
    if depth > 8:
        return False
    if isinstance(v, dict):
        return all(_bounded(x, depth + 1) for x in v.values())
    if isinstance(v, list):
        return all(_bounded(x, depth + 1) for x in v)
    return False


def _f(v: Any) -> float:
    return float(v) if _num(v) else 0.0


def _int(v: Any) -> int | None:
    return int(v) if _num(v) else None


# --- by attempt ------------------------------------------------------------------------------------

@dataclass
class _Raw:
    """One attempt's lines while grouping."""
    number: int
    start: dict[str, Any] | None = None
    end: dict[str, Any] | None = None
    lines: list[dict[str, Any]] = field(default_factory=list)

    def of(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.lines if r["event"] == event]

    def first(self, event: str) -> dict[str, Any] | None:
        return next((r for r in self.lines if r["event"] == event), None)


def group(records: list[dict[str, Any]]) -> list[_Raw]:
    """Lines by attempt: a start line opens one; so does a line after an end, or one naming another
    attempt number (a start refused as a crash loop leaves only an end line)."""
    raws: list[_Raw] = []
    for r in records:
        cur = raws[-1] if raws else None
        number = r.get("attempt") if isinstance(r.get("attempt"), int) else None
        other = cur is not None and number is not None and cur.number != number and (cur.start is None or "attempt" in cur.start)
        if r["event"] == "start" or cur is None or cur.end is not None or other:
            cur = _Raw(number if number is not None else (raws[-1].number + 1 if raws else 1))
            raws.append(cur)
            if r["event"] == "start":
                cur.start = r
        if r["event"] == "end":
            cur.end = r
        cur.lines.append(r)
    return raws


# --- rollbacks -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rollback:
    """A rollback after a sync check's vote (boundary/rollback.py): found at `step`, every rank went back to
    `to`; `ranks` disagreed with the majority, on `hosts` (one per rank)."""
    attempt: int
    t: float
    step: int
    to: int
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]

    @property
    def lost(self) -> int:
        return max(0, self.step - self.to)

    def who(self) -> list[str]:
        return [f"rank {r}" + (f" on {h}" if h else "") for r, h in zip(self.ranks, self.hosts + ("",) * len(self.ranks))]


def rollbacks(a: _Raw) -> list[Rollback]:
    """Attempt `a`'s rollbacks, in order."""
    return [Rollback(a.number, r["t"], int(r["step"]), int(r["to"]),
                     tuple(int(k) for k in r.get("ranks") or () if _num(k)), tuple(str(h) for h in r.get("hosts") or ()))
            for r in a.of("rollback") if _num(r.get("step")) and _num(r.get("to"))]


def since_rollback(a: _Raw) -> list[dict[str, Any]]:
    """Attempt `a`'s lines from its last rollback on, that rollback's line standing at its `to` step: what the
    attempt did before it was trained again."""
    last = max((i for i, r in enumerate(a.lines) if r["event"] == "rollback" and _num(r.get("to"))), default=None)
    return a.lines if last is None else [{**a.lines[last], "step": a.lines[last]["to"]}, *a.lines[last + 1:]]

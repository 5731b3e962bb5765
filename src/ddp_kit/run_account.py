"""The run's account, from its run ledger: what each attempt of a run did, and what the run's wall time
bought (goodput) or lost (badput, by cause). It reads the run ledger, run_dir/attempts.jsonl (rank 0's lines:
boundary/attempts.py and RunLedger write them; run_account_records.py reads and checks them), and
run_dir/config.yaml's max_steps, nothing else: no torch, no process group, no checkpoint storage, so it
answers for a run whose checkpoints are at a URL, from any machine.

The wall time, from the first attempt's launch to the last one's end (now, while it runs), is cut into
pieces that add up to it by construction. Each attempt's span is split into its start-up (launch to the
end of its first step, less that step), checkpoint blocking, evaluation, replica pauses and discarded
steps (strategy ft), the hang before a watchdog fired, and its steps: kept ones are goodput, ones a later
attempt trained again are "replayed". A running attempt's time since its last line is "unlogged" (training
or stalled: its next line tells), so a stall never shows as goodput. What its records do not explain is
"other"; the gap between one
attempt's end and the next one's launch is "down". A step's time is the attempt's mean over its log
windows (checkpoint, eval and pauses inside a window taken out), so replayed time is the count of replayed
steps (exact) times that attempt's step time (an estimate).

An attempt killed without an end line (SIGKILL, the OOM killer, a lost node) is accounted for from what it
left: its last line, and the step its rank 0 was on (`killed_before` in the next start line, from the
progress mirror the dead process left)."""
from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import UserError
from .run_account_records import Rollback, _f, _int, _num, _Raw, group, max_steps_of, read, rollbacks, since_rollback

LEDGER = "attempts.jsonl"  # in run_dir; the writer's name for it is boundary/attempts.py's FILE
# Badput causes, in the order the status table shows them.
CAUSES = ("startup", "checkpoint", "evaluation", "replayed", "down", "hang", "replica", "other", "unlogged")
# Phases of reliability/progress.py in which the step the mirror names had finished.
COMPLETE_PHASES = frozenset({"after step", "preemption check", "log all-reduce", "sync check", "checkpoint",
                             "between epochs", "finish", "eval"})
# Ledgers written before verdicts existed have only an outcome word.
OLD_OUTCOMES = {"done": "finished", "preempted": "preempted", "interrupted": "interrupted",
                "user error": "user_error", "failed": "failed"}
KILLED_CAUSE = "no end line (SIGKILL, the OOM killer, a lost node or pod)"
RUNNING_QUIET_S = 120.0  # an unended attempt whose last line is younger than this (or 2 log gaps) is running


@dataclass(frozen=True)
class Attempt:
    """One attempt (one launch of the job) as the ledger tells it. Times are unix wall seconds."""
    number: int
    launched_t: float
    end_t: float
    end_estimated: bool  # killed (or running): end_t is estimated from its last line (or is now)
    world_size: int | None
    engine: str | None
    hosts: tuple[str, ...]
    verdict: str  # end line's verdict; "killed" without one; "running" while it runs
    retryable: bool | None
    exit: int | None
    rank: int | None
    host: str | None
    cause: str
    fix: str
    resumed_step: int | None  # steps done once restored
    resumed_from: str | None  # checkpoint, peer, none
    last_step: int | None  # steps done when it ended
    steps: int  # steps it trained
    replayed_steps: int  # of those, steps a later attempt trained again
    step_time_s: float | None
    seconds: dict[str, float]  # goodput and each cause inside this attempt ("down": the gap before it)
    marks: tuple[tuple[float, str, float], ...] = ()  # (t, cause, seconds) of its checkpoints, evals, pauses
    resumed_tier: str | None = None  # memory (its node's own copy), peer (another node's), durable; None: not resumed
    spared_steps: int = 0  # steps its memory-tier resume did not replay: from the durable step up to the resumed one

    @property
    def duration_s(self) -> float:
        return self.end_t - self.launched_t


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint and what became of it."""
    step: int
    attempt: int
    t: float
    blocking_s: float
    commit_s: float | None
    fate: str  # "resumed by attempt N", "skipped by attempt N ..." (it resumed from before), "passed", "newest", ""


@dataclass(frozen=True)
class Slowest:
    rank: int
    host: str | None
    windows: int  # log windows in which it was the slowest rank
    of: int  # log windows that named a slowest rank


@dataclass(frozen=True)
class RunAccount:
    """The whole run: goodput_s + sum(badput.values()) == wall_s (exactly, up to float rounding)."""
    state: str  # running, finished, preempted, interrupted, failed, crash loop
    step: int | None
    max_steps: int | None
    steps_per_s: float | None
    eta_s: float | None  # training time left at the last attempt's pace (no failures counted)
    start_t: float
    end_t: float
    wall_s: float
    goodput_s: float
    badput: dict[str, float]  # each of CAUSES, seconds
    replayed_steps: int
    attempts: tuple[Attempt, ...]
    checkpoints: tuple[Checkpoint, ...]
    slowest: Slowest | None
    skipped_lines: int = 0  # lines that were not a record (a line cut by a kill)
    spared: dict[str, int] = field(default_factory=dict)  # per tier (memory, peer): steps its resumes did not replay
    rollbacks: tuple[Rollback, ...] = ()  # after a sync check's vote (sync_fix rollback): their lost steps are replayed
    now: float = field(default=0.0, compare=False)

    @property
    def goodput_pct(self) -> float:
        return 100.0 * self.goodput_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["goodput_pct"] = self.goodput_pct
        for a, d in zip(self.attempts, out["attempts"]):
            d["duration_s"] = a.duration_s
            d["marks"] = [list(m) for m in a.marks]
        return out


# --- reading ---------------------------------------------------------------------------------------

def load(run_dir: str | Path, now: float | None = None) -> RunAccount:
    """The account of the run in run_dir; a missing or unreadable folder or ledger is a UserError."""
    d = Path(run_dir)
    if not d.is_dir():
        raise UserError(f"no run folder at {str(d)!r}", "pass the run_dir of a ddp_kit run (its --run_dir)")
    path = d / LEDGER
    try:
        records, bad = read(path)
    except FileNotFoundError:
        raise UserError(f"no {LEDGER} in {str(d)!r}: the run has not started an attempt yet, or is not a ddp_kit run",
                        "pass the run_dir of a ddp_kit run; a run that predates the ledger has no attempts to show") from None
    except OSError as exc:
        raise UserError(f"cannot read {str(path)!r}: {exc.strerror}", "check the folder's permissions") from None
    if not records:
        raise UserError(f"{str(path)!r} holds no attempt yet", "wait for the run's first attempt to start")
    return account(records, now=now, max_steps=max_steps_of(d), skipped_lines=bad)


# --- accounting ------------------------------------------------------------------------------------

def _complete(killed_before: Any) -> int | None:
    """Steps complete when the previous attempt died, from its progress mirror's step and phase."""
    if not isinstance(killed_before, dict) or not _num(killed_before.get("step")):
        return None
    s = int(killed_before["step"])
    return s if killed_before.get("phase") in COMPLETE_PHASES else s - 1


def _resumed(a: _Raw) -> int | None:
    """Steps done once this attempt was restored; None when it never got that far."""
    resume, first = a.first("resume"), a.first("first_step")
    if resume is not None and _num(resume.get("step")):
        return int(resume["step"])
    if first is not None and _num(first.get("step")):
        return int(first["step"]) - 1
    if a.start is not None and "attempt" not in a.start:  # an old ledger: the checkpoint it found
        latest = _int(a.start.get("latest")) or 0
        ended = _int(a.end.get("step")) if a.end else None
        if ended is not None and ended > latest:
            return latest
    return None


def _last_step(a: _Raw, nxt: _Raw | None, resumed: int | None) -> int | None:
    if a.end is not None and _num(a.end.get("step")):
        return int(a.end["step"])
    if a.end is None and nxt is not None and nxt.start is not None:
        done = _complete(nxt.start.get("killed_before"))
        if done is not None:
            return done
    seen = [int(r["step"]) for r in since_rollback(a) if r["event"] in ("progress", "checkpoint", "first_step", "eval",
                                                                       "resume", "rollback") and _num(r.get("step"))]
    return max(seen) if seen else resumed


def _window_losses(a: _Raw) -> tuple[list[int], list[float]]:
    """Steps and prefix sums of the time a log window holds that is not steps: checkpoint blocking,
    evaluation and replica pauses (each at the step it followed)."""
    marks = sorted((int(r["step"]), s) for r in a.lines if _num(r.get("step"))
                   for s in [_f(r.get("blocking_s")) if r["event"] == "checkpoint" else
                             _f(r.get("seconds")) if r["event"] == "eval" else
                             _f(r.get("paused_s")) if r["event"] == "replica_pause" else 0.0] if s > 0)
    prefix = [0.0]
    for _, s in marks:
        prefix.append(prefix[-1] + s)
    return [m for m, _ in marks], prefix


def _step_time(a: _Raw, resumed: int | None, last_step: int | None, blocking: float, evaluating: float,
               pausing: float) -> float | None:
    """Seconds per step: the log windows' time less what was not steps, over their steps (a window
    reaching back past the resume counts only the steps this attempt did); else the time from the
    first step to the last line, over the steps between."""
    steps_at, prefix = _window_losses(a)
    busy = count = 0.0
    for r in a.of("progress"):
        k, w, s = r.get("steps"), r.get("window_s"), r.get("step")
        if not (_num(k) and _num(w) and _num(s)) or k <= 0:
            continue
        inside = prefix[bisect_left(steps_at, s)] - prefix[bisect_left(steps_at, s - k)]
        busy += max(0.0, w - inside - _f(r.get("mem_s")))  # the memory tier's waits in the window
        count += min(k, s - resumed) if resumed is not None and s > resumed else k
    if count > 0 and busy > 0:
        return busy / count
    first = a.first("first_step")
    last = a.end or a.lines[-1]
    lost = blocking + evaluating + pausing
    if first is not None and _num(first.get("step")):
        if a.end is None:  # killed: the last line's own step, not the one the mirror told
            seen = [int(r["step"]) for r in a.lines if _num(r.get("step"))]
            last_step = max(seen) if seen else last_step
        n = (last_step or 0) - int(first["step"])
        if n > 0 and last["t"] - first["t"] - lost > 0:
            return float(last["t"] - first["t"] - lost) / n
        return None
    resumed = _resumed(a)
    if a.start is not None and a.end is not None and last_step is not None and resumed is not None:
        n = last_step - resumed  # an old ledger: start to end over the steps between
        if n > 0 and a.end["t"] - a.start["t"] - lost > 0:
            return float(a.end["t"] - a.start["t"] - lost) / n
    return None


def _verdict(a: _Raw, running: bool) -> tuple[str, bool | None, str]:
    if a.end is None:
        return ("running", None, "") if running else ("killed", True, KILLED_CAUSE)
    e = a.end
    verdict = e.get("verdict") or OLD_OUTCOMES.get(str(e.get("outcome")), str(e.get("outcome") or "failed"))
    retryable = e.get("retryable") if isinstance(e.get("retryable"), bool) else None
    cause = str(e.get("cause") or (f"exit {e['exit']}" if "exit" in e else ""))
    return str(verdict), retryable, cause


def account(records: list[dict[str, Any]], now: float | None = None, max_steps: int | None = None,
            skipped_lines: int = 0) -> RunAccount:
    """The run's account from its ledger records (read()'s first value). `now`: the wall time to
    account a running run up to (default: time.time())."""
    now = time.time() if now is None else now
    # A refused restart (a crash loop, a deterministic failure) is a line of its own, not an attempt.
    refused = [r for r in records if r["event"] == "refused"]
    records = [r for r in records if r["event"] != "refused"]
    raws = group(records)
    if not raws:
        raise ValueError("no ledger records")
    gaps = [b["t"] - a["t"] for raw in raws for a, b in zip(raw.of("progress"), raw.of("progress")[1:])]
    quiet = max([RUNNING_QUIET_S] + [2 * g for g in gaps])
    running = raws[-1].end is None and now - raws[-1].lines[-1]["t"] < quiet

    resumed = [_resumed(a) for a in raws]
    launched = [_f(a.start.get("launched_t", a.start["t"])) if a.start else
                _f(a.lines[0].get("launched_t", a.lines[0]["t"])) for a in raws]
    attempts: list[Attempt] = []
    boundary = launched[0]  # the end of the previous piece of the timeline
    total = dict.fromkeys(("goodput",) + CAUSES, 0.0)
    replayed_total = 0
    for i, a in enumerate(raws):
        nxt = raws[i + 1] if i + 1 < len(raws) else None
        attempt = _attempt(a, nxt, resumed[i:], launched[i], launched[i + 1] if nxt is not None else None,
                           boundary, running and nxt is None, now)
        boundary = attempt.end_t
        for k, v in attempt.seconds.items():
            total[k] += v
        replayed_total += attempt.replayed_steps
        attempts.append(attempt)

    wall = boundary - launched[0]
    last = attempts[-1]
    state = _state(last, running)
    if not running and refused and refused[-1]["t"] >= raws[-1].lines[-1]["t"]:
        state = "crash loop" if refused[-1].get("why") == "crash_loop" else "deterministic failure"
    paced = next((x.step_time_s for x in reversed(attempts) if x.step_time_s), None)
    step = last.last_step if last.last_step is not None else next(
        (x.last_step for x in reversed(attempts) if x.last_step is not None), None)
    eta = None
    if max_steps is not None and paced and step is not None and state not in ("finished", "crash loop"):
        eta = max(0, max_steps - step) * paced
    return RunAccount(
        state=state, step=step, max_steps=max_steps, steps_per_s=1.0 / paced if paced else None, eta_s=eta,
        start_t=launched[0], end_t=boundary, wall_s=wall, goodput_s=total["goodput"],
        badput={k: total[k] for k in CAUSES}, replayed_steps=replayed_total, attempts=tuple(attempts),
        checkpoints=_lineage(raws, resumed), slowest=_slowest(records), skipped_lines=skipped_lines,
        spared={t: sum(a.spared_steps for a in attempts if a.resumed_tier == t) for t in ("memory", "peer")
                if any(a.resumed_tier == t for a in attempts)},
        rollbacks=tuple(rb for a in raws for rb in rollbacks(a)), now=now)


def _attempt(a: _Raw, nxt: _Raw | None, resumed: list[int | None], launched_t: float, next_launched_t: float | None,
             boundary: float, last_run: bool, now: float) -> Attempt:
    """Attempt `a` on the timeline: from its launch (or `boundary`, the end of the piece before it) to its
    end, cut at the next attempt's launch. resumed: its own resumed step, then the later attempts'."""
    r0 = resumed[0]
    d = _last_step(a, nxt, r0)
    n = max(0, d - r0) if d is not None and r0 is not None else 0
    later = [r for r in resumed[1:] if r is not None]
    kept = min(max(min(later), r0), d) - r0 if later and r0 is not None and d is not None else n
    kept = max(0, min(kept, n))
    n += sum(rb.lost for rb in rollbacks(a))  # a rollback's lost steps were trained twice: the first time is replayed
    blocking = (sum((_f(r.get("blocking_s")) for r in a.of("checkpoint")), 0.0)
                + sum((_f(r.get("mem_s")) for r in a.of("progress")), 0.0))  # the memory tier's waits
    evaluating = sum((_f(r.get("seconds")) for r in a.of("eval")), 0.0)
    pausing = sum((_f(r.get("paused_s")) for r in a.of("replica_pause")), 0.0)
    st = _step_time(a, r0, d, blocking, evaluating, pausing)
    step_s = st or 0.0
    verdict, retryable, cause = _verdict(a, last_run)

    end_t = _end_t(a, d, step_s, next_launched_t, last_run, now)
    start = max(launched_t, boundary)
    end = max(start, min(end_t, next_launched_t) if next_launched_t is not None else end_t)
    hang = _f(a.end.get("stalled_s")) if a.end is not None and verdict == "hang" else 0.0
    parts = {"checkpoint": blocking, "evaluation": evaluating, "hang": hang,
             "replica": pausing + len(a.of("step_discarded")) * step_s,
             "goodput": kept * step_s, "replayed": (n - kept) * step_s, "unlogged": 0.0}
    parts = _fit(a, parts, start, end - start, step_s, n, last_run, now)
    parts["down"] = start - boundary

    s = a.start or {}
    e = a.end or {}
    marks = tuple((r["t"], {"checkpoint": "checkpoint", "eval": "evaluation"}.get(r["event"], "replica"),
                   _f(r.get("blocking_s") or r.get("seconds") or r.get("paused_s")))
                  for r in a.lines if r["event"] in ("checkpoint", "eval", "replica_pause"))
    resume = a.first("resume")
    return Attempt(
        number=a.number, launched_t=start, end_t=end, end_estimated=a.end is None,
        world_size=_int(s.get("world_size")), engine=s.get("engine"),
        hosts=tuple(str(h) for h in s.get("hosts") or ()), verdict=verdict, retryable=retryable,
        exit=_int(e.get("exit")), rank=_int(e.get("rank")), host=e.get("host"), cause=cause,
        fix=str(e.get("fix") or ""), resumed_step=r0,
        resumed_from=resume.get("from") if resume else None, last_step=d, steps=n,
        replayed_steps=n - kept, step_time_s=st, seconds={k: parts[k] for k in ("goodput",) + CAUSES},
        marks=marks, resumed_tier=str(resume["tier"]) if resume and resume.get("tier") else None,
        spared_steps=_spared(resume))


def _end_t(a: _Raw, last_step: int | None, step_s: float, next_launched_t: float | None, last_run: bool,
           now: float) -> float:
    """When attempt `a` ended: its end line; now, while it runs; else (killed) its last line, plus the
    steps it did after it (the mirror's step), but not past the next attempt's launch."""
    end_t: float
    if a.end is not None:
        end_t = a.end["t"]
    elif last_run:
        end_t = now
    else:
        seen = [int(r["step"]) for r in a.lines if _num(r.get("step"))]
        after = max(0, (last_step or 0) - max(seen)) if seen and last_step is not None else 0
        end_t = a.lines[-1]["t"] + after * step_s
        if next_launched_t is not None:
            end_t = min(end_t, next_launched_t)
    return end_t


def _fit(a: _Raw, parts: dict[str, float], start: float, span: float, step_s: float, n: int, last_run: bool,
         now: float) -> dict[str, float]:
    """`parts` with its start-up, unlogged time and "other" added, within the attempt's `span`."""
    first = a.first("first_step")
    if last_run and first is not None:
        # Training or stalled since its last line: not known yet (the next line tells), so not goodput.
        parts["unlogged"] = max(0.0, now - a.lines[-1]["t"])
    if first is not None:
        parts["startup"] = max(0.0, first["t"] - start - step_s)
    elif n == 0:  # never trained a step: all of it was getting there
        parts["startup"] = max(0.0, span - sum(parts.values()))
    else:  # an old ledger: no first step line, start-up cannot be told apart
        parts["startup"] = 0.0
    used = sum(parts.values())
    if used > span > 0 or (used > 0 and span == 0):  # estimates past the span: shrink them to it
        parts = {k: v * span / used for k, v in parts.items()}
        used = span
    parts["other"] = span - used
    return parts


def _spared(resume: dict[str, Any] | None) -> int:
    """Steps a resume from the memory tier did not replay: a restart from the durable tier would have."""
    if not resume or resume.get("tier") not in ("memory", "peer"):
        return 0
    if not _num(resume.get("step")) or not _num(resume.get("durable_step")):
        return 0
    return max(0, int(resume["step"]) - int(resume["durable_step"]))


def _state(last: Attempt, running: bool) -> str:
    if running:
        return "running"
    if last.verdict in ("finished", "preempted", "interrupted"):
        return last.verdict
    if last.verdict == "user_error" and last.cause.startswith("crash loop"):
        return "crash loop"
    return "failed"


def _lineage(raws: list[_Raw], resumed: list[int | None]) -> tuple[Checkpoint, ...]:
    out = []
    for i, a in enumerate(raws):
        for r in a.of("checkpoint"):
            if not _num(r.get("step")):
                continue
            c = int(r["step"])
            fate = next((f"set aside by the rollback at step {rb.step}" for rb in rollbacks(a)
                         if rb.t >= r["t"] and rb.to < c <= rb.step), "")
            for j in range(i + 1, len(raws) if not fate else 0):
                rj = resumed[j]
                if rj is None:
                    continue
                if rj == c:
                    fate = f"resumed by attempt {raws[j].number}"
                    break
                if rj < c:
                    fate = f"skipped by attempt {raws[j].number} (it resumed from step {rj})"
                    break
                fate = "passed"
            out.append(Checkpoint(step=c, attempt=a.number, t=r["t"], blocking_s=_f(r.get("blocking_s")),
                                  commit_s=float(r["commit_s"]) if _num(r.get("commit_s")) else None, fate=fate))
    if out and not out[-1].fate:
        out[-1] = replace(out[-1], fate="newest")
    return tuple(out)


def _slowest(records: list[dict[str, Any]]) -> Slowest | None:
    named = [(int(r["slowest_rank"]), r.get("slowest_host")) for r in records
             if r["event"] == "progress" and _num(r.get("slowest_rank"))]
    if not named:
        return None
    (rank, windows), = Counter(k for k, _ in named).most_common(1)
    hosts = Counter(h for k, h in named if k == rank and h)
    return Slowest(rank=rank, host=hosts.most_common(1)[0][0] if hosts else None, windows=windows, of=len(named))

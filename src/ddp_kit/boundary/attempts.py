"""A crash loop ends: attempts that fail without a new checkpoint are counted, preemptions are not.

A restart policy (Kubernetes, Ray's FailureConfig, torchrun --max-restarts, a SLURM requeue) reruns
the command after a failure. A deterministic crash then fails again at the same place, forever or
until a counter the engine keeps runs out; and most engines keep one counter for preemptions and
failures alike, so a cap big enough for a week of spot reclaims lets a broken job loop all week.
So rank 0 keeps run_dir/attempts.jsonl: a "start" record per attempt (with the newest committed
checkpoint then) and an "end" record (its outcome and exit code; none when the process was
killed). At startup under an automatic restarter, when the last `max_failed_attempts` attempts
each failed (or were killed) and none of them committed a checkpoint, the job stops with one line
and exit 2, which the templates map to "do not retry". A preempted attempt (exit 75) breaks the
run of failures, and so does any attempt that committed a checkpoint: that is progress. A plain
rerun by hand is never refused (you are fixing something).

Both refusals count only the attempts of this attempt's own launch (dist/launch_token.py, recorded
in each start record as "launch"): a restart of the same launch (a torchrun restart, a SLURM requeue
of the same job, the same pod or TrainJob restarted) is refused, while a new submission (a new SLURM
job, a new torchrun, a new TrainJob) is the fix being tried: it starts, saying in one line what
failed before. Every SLURM job and every pod has a restarter around it, so without this a fixed
script resubmitted as a new job would be refused forever.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..dist.collectives import gather_object, rank0_verdict
from ..dist.launch_token import launch_of
from ..env.facts import host_name
from ..errors import UserError
from ..exit_codes import EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_USER_ERROR
from ..reliability.verdicts import REPEATABLE, Verdict
from ..run_account import LEDGER

if TYPE_CHECKING:  # the core imports its parts: they name what they use of it (protocol.py), not the core
    from .protocol import Boundary

FILE = LEDGER  # the run ledger's file, named where it is read (ddp_kit/run_account.py)
OUTCOMES = {0: "done", EXIT_PREEMPTED: "preempted", EXIT_INTERRUPTED: "interrupted", EXIT_USER_ERROR: "user error"}


def append(path: Path, record: dict[str, Any]) -> None:
    """One line, one write: a kill cuts at most this line."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")



def begin(b: Boundary, killed_before: tuple[int, str] | None = None) -> int:
    """At startup (collective): refuse a crash loop or a deterministic failure, then record this
    attempt's start (rank 0). Returns the attempt's number (1-based) on rank 0, else 0. Every rank
    learns how the previous attempt ended (b.previous_end), for the repeat rule at a failure.
    `killed_before`: the step and phase rank 0 of a killed previous attempt was at (its progress mirror)."""
    if b.rd is None:
        return 0
    path = b.rd.path / FILE
    hosts = gather_object(b.ctx, host_name())
    number = 0

    def check() -> dict[str, Any] | None:
        nonlocal number
        latest = _latest(b)
        records = read(path)
        env = b.ctx.env
        launch = launch_of(env).id
        automatic = env.restarted_by_engine or env.restart_count > 0 or env.requeue_command is not None
        limit = b.policy.max_failed_attempts
        mine = this_launch(records, launch)  # the refusals count only this launch's own attempts
        failed = failed_in_a_row(mine, latest)
        starts = [r for r in records if r.get("event") == "start"]
        bounds = [r for r in records if r.get("event") in ("start", "end")]
        previous = bounds[-1] if bounds and bounds[-1].get("event") == "end" else None
        if automatic:
            _say_new_launch(path, records, mine, previous, latest, limit)
        if automatic and previous is not None and previous.get("retryable") is False and \
                previous.get("verdict") in REPEATABLE and mine:
            raise _refused(path, "deterministic", f"the previous attempt of this run ended with a deterministic failure ("
                            f"{previous.get('error')}, at step {previous.get('step')} twice): not starting another",
                            f"fix it (history: {path}), then rerun")
        if automatic and limit and len(failed) >= limit:
            last = failed[-1]
            raise _refused(path, "crash_loop", f"the last {len(failed)} attempts of this run failed without a new checkpoint (the newest "
                            f"is {_step(latest)}; the last ended with exit {last.get('exit', 'killed')} at step "
                            f"{last.get('step', '?')}): not starting another, a restart would fail the same way",
                            f"fix the error the previous attempts printed (history: {path}), then rerun; or raise "
                            f"max_failed_attempts (0: no limit)")
        number = len(starts) + 1
        start: dict[str, Any] = {"event": "start", "t": round(time.time(), 3), "attempt": number,
                                 "launched_t": launched_at(), "latest": latest, "restart_count": env.restart_count,
                                 "launch": launch,
                                 "world_size": b.ctx.world_size, "engine": env.launcher, "hosts": hosts}
        if killed_before is not None and (not records or records[-1].get("event") != "end"):
            start["killed_before"] = {"step": killed_before[0], "phase": killed_before[1]}
        append(path, start)
        b.steps.attempt_started = True
        return previous

    b.previous_end = rank0_verdict(b.ctx, check)
    return number


def record_end(b: Boundary, code: int, verdict: Verdict, **extra: Any) -> None:
    """The end line (rank 0, once): exit code, verdict and where; never raises."""
    if b.rd is None or not b.ctx.is_main or not b.steps.attempt_started or b.steps.ended:
        return  # an attempt refused at startup leaves no end: the failures before it stay in a row
    b.steps.ended = True
    try:
        append(b.rd.path / FILE, {"event": "end", "t": round(time.time(), 3), "attempt": b.attempt, "exit": code,
                                  "outcome": OUTCOMES.get(code, "failed"), "step": b.steps.done,
                                  "verdict": verdict.name, "retryable": verdict.retryable, **verdict.fields(),
                                  **extra})
    except OSError:
        pass


def this_launch(records: list[dict[str, Any]], launch: str) -> list[dict[str, Any]]:
    """The trailing records of `launch`'s own attempts: from the first start of the last run of starts
    that name it (a start record without a launch, written before they were recorded, names none)."""
    first = len(records)
    for i in range(len(records) - 1, -1, -1):
        if records[i].get("event") != "start":
            continue
        if records[i].get("launch") != launch:
            break
        first = i
    return records[first:]


def _say_new_launch(path: Path, records: list[dict[str, Any]], mine: list[dict[str, Any]],
                    previous: dict[str, Any] | None, latest: int | None, limit: int) -> None:
    """One line when an earlier launch's failures would have refused a restart, and this is a new one."""
    if mine or not records:
        return
    before = [r for r in records if r.get("event") == "start"][-1:]
    launch = before[0].get("launch", "an earlier launch") if before else "an earlier launch"
    if previous is not None and previous.get("retryable") is False and previous.get("verdict") in REPEATABLE:
        what = (f"ended with a deterministic failure ({previous.get('error')}, at step {previous.get('step')}), "
                f"which a restart of that launch would repeat")
    elif limit and len(failed_in_a_row(records, latest)) >= limit:
        what = f"failed {len(failed_in_a_row(records, latest))} times in a row without a new checkpoint"
    else:
        return
    print(f"ddp_kit: the last attempt of this run ({launch}) {what}; this is a new submission, so it starts "
          f"(history: {path})", file=sys.stderr, flush=True)


def _refused(path: Path, why: str, message: str, hint: str) -> UserError:
    """The refusal of an automatic restart, with its own line in the ledger (not an attempt: it leaves
    the failures before it in a row)."""
    try:
        append(path, {"event": "refused", "t": round(time.time(), 3), "why": why, "cause": message})
    except OSError:
        pass
    return UserError(message, hint)


def launched_at(imported: tuple[float, float] | None = None) -> float | None:
    """When this launch started (unix time): the time before ddp_kit.init counts as start-up.

    /proc's start time is when this process was forked. A shell running `a && b && python ...` execs its
    last command in its own process, so that time would be the shell's, before `a` and `b` (a pip install,
    a sleep). So when this process waited for children before (their page faults and CPU time, which exec
    keeps) and the interpreter's own start is more than EXEC_GAP_S later, that is the start: the time
    ddp_kit was imported less the CPU seconds spent by then (interpreter start-up and imports are CPU).
    `imported`: (unix time, CPU seconds) at that import (ddp_kit.IMPORTED)."""
    from .. import IMPORTED

    forked = _forked_at()
    at, cpu = imported or IMPORTED
    interpreter = at - cpu
    if forked is None:
        return round(interpreter, 3)
    if _waited_for_children() and interpreter - forked > EXEC_GAP_S:
        return round(interpreter, 3)
    return forked


EXEC_GAP_S = 2.0  # more than imports' waits on a busy disk or CPU, less than any command worth booking apart


def _stat() -> list[str]:
    return Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # fields from 3 (state) on


def _forked_at() -> float | None:
    try:
        booted = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                      if line.startswith("btime "))
        return round(booted + int(_stat()[19]) / os.sysconf("SC_CLK_TCK"), 3)
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _waited_for_children() -> bool:
    """Whether this process (before an exec too) waited for a child: cminflt, cmajflt, cutime, cstime."""
    try:
        fields = _stat()
        return any(int(fields[i]) > 0 for i in (8, 10, 13, 14))  # fields 11, 13, 16, 17
    except (OSError, ValueError, IndexError):
        return False


def failed_in_a_row(records: list[dict[str, Any]], latest: int | None) -> list[dict[str, Any]]:
    """The trailing attempts that failed or were killed and made no progress: committed no checkpoint,
    and (memory tier) left none that the next attempt resumed further from. For each, its end record
    (or its start record, when it was killed). `latest`: the newest committed step now."""
    attempts: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    resumed: dict[Any, int] = {}  # attempt number -> the step it resumed at
    for r in records:
        if r.get("event") == "start":
            attempts.append((r, None))
        elif r.get("event") == "end" and attempts and attempts[-1][1] is None:
            attempts[-1] = (attempts[-1][0], r)
        elif r.get("event") == "resume" and isinstance(r.get("step"), int):
            resumed.setdefault(r.get("attempt"), r["step"])
    out: list[dict[str, Any]] = []
    after = latest  # the newest checkpoint when the attempt after this one started
    after_resumed: int | None = None  # the step the attempt after this one resumed at (unknown for the new one)
    for start, finish in reversed(attempts):
        failed = finish is None or finish.get("outcome") == "failed"
        mine = resumed.get(start.get("attempt"))
        further = after_resumed is not None and mine is not None and after_resumed > mine
        if not failed or after != start.get("latest") or further:  # a clean or preempted end, or progress
            break
        out.append(finish or start)
        after, after_resumed = start.get("latest"), mine
    return out[::-1]


def read(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return out


def _latest(b: Boundary) -> int | None:
    try:
        return b.checkpointer().latest()
    except Exception:
        return None


def _step(latest: int | None) -> str:
    return "none yet" if latest is None else f"step_{latest}"

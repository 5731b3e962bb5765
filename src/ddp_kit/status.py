"""`python -m ddp_kit.status RUN_DIR [--json] [--watch [SECONDS]]`: where a run stands and what its
failures cost, from its run ledger (the account: ddp_kit/run_account.py). Reads files only: no torch, no
process group, no checkpoint storage (a run whose checkpoints are at a URL is read the same way)."""
from __future__ import annotations

import sys
import time
from collections import Counter
from datetime import datetime
from json import dumps
from typing import Any

from .errors import UserError
from .exit_codes import EXIT_USER_ERROR
from .run_account import CAUSES, Attempt, RunAccount, load

WATCH_DEFAULT_S = 10.0
SHOWN_CHECKPOINTS = 5
SHOWN_ATTEMPTS = 12
MEANING = {  # one line per cause, under the table
    "startup": "launch to the first step (imports, rendezvous, restore), less that step",
    "checkpoint": "time the training loop was blocked by checkpoint saves",
    "evaluation": "evaluation passes",
    "replayed": "steps trained, then lost to a restart from an older checkpoint or a rollback, and trained again",
    "down": "from one attempt's end to the next one's launch (requeue, scheduling, restart back-off)",
    "hang": "stalls: from the last progress to the watchdog's report",
    "replica": "strategy ft: pauses while replica groups left or joined, and discarded steps",
    "other": "what the ledger does not explain (teardown, final saves, clock noise)",
    "unlogged": "a running attempt's time since its last ledger line: training or stalled (the next line tells)",
}


def duration(s: float | None) -> str:
    if s is None:
        return "?"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _ended(a: Attempt) -> str:
    at = f" at step {a.last_step}" if a.last_step is not None else ""
    if a.verdict == "running":
        return f"running{at}"
    said = f"{a.verdict}{at}"
    if a.exit is not None:
        said += f", exit {a.exit}"
    if a.retryable is not None and a.verdict != "finished":
        said += ", retryable" if a.retryable else ", not retryable"
    where = f"rank {a.rank}" + (f" on {a.host}" if a.host else "") if a.rank is not None else ""
    if where:
        said += f" ({where})"
    if a.cause and a.verdict != "finished":
        said += f": {a.cause}"
    if a.fix and a.verdict != "finished":
        said += f" (fix: {a.fix})"
    return said


def render(run: RunAccount, run_dir: str = "") -> str:
    """What `python -m ddp_kit.status` prints."""
    lines = []
    step = "no step yet" if run.step is None else f"step {run.step}" + (f" of {run.max_steps}" if run.max_steps else "")
    pace = f", {run.steps_per_s:.2f} steps/s" if run.steps_per_s else ""
    eta = f", ETA {duration(run.eta_s)} of training" if run.eta_s is not None and run.eta_s > 0 else ""
    lines.append(f"{run_dir}: {run.state} at {step}{pace}{eta}")
    lines.append(f"{len(run.attempts)} attempt{'s' if len(run.attempts) != 1 else ''}, wall {duration(run.wall_s)} "
                 f"since {_clock(run.start_t)}; goodput {run.goodput_pct:.1f}% ({duration(run.goodput_s)} of kept steps)"
                 + (f"; {run.replayed_steps} step{'s' if run.replayed_steps != 1 else ''} replayed" if run.replayed_steps else ""))
    if run.spared:
        lines.append("memory tier: " + ", ".join(f"{n} step{'s' if n != 1 else ''} not replayed thanks to "
                                                 f"{'own-node copies' if t == 'memory' else 'peer copies'}"
                                                 for t, n in run.spared.items()))
    if run.rollbacks:  # sync_fix rollback: a rank outvoted at a sync check (docs/sdc.md)
        lost = sum(rb.lost for rb in run.rollbacks)
        who = ", ".join(dict.fromkeys(w for rb in run.rollbacks for w in rb.who()))
        lines.append(f"rollbacks: {len(run.rollbacks)} ({lost} step{'s' if lost != 1 else ''} trained again; {who})")
    lines.append("")
    lines.append(f"  {'badput':<11} {'seconds':>10} {'%':>6}")
    for cause in CAUSES:
        s = run.badput[cause]
        pct = 100.0 * s / run.wall_s if run.wall_s > 0 else 0.0
        lines.append(f"  {cause:<11} {s:>10.1f} {pct:>6.1f}   {MEANING[cause]}")
    lines.append("")
    shown = run.attempts[-SHOWN_ATTEMPTS:]
    if len(shown) < len(run.attempts):
        earlier = Counter(a.verdict for a in run.attempts[:-len(shown)])
        lines.append(f"  attempts (the last {len(shown)} of {len(run.attempts)}; the earlier ones: "
                     + ", ".join(f"{n} {v}" for v, n in earlier.most_common()) + ")")
    lines.append(f"  {'#':>3} {'launched':<19} {'duration':>9} {'ranks':>5} {'engine':<9} {'steps':>13}  ended")
    for a in shown:
        steps = (f"{a.resumed_step}->{a.last_step}" if a.resumed_step is not None and a.last_step is not None else "-")
        hosts = ",".join(sorted(set(a.hosts)))
        lines.append(f"  {a.number:>3} {_clock(a.launched_t):<19} {duration(a.duration_s):>9} "
                     f"{a.world_size if a.world_size is not None else '?':>5} {a.engine or '?':<9} {steps:>13}  {_ended(a)}"
                     + (f" [hosts {hosts}]" if hosts else "")
                     + (f" [{a.replayed_steps} replayed]" if a.replayed_steps else "")
                     + (f" [from the {'memory tier' if a.resumed_tier == 'memory' else 'peer copy'}: "
                        f"{a.spared_steps} step{'s' if a.spared_steps != 1 else ''} not replayed]"
                        if a.resumed_tier in ("memory", "peer") else ""))
    if run.checkpoints:
        recent = run.checkpoints[-SHOWN_CHECKPOINTS:]
        lines.append("")
        lines.append(f"  checkpoints (the last {len(recent)} of {len(run.checkpoints)}):")
        for c in recent:
            commit = f", commit {c.commit_s:.2f}s" if c.commit_s is not None else ""
            lines.append(f"    step {c.step:<8} attempt {c.attempt:<3} {_clock(c.t)}  blocked {c.blocking_s:.2f}s{commit}  {c.fate}".rstrip())
    if run.slowest is not None:
        slow = run.slowest
        lines.append("")
        lines.append(f"  slowest rank: {slow.rank}" + (f" on {slow.host}" if slow.host else "")
                     + f" (the slowest in {slow.windows} of {slow.of} log windows)")
    if run.skipped_lines:
        lines.append(f"  ({run.skipped_lines} ledger line{'s' if run.skipped_lines != 1 else ''} skipped: cut by a kill, "
                     f"or damaged)")
    return "\n".join(lines)


def health(run_dir: str) -> dict[str, Any]:
    """The health gate's last results (its "health" line in the ledger: per host, and what it cost) and the
    hosts attempts left out, with why."""
    from pathlib import Path

    from .preflight.leave import left_out
    from .run_account import LEDGER
    from .run_account_records import read

    records, _ = read(Path(run_dir) / LEDGER)
    gates = [r for r in records if r.get("event") == "health" and isinstance(r.get("per_host"), dict)]
    return {"gate": gates[-1] if gates else None, "left_out": left_out(records)}


def render_health(seen: dict[str, Any]) -> list[str]:
    lines = []
    gate = seen["gate"]
    if gate is not None:
        hosts = gate["per_host"]
        lines.append(f"  health gate (attempt {gate.get('attempt', '?')}, {gate.get('mode', '?')}, "
                     f"{float(gate.get('seconds') or 0):.2f}s of its start-up): "
                     + ", ".join(f"{h} {'ok' if v.get('ok') else 'FAILED'}" for h, v in hosts.items()))
        lines += [f"    {line}" for v in hosts.values() for line in v.get("failed", [])]
    if seen["left_out"]:
        lines.append("  hosts left out: " + "; ".join(f"{h} ({why})" for h, why in seen["left_out"].items()))
    return [""] + lines if lines else []


def last_cadence(run_dir: str) -> dict[str, Any] | None:
    """The run's last "cadence" line: the automatic checkpoint intervals in force and their inputs."""
    from pathlib import Path

    from .run_account import LEDGER
    from .run_account_records import read

    records, _ = read(Path(run_dir) / LEDGER)
    return next((r for r in reversed(records) if r.get("event") == "cadence"), None)


def show(run_dir: str, as_json: bool = False) -> RunAccount:
    from .reliability.cadence import describe

    run = load(run_dir)
    seen, chosen = health(run_dir), last_cadence(run_dir)
    print(dumps({**run.as_dict(), "health": seen, "cadence": chosen}) if as_json else
          "\n".join([render(run, run_dir), *render_health(seen), *describe(chosen)]), flush=True)
    return run


def main(run_dir: str, json: bool = False, watch: float | bool | None = None) -> None:
    """Print where the run in RUN_DIR stands and what its failures cost. --json: one JSON object;
    --watch [SECONDS]: redraw every SECONDS (default 10) until the run is no longer running."""
    run_dir = str(run_dir)
    try:
        if watch is None or watch is False:
            show(run_dir, json)
            return
        every = WATCH_DEFAULT_S if watch is True else float(watch)
        if not every > 0:
            raise UserError(f"--watch takes a number of seconds above 0; got {watch!r}", "e.g. --watch 5")
        while True:
            if not json and sys.stdout.isatty():
                print("\033[H\033[2J", end="")
            if show(run_dir, json).state != "running":
                return
            time.sleep(every)
    except UserError as err:
        print(err.line(), file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        return


if __name__ == "__main__":
    import fire

    fire.Fire(main)

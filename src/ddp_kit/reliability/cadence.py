"""How often to save: the interval that loses the least time, from what the run measures. Plain data and
arithmetic (no torch): services/cadence.py applies it during a run, `python -m ddp_kit.status` shows it.

A save blocks the loop for C seconds; a failure costs what was trained since the last save, half an
interval on average. Per hour of training, an interval of T seconds loses

    3600 C / T  (the saves)  +  R T / 2  (the replay; R failures an hour)

which is least at T = sqrt(2 C 3600 / R): Young's interval (1974), close to Daly's (2006) refinement while
C is small against T, which it is for any interval worth taking. C is each tier's measured blocking time;
R is the failures this run has seen per hour of training, blended with a prior, and never below one
failure per the hours the run has run (docs/cadence.md).

What counts as a failure: an attempt that ended in anything but a clean finish, a user error or Ctrl-C.
A preemption counts only when a later attempt had to train steps again (one whose stop checkpoint
committed cost no replay: a shorter interval would not have helped it). With a memory tier on, the
durable tier's rate is the failures the memory tier did not cover: those a later attempt resumed from
the durable tier, or from nothing."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

# The prior rate counts as this many observed failures' worth of evidence: at 1, the second and third failures
# still pulled the rate to 2/3 and 3/4 of the observed one (the bench: 4 failures to come within 25 %).
PRIOR_WEIGHT = 0.25
MEMORY_MISS = 0.1  # with a memory tier on: the prior share of failures it cannot cover (every node's memory gone)
FIXED_STEPS = 100  # the reference job's default ckpt_every: the fixed interval `status` compares with
NOT_FAILURES = frozenset({"finished", "running", "user_error", "interrupted"})


@dataclass(frozen=True)
class Failures:
    """What the run's ledger says about failures: counted ones, those the memory tier did not cover, and
    the hours of attempts they happened in."""
    count: int = 0
    uncovered: int = 0
    hours: float = 0.0


@dataclass(frozen=True)
class Choice:
    """One tier's interval in force and why (a "cadence" record of the run ledger holds these)."""
    every_s: float
    cost_s: float | None  # None: not measured yet (the first save measures it)
    rate_per_h: float
    failures: int
    hours: float
    step_s: float | None
    loss_s_per_h: float | None  # expected seconds lost per hour of training at every_s
    fixed_loss_s_per_h: float | None  # ... and at FIXED_STEPS steps

    @property
    def every_steps(self) -> int | None:
        return max(1, round(self.every_s / self.step_s)) if self.step_s else None

    def as_dict(self) -> dict[str, Any]:
        out = {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}
        out["every_steps"] = self.every_steps
        return out


def blended_rate(failures: int, hours: float, prior_per_h: float, weight: float = PRIOR_WEIGHT) -> float:
    """Failures per hour: the observed rate weighed by its count against the prior weighed by `weight`.
    Not a Gamma posterior over hours: a prior of one failure in 1000 node-hours would outweigh three
    failures in the run's first hour for a thousand hours; here three failures outweigh it at once."""
    if failures <= 0 or hours <= 0:
        return prior_per_h
    return (failures * (failures / hours) + weight * prior_per_h) / (failures + weight)


def rate_per_h(failures: int, hours: float, prior_per_h: float, share: float = 1.0) -> float:
    """The rate an interval is chosen for: the blend, and never below one failure per the hours the run has
    run. A run has not shown that its failures are rarer than that: before its first failure it trusts no
    prior for longer than it has run (the interval then grows as sqrt(2 C t) with the time t run: the saves
    cost about one interval's worth in all, and a failure in the first hours, the likeliest ones, replays
    little); after one failure, one per the hours run is the observed rate itself. `share`: the part of the
    failures that count (MEMORY_MISS for the durable tier under a memory tier), which scales the floor too."""
    floor = share / hours if hours > 0 else 0.0
    return max(blended_rate(failures, hours, prior_per_h), floor)


def interval_s(cost_s: float, rate_per_h: float, low_s: float, high_s: float) -> float:
    """Young's interval for a save of `cost_s` at `rate_per_h` failures an hour, within [low_s, high_s]."""
    if rate_per_h <= 0:
        return high_s
    return min(max(math.sqrt(2.0 * max(cost_s, 1e-6) * 3600.0 / rate_per_h), low_s), high_s)


def loss_per_h(every_s: float, cost_s: float, rate_per_h: float) -> float:
    """Seconds an hour of training loses at this interval: the saves' blocking and the expected replay."""
    return 3600.0 * cost_s / max(every_s, 1e-9) + rate_per_h * every_s / 2.0


def choose(cost_s: float | None, failures: int, hours: float, prior_per_h: float, step_s: float | None,
           high_s: float, probe_s: float, share: float = 1.0) -> Choice:
    """The interval for one tier. Before its cost is measured the tier saves after `probe_s` (one early
    save that measures it); at least one step, at most `high_s`."""
    rate = rate_per_h(failures, hours, prior_per_h, share)
    low = step_s or 0.0
    if cost_s is None:
        return Choice(min(probe_s, high_s), None, rate, failures, hours, step_s, None, None)
    every = interval_s(cost_s, rate, low, high_s)
    fixed = loss_per_h(FIXED_STEPS * step_s, cost_s, rate) if step_s else None
    return Choice(every, cost_s, rate, failures, hours, step_s, loss_per_h(every, cost_s, rate), fixed)


def failures_of(attempts: Iterable[Any]) -> Failures:
    """Failures and hours of training from a run account's attempts (run_account.Attempt: verdict,
    replayed_steps, resumed_tier, duration_s, seconds), the running one's included. An attempt's start-up
    (launch to its first step) is not counted: a failure there replays nothing, and with a start-up of 5-8 s
    against failures 5 s apart the rate read 231/h for 720/h."""
    seen = list(attempts)
    count = uncovered = 0
    for a, nxt in zip(seen, seen[1:] + [None]):
        if a.verdict in NOT_FAILURES or (a.verdict == "preempted" and not a.replayed_steps):
            continue
        count += 1
        if nxt is None or nxt.resumed_tier in (None, "durable"):
            uncovered += 1
    trained = sum(max(a.duration_s - (getattr(a, "seconds", None) or {}).get("startup", 0.0), 0.0) for a in seen)
    return Failures(count, uncovered, trained / 3600.0)


def last_costs(records: Iterable[dict[str, Any]]) -> tuple[dict[str, float], float | None]:
    """({tier: cost seconds}, step seconds) as the run's last cadence record has them; the durable tier's
    newest checkpoint record counts where no cadence record measured it."""
    costs: dict[str, float] = {}
    step_s = None
    for r in records:
        if r.get("event") == "checkpoint" and isinstance(r.get("blocking_s"), (int, float)):
            costs["durable"] = float(r["blocking_s"])
        elif r.get("event") == "cadence":
            step_s = r.get("step_s") or step_s
            for tier, c in (r.get("tiers") or {}).items():
                if isinstance(c, dict) and isinstance(c.get("cost_s"), (int, float)):
                    costs[tier] = float(c["cost_s"])
    return costs, step_s


def describe(record: dict[str, Any] | None) -> list[str]:
    """`python -m ddp_kit.status`'s lines for the run's last cadence record (none: no tier is on auto)."""
    if not record or not isinstance(record.get("tiers"), dict):
        return []
    lines = ["", f"  checkpoint interval (auto; attempt {record.get('attempt', '?')} at step {record.get('step', '?')}, "
                 f"prior {float(record.get('prior_per_h') or 0):.3g} failures/h):"]
    for tier, c in record["tiers"].items():
        if not isinstance(c, dict):
            continue
        steps = f" (~{c['every_steps']} steps)" if c.get("every_steps") else ""
        n, hours = int(c.get("failures") or 0), float(c.get("hours") or 0)
        seen = f"{n} failure{'s' if n != 1 else ''} in {_span(hours * 3600)} (rate {float(c.get('rate_per_h') or 0):.3g}/h)"
        if c.get("cost_s") is None:
            lines.append(f"    {tier:<8} save at the next stop check: its cost is not measured yet; {seen}")
            continue
        lost = f"{float(c['loss_s_per_h']):.3g} s lost an hour"
        if c.get("fixed_loss_s_per_h") is not None:
            lost += f" (at every {FIXED_STEPS} steps: {float(c['fixed_loss_s_per_h']):.3g} s)"
        lines.append(f"    {tier:<8} every {_span(float(c['every_s']))}{steps}: save blocks {float(c['cost_s']):.3g} s, "
                     f"{seen} -> {lost}")
    return lines


def _span(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.2g} s"

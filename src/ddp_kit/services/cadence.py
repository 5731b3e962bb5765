"""Checkpoint intervals chosen by the run (`ckpt_every="auto"`, `mem_ckpt_every="auto"`): each tier set to
auto saves every T seconds, T from the tier's measured blocking time and the failure rate the run has
seen (reliability/cadence.py: Young's interval, the rate blended with a prior of `node_mtbf_h`).

Rank 0 decides: at the first step (the ledger's earlier attempts: their failures, hours and save costs)
and at every log window (this attempt's saves and step time). The tiers it finds due go into the stop
check's one all-reduce (stopping.py), so every rank saves at the same step and no collective is added;
a due tier is saved at the next stop check (every preempt_check_every steps). Each choice that moves by
more than half is a "cadence" line of the run ledger, with its inputs; `python -m ddp_kit.status`
shows the last one."""
from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import Any

from ..hooks import Boundary, StepHooks
from ..options import AUTO, Option, above
from ..reliability import cadence
from ..service_registry import Service

OPTIONS = (
    Option("node_mtbf_h", 1000.0, key="node_mtbf_h", resumable=True, check=above("node_mtbf_h", 0, "1000", strict=True),
           help="ckpt_every/mem_ckpt_every auto: the prior mean time between failures of one node, in hours (the job's prior rate is its node count over this); the failures the run sees outweigh it from the first one. See docs/cadence.md."),
    Option("ckpt_auto_max_s", 1800.0, key="ckpt_auto_max_s", resumable=True, check=above("ckpt_auto_max_s", 0, "1800", strict=True),
           help="ckpt_every/mem_ckpt_every auto: the longest interval between two saves of a tier, in seconds."),
)
PROBE_S = 0.0  # a tier whose cost is unknown (the first attempt) saves at the first stop check: that measures it
MOVED = 0.5  # a choice is written to the ledger when it moves by more than this share (a cost of a few ms is noisy)
KEPT = 5  # the newest this many cost samples of a tier are its cost (their median)


class Cadence(StepHooks):
    """Rank 0's clock and measurements for the tiers set to auto; other ranks only take part in the
    stop check's all-reduce."""

    def __init__(self, prior_per_h: float, high_s: float):
        self.prior_per_h, self.high_s = prior_per_h, high_s
        self.auto: tuple[str, ...] = ()
        self.memory_on = False
        self.past = cadence.Failures()
        self.samples: dict[str, list[float]] = {}
        self.step_s: float | None = None
        self.last_t: dict[str, float] = {}
        self.began = 0.0
        self.choices: dict[str, cadence.Choice] = {}
        self.copies = 0  # memory-tier saves since the last log window (its blocking comes per window)

    def first_step(self, b: Boundary) -> None:
        bb: Any = b
        if not b.ctx.is_main or bb.rd is None:
            return
        self.auto = tuple(t.name for t in bb.tiers if getattr(t, "every", None) == AUTO)
        self.memory_on = any(not t.durable for t in bb.tiers)
        self.past, costs, self.step_s = _history(bb.rd.path)
        self.samples = {t: [c] for t, c in costs.items()}
        self.began = time.monotonic()
        self.last_t = dict.fromkeys(self.auto, self.began)  # the resumed step (or step 0) is where replay would start
        self._decide(b, force=True)

    def saved(self, b: Boundary, tier: str, seconds: float) -> None:
        if not b.ctx.is_main or not self.began:
            return
        now = time.monotonic()
        durable = tier == "durable"
        for name in self.auto:  # a durable save is where every tier's replay would start from
            if name == tier or durable:
                self.last_t[name] = now
        # A memory copy's blocking comes per log window (its wait at the next optimizer step included); its
        # first save's own time stands for it until then.
        if tier == "memory":
            self.copies += 1
        if tier != "memory" or not self.samples.get(tier):
            _keep(self.samples.setdefault(tier, []), seconds)
        if tier in self.choices and self.choices[tier].cost_s is None:  # the probe: its cost is known now
            self._decide(b)

    def event(self, b: Boundary, record: dict[str, Any]) -> None:
        if record.get("event") != "progress" or not self.began:
            return
        steps, mem_s = record.get("steps") or 0, float(record.get("mem_s") or 0.0)
        if steps > 0:  # the copies' blocking (waits at the optimizer step included) is reported per window
            self.step_s = max(float(record.get("window_s") or 0.0) - mem_s, 0.0) / steps or self.step_s
        if self.copies:
            _keep(self.samples.setdefault("memory", []), mem_s / self.copies)
            self.copies = 0
        self._decide(b)

    def timed_due(self, b: Boundary) -> tuple[str, ...]:
        now = time.monotonic()
        return tuple(t for t in self.auto if t in self.choices and now - self.last_t[t] >= self.choices[t].every_s)

    def _decide(self, b: Boundary, force: bool = False) -> None:
        hours = self.past.hours + (time.monotonic() - self.began) / 3600.0
        made: dict[str, cadence.Choice] = {}
        for tier in sorted(self.auto, key=lambda t: t != "durable"):  # the durable interval bounds the memory tier's
            covered_elsewhere = tier == "durable" and self.memory_on
            failures = self.past.uncovered if covered_elsewhere else self.past.count
            share = cadence.MEMORY_MISS if covered_elsewhere else 1.0
            prior = self.prior_per_h * share
            high = min(self.high_s, made["durable"].every_s) if "durable" in made else self.high_s
            cost = statistics.median(self.samples[tier]) if self.samples.get(tier) else None
            made[tier] = cadence.choose(cost, failures, hours, prior, self.step_s, high, PROBE_S, share)
        was = self.choices
        moved = any(t not in was or abs(c.every_s - was[t].every_s) > MOVED * max(c.every_s, was[t].every_s)
                    or (c.cost_s is None) != (was[t].cost_s is None) for t, c in made.items())
        self.choices = made
        if moved or force:
            b.tell({"event": "cadence", "step": b.steps.done, "step_s": self.step_s, "prior_per_h": self.prior_per_h,
                    "tiers": {t: c.as_dict() for t, c in made.items()}})


def _keep(samples: list[float], seconds: float) -> None:
    samples.append(seconds)
    del samples[:-KEPT]


def _history(run_dir: Any) -> tuple[cadence.Failures, dict[str, float], float | None]:
    """What the run's ledger says before this attempt: failures and hours, the save costs, the step time."""
    from ..run_account import LEDGER, account
    from ..run_account_records import read

    try:
        records, _ = read(run_dir / LEDGER)
        attempts = account(records).attempts if records else ()
    except (OSError, ValueError):
        return cadence.Failures(), {}, None
    costs, step_s = cadence.last_costs(records)
    paced = next((a.step_time_s for a in reversed(attempts) if a.step_time_s), None)
    return cadence.failures_of(attempts), costs, step_s or paced


def make(b: Any, settings: Mapping[str, Any]) -> Cadence | None:
    if b.rd is None or AUTO not in (b.policy.ckpt_every, *b.policy.settings.values()):
        return None
    if not b.policy.preempt_check_every:
        from ..errors import UserError

        raise UserError("ckpt_every/mem_ckpt_every auto needs preempt_check_every > 0: an automatic save is agreed "
                        "at the stop check", "pass preempt_check_every=10 (the default)")
    nodes = max(getattr(b.ctx.env, "num_nodes", 1), 1)
    return Cadence(nodes / settings["node_mtbf_h"], settings["ckpt_auto_max_s"])


SERVICE = Service("cadence", OPTIONS, make)

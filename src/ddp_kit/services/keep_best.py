"""The best K checkpoints by a metric, kept beside the newest `keep_last` (`keep_best`, `monitor`, `mode`):
what Lightning's ModelCheckpoint(save_top_k, monitor, mode) and Ray Train's CheckpointConfig(num_to_keep,
checkpoint_score_attribute) do, with the ranks agreeing through one reduced decision.

The metric is a value of the run's metrics records (`run.log_event(record)`, and the log events' own train
records): `monitor` "EVENT.NAME" is key NAME, or EVENT_NAME (the reference job writes eval_loss), of a record
whose "event" is EVENT: eval.loss, eval.accuracy, train.loss; a name without a dot is that key in any record.
Each rank keeps the last value it was told since the last durable checkpoint (a record a script logs on
rank 0 only reaches rank 0's hooks only).

At each durable checkpoint (the `saving` hook: every rank, at the same step) one all-reduce of two numbers,
(how many ranks have a value, their sum), makes the step's score: the mean over the ranks that reported
it. So a metric logged on rank 0 only counts as well as one every rank logs (Lightning#19072: there, the
other ranks never saw it), and every rank holds the same best set. A score that is not finite (a NaN on any
rank makes the mean one) is said and never a candidate. The set, best first, goes into this step's
meta.json (b.meta): steps.prune keeps the steps the newest step's meta names, on a folder or a URL alike;
resume takes it back; `python -m ddp_kit.checkpoint list` marks them. The step itself is a candidate until
its save returned (b.steps.saved is that step; looked at in the `saved` hook, at the next step and at the
next decision, whichever comes first): a save that raised while the script went on leaves it out, so no
later meta names a step that does not exist. (An async save returns once copied; a write that fails later
raises at the next save's wait.) Off (K=0): nothing is made.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..checkpoint.steps import KEEP_BEST, kept_best
from ..errors import UserError
from ..hooks import Boundary, StepHooks
from ..options import Option, at_least_zero
from ..service_registry import Service

MODES = ("min", "max")
SEEN_MAX = 40  # metric names remembered for the hint when the monitor never matched


def _mode(value: Any) -> None:
    if value not in MODES:
        raise UserError(f"config key 'mode' must be min or max; got {value!r}",
                        "pass --mode min for a loss, --mode max for an accuracy")


OPTIONS = (
    Option("keep_best", 0, key="keep_best", resumable=True, check=at_least_zero("keep_best"),
           help="Also keep the best this many checkpoints by `monitor`, beside the newest keep_last (0: off). Each durable checkpoint is scored by the mean over the ranks that reported the metric since the previous one. See docs/checkpoints.md."),
    Option("monitor", "", key="monitor", resumable=True,
           help="keep_best's metric: EVENT.NAME is NAME (or EVENT_NAME) of a metrics record with that event (eval.loss, eval.accuracy, train.loss, or your run.log_event({'event': 'val', 'f1': ...}) as val.f1); a name without a dot: that key in any record."),
    Option("mode", "min", key="mode", resumable=True, choices=MODES, check=_mode,
           help="keep_best: min keeps the lowest scores (a loss), max the highest (an accuracy)."),
)


# ---- the pure parts: which value a record holds, the ranks' one score, the best set ----------------

def value_of(record: Mapping[str, Any], monitor: str) -> float | None:
    """The number `monitor` names in `record` (see the module docstring); None where it names none. NaN and
    inf are numbers too: they reach the decision, which says so and keeps them out of the best set."""
    event, dot, name = monitor.rpartition(".")
    if dot and record.get("event") != event:
        return None
    for key in ((name, f"{event}_{name}") if dot else (name,)):
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def contribution(value: float | None) -> list[float]:
    """What one rank adds to the all-reduce: (has a value, the value)."""
    return [1.0, value] if value is not None else [0.0, 0.0]


def agreed(count: float, total: float) -> float | None:
    """The step's score from the reduced (count, sum): the mean over the ranks that reported; None: none did."""
    return total / count if count > 0 and math.isfinite(total) else None


def choose(scores: Mapping[int, float], k: int, mode: str) -> list[tuple[int, float]]:
    """The best `k` (step, score), best first; of equal scores the older step (a newer one must do better)."""
    sign = 1.0 if mode == "min" else -1.0
    return sorted(scores.items(), key=lambda item: (sign * item[1], item[0]))[:k]


# ---- the service --------------------------------------------------------------------------------

class KeepBest(StepHooks):
    """Every rank's view: the value it was told since the last durable checkpoint, and the agreed best set."""

    def __init__(self, k: int, monitor: str, mode: str):
        self.k, self.monitor, self.mode = k, monitor, mode
        self.value: float | None = None
        self.best: list[tuple[int, float]] = []  # of steps whose save returned
        self.candidate: tuple[int, float] | None = None  # this step's score, until its save returned (or failed)
        self.scored = False  # a checkpoint of this attempt got a score (or a resumed one had some)
        self.saves = 0  # durable checkpoints of this attempt
        self.seen: set[str] = set()  # the names records had, for the hint should the monitor match none

    def _publish(self, b: Any, best: list[tuple[int, float]] | None = None) -> None:
        b.meta[KEEP_BEST] = {"monitor": self.monitor, "mode": self.mode, "k": self.k,
                             "best": [[s, v] for s, v in (self.best if best is None else best)]}

    def attach(self, b: Boundary) -> None:
        self._publish(b)  # a checkpoint before any score still says what is monitored

    def logged(self, b: Boundary, record: dict[str, Any]) -> None:
        value = value_of(record, self.monitor)
        if value is not None:
            self.value = value
        elif not self.scored and len(self.seen) < SEEN_MAX:
            event = record.get("event")
            self.seen |= {f"{event}.{k}" if event else k for k, v in record.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "epoch")}

    def _settle(self, b: Boundary) -> None:
        """The candidate into the best set if its save returned (b.steps.saved is its step), else dropped. The
        same on every rank: a durable save returns, or raises, on every rank."""
        if self.candidate is None:
            return
        step, score = self.candidate
        self.candidate = None
        if b.steps.saved == step:
            self.best = choose({**dict(self.best), step: score}, self.k, self.mode)
        else:
            b.say(f"ddp_kit: warning: keep_best: step_{step} was not saved (its checkpoint failed): not kept")
        self._publish(b)

    def saved(self, b: Boundary, tier: str, seconds: float) -> None:
        self._settle(b)

    def after_step(self, b: Boundary) -> None:
        self._settle(b)  # a save that raised, and the run went on: out before the next tier's copy takes b.meta

    def saving(self, b: Boundary) -> None:
        from ..dist.collectives import all_reduce_sum

        bb: Any = b
        self._settle(b)  # a save that failed since the last decision (raised, and the run went on) is left out
        self.saves += 1
        with bb.collective("keep_best all-reduce"):
            count, total = all_reduce_sum(b.ctx, contribution(self.value))
        self.value = None
        score = agreed(count, total)
        if score is None:
            if count:
                b.say(f"ddp_kit: warning: keep_best: {self.monitor} at step {b.steps.done} is not finite: not a candidate")
            return
        self.scored = True
        step = b.steps.done
        self.candidate = (step, score)
        # This step's own meta names it already (it is the save that makes it exist); self.best takes it once saved.
        best = choose({**dict(self.best), step: score}, self.k, self.mode)
        self._publish(b, best)
        rank = next((i for i, (s, _) in enumerate(best, 1) if s == step), None)
        kept = ", ".join(f"step_{s} {v:.4g}" for s, v in best)
        b.say(f"ddp_kit: keep_best: step_{step} {self.monitor}={score:.4g} "
              + (f"is #{rank} of the best {self.k}" if rank else f"is not among the best {self.k}") + f" (kept: {kept})")

    def resumed(self, b: Boundary, meta: dict[str, Any]) -> None:
        if not meta:  # nothing was read (a fresh start, a peer's state): what this process holds stands
            return
        self.candidate = None  # a rollback: the steps after the restored one are abandoned
        monitor, best = kept_best(meta)
        mode = (meta.get(KEEP_BEST) or {}).get("mode")
        if best and (monitor, mode) != (self.monitor, self.mode):
            b.say(f"ddp_kit: keep_best: the checkpoint's best steps were chosen by {monitor} ({mode}); this run "
                  f"monitors {self.monitor} ({self.mode}): starting over, and those steps are pruned like any other")
            best = []
        self.best = choose({s: v for s, v in best if s <= b.steps.done and math.isfinite(v)}, self.k, self.mode)
        self.scored = self.scored or bool(self.best)
        self._publish(b)
        if self.best:
            b.say(f"ddp_kit: keep_best: the best {self.k} by {self.monitor} so far: "
                  + ", ".join(f"step_{s} {v:.4g}" for s, v in self.best))

    def summary(self, b: Boundary) -> dict[str, Any]:
        self._settle(b)
        return {KEEP_BEST: {"monitor": self.monitor, "mode": self.mode, "best": [[s, v] for s, v in self.best]}}

    def ending(self, b: Boundary, code: int) -> None:
        if self.scored or not self.saves or code or not b.ctx.is_main:  # a failure's own report is what matters then
            return
        seen = ", ".join(sorted(self.seen)[:12]) or "none"
        b.say(f"ddp_kit: warning: keep_best: no checkpoint got a score: no metrics record named {self.monitor} "
              f"before a checkpoint (records had: {seen}); check --monitor (EVENT.NAME, e.g. eval.loss)")


def check(settings: Mapping[str, Any], run_dir: str | None) -> None:
    if not settings["keep_best"]:
        return
    if not str(settings["monitor"]).strip():
        raise UserError(f"keep_best {settings['keep_best']} needs a metric to rank the checkpoints by, and monitor is empty",
                        "pass monitor, e.g. --monitor eval.loss --mode min (ddp_kit.init(monitor=\"eval.loss\"))")
    if run_dir is None:
        raise UserError("keep_best keeps checkpoints, and this run has no run folder to save them in",
                        'pass run_dir to ddp_kit.init(run_dir="runs/my_run", ...), or leave keep_best at 0')


def make(b: Any, settings: Mapping[str, Any]) -> KeepBest | None:
    if not settings["keep_best"]:
        return None
    return KeepBest(int(settings["keep_best"]), str(settings["monitor"]).strip(), settings["mode"])


SERVICE = Service("keep_best", OPTIONS, make, check)

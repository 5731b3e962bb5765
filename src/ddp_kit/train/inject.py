"""The reference job's test hooks: inject a fault at a given rank and step, to prove recovery and
diagnosis with real processes.

Spec (config key `inject`), comma-separated: `KIND:rank=R:step=S[:ms=M]`, e.g. `kill:rank=1:step=8`.
Kinds: kill (SIGKILL itself), raise, hang (sleep forever), freeze (SIGSTOP itself), extra_collective (one all_reduce the
others never join), perturb (add noise to its parameters), slow (sleep M ms every step from S on),
config (that rank runs with another seed, as if it had loaded a different config file), nan (that
rank's loss is NaN at step S), nodata (that rank's data_root is missing, as if on a node without the files).
Faults fire only in a run that started from scratch on the first attempt, so a restarted or
resumed run can show that it recovers; `:always=1` fires on every attempt (a deterministic crash,
for the crash-loop limit).
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from ..errors import UserError

KINDS = ("kill", "raise", "hang", "freeze", "extra_collective", "perturb", "slow", "config", "nan", "nodata")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    ms: int = 0
    always: bool = False  # on every attempt, not only the first


def parse(spec: str) -> tuple[Fault, ...]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, *fields = item.split(":")
        try:
            kv = dict(f.split("=", 1) for f in fields)
            fault = Fault(kind, int(kv.get("rank", 0)), int(kv.get("step", 1)), int(kv.get("ms", 0)),
                          kv.get("always", "0") == "1")
        except ValueError:
            fault = None
        if fault is None or kind not in KINDS:
            raise UserError(f"cannot parse inject spec {item!r}", f"use KIND:rank=R:step=S with KIND in {', '.join(KINDS)}")
        out.append(fault)
    return tuple(out)


class Injector:
    def __init__(self, faults: tuple[Fault, ...], rank: int, armed: bool):
        self.faults = tuple(f for f in faults if f.rank == rank and (armed or f.always))

    def __bool__(self) -> bool:
        return bool(self.faults)

    def loss_factor(self, step: int) -> float:
        """1.0, or NaN at the step a `nan` fault of this rank is due (multiplied into the loss)."""
        return float("nan") if any(f.kind == "nan" and f.step == step for f in self.faults) else 1.0

    def at_step(self, step: int, model=None) -> None:
        """Called after each optimizer step; does nothing unless a fault of this rank is due."""
        for f in self.faults:
            if f.kind == "slow" and step >= f.step:
                time.sleep(f.ms / 1000)
            elif step != f.step:
                continue
            elif f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "raise":
                raise RuntimeError(f"injected fault: rank {f.rank} raises at step {step}")
            elif f.kind == "hang":
                while True:
                    time.sleep(3600)
            elif f.kind == "freeze":  # the whole process stops, watchdog thread included (a dead peer
                os.kill(os.getpid(), signal.SIGSTOP)  # whose socket stays open: no collective fails)
            elif f.kind == "extra_collective":
                import torch
                import torch.distributed as tdist

                tdist.all_reduce(torch.zeros(1))
            elif f.kind == "perturb":
                import torch

                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1e-3)

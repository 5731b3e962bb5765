"""The reference job's test hooks: inject a fault at a given rank and step, to prove recovery and
diagnosis with real processes.

Spec (config key `inject`), comma-separated: `KIND:rank=R:step=S[:ms=M]`, e.g. `kill:rank=1:step=8`.
Kinds: kill (SIGKILL itself), raise, hang (sleep forever), freeze (SIGSTOP itself), extra_collective (one all_reduce the
others never join), perturb (add noise to its parameters), slow (sleep M ms every step from S on),
config (that rank runs with another seed, as if it had loaded a different config file), nan (that
rank's loss is NaN at step S), nodata (that rank's data_root is missing, as if on a node without the files),
bitflip (one bit of one parameter element flips on that rank after step S's optimizer step: silent data
corruption, which the next sync check's vote names; docs/sdc.md), gradflip (one bit of that rank's local
gradient flips in step S's first backward, before DDP averages it: a transient fault in the arithmetic, which
every replica then shares and only a replay check names; docs/sdc.md), oom (`oom:rank=R:above=N`: each batch-size
trial of `--batch_size auto` on that rank with a per-rank batch above N raises torch.OutOfMemoryError, as
a GPU with less memory would; docs/gpus.md).
Faults fire only in a run that started from scratch on the first attempt, so a restarted or
resumed run can show that it recovers; `:always=1` fires on every attempt (a deterministic crash,
for the crash-loop limit). Each fires once in a process: a rollback that trains step S again does not meet it again.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from ..errors import UserError

KINDS = ("kill", "raise", "hang", "freeze", "extra_collective", "perturb", "slow", "config", "nan", "nodata", "bitflip",
         "gradflip", "oom")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    ms: int = 0
    always: bool = False  # on every attempt, not only the first
    above: int = 0  # oom: the largest per-rank batch that still fits on this rank


def parse(spec: str) -> tuple[Fault, ...]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, *fields = item.split(":")
        try:
            kv = dict(f.split("=", 1) for f in fields)
            fault = Fault(kind, int(kv.get("rank", 0)), int(kv.get("step", 1)), int(kv.get("ms", 0)),
                          kv.get("always", "0") == "1", int(kv.get("above", 0)))
        except ValueError:
            fault = None
        if fault is None or kind not in KINDS:
            raise UserError(f"cannot parse inject spec {item!r}", f"use KIND:rank=R:step=S (oom:rank=R:above=N) with KIND "
                            f"in {', '.join(KINDS)}")
        out.append(fault)
    return tuple(out)


class Injector:
    def __init__(self, faults: tuple[Fault, ...], rank: int, armed: bool):
        self.faults = tuple(f for f in faults if f.rank == rank and (armed or f.always))
        self.fired: set[Fault] = set()  # a step trained again after a rollback meets no fault a second time

    def __bool__(self) -> bool:
        return bool(self.faults)

    def loss_factor(self, step: int) -> float:
        """1.0, or NaN at the step a `nan` fault of this rank is due (multiplied into the loss)."""
        return float("nan") if any(f.kind == "nan" and f.step == step for f in self.faults) else 1.0

    def batch_trial(self, per_rank_batch: int) -> None:
        """Called by each batch-size trial (--batch_size auto): an `oom` fault of this rank raises
        torch.OutOfMemoryError for a per-rank batch above its `above`, as a smaller GPU would."""
        for f in self.faults:
            if f.kind == "oom" and per_rank_batch > f.above:
                import torch

                raise torch.OutOfMemoryError(f"injected: rank {f.rank} runs out of memory at a per-rank batch of "
                                             f"{per_rank_batch} (oom above {f.above})")

    def before_backward(self, step: int, model) -> None:
        """Called before each step's forward and backward: a `gradflip` fault of this rank due at `step` flips
        one bit of the next gradient autograd delivers for the first floating parameter, at its largest element
        (once: computed again, the step's gradient is right, as after a transient fault in the arithmetic)."""
        for f in self.faults:
            if f.kind != "gradflip" or f.step != step or f in self.fired:
                continue
            self.fired.add(f)
            name, p = next((n, p) for n, p in model.named_parameters() if p.dtype.is_floating_point and p.requires_grad)
            handles: list = []

            def hook(grad, name=name, rank=f.rank, handles=handles):
                handles[0].remove()
                flipped = grad.clone()
                i = int(flipped.abs().argmax())
                before, b = _flip(flipped.view(-1)[i:i + 1])
                print(f"ddp_kit: inject: rank {rank} flips bit {b} of the gradient of {name}[{i}] in step {step} "
                      f"({before:.6g} -> {float(flipped.view(-1)[i]):.6g})", flush=True)
                return flipped

            handles.append(p.register_hook(hook))

    def at_step(self, step: int, model=None) -> None:
        """Called after each optimizer step; does nothing unless a fault of this rank is due."""
        for f in self.faults:
            if f.kind == "slow" and step >= f.step:
                time.sleep(f.ms / 1000)
            elif step != f.step or f in self.fired:
                continue
            self.fired.add(f)
            if f.kind == "bitflip":
                flip_bit(model, f.rank, step)
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


# The lowest exponent bit of each floating type (its integer twin of the same width): flipping it halves or
# doubles the value, which stays finite and is plainly visible in a checksum, as a real upset often is.
_EXPONENT = {"float32": ("int32", 23), "float64": ("int64", 52), "float16": ("int16", 10), "bfloat16": ("int16", 7)}


def flip_bit(model, rank: int, step: int) -> None:
    """Flip one bit of this rank's copy of the first floating parameter, at its middle element: the lowest
    exponent bit (the next one up if that would make it inf). The same choice on every run."""
    import torch

    name, p = next((n, p) for n, p in model.named_parameters() if p.dtype.is_floating_point and p.numel())
    with torch.no_grad():
        i = p.numel() // 2
        cell = p.data.view(-1)[i:i + 1]
        before, b = _flip(cell)
    print(f"ddp_kit: inject: rank {rank} flips bit {b} of {name}[{i}] after step {step} ({before:.6g} -> "
          f"{float(cell):.6g})", flush=True)


def _flip(cell) -> tuple[float, int]:
    """Flip the lowest exponent bit of the one-element tensor `cell`, in place (the next one up if that would
    make it inf): its value times or over a power of two. Returns the value before and the bit flipped."""
    import torch

    int_name, bit = _EXPONENT[str(cell.dtype).removeprefix("torch.")]
    before = float(cell)
    with torch.no_grad():
        for b in (bit, bit + 1):
            cell.view(getattr(torch, int_name)).bitwise_xor_(1 << b)
            if torch.isfinite(cell).all():
                break
            cell.view(getattr(torch, int_name)).bitwise_xor_(1 << b)  # back: try the next bit
    return before, b

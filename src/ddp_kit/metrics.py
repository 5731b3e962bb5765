"""Per-rank step timing and memory, gathered to rank 0 at each log event, and the straggler check.

A step's wall time is the same on every rank (the fast ranks wait for the slow one inside DDP's
backward all-reduce, or in the loop's own collectives: log, preemption and sync checks), so it
cannot show who is slow. What differs is each rank's *local* work: waiting for data, forward,
optimizer and the loop's bookkeeping. `local_s` is that sum; a rank whose local_s stays above the
median rank's by more than the margin is the straggler. Blind spot: a rank slow in backward
compute only (its time mixes with the all-reduce wait).
"""
from __future__ import annotations

import os
import resource
import socket
import statistics
import time
from dataclasses import dataclass, field

import torch

from .dist import DistContext, gather_object

PARTS = ("data", "forward", "backward", "optimizer", "comm", "other")


@dataclass
class StepTimer:
    """Sums of seconds per part over the current log window; a few perf_counter calls per step."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    steps: int = 0
    _t: float = field(default_factory=time.perf_counter)

    def mark(self, part: str) -> None:
        """Charge the time since the previous mark to `part`."""
        now = time.perf_counter()
        self.sums[part] += now - self._t
        self._t = now

    def window(self) -> dict[str, float]:
        """Mean seconds per step for each part since the last call, then start a new window."""
        n = max(self.steps, 1)
        out = {f"{k}_s": v / n for k, v in self.sums.items()}
        out["step_s"] = sum(self.sums.values()) / n
        # backward holds DDP's all-reduce wait, comm the loop's own collectives: both absorb other ranks' lag
        out["local_s"] = out["step_s"] - out["backward_s"] - out["comm_s"]
        self.sums = dict.fromkeys(PARTS, 0.0)
        self.steps = 0
        return out


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def gather_ranks(ctx: DistContext, window: dict[str, float], samples_per_step: int) -> list[dict] | None:
    """Every rank's window, on rank 0 only (it logs them and looks for stragglers); None elsewhere."""
    mine = {"rank": ctx.rank, "host": socket.gethostname(), "pid": os.getpid(), **{k: round(v, 6) for k, v in window.items()},
            "samples_per_s": samples_per_step / window["step_s"] if window["step_s"] > 0 else 0.0,
            "peak_mem_mb": round(peak_memory_mb(ctx.device), 1)}
    return gather_object(ctx, mine)


def summarize_ranks(ranks: list[dict]) -> dict[str, dict]:
    """Per numeric field: the median over ranks, the max and the rank holding it (where a straggler
    shows), for records too many ranks wide to keep whole."""
    out = {}
    for key, value in ranks[0].items():
        if key in ("rank", "pid") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        vals = [(r.get(key, 0.0), r["rank"]) for r in ranks]
        top, who = max(vals)
        out[key] = {"median": statistics.median(v for v, _ in vals), "max": top, "argmax": who}
    return out


@dataclass
class StragglerWatch:
    """Warn once a rank's local time exceeds the median rank's by `margin` for `patience` windows in a row."""

    margin: float = 0.2
    patience: int = 2
    streak: dict[int, int] = field(default_factory=dict)
    warned: set[int] = field(default_factory=set)

    def update(self, ranks: list[dict]) -> list[str]:
        if len(ranks) < 2 or self.margin <= 0:
            return []
        med = statistics.median(r["local_s"] for r in ranks)
        lines = []
        for r in ranks:
            slow = med > 0 and r["local_s"] > med * (1 + self.margin) and r["local_s"] - med > 1e-4
            self.streak[r["rank"]] = self.streak.get(r["rank"], 0) + 1 if slow else 0
            if self.streak[r["rank"]] >= self.patience and r["rank"] not in self.warned:
                self.warned.add(r["rank"])
                lines.append(f"straggler: rank {r['rank']} on {r['host']} spends {r['local_s'] * 1e3:.1f} ms/step in its own "
                             f"work (data {r['data_s'] * 1e3:.1f}, forward {r['forward_s'] * 1e3:.1f}, optimizer "
                             f"{r['optimizer_s'] * 1e3:.1f}, other {r['other_s'] * 1e3:.1f}) against a median of "
                             f"{med * 1e3:.1f} ms: every rank waits for it")
        return lines


def model_flops_per_sample(model: torch.nn.Module, sample: torch.Tensor) -> float | None:
    """Training FLOPs per sample (3x the forward: forward + backward), counted once with torch's FlopCounterMode."""
    was_training = model.training
    model.eval()  # no BatchNorm statistics updated, batch of one allowed
    try:
        from torch.utils.flop_counter import FlopCounterMode

        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(sample[:1])
        return 3.0 * counter.get_total_flops()
    except Exception:  # counting is best effort; training must not depend on it
        return None
    finally:
        model.train(was_training)


# Dense bf16 peak TFLOP/s of common training GPUs, for an MFU-style figure (None: unknown GPU).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0, "L4": 121.0}


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)

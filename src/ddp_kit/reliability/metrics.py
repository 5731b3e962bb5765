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
import re
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dist import DistContext
from ..dist.collectives import gather_object
from ..env.facts import host_name

PARTS = ("data", "forward", "backward", "optimizer", "comm", "other")


# Which marks open and close which GPU span. "forward start": the inner module of a DDP model starts,
# after DDP's buffer broadcast (a wait on the others), so the span reopened there is the forward's own work.
_OPENS = {"data": "forward", "forward start": "forward", "backward": "optimizer"}
_CLOSES = {"forward": "forward", "optimizer": "optimizer"}


@dataclass
class GpuSpans:
    """The GPU's own time for forward and for the optimizer, by CUDA events recorded at the step's
    marks (a few microseconds each, no wait) and read at the window's end, where the log event's
    reduction has drained the GPU anyway. On a GPU the host only queues kernels, so host times look
    alike on every rank and a slow or throttled GPU's lag is booked as waiting; these spans are
    local (backward is left out: it ends waiting for DDP's all-reduce, i.e. for the other ranks).
    Events are recorded only at marks that open or close a span, and reused once read (or dropped
    unread): after the first window no new event is made. GPU-only."""

    spans: dict[str, list] = field(default_factory=lambda: {"forward": [], "optimizer": []})
    _open: dict[str, Any] = field(default_factory=dict)
    _free: list = field(default_factory=list)  # events no span holds: recorded again rather than made anew

    def _record(self) -> Any:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, part: str) -> None:
        if part not in _OPENS and part not in _CLOSES:
            return  # no span starts or ends here
        event = self._record()
        span = _CLOSES.get(part)
        if span in self._open:
            pairs = self.spans[span]
            if len(pairs) >= 10_000:  # never read (no log events): keep the event count bounded
                self._free.extend(e for pair in pairs for e in pair)
                pairs.clear()
            pairs.append((self._open.pop(span), event))
        elif part in _OPENS:
            replaced = self._open.get(_OPENS[part])
            if replaced is not None:  # reopened before it closed: that start is never read
                self._free.append(replaced)
            self._open[_OPENS[part]] = event
        else:
            self._free.append(event)  # closes a span that is not open

    def window(self, steps: int) -> dict[str, float]:
        out = {}
        for name, pairs in self.spans.items():
            for _, end in pairs:
                end.synchronize()  # already complete after the log event's reduction: no wait
            out[f"gpu_{name}_s"] = sum(start.elapsed_time(end) for start, end in pairs) / 1e3 / max(steps, 1)
            self._free.extend(e for pair in pairs for e in pair)
            pairs.clear()
        return out


# The parts the forward hooks split the stretch from the loop's last mark to the end of backward into.
SPLIT = ("other", "comm", "forward", "backward")


@dataclass
class StepTimer:
    """Sums of seconds per part over the current log window; a few perf_counter calls per step
    (and, on a GPU, `gpu`'s CUDA events).

    Forward is told apart from backward by module hooks (`hooked`), which cost every forward call
    torch's slow path; so the step boundary registers them on a few steps of each window only
    (boundary/forward_split.py: `sampling`, and `split` on those steps). On the other steps the
    stretch from the loop's last mark to the end of backward is timed whole, and the window divides it
    in the proportions the sampled steps had (the last window's when this one had none). The CUDA
    events are recorded on the sampled steps only, and their spans averaged over those steps. Used
    without sampling (the default), every step's marks count as they come."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    steps: int = 0
    gpu: GpuSpans | None = None
    sampling: bool = False  # the forward hooks run on sampled steps only (ForwardSplit)
    split: bool = True  # this step's forward/backward is split by the hooks (always, without sampling)
    _t: float = field(default_factory=time.perf_counter)
    _segment: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SPLIT, 0.0))  # sampled steps, by part
    _whole: float = 0.0  # the unsampled steps' forward-to-backward stretch, undivided
    _in_segment: bool = False
    _sampled_steps: int = 0
    _shares: dict[str, float] | None = None  # the proportions last used
    _gpu_last: dict[str, float] = field(default_factory=dict)

    def mark(self, part: str, gpu: str | None = None) -> None:
        """Charge the time since the previous mark to `part`; `gpu`: the GPU spans' name for this
        point when it differs from `part`."""
        now = time.perf_counter()
        spent = now - self._t
        self._t = now
        if part == "backward":
            if self._in_segment:  # a sampled step's stretch ends here
                self._in_segment = False
                self._segment["backward"] += spent
                self._sampled_steps += 1
            elif not self.split:  # an unsampled step: forward and backward in one
                self._whole += spent
                return
        self.sums[part] += spent
        if self.gpu is not None and self.split:
            self.gpu.mark(gpu or part)

    def hooked(self, part: str, gpu: str | None = None) -> None:
        """A forward hook's mark: like `mark`, and kept as a piece of the sampled stretch that ends at backward."""
        now = time.perf_counter()
        spent = now - self._t
        self._t = now
        self.sums[part] += spent
        self._segment[part] += spent
        self._in_segment = True
        if self.gpu is not None:
            self.gpu.mark(gpu or part)

    def window(self) -> dict[str, float]:
        """Mean seconds per step for each part since the last call, then start a new window."""
        n = max(self.steps, 1)
        if self._whole:
            total = sum(self._segment.values())
            shares = {k: v / total for k, v in self._segment.items()} if total > 0 else self._shares
            self._shares = shares
            for k, share in (shares or {"backward": 1.0}).items():  # no sample yet: as without the hooks
                self.sums[k] += self._whole * share
        out = {f"{k}_s": v / n for k, v in self.sums.items()}
        out["step_s"] = sum(self.sums.values()) / n
        # backward holds DDP's all-reduce wait, comm the loop's own collectives: both absorb other ranks' lag
        out["local_s"] = out["step_s"] - out["backward_s"] - out["comm_s"]
        if self.gpu is not None:
            measured = self._sampled_steps if self.sampling else n
            spans = self.gpu.window(max(measured, 1))  # read (and free) whatever was recorded
            if measured:
                self._gpu_last = spans
            out.update(self._gpu_last or spans)
            # a slow GPU shows in its own forward and optimizer time, not in the host's
            gpu_local = out["data_s"] + out["other_s"] + out["gpu_forward_s"] + out["gpu_optimizer_s"]
            out["local_s"] = max(out["local_s"], gpu_local)
        self.sums = dict.fromkeys(PARTS, 0.0)
        self._segment = dict.fromkeys(SPLIT, 0.0)
        self._whole, self._sampled_steps, self.steps = 0.0, 0, 0
        return out


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def gather_ranks(ctx: DistContext, window: dict[str, float], samples_per_step: int,
                 memory: dict[str, int] | None = None) -> list[dict] | None:
    """Every rank's window, on rank 0 only (it logs them and looks for stragglers); None elsewhere.
    `memory`: this rank's parameter/gradient/optimizer bytes, when measured."""
    mine = {"rank": ctx.rank, "host": host_name(), "pid": os.getpid(), **{k: round(v, 6) for k, v in window.items()},
            "samples_per_s": samples_per_step / window["step_s"] if window["step_s"] > 0 else 0.0,
            "peak_mem_mb": round(peak_memory_mb(ctx.device), 1), **(memory or {})}
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
                             f"{r['optimizer_s'] * 1e3:.1f}, other {r['other_s'] * 1e3:.1f}"
                             + (f"; GPU forward {r['gpu_forward_s'] * 1e3:.1f}, GPU optimizer "
                                f"{r['gpu_optimizer_s'] * 1e3:.1f}" if "gpu_forward_s" in r else "")
                             + f") against a median of {med * 1e3:.1f} ms: every rank waits for it")
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


# Dense peak TFLOP/s by the math the run uses (bf16/fp16 tensor cores, tf32, plain fp32), from the
# vendors' data sheets, for an MFU-style figure. Matched in order against torch's device name by
# whole words, so "L4" is not "L40S" and the H100's PCIe and NVL cards are not its SXM module
# ("NVIDIA H100 80GB HBM3"). None: an unknown GPU, no MFU.
PEAK_TFLOPS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    # H200 NVL (PCIe card, 600 W): NVIDIA's H200 sheet gives 1,671 bf16 / 835 TF32 TFLOP/s with
    # sparsity and 60 fp32; dense is half the sparse figure. Before the bare "H200" (SXM).
    (("H200", "NVL"), {"bf16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    (("H200",), {"bf16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    (("H100", "PCIe"), {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    (("H100", "NVL"), {"bf16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    (("H100",), {"bf16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    (("A100",), {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (("L40S",), {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    (("L4",), {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (("A10",), {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (("V100",), {"bf16": 125.0, "fp32": 15.7}),  # fp16 tensor cores; no bf16 or tf32 units
)


def peak_tflops(device: torch.device, amp: str = "off", tf32: bool | None = None) -> float | None:
    """The peak for the math this run does: amp bf16/fp16 -> 16-bit tensor cores; else tf32 when
    TF32 is on (torch.backends.cuda.matmul.allow_tf32 unless given), else fp32."""
    if device.type != "cuda":
        return None
    return peak_for(torch.cuda.get_device_name(device), amp,
                    torch.backends.cuda.matmul.allow_tf32 if tf32 is None else tf32)


def peak_for(name: str, amp: str, tf32: bool) -> float | None:
    words = set(re.split(r"[\s\-_]+", name))
    for pattern, peaks in PEAK_TFLOPS:
        if all(p in words for p in pattern):
            kind = "bf16" if amp in ("bf16", "fp16") else "tf32" if tf32 and "tf32" in peaks else "fp32"
            return peaks[kind]
    return None

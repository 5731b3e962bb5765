"""Non-finite loss: kept on the device every step, read by the host only where the loop waits anyway.

Each step's loss is copied into a preallocated device slot (LossBuffer: one kernel, no host sync);
whether one was NaN or inf is asked only when the slots are read, at log events and before every
checkpoint (a full buffer is folded on the device, a few kernels every `capacity` steps). At log events and before every checkpoint the ranks reduce it: if any rank saw NaN or
inf, every rank stops with the same line naming the first bad step and the ranks, before a
checkpoint of the damaged weights can be written (so `latest` and `keep_last` never favour it).
A NaN gradient shows up as NaN weights and so as a NaN loss one step later.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as tdist

from ..dist import DistContext
from ..dist.collectives import all_gather_object
from ..errors import UserError

_NONE = 2**62


class LossBuffer:
    """A log window's per-step losses on their device: one copy kernel a step, into a preallocated
    float32 slot (the cast to float32 is the same kernel). Read once at a log event or a checkpoint,
    where the host waits anyway. A full buffer (more steps than `capacity` between two log events)
    is folded on the device into a float64 sum and the first non-finite step, without a host read."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.values: torch.Tensor | None = None
        self.steps: list[int] = []  # the step of each filled slot
        self.folded: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (sum, first bad step, steps) of full buffers
        self._read: list[float] | None = None  # the filled slots, once read on the host

    def put(self, loss: torch.Tensor, step: int) -> None:
        if self.values is None:
            self.values = torch.empty(self.capacity, dtype=torch.float32, device=loss.device)
        if len(self.steps) == self.capacity:
            self._fold()
        value = loss.detach()
        value = value.reshape(()) if value.numel() == 1 else value.float().mean()
        self.values[len(self.steps)].copy_(value)
        self.steps.append(step)
        self._read = None

    def _fold(self) -> None:
        assert self.values is not None
        steps = torch.tensor(self.steps, dtype=torch.int64).to(self.values.device)
        total = self.values.sum(dtype=torch.float64)
        first = torch.where(torch.isfinite(self.values), _NONE, steps).min()
        if self.folded is not None:
            total, first = total + self.folded[0], torch.minimum(first, self.folded[1])
        self.folded = (total, first, len(self.steps) + (self.folded[2] if self.folded else 0))
        self.steps = []  # the slots are refilled after the fold's kernels on the same stream: ordered

    def _host(self) -> list[float]:
        if self._read is None:
            self._read = self.values[:len(self.steps)].tolist() if self.values is not None and self.steps else []
        return self._read

    def first_bad(self) -> int:
        """The first step whose loss was not finite, _NONE if none: reads the device."""
        bad = [s for s, v in zip(self.steps, self._host()) if not math.isfinite(v)]
        folded = int(self.folded[1].item()) if self.folded is not None else _NONE
        return min([folded, *bad[:1]])

    def take(self) -> tuple[float, int]:
        """(sum, steps) since the last take, and an empty window: reads the device."""
        total, n = math.fsum(self._host()), len(self.steps)
        if self.folded is not None:
            total, n = total + float(self.folded[0].item()), n + self.folded[2]
        self.steps, self.folded, self._read = [], None, None
        return total, n


class NonFiniteLoss:
    def __init__(self) -> None:
        self.first: torch.Tensor | None = None  # int64 scalar on the loss's device; _NONE while all finite
        self.first_host = _NONE  # the same for losses read on the host (CPU training: no device to wait for)
        self.buffers: list[LossBuffer] = []  # device losses not yet checked (the records' window)

    def watch(self, buffer: LossBuffer) -> None:
        """Check `buffer`'s losses too; its window must be taken only after a check (MetricsRecords.log)."""
        self.buffers.append(buffer)

    def update(self, loss: torch.Tensor, step: int) -> None:
        """A loss kept outside a LossBuffer (bench/step_overhead.py): three device ops, no host sync: this step's number where the loss is not finite, folded
        into the running minimum in place (the first bad step wins)."""
        if self.first is None:
            self.first = torch.full((), _NONE, dtype=torch.int64, device=loss.device)
        here = torch.where(torch.isfinite(loss.detach()), _NONE, step)
        torch.minimum(self.first, here, out=self.first)

    def update_host(self, loss: float, step: int) -> None:
        if self.first_host == _NONE and not math.isfinite(loss):
            self.first_host = step

    def check(self, ctx: DistContext, ckpt: Any = None) -> None:
        """Collective: raise the same UserError on every rank if any rank saw a non-finite loss."""
        mine = _NONE if self.first is None else int(self.first.item())  # the one read of the device scalar
        mine = min(mine, self.first_host, *(b.first_bad() for b in self.buffers))
        step = mine
        if ctx.world_size > 1:  # alone, nothing to agree on: no control tensor (on NCCL, a GPU round trip)
            first = torch.tensor([mine], dtype=torch.int64, device=ctx.control_device)
            tdist.all_reduce(first, op=tdist.ReduceOp.MIN, group=ctx.control_group)
            step = int(first.item())
        if step == _NONE:
            return
        # The ranks that saw it first: after the all-reduce every rank's weights are NaN one step later.
        ranks = [r for r, s in enumerate(all_gather_object(ctx, mine)) if s == step]
        last = ckpt.latest_name() if ckpt is not None else "none"
        raise UserError(f"the loss became non-finite (NaN/inf) at step {step} on rank(s) "
                        f"{', '.join(map(str, ranks[:8]))}{' ...' if len(ranks) > 8 else ''}; stopped without saving "
                        f"these weights; last checkpoint: {last}",
                        "lower lr, try amp off or bf16 instead of fp16, or check the data at that step; "
                        "a rerun resumes from the last checkpoint")

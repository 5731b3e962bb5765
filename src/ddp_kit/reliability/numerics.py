"""Non-finite loss: noticed on the device every step, read by the host only where the loop waits anyway.

Each step folds "is this step's loss finite?" into a device scalar (the first bad step), with no
host sync. At log events and before every checkpoint the ranks reduce it: if any rank saw NaN or
inf, every rank stops with the same line naming the first bad step and the ranks, before a
checkpoint of the damaged weights can be written (so `latest` and `keep_last` never favour it).
A NaN gradient shows up as NaN weights and so as a NaN loss one step later.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as tdist

from ..dist import DistContext
from ..dist.collectives import all_gather_object
from ..errors import UserError

_NONE = 2**62


class NonFiniteLoss:
    def __init__(self) -> None:
        self.first: torch.Tensor | None = None  # int64 scalar on the loss's device; _NONE while all finite
        self.first_host = _NONE  # the same for losses read on the host (CPU training: no device to wait for)

    def update(self, loss: torch.Tensor, step: int) -> None:
        """Three device ops, no host sync: this step's number where the loss is not finite, folded
        into the running minimum in place (the first bad step wins)."""
        if self.first is None:
            self.first = torch.full((), _NONE, dtype=torch.int64, device=loss.device)
        here = torch.where(torch.isfinite(loss.detach()), _NONE, step)
        torch.minimum(self.first, here, out=self.first)

    def update_host(self, loss: float, step: int) -> None:
        if self.first_host == _NONE and not math.isfinite(loss):
            self.first_host = step

    def check(self, ctx: DistContext, ckpt=None) -> None:
        """Collective: raise the same UserError on every rank if any rank saw a non-finite loss."""
        mine = _NONE if self.first is None else int(self.first.item())  # the one read of the device scalar
        mine = min(mine, self.first_host)
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

"""Non-finite loss: noticed on the device every step, read by the host only where the loop waits anyway.

Each step folds "is this step's loss finite?" into a device scalar (the first bad step), with no
host sync. At log events and before every checkpoint the ranks reduce it: if any rank saw NaN or
inf, every rank stops with the same line naming the first bad step and the ranks, before a
checkpoint of the damaged weights can be written (so `latest` and `keep_last` never favour it).
A NaN gradient shows up as NaN weights and so as a NaN loss one step later.
"""
from __future__ import annotations

import torch
import torch.distributed as tdist

from ..collectives import all_gather_object
from ..dist import DistContext
from ..errors import UserError

_NONE = 2**62


class NonFiniteLoss:
    def __init__(self):
        self.first: torch.Tensor | None = None  # int64 scalar on the loss's device; _NONE while all finite

    def update(self, loss: torch.Tensor, step: int) -> None:
        if self.first is None:
            self.first = torch.full((), _NONE, dtype=torch.int64, device=loss.device)
        bad = ~torch.isfinite(loss.detach())
        self.first = torch.where(bad & (self.first == _NONE), torch.full_like(self.first, step), self.first)

    def check(self, ctx: DistContext, ckpt=None) -> None:
        """Collective: raise the same UserError on every rank if any rank saw a non-finite loss."""
        mine = _NONE if self.first is None else int(self.first.item())  # the one read of the device scalar
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

"""`run.forward_backward`: a step's forward and backward, computed again every sdc_check_every steps and
compared before the optimizer sees them (reliability/replay.py; docs/sdc.md). What it found is said once (rank
0), told to the run ledger (a `replay` line, which the health gate's rule of two counts against the host), and,
where a rank's computations do not repeat, ends the attempt naming the host."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..dist.collectives import all_gather_object
from ..env.facts import host_name
from ..errors import Unhealthy, UserError
from ..parallel.fsdp import is_sharded
from ..parallel.wrap import sync_gradients
from ..reliability.replay import GOES_ON, checked

if TYPE_CHECKING:
    from .protocol import Boundary

DETERMINISM = ("make the step deterministic (on a GPU: ddp_kit.init(deterministic=True), --deterministic true; a loss "
               "that draws from a random generator of its own must draw from torch's), or set sdc_check_every 0")


def forward_backward(b: Boundary, model: nn.Module, compute: Callable[[], torch.Tensor],
                     backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """`compute()`, then `backward` of its loss; returns the loss. On a check step, computed again and compared."""
    every, step = b.policy.sdc_check_every, b.steps.done + 1
    if not every or step % every:
        loss = compute()
        backward(loss)
        return loss
    if is_sharded(model):
        raise UserError("sdc_check_every needs each rank's whole gradient, and this model's parameters are sharded "
                        "(FSDP, HSDP)", "set sdc_check_every 0 under a sharded strategy; the sync check still "
                        "compares what the ranks replicate")
    ctx = b.ctx
    loss, found = checked(model, compute, backward, step=step, device=ctx.device,
                          local=lambda: sync_gradients(model, False),
                          exchange=lambda mine: all_gather_object(ctx, mine), host=host_name())
    if found is None:
        return loss
    b.tell(found.record())
    if found.goes_on:
        b.say("ddp_kit: " + found.line())
        return loss
    bad = [r for r, o in enumerate(found.odd) if o not in GOES_ON]
    if len(bad) == len(found.odd) and len(bad) > 1:
        raise UserError(found.not_repeatable(), DETERMINISM)
    hosts: list[Any] = list(dict.fromkeys(found.hosts[r] for r in bad))
    raise Unhealthy(found.not_repeatable(), f"drain {', '.join(hosts)} and check its GPU (nvidia-smi -q -d ECC, Xid "
                    f"lines in its kernel log), or, if the step draws random numbers the check cannot replay, "
                    f"{DETERMINISM}", hosts)

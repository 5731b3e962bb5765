"""`run.forward_backward`: a step's forward and backward, computed again every sdc_check_every steps and
compared before the optimizer sees them (reliability/replay.py; docs/sdc.md). What it found is said once (rank
0), told to the run ledger (a `replay` line, which the health gate's rule of two counts against the host), and,
where a rank's computations do not repeat, ends the attempt naming the host."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..dist.collectives import all_gather_object, all_true
from ..env.facts import host_name
from ..errors import Unhealthy, UserError
from ..parallel.fsdp import is_sharded
from ..parallel.strategy import strategy_of
from ..parallel.wrap import sync_gradients
from ..reliability.replay import checked

if TYPE_CHECKING:
    from .protocol import Boundary

DETERMINISM = ("make the step deterministic (on a GPU: ddp_kit.init(deterministic=True), --deterministic true; a loss "
               "that draws from a random generator of its own must draw from torch's), or set sdc_check_every 0")


def refuse_strategy(every: int, strategy: Any) -> None:
    """At run.prepare: the strategies the replay check cannot serve, refused before step 1."""
    if not every:
        return
    if strategy.sharded:
        raise UserError(f"sdc_check_every needs each rank's whole gradient, and strategy {strategy.name} shards the "
                        "parameters", f"set sdc_check_every 0 under strategy {strategy.name}; the sync check still "
                        "compares what the ranks replicate")
    if strategy.name == "ft":  # a third computation's all-reduce in one replica group would pair with another step's
        raise UserError("sdc_check_every is not supported under strategy ft: a step computed a third time in one replica "
                        "group would all-reduce across groups that computed it once", "set sdc_check_every 0 under "
                        "strategy ft; its groups' sync check still compares the replicas")


def refuse_sync_bn(every: int, models: Sequence[nn.Module], world_size: int) -> None:
    """At run.prepare (and at a check, for a model prepared elsewhere): SyncBatchNorm shares batch statistics
    across ranks in the forward and the backward, no_sync or not, so no rank computes a step alone and a fault
    on one rank would move every rank's computation (every host blamed)."""
    if every and world_size > 1 and any(isinstance(m, nn.SyncBatchNorm) for model in models for m in model.modules()):
        raise UserError("sdc_check_every needs each rank to compute a step alone, and SyncBatchNorm shares the batch "
                        "statistics across ranks in every computation", "set sdc_check_every 0, or drop sync_bn (each "
                        "rank then keeps its own BatchNorm statistics)")


def _local(models: Sequence[nn.Module]) -> ExitStack:
    """No all-reduce for any of the models (the replay's computation is each rank's own)."""
    stack = ExitStack()
    for m in models:
        stack.enter_context(sync_gradients(m, False))
    return stack


def forward_backward(b: Boundary, model: nn.Module, compute: Callable[[], torch.Tensor],
                     backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """`compute()`, then `backward` of its loss; returns the loss. On a check step, computed again and compared."""
    every, step = b.policy.sdc_check_every, b.steps.done + int(b.steps.pending) + 1  # as run.steps_done + 1
    if not every or step % every:
        loss = compute()
        backward(loss)
        return loss
    if is_sharded(model):  # a model prepared elsewhere than run.prepare (refuse_strategy)
        refuse_strategy(every, strategy_of(model))
    ctx = b.ctx
    # Every model the run prepared, not only the one named: a loss may reach another (a GAN's discriminator,
    # an encoder and a decoder), whose gradients a replay would otherwise add to and whose buffers it would move.
    models = list(dict.fromkeys([model, *b.models]))
    if len(models) > len(b.models):  # `model` was prepared elsewhere (run.prepare refused the others' SyncBatchNorm)
        refuse_sync_bn(every, [model], ctx.world_size)
    loss, found = checked(models, compute, backward, step=step, device=ctx.device,
                          local=lambda: _local(models), agree=lambda same: all_true(ctx, same),
                          exchange=lambda mine: all_gather_object(ctx, mine), host=host_name())
    if found is None:
        return loss
    if found.goes_on:
        b.tell(found.record())  # the run ledger's replay line: the health gate counts it against the host
        b.say("ddp_kit: " + found.line())
        return loss
    if not found.a_host_to_blame:  # the step itself does not repeat: a setting, not a host
        raise UserError(found.not_repeatable(), DETERMINISM, verdict=True)
    hosts: list[Any] = list(dict.fromkeys(found.hosts[r] for r in found.bad))
    # The attempt's end line names the hosts (verdict infrastructure): the health gate counts that, once.
    raise Unhealthy(found.not_repeatable(), f"drain {', '.join(hosts)} and check its GPU (nvidia-smi -q -d ECC, Xid "
                    f"lines in its kernel log)", hosts)

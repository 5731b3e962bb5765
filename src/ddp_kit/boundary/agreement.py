"""Startup, before step 1 ends: the optimizers train the prepared models, every rank holds the same
versions, data, model shapes, config and resumed step, and then the collective timeout tightens."""
from __future__ import annotations

from collections.abc import Sized
from typing import TYPE_CHECKING, Any, cast

import torch

from ..dist.collectives import barrier, set_collective_timeout
from ..errors import UserError
from ..reliability.recipe import config_hash
from ..reliability.sync_checks import check_agreement, check_consistency, optimizer_steps, shapes_digest
from ..version import __version__
from . import rollback

if TYPE_CHECKING:  # the core imports its parts: they name what they use of it (protocol.py), not the core
    from .protocol import Boundary



def agree(b: Boundary, facts: dict[str, Any] | None = None, details: dict[str, dict[str, Any]] | None = None) -> None:
    """Every rank holds the same versions, data, model shapes and resumed step (plus the caller's
    `facts`); else every rank stops with one line naming the rank."""
    mine = {"world_size": b.ctx.world_size, "ddp_kit": __version__, "torch": torch.__version__,
            "resumed_step": b.steps.done, **(facts or {})}
    if b.config is not None:
        mine["config"] = config_hash(b.config)
        details = {**(details or {}), "config": b.config}
    for i, loader in enumerate(b.loaders):
        mine[f"loader{i}_dataset_len"] = len(cast(Sized, loader.dataset))
        mine[f"loader{i}_steps_per_epoch"] = loader.steps_per_epoch
    for i, module in enumerate(b.modules):
        mine[f"model{i}_param_shapes"] = shapes_digest(module)
    with b.collective("startup"):
        check_agreement(b.ctx, mine, details)


def check_optimizers(b: Boundary) -> None:
    """Every registered optimizer steps parameters of a registered model; else the run would train
    nothing, or (a sharded strategy) fail only at its first checkpoint, possibly hours later. The usual
    cause: the optimizer was made before run.prepare, which under FSDP replaces the parameters."""
    if not b.models:
        return
    owned = {id(p) for m in b.models for p in m.parameters()}
    for name, opt in b.named(torch.optim.Optimizer).items():
        params = [p for g in opt.param_groups for p in g["params"]]
        if not params or any(id(p) in owned for p in params):
            continue
        if b.strategy.sharded:
            raise UserError(f"optimizer {name!r} holds none of the prepared model's parameters (run.prepare(..., "
                            f"strategy='{b.strategy.name}') replaces them with sharded ones): it would train nothing, "
                            f"and its checkpoint would fail",
                            "create the optimizer after run.prepare, from the model it returned: "
                            "optimizer = AdamW(model.parameters())", verdict=True)
        # Under DDP the parameters stay the same tensors: an optimizer over another module's (a
        # learnable loss head) is legitimate, but it is worth a word once.
        b.say(f"ddp_kit: warning: optimizer {name!r} holds none of the prepared models' parameters; if it "
              f"should train the model, create it from the model run.prepare returned")


def first_step_over(b: Boundary) -> None:
    if not b.steps.resumed:  # run.resume checked them already
        b.check_optimizers()
    b.agree()
    # Startup is over (data ready, kernels compiled): from here a collective that takes longer
    # than collective_timeout_s is a fault, not a slow start.
    with b.collective("after step"):
        barrier(b.ctx)
    set_collective_timeout(b.ctx, b.policy.collective_timeout_s)
    b.progress.warm = True
    b.flag.started()  # from here a stop signal is agreed on and checkpointed
    for hook in b.hooks:
        hook.first_step(b)
    b.records.first_step_over(b.steps.done)
    b.tell({"event": "first_step", "step": b.steps.done})


def compare_weights(b: Boundary, done: int) -> bool:
    """Every sync_check_every steps: the ranks' parameter and buffer checksums compared (sync_checks.py). True
    when the ranks differed and every rank rolled back to an earlier step (sync_fix rollback: rollback.py)."""
    with b.collective("sync check"):
        b.nonfinite.check(b.ctx, b.checkpointer_if_open())  # NaN weights would read as divergence
        steps = optimizer_steps(b.named(torch.optim.Optimizer))
        fix = b.policy.sync_fix
        # Strategy ft keeps replica groups in step: one group rolling back alone would leave them. It stops as error does.
        if fix == "rollback" and not any(hook.across_groups for hook in b.hooks):
            if rollback.check(b, done, steps):
                return True  # at the restored step, which the ranks agree on (rollback.roll_back)
        else:
            for i, model in enumerate(b.models):
                warning = check_consistency(b.ctx, model, done, "error" if fix == "rollback" else fix,
                                            extra=steps if i == 0 else [])
                if warning:
                    b.say(f"ddp_kit: warning: {warning}")
    b.steps.synced = done  # passed (or, sync_fix broadcast, made so)
    return False

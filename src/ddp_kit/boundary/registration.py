"""What a run registers, and the hooks that watch it: a model's forward (timed on sampled steps;
forward_split.py), a loader's fetches (where the implicit step boundary runs), an
optimizer's step (counted as a step, gradients measured). Registered objects are checkpointed."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..data import TrainLoader
from ..errors import UserError
from ..parallel.ddp import unwrap
from ..reliability.recipe import is_scheduler
from . import loop_hooks

if TYPE_CHECKING:  # the core imports its parts: they name what they use of it (protocol.py), not the core
    from .protocol import Boundary



def track(b: Boundary, obj: Any, name: str | None = None, module: nn.Module | None = None) -> None:
    """Register `obj` for checkpointing (models, ddp_kit loaders, optimizers are also watched).
    `module`: a model's own module under its wrappers, where the caller has it."""
    if b.state.holds(obj):
        return
    if b.steps.resumed:
        raise UserError(f"{type(obj).__name__} registered after run.resume(): it would never be restored "
                        f"from a checkpoint", "call run.prepare(...) and pass every object before run.resume(...)")
    if isinstance(obj, nn.Module):
        b.models.append(obj)
        b.modules.append(module if module is not None else unwrap(obj))
        # The forward/backward split is read by the per-rank metrics only, and measured on a few
        # steps of each window (forward_split.py); without them no hook is ever registered.
        if b.records.split is not None:
            b.records.split.add(obj)
        base = "model"
    elif isinstance(obj, TrainLoader):
        b.loaders.append(obj)
        obj.on_fetch = lambda: loop_hooks.fetching(b)
        obj.on_batch = lambda: loop_hooks.fetched(b)
        obj.on_end = lambda: loop_hooks.epoch_end(b)
        base = "data"
    elif isinstance(obj, torch.optim.Optimizer):
        b.optimizers.append(obj)
        obj.register_step_pre_hook(lambda *_: loop_hooks.stepping(b))  # backward and DDP's wait end here
        obj.register_step_post_hook(lambda *_: loop_hooks.stepped(b))
        for hook in b.hooks:  # strategy ft: the step runs only if the quorum commits it
            hook.gate(obj, scheduler=False)
        base = "optimizer"
    elif is_scheduler(obj):
        for hook in b.hooks:  # strategy ft: and the schedule follows the same decision
            hook.gate(obj, scheduler=True)
        base = type(obj).__name__.lower()
    else:
        base = type(obj).__name__.lower()
    b.state.add(name or b.state.next_name(base), obj)

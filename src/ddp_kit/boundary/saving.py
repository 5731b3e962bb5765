"""A checkpoint of everything registered, at this step: the shared state (rank 0's files), each
rank's RNG, the strategy's sharded state where it has one, and meta.json."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint.backend import CheckpointBackend
from ..checkpoint.checkpointer import rng_state
from ..checkpoint.memory_tier import MemoryTier
from ..checkpoint.spared import AGREED
from ..parallel.ddp import sync_ddp_buffers
from ..reliability.recipe import config_hash, not_recipe
from ..version import __version__
from . import grace_period

if TYPE_CHECKING:  # the core imports its parts: they name what they use of it (protocol.py), not the core
    from .protocol import Boundary



def save(b: Boundary, ckpt: CheckpointBackend) -> None:
    """Checkpoint everything registered at this step into `ckpt` (collective). Called by the core
    only, once the boundary owed by the last step has run."""
    b.nonfinite.check(b.ctx, ckpt)  # never save a run whose loss went NaN/inf
    for hook in b.hooks:  # e.g. services/keep_best.py: its one decision goes into this step's meta.json
        hook.saving(b)
    for model in b.models:  # model.pt holds rank 0's buffers: from here every rank has those too
        sync_ddp_buffers(model)
    shared, sharded, meta = snapshot(b)
    # prune spares the newest step at or before the last passed sync check (or rollback): where a rollback goes.
    # Not where the last agreement is this attempt's resume: keep_last then holds as asked (a run that ends
    # before its next check kept its resumed step forever, and the clean end's own check comes after it).
    if b.policy.sync_fix == "rollback" and b.policy.sync_check_every and b.steps.synced != b.steps.resumed_from:
        meta[AGREED] = b.steps.synced
    phase = b.progress.phase
    b.progress.enter("checkpoint")
    ckpt.save(b.steps.done, shared, {"rng": rng_state()}, meta, sharded=sharded)
    b.progress.enter(phase)
    b.steps.saved = b.steps.done
    b.steps.last_save_t = time.monotonic()
    grace_period.note_timings(b)  # this save's time if it committed already, else the previous one's


def save_memory(b: Boundary, tier: MemoryTier) -> None:
    """A memory-tier copy of everything registered at this step: what `save` writes, each rank its
    own (DDP's buffers as they are on this rank: nothing is synchronized, so the copy changes no
    training), blocking for the copy into node memory only (memory_tier.py)."""
    shared, sharded, meta = snapshot(b)
    phase = b.progress.phase
    b.progress.enter("checkpoint")
    # Only optimizer.step writes parameters and optimizer state, and it waits for their copy (core.stepping).
    written = {t.data_ptr() for opt in b.optimizers for t in _owned(opt)}
    tier.save(b.steps.done, {"shared": shared, "per_rank": {"rng": rng_state()}, "sharded": sharded}, meta, b.say,
              later=lambda t: t.data_ptr() in written)
    b.progress.enter(phase)


def _owned(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors an optimizer's step writes: its parameters and its state (non-empty: an empty tensor has no address)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return [t for t in params + state if t.numel()]


def snapshot(b: Boundary) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """(shared state, the strategy's sharded state, meta) of this step: what every tier saves."""
    models, optimizers = b.sharded()
    shared = {**b.state.state_dict(skip=frozenset(models) | frozenset(optimizers)), "loop": {"step": b.steps.done}}
    with b.state_io():
        sharded = b.strategy.state_dicts(models, optimizers)
    meta = {"ddp_kit": __version__, "torch": torch.__version__, "strategy": b.strategy.name, **b.meta}
    if b.config is not None:
        meta.update(config=b.config, config_hash=config_hash(b.config, leave_out=not_recipe()))
    if b.loaders:
        meta.update(epoch=b.loaders[0].epoch, position=b.loaders[0].position)
    return shared, sharded, meta

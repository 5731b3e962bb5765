"""Resume: register the objects, find the checkpoint the policy names, refuse one that does not
fit (another strategy, a changed recipe), restore every object and this rank's RNG, and start or
continue one lineage in the run folder (checkpoint_io.archive_lineage)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint.checkpointer import set_rng_state
from ..dist.collectives import broadcast_object
from ..errors import UserError
from ..hooks import Tier
from ..parallel.strategy import UNRECORDED
from ..reliability.recipe import hyperparameters, is_scheduler, overridden, refuse_changed
from .checkpoint_io import archive_lineage

if TYPE_CHECKING:  # the core imports its parts: they name what they use of it (protocol.py), not the core
    from .protocol import Boundary



def resume(b: Boundary, objects: dict[str, Any], check: Callable[[dict[str, Any]], str | None] | None = None) -> int:
    """Register `objects`, then continue from the checkpoint `policy.resume` names (if any)."""
    for name, obj in objects.items():
        b.track(obj, name)
    b.steps.resumed = True
    b.check_optimizers()
    ckpt = b.checkpointer()
    b.progress.enter("startup")
    # A replica group that restarts while others train (strategy ft) takes their state live instead.
    live = any([hook.restore(b) for hook in b.hooks])
    warn = lambda msg: b.say(f"ddp_kit: warning: {msg}")
    durable_tier, others = b.tiers[0], [t for t in b.tiers[1:]] if not live and b.rd is not None else []
    source, found, durable = _find(b, ckpt, durable_tier, others, warn) if not live else (durable_tier, None, None)
    meta = restore(b, source, found, check) if found is not None else {}
    if found is not None:
        b.steps.resumed_from, b.steps.resumed_path = b.steps.done, found.path
    b.steps.synced = b.steps.done  # one state on every rank: a checkpoint's, a peer's, or the start
    if source is not durable_tier:  # not durable until saved durably: the end, a stop or the next ckpt_every saves it
        b.steps.saved = durable if durable is not None else -1
    for tier in others:
        tier.continues_from(b.steps.resumed_from)
    if not live:
        for hook in b.hooks:
            hook.restored_from_disk(b)
    if b.ctx.is_main and b.rd is not None and b.writer is not None and not live:  # a live recovery continues the run's own lineage
        archive_lineage(ckpt, b.rd, b.writer, b.policy.resume == "never", b.steps.resumed_from, b.steps.resumed_path, b.say,
                        from_memory=source is not durable_tier, durable=durable)
    if b.policy.ckpt_every == 0 and b.rd is not None:
        every = b.policy.ckpt_every_s
        b.say(f"ddp_kit: checkpoints {f'every {every / 60:g} min (ckpt_every_s) and ' if every > 0 else ''}at the "
              f"end, none by step (ckpt_every=0); pass ckpt_every=N to ddp_kit.init for one every N steps")
    b.tell({"event": "resume", "step": b.steps.done, "from": "peer" if live else "checkpoint" if found else "none",
            # which tier, and the durable step a restart without the other tiers would have replayed from
            **({"tier": getattr(found, "tier", source.name), "durable_step": (found.step if source is durable_tier else durable) or 0}
               if found else {})})
    for hook in b.hooks:
        hook.resumed(b, meta)  # this attempt's first step is known now
    return b.steps.done


def _find(b: Boundary, ckpt: Any, durable_tier: Tier, others: list[Tier],
          warn: Callable[[str], None]) -> tuple[Tier, Any, int | None]:
    """(the tier, the newest complete step across the tiers, the durable tier's newest step when another
    tier was asked first). The durable step is the floor: another tier's copy counts only when newer."""
    found: Any = None
    durable: int | None = None
    if others:
        ckpt.claim()  # one writer: before another tier's cleanup and a resume that never calls find
        if b.policy.resume != "auto":  # a new lineage (never, or a named step): what the other tiers hold is abandoned
            for tier in others:
                tier.clear()
        else:
            known, durable = _durable_latest(b, ckpt)  # a name only: the durable step is downloaded only if needed
            if not known:  # the pointer could not be read: the durable tier's own choice first, as its floor
                found = ckpt.find(b.policy.resume, warn=warn)
                durable = found.step if found is not None else None
            best: tuple[Tier, Any] | None = None
            for tier in others:  # every rank asks every tier: each find is collective
                mine = tier.find(b, durable, warn)
                if mine is not None and (best is None or mine.step > best[1].step):
                    best = (tier, mine)
            if best is not None:
                return best[0], best[1], durable
    if found is None:
        found = ckpt.find(b.policy.resume, warn=warn)
    return durable_tier, found, durable


def _durable_latest(b: Boundary, ckpt: Any) -> tuple[bool, int | None]:
    """(whether it could be read, the step) the durable tier's pointer names: rank 0 reads it, a name only
    (the step itself is downloaded and checked only if the memory tier has nothing newer)."""
    def read() -> tuple[bool, int | None]:
        try:
            return True, ckpt.latest()
        except Exception:  # the durable tier's find says what is wrong, in its own words
            return False, None
    known, step = broadcast_object(b.ctx, read() if b.ctx.is_main else None)
    return bool(known), step


def restore(b: Boundary, ckpt: Any, found: Any, check: Callable[[dict[str, Any]], str | None] | None,
            settle: bool = True, say: bool = True) -> dict[str, Any]:
    """Load `found` (of tier `ckpt`) into every registered object and this rank's RNG; returns its meta. Also a
    rollback's (rollback.py): `settle` False there (DDP's buckets are rebuilt already), `say` False (it says where)."""
    loaded = ckpt.load(found)
    shared, own = loaded[0], loaded[1]
    meta: dict[str, Any] = loaded[2]
    if check is None and b.config is not None:  # a script's own config: the reference job's rules
        config = b.config
        check = lambda m: refuse_changed(m.get("config") or {}, config, m["path"],
                                         "use a new run_dir, or resume='never' to start over in this one")
    optimizers = b.named(torch.optim.Optimizer)
    scheduled = any(is_scheduler(o) for o in b.state.objects.values())
    scripted = hyperparameters(optimizers, scheduled)
    # Before any state is loaded: the caller may refuse this checkpoint, or say what changed.
    said = check({**meta, "path": str(found.path)}) if check is not None else None
    written = meta.get("strategy", UNRECORDED)
    if written != b.strategy.name:
        raise UserError(f"checkpoint {found.path} was written with strategy {written}; this run uses "
                        f"{b.strategy.name}",
                        f"resume it with strategy {written}, or export its weights (python -m ddp_kit.checkpoint "
                        f"export) and start a new run_dir from them")
    models, sharded_optimizers = b.sharded()
    notes = b.state.load_state_dict(shared, str(found.path), skip=frozenset(models) | frozenset(sharded_optimizers))
    if b.strategy.sharded:
        with b.state_io():
            b.strategy.load_state_dicts(models, sharded_optimizers, ckpt.sharded_keys(found),
                                        lambda template: ckpt.load_sharded(found, template))
    b.steps.done = b.steps.saved = int(shared["loop"]["step"])
    b.records.restart_window(b.steps.done)  # samples/s counts this process's steps only
    b.progress.enter("startup", b.steps.done)
    if settle and b.ctx.world_size > 1 and b.loaders:
        for model in b.models:  # e.g. ddp.settle_ddp_buckets: bit-identical resume needs it
            b.strategy.settle(model, b.loaders[0].sample_batch(), b.ctx.device)
    if own is not None and meta.get("world_size") == b.ctx.world_size:
        set_rng_state(own["rng"])
    else:
        torch.manual_seed(1_000_003 * b.steps.done + b.ctx.rank)
    extra = [said] if said else []
    extra += overridden(scripted, hyperparameters(b.named(torch.optim.Optimizer), scheduled))
    if meta.get("world_size") != b.ctx.world_size:
        extra.append(f"written by {meta.get('world_size')} rank(s), resumed on {b.ctx.world_size}: "
                     f"data order continues, per-rank RNG streams are reseeded")
    if say or extra:
        b.say(f"ddp_kit: resumed from {found.path} (step {b.steps.done}, epoch {b.epoch})"
              + ("; " + "; ".join(extra) if extra else ""))
    for note in notes:
        b.say(f"ddp_kit: warning: {note}")
    return meta

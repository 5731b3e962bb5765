"""What may change between a checkpoint and the run that resumes it: the reference job's keys,
applied to any config dict (the job's, or the one a script passes to `ddp_kit.init(config=...)`).

Plain data and functions: the library compares a checkpoint's config with this run's through
`refuse_changed`, without reading the job's config system; without a config, the optimizer settings
a checkpoint overrides are named (`hyperparameters`, `overridden`)."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import UserError

_NOT_RECIPE = frozenset({"progress", "log_every", "resume", "inject", "debug_ckpt_delay_s", "run_dir", "num_workers",
                        "ckpt_every", "keep_last", "async_ckpt", "init_timeout_s", "sync_check_every", "sdc_check_every", "sync_fix",
                        "collective_timeout_s", "hang_timeout_s", "peer_timeout_s", "preempt_check_every", "rank_metrics", "rank_records_max",
                        "straggler_margin", "ckpt_dir", "ckpt_upload_timeout_s"})
# Keys that may differ between a checkpoint and the run resuming it: how long the run goes, where
# it executes, and its bookkeeping. Anything that changes what a step computes (model, data, batch,
# optimizer and its settings, LR and schedule shape, precision, seed) may not: the restored optimizer
# and scheduler would keep the old values or fail to load, and the result would carry a recipe it
# never ran. Beyond NOT_RECIPE (logging, checkpointing, timeouts, checks, resume mode, test hooks):
#   epochs, max_steps   lengthen or shorten the run; the LR schedule is rebuilt over the new total.
#   data_root, download where the same dataset's files are found.
#   device, backend     where it runs, like the world size (elastic resume): the numbers may move in
#                       the last bits, the recipe does not.
#   eval_every_epoch    evaluation only.
# compile and channels_last keep the math too, but resuming across them is untested, so they stay out.
# A strategy's own config keys say it themselves (Option.resumable, parallel/<name>.py): see RESUMABLE.
# A service's settings (services/<name>.py: the run ledger, trackers, the memory tier, ...) are its
# bookkeeping: those declared resumable are not recipe either (NOT_RECIPE).
_JOB_RESUMABLE = _NOT_RECIPE | frozenset({"epochs", "max_steps", "data_root", "download", "device", "backend",
                                         "eval_every_epoch", "tf32", "cudnn_benchmark", "deterministic", "device_data"})
# These differ on every recovery by nature (resume) or are never applied to a resumed run (inject).
_UNREPORTED = frozenset({"resume", "inject"})


def recipe_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """A checkpoint's config against this run's: ({refused key: (old, new)}, {allowed key: (old, new)}).

    Keys one side lacks (a checkpoint from another ddp_kit version) are not compared."""
    changed = {k: (saved[k], v) for k, v in current.items() if k in saved and saved[k] != v}
    resumable = _resumable()
    refused = {k: c for k, c in changed.items() if k not in resumable}
    allowed = {k: c for k, c in changed.items() if k in resumable and k not in _UNREPORTED}
    return refused, allowed


def _resumable() -> frozenset[str]:
    """RESUMABLE: the job's keys above, each strategy's config keys declared resumable and the
    services' (NOT_RECIPE). Asked for late: it imports every strategy's file (and torch), which the rest
    of this module does without."""
    from ..parallel.strategy import config_options

    return _JOB_RESUMABLE | not_recipe() | frozenset(o.key for o in config_options() if o.resumable)


def not_recipe() -> frozenset[str]:
    """NOT_RECIPE: the keys above and every service's resumable settings (torch-free: services/ declares them)."""
    from ..service_registry import options

    return _NOT_RECIPE | frozenset(o.key or o.name for o in options() if o.resumable)


def __getattr__(name: str) -> Any:
    if name == "RESUMABLE":
        return _resumable()
    if name == "NOT_RECIPE":
        return not_recipe()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def describe_changes(changes: Mapping[str, tuple]) -> str:
    """'lr 0.003 -> 0.01, optimizer adamw -> sgd'"""
    return ", ".join(f"{k} {_show(old)} -> {_show(new)}" for k, (old, new) in changes.items())


def _show(value: Any) -> str:
    return "''" if value == "" else str(value)


def refuse_changed(saved: Mapping[str, Any], current: Mapping[str, Any], path: str, hint: str) -> str | None:
    """Refuse a resume whose recipe changed (one UserError naming every change), or return the note
    for the "resumed from" line that names the allowed changes applied (None when nothing changed)."""
    refused, applied = recipe_changes(saved, current)
    if refused:
        # every rank compares the same checkpoint's config: one verdict, printed once
        raise UserError(f"cannot resume from {path}: the recipe changed since it was saved ({describe_changes(refused)})",
                        hint, verdict=True)
    return f"changed since that checkpoint and applied: {describe_changes(applied)}" if applied else None


# What LR schedulers move as they go (OneCycleLR and CyclicLR move momentum or betas too): with one
# registered, only the base rate a scheduler wrote ("initial_lr") stands for the script's choice.
_SCHEDULED = frozenset({"lr", "momentum", "betas", "max_lr", "min_lr", "base_lr", "max_momentum", "base_momentum"})


def is_scheduler(obj: Any) -> bool:
    import torch  # here only: the rest of this module is plain data

    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau))


def hyperparameters(optimizers: Mapping[str, Any], scheduled: bool) -> dict[str, dict[str, Any]]:
    """{optimizer name: {"lr": 0.01, "group 1 weight_decay": 0.0, ...}}: the plain numbers of each
    param group, less those a registered scheduler moves (see _SCHEDULED)."""
    out: dict[str, dict[str, Any]] = {}
    for name, opt in optimizers.items():
        keys: dict[str, Any] = {}
        for i, group in enumerate(opt.param_groups):
            for key, value in group.items():
                if key == "params" or (scheduled and key in _SCHEDULED) or (key == "lr" and "initial_lr" in group):
                    continue
                if isinstance(value, (bool, int, float, str)) or (
                        isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value)):
                    keys[(f"group {i} " if i else "") + ("lr" if key == "initial_lr" else key)] = value
        out[name] = keys
    return out


def overridden(scripted: Mapping[str, dict], restored: Mapping[str, dict]) -> list[str]:
    """The resume line's notes: each optimizer setting the checkpoint replaced ("optimizer lr 0.003 in
    the script, 0.01 restored"); `scripted` and `restored` are hyperparameters() before and after loading."""
    return [f"{name} {key} {mine} in the script, {theirs} restored"
            for name, keys in scripted.items() for key, mine in keys.items()
            if (theirs := restored.get(name, {}).get(key, mine)) != mine]


def config_hash(config: Mapping[str, Any], leave_out: Iterable[str] = ()) -> str:
    """A short, stable hash of a config dict (less the keys `leave_out`): meta.json, summary.json and
    the startup agreement carry it. Key order does not matter; a value JSON cannot hold hashes as its str()."""
    kept = {k: v for k, v in config.items() if k not in frozenset(leave_out)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]

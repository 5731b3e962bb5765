"""Ray Train: pass ddp_kit's metrics records to `ray.train.report`, when this process is a Ray Train
worker.

Only metrics travel. Checkpoints stay ddp_kit's own (atomic, in run_dir, on storage every worker
sees), and a restart by Ray's `FailureConfig` resumes from run_dir, so Ray's checkpoint API is not
used. The contract, from Ray 2.60's ray/train/v2/api/train_fn_utils.py (`report`): every worker
must call `ray.train.report` the same number of times, because it is a barrier across the workers;
only rank 0's metrics are kept in the result; tensors are refused. ddp_kit's log records are made
at the same step on every rank (boundary/records.py calls each on_log callback on every rank,
after the log all-reduce), so a callback on that hook meets the barrier's rule.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from numbers import Integral, Real
from typing import Any


def in_train_worker(modules: Mapping[str, Any] | None = None) -> bool:
    """True inside a function that Ray Train runs on a worker. Never imports Ray: a Ray Train worker
    has imported `ray.train` before it calls the user's function, so a process without it in
    `sys.modules` is not one (and an installed but unused Ray costs nothing)."""
    modules = sys.modules if modules is None else modules
    train = modules.get("ray.train")
    if train is None:
        return False
    try:  # outside a worker (the driver, a Ray task) Ray 2.x raises RuntimeError here
        return train.get_context().get_world_size() >= 1
    except Exception:  # any failure to ask means: not a Train worker we could report from
        return False


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, float | int]:
    """The numbers of a metrics record, nested mappings joined with "/" (`rank_summary/step_s/max`).

    Strings (the event name) and lists (the per-rank records: rank 0 alone holds them, and their
    size grows with the world) are left out; booleans too, which Ray would chart as numbers."""
    out: dict[str, float | int] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, Real) and not isinstance(value, bool):
            out[name] = int(value) if isinstance(value, Integral) else float(value)  # NumPy scalars too
    return out


def reporter(modules: Mapping[str, Any] | None = None) -> Callable[[dict], None] | None:
    """A `run.on_log` callback passing each record's numbers to `ray.train.report`, or None when
    this process is not a Ray Train worker."""
    if not in_train_worker(modules):
        return None
    train = (sys.modules if modules is None else modules)["ray.train"]

    def report(record: dict) -> None:
        train.report(flatten(record))

    return report

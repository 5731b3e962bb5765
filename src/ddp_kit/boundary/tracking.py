"""The step boundary's door to the experiment trackers (trackers/): which tracker run an attempt
continues, what the trackers are told, and when they open and close.

One tracker run per ddp_kit run, across every attempt. Its id is kept in run_dir/trackers.json and in
every checkpoint's meta ("trackers"), with the last step sent to it. An attempt continues it when
it resumes from a checkpoint (the checkpoint's ids first: a run resumed from a checkpoint in
another folder continues the same tracker runs), when it is a restart of the same job
(torchrun --max-restarts, a Kubernetes or Ray restart) or a replica group recovered live from a
peer; a fresh start (resume='never', or a rerun by hand that finds no checkpoint) starts new
ones, as metrics.jsonl starts anew. The trackers open once the attempt knows its first step: at
the end of run.resume, else after the first step (a script that never resumes), else at close.

One rank logs: rank 0, and under replica groups (strategy ft) rank 0 of group 0, so the job has one
tracker run; the records of steps trained while group 0 is away are in the other groups'
metrics.jsonl only.
"""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from ..trackers.base import Opening
from ..trackers.hub import Hub, TrackerRuns
from ..version import __version__

if TYPE_CHECKING:  # the core imports its parts: they name what they use of it (protocol.py), not the core
    from .protocol import Boundary

META_KEY = "trackers"  # in a checkpoint's meta.json: {tracker: {"run_id": ..., "logged_step": ...}}


def hub_for(ctx: Any, names: tuple[str, ...]) -> Hub:
    """This attempt's trackers: live on the rank that logs, a no-op on every other."""
    return Hub(names, active=ctx.is_main and ctx.env.leads_job)


def open_trackers(b: Boundary, hub: Hub, start: int, saved: dict[str, Any] | None = None) -> None:
    """Open the trackers (once): this attempt trains from step `start`; `saved` is the resumed
    checkpoint's meta entry (None: no checkpoint was read)."""
    if hub.opened or hub.closed or not hub.names:
        return
    path = b.rd.trackers if b.rd is not None else None
    here = TrackerRuns.read(path)
    if b.policy.resume == "never" and here and b.rd is not None and path is not None:  # the abandoned tracker runs' ids go where its metrics went
        dest = b.rd.archive / time.strftime("%Y%m%dT%H%M%S")
        dest.mkdir(parents=True, exist_ok=True)
        (dest / path.name).write_text(json.dumps(here, indent=1, sort_keys=True) + "\n")
        here = {}
    env = b.ctx.env
    same_job = b.steps.resumed_from is not None or env.restart_count > 0 or env.restarted_by_engine or start > 0
    entries, openings, floors, facts = dict(here), {}, {}, _facts(b)
    for name in hub.names:
        run_id, floor = lineage(name, saved if isinstance(saved, dict) else {}, here,
                                fresh=b.policy.resume == "never", same_job=same_job)
        entries.pop(name, None)
        if run_id is not None:
            entries[name] = {"run_id": run_id, "logged_step": floor}
        openings[name] = Opening(run_dir=b.rd.path if b.rd is not None else None, name=_name(b), run_id=run_id,
                                 rewind_to=start, config=b.config or {}, facts=facts)
        floors[name] = floor
    runs = TrackerRuns(path, entries, mirror=lambda e: b.meta.__setitem__(META_KEY, e))
    runs.write()  # trackers.json and the checkpoints carry this lineage from now on, before any tool answers
    hub.open(openings, floors, runs)


def lineage(name: str, saved: dict[str, Any], here: dict[str, Any], fresh: bool, same_job: bool) -> tuple[str | None, int | None]:
    """(the tracker run to continue or None for a new one, the last step sent to it) for tracker
    `name`, from the resumed checkpoint's entries (`saved`) and the run folder's (`here`)."""
    if fresh:
        return None, None
    ours, local = saved.get(name) or {}, here.get(name) or {}
    if ours.get("run_id"):
        floor = ours.get("logged_step", -1)
        if local.get("run_id") == ours["run_id"]:  # this folder sent it more since that checkpoint
            floor = max(floor, local.get("logged_step", -1))
        return ours["run_id"], floor
    if local.get("run_id") and same_job:
        return local["run_id"], local.get("logged_step", -1)
    return None, None


def close_trackers(b: Boundary, hub: Hub, exit_code: int, within_s: float | None = None) -> None:
    """The attempt ends: records held for trackers that never opened (no step was trained) open
    them first; then every tracker gets what is queued and the exit code, within hub's bounds and
    `within_s` (what a stop signal's grace period leaves: grace_period.close_budget_s)."""
    if not hub.opened and hub.has_pending:
        try:
            open_trackers(b, hub, start=b.steps.done)
        except Exception as err:  # the attempt is ending: its exit code is what matters now
            hub.say(f"ddp_kit: warning: the trackers could not be opened ({type(err).__name__}: {err})")
    if within_s is None:
        hub.close(exit_code)
    else:
        hub.close(exit_code, within_s)


def _name(b: Boundary) -> str:
    if b.rd is None:
        return "ddp_kit"
    path = b.rd.path
    return path.parent.name if b.ctx.env.part else path.name  # the folder of a part is the run's own


def _facts(b: Boundary) -> dict[str, Any]:
    import torch

    return {"ddp_kit": __version__, "torch": torch.__version__, "world_size": b.ctx.world_size,
            "backend": b.ctx.backend, "device": str(b.ctx.device), "strategy": b.strategy.name, **b.ctx.env.job_facts()}

"""The experiment trackers as a service (trackers/: tensorboard, mlflow, wandb): every metrics.jsonl
record also goes to them, one tracker run across every attempt (boundary/tracking.py: which run an
attempt continues). They open once the attempt knows its first step: at the end of run.resume, else
after the first step (a script that never resumes), else at the end; the end closes them with the
attempt's exit code, within what a stop signal's grace period leaves. Off (None) when none is named."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..boundary.protocol import Boundary as Whole
from ..errors import UserError
from ..hooks import Boundary, StepHooks
from ..options import Option
from ..service_registry import Service
from ..trackers import check_installed, parse, tracker_class

OPTIONS = (
    Option("trackers", "", key="trackers", resumable=True, parse=parse, check=check_installed,
           help="Experiment trackers rank 0 logs every metrics.jsonl record to, comma-separated: tensorboard (run_dir/tb), mlflow, wandb (pip install 'ddp_kit[NAME]'); settings from their own variables (MLFLOW_TRACKING_URI, WANDB_PROJECT, WANDB_MODE, ...). Every attempt of the run continues one tracker run. See docs/observability.md."),
)


class Trackers(StepHooks):
    def __init__(self, b: Whole, hub: Any):
        self.b, self.hub = b, hub  # the boundary as its parts see it (the hooks get its narrower view)

    def resumed(self, b: Boundary, meta: dict[str, Any]) -> None:
        from ..boundary.tracking import META_KEY, open_trackers

        open_trackers(self.b, self.hub, start=b.steps.done, saved=meta.get(META_KEY))  # the first step is known now

    def first_step(self, b: Boundary) -> None:
        from ..boundary.tracking import open_trackers

        open_trackers(self.b, self.hub, start=b.steps.done - 1)  # a script that never called run.resume: it started at this step

    def logged(self, b: Boundary, record: dict[str, Any]) -> None:
        self.hub.log(record)

    def ending(self, b: Boundary, code: int) -> None:
        from ..boundary import grace_period
        from ..boundary.tracking import close_trackers
        from ..trackers.hub import CLOSE_TIMEOUT_S

        # bounded, and a tracker's failure is its own warning (trackers/hub.py)
        close_trackers(self.b, self.hub, code, grace_period.close_budget_s(self.b, CLOSE_TIMEOUT_S))

    def close(self, b: Boundary) -> None:
        self.hub.close(1)  # a no-op after `ending` closed them with the attempt's exit code


def check(settings: Mapping[str, Any], run_dir: str | None) -> None:
    for name in settings["trackers"]:
        if tracker_class(name).needs_run_dir and run_dir is None:
            raise UserError(f"tracker {name} writes into the run folder, and this run has none",
                            'pass run_dir to ddp_kit.init(run_dir="runs/my_run", ...)')


def make(b: Any, settings: Mapping[str, Any]) -> Trackers | None:
    from ..boundary.tracking import hub_for

    names = settings["trackers"]
    return Trackers(b, hub_for(b.ctx, names)) if names else None


SERVICE = Service("trackers", OPTIONS, make, check)

"""Experiment trackers (TensorBoard, MLflow, Weights & Biases): rank 0 sends them what it writes to
metrics.jsonl, and every attempt of a run continues one tracker run (hub.py, boundary/tracking.py).

`TRACKERS`: adding one is a new file defining `TRACKER` (a base.Tracker subclass) plus one line
there. The registry names modules rather than importing them, and a tracker's file imports its tool
only when a run opens it: this module loads neither torch nor any tool, so that the job's config
check can ask it for names and installed packages.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..errors import UserError

if TYPE_CHECKING:
    from .base import Tracker

TRACKERS: dict[str, str] = {
    "tensorboard": "ddp_kit.trackers.tensorboard",
    "mlflow": "ddp_kit.trackers.mlflow",
    "wandb": "ddp_kit.trackers.wandb",
}
NAMES: tuple[str, ...] = tuple(TRACKERS)
__all__ = ["NAMES", "TRACKERS", "check_installed", "parse", "tracker_class"]


def tracker_class(name: str) -> type[Tracker]:
    """The Tracker subclass called `name` (its tool is not imported)."""
    return importlib.import_module(TRACKERS[name]).TRACKER


def parse(trackers: str | Iterable[str] | None) -> tuple[str, ...]:
    """`trackers` as a tuple of known names: a list, or one comma-separated string ("" and "none": none).
    An unknown name is one line, with "did you mean"."""
    if trackers is None:
        return ()
    items = trackers.split(",") if isinstance(trackers, str) else list(trackers)
    if not all(isinstance(t, str) for t in items):
        raise UserError(f"trackers must be names, got {trackers!r}", f"e.g. trackers=['tensorboard', 'mlflow'] "
                        f"(--trackers tensorboard,mlflow); known: {', '.join(NAMES)}")
    names = tuple(dict.fromkeys(t.strip().lower() for t in items if t.strip() and t.strip().lower() != "none"))
    for name in names:
        if name not in TRACKERS:
            near = difflib.get_close_matches(name, NAMES, n=1, cutoff=0.5)
            raise UserError(f"unknown tracker {name!r}", (f"did you mean {near[0]}? " if near else "")
                            + f"known: {', '.join(NAMES)}")
    return names


def check_installed(names: Iterable[str]) -> None:
    """Refuse, in one line naming the extra to install, a tracker whose package is missing."""
    for name in names:
        cls = tracker_class(name)
        if importlib.util.find_spec(cls.package) is None:
            raise UserError(f"tracker {name} needs the {cls.package} package, which is not installed",
                            f"pip install 'ddp_kit[{cls.extra}]' (or pip install {cls.package}), or drop {name} "
                            f"from trackers")

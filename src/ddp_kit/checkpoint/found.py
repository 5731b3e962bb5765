"""The step a resume chose: the one value every backend's `find` returns and its `load` takes back.
A leaf of its own, so that the backends and the dispatcher that opens them (backend.py) name it
without importing each other."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Found:
    """A committed step chosen for resume: where it lives (a folder, or on a store its URL) and its step number."""
    path: Path | str
    step: int

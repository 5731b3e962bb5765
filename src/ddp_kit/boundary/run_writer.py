"""What a run leaves in run_dir: config.yaml, metrics.jsonl, summary.json. Written by rank 0 only.
(TensorBoard's event files, once written here when tensorboard was installed, are a tracker now:
trackers/tensorboard.py, with `trackers=["tensorboard"]`.)"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from ..checkpoint.durable import atomic_write_text
from ..run_folder import RunDir


class RunWriter:
    """Appends one JSON object per log event; a no-op on every rank but rank 0."""

    def __init__(self, rd: RunDir, is_main: bool):
        self.rd = rd
        self.run_dir = rd.path
        self.is_main = is_main
        self._metrics = None
        if is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # Line-buffered append: a killed run keeps every line written so far, and a resumed run continues the file.
            self._metrics = open(rd.metrics, "a", buffering=1)

    def supersede(self, after_step: int | None, archive: Path) -> None:
        """Move records that no longer describe this run out of metrics.jsonl (and summary.json),
        into archive/<time>/: after a resume from step S, those of steps past S, which the resumed
        run computes again; on a fresh start, all of them."""
        if not self.is_main or not self.rd.metrics.exists():
            return
        lines = self.rd.metrics.read_text().splitlines(keepends=True)
        keep: list[str] = []
        gone: list[str] = []
        for ln in lines:
            (keep if after_step is not None and _step_of(ln) <= after_step else gone).append(ln)
        summary = self.rd.summary
        if not gone and not summary.exists():
            return
        dest = archive / time.strftime("%Y%m%dT%H%M%S")
        dest.mkdir(parents=True, exist_ok=True)
        if gone:
            with open(dest / self.rd.metrics.name, "a") as f:
                f.writelines(gone)
        if summary.exists():  # it described the run that ended; a new one will be written
            os.replace(summary, dest / summary.name)
        if self._metrics is not None:
            self._metrics.close()
        atomic_write_text(self.rd.metrics, "".join(keep))
        self._metrics = open(self.rd.metrics, "a", buffering=1)

    def write_config(self, config: dict[str, Any]) -> None:
        if self.is_main:
            atomic_write_text(self.rd.config, yaml.safe_dump(config, sort_keys=False))

    def log(self, record: dict[str, Any]) -> None:
        if self._metrics:
            self._metrics.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.is_main:
            atomic_write_text(self.rd.summary, json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        if self._metrics:
            self._metrics.close()
            self._metrics = None


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0


"""What a run leaves in run_dir: config.yaml, metrics.jsonl, summary.json. Written by rank 0 only."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from ..checkpoint.durable import atomic_write_text
from .run_dir import RunDir


class RunWriter:
    """Appends one JSON object per log event; a no-op on every rank but rank 0."""

    def __init__(self, rd: RunDir, is_main: bool):
        self.rd = rd
        self.run_dir = rd.path
        self.is_main = is_main
        self._metrics = None
        self._tb = None
        if is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # Line-buffered append: a killed run keeps every line written so far, and a resumed run continues the file.
            self._metrics = open(rd.metrics, "a", buffering=1)
            self._tb = _tensorboard(self.run_dir / "tb")

    def supersede(self, after_step: int | None, archive: Path) -> None:
        """Move records that no longer describe this run out of metrics.jsonl (and summary.json),
        into archive/<time>/: after a resume from step S, those of steps past S, which the resumed
        run computes again; on a fresh start, all of them."""
        if not self.is_main or not self.rd.metrics.exists():
            return
        lines = self.rd.metrics.read_text().splitlines(keepends=True)
        keep, gone = [], []
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
        self._metrics.close()
        atomic_write_text(self.rd.metrics, "".join(keep))
        self._metrics = open(self.rd.metrics, "a", buffering=1)

    def write_config(self, config: dict[str, Any]) -> None:
        if self.is_main:
            atomic_write_text(self.rd.config, yaml.safe_dump(config, sort_keys=False))

    def log(self, record: dict[str, Any]) -> None:
        if self._metrics:
            self._metrics.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
        if self._tb is not None:
            step, event = record.get("step", 0), record.get("event", "train")
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                    self._tb.add_scalar(f"{event}/{key}", value, step)
            for r in record.get("ranks", []):
                self._tb.add_scalar(f"ranks/local_ms/rank{r['rank']}", r["local_s"] * 1e3, step)
                self._tb.add_scalar(f"ranks/peak_mem_mb/rank{r['rank']}", r["peak_mem_mb"], step)

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.is_main:
            atomic_write_text(self.rd.summary, json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        if self._metrics:
            self._metrics.close()
            self._metrics = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0


def _tensorboard(log_dir: Path):
    """A SummaryWriter when the optional tensorboard package is installed; otherwise None, silently."""
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(log_dir))

"""What a run leaves in run_dir: config.yaml, metrics.jsonl, summary.json. Written by rank 0 only."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import yaml


class RunWriter:
    """Appends one JSON object per log event; a no-op on every rank but rank 0."""

    def __init__(self, run_dir: str | Path, is_main: bool):
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self._metrics = None
        if is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # Line-buffered append: a killed run keeps every line written so far, and a resumed run continues the file.
            self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)

    def write_config(self, config: dict[str, Any]) -> None:
        if self.is_main:
            atomic_write_text(self.run_dir / "config.yaml", yaml.safe_dump(config, sort_keys=False))

    def log(self, record: dict[str, Any]) -> None:
        if self._metrics:
            self._metrics.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.is_main:
            atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        if self._metrics:
            self._metrics.close()
            self._metrics = None


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

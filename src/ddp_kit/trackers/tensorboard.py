"""TensorBoard: event files in run_dir/tb (torch's SummaryWriter; `pip install 'ddp_kit[tensorboard]'`).

The tracker run is the folder. A resumed attempt opens it with `purge_step` one past the step it
resumed from: TensorBoard then hides what earlier attempts wrote for the steps this one computes
again, and shows this attempt's values there. A new tracker run (resume='never', or a fresh start
by hand) first moves an old run_dir/tb to run_dir/archive/<time>/tb."""
from __future__ import annotations

import json
import time

from .base import Opening, Tracker

FOLDER = "tb"


class TensorBoard(Tracker):
    package = "tensorboard"  # torch.utils.tensorboard needs it
    extra = "tensorboard"
    rewinds = True
    needs_run_dir = True

    def open(self, opening: Opening) -> str:
        log_dir = opening.run_dir / FOLDER
        self.location = str(log_dir)
        if opening.run_id is None and log_dir.exists() and any(log_dir.iterdir()):
            dest = opening.archive / time.strftime("%Y%m%dT%H%M%S")
            dest = dest if not (dest / FOLDER).exists() else dest.with_name(f"{dest.name}.{time.monotonic_ns()}")
            dest.mkdir(parents=True, exist_ok=True)
            log_dir.rename(dest / FOLDER)
        from torch.utils.tensorboard import SummaryWriter

        purge = None if opening.run_id is None else opening.rewind_to + 1
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)
        if opening.run_id is None:
            self.writer.add_text("config", _block(opening.config), 0)
            self.writer.add_text("versions", _block(opening.facts), 0)
        self.writer.flush()
        return FOLDER

    def log(self, step: int, scalars: dict[str, float], wall_time: float) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step, walltime=wall_time)
        self.writer.flush()  # a killed attempt keeps what it logged (the writer's own flush is every 2 minutes)

    def close(self, exit_code: int) -> None:
        self.writer.close()


def _block(values: dict) -> str:
    return "```\n" + json.dumps(values, indent=1, sort_keys=True, default=str) + "\n```"


TRACKER = TensorBoard

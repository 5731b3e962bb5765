"""Weights & Biases: one W&B run per ddp_kit run (`pip install 'ddp_kit[wandb]'`).

Settings are W&B's own environment variables: WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE (offline:
files only, `wandb sync` later), WANDB_API_KEY, WANDB_NAME (else the run folder's name), WANDB_DIR
(else the run folder: run_dir/wandb/), WANDB_CONSOLE (else off: rank 0's console stays ddp_kit's),
WANDB_QUIET / WANDB_SILENT (else quiet).

The run's id is chosen before wandb.init and kept in trackers.json first (a kill during W&B's start
then leaves no second run); every attempt passes it with resume="allow", so W&B continues the run. W&B's history
only moves forward and keeps what it was sent, so the steps an earlier attempt sent are skipped
(hub.py), and so is a record below a step already sent (an async checkpoint's timing that lands
late). W&B's rewind (resume_from) needs its cloud and is not used: in offline mode, and on a server
without it, it could not be relied upon. Preempted attempts are marked preempting before they finish."""
from __future__ import annotations

import os
import secrets

from .base import Opening, Tracker


class WandB(Tracker):
    package = "wandb"
    extra = "wandb"
    _chosen: str | None = None

    def new_run_id(self) -> str:
        self._chosen = secrets.token_hex(4)  # W&B's own ids are 8 characters of [a-z0-9] too
        return self._chosen

    def open(self, opening: Opening) -> str:
        self.location = f"W&B {os.environ.get('WANDB_MODE') or 'online'}"
        import wandb

        settings = {} if "WANDB_CONSOLE" in os.environ else {"console": "off"}
        if "WANDB_QUIET" not in os.environ and "WANDB_SILENT" not in os.environ:
            settings["quiet"] = True  # W&B's lines say where the run is; its history summary at the end is left out
        options = {}
        if "WANDB_NAME" not in os.environ:
            options["name"] = opening.name
        if "WANDB_DIR" not in os.environ and opening.run_dir is not None:
            options["dir"] = str(opening.run_dir)
        config = {**opening.config, "ddp_kit": opening.facts}
        if opening.run_id is None:
            options["config"] = config
        self.run = wandb.init(id=opening.run_id or self._chosen, resume="allow", reinit="create_new",
                              settings=wandb.Settings(**settings), **options)
        if opening.run_id is not None:  # W&B's config may change: this attempt's (a resume may change epochs)
            self.run.config.update(config, allow_val_change=True)
        self._next = self.run.step  # on a resumed online run: the step after the last one W&B holds
        return self.run.id

    def log(self, step: int, scalars: dict[str, float], wall_time: float) -> None:
        if step < self._next:
            return  # W&B drops it (with a warning): its steps only move forward
        self.run.log(scalars, step=step)
        self._next = step

    def close(self, exit_code: int) -> None:
        if exit_code == 75:
            self.run.mark_preempting()
        self.run.finish(exit_code=exit_code)


TRACKER = WandB

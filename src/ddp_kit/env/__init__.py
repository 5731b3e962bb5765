"""Launcher detection: who started this process, and what is its place in the job.

`detect()` is a pure function over a mapping (default `os.environ`): it asks each launcher of
`LAUNCHERS` in turn, takes the first that recognises the process, checks the numbers, and adds the
facts of the scheduler allocation around it. It never writes the environment and does not import
torch, so the doctor and the launch helpers can use it cheaply.

One file per launcher, each with `NAME` and a pure `detect(environ) -> DistEnv | None` (None: not
this launcher), and optionally `check_gpus(env, visible, environ)` for its own GPU layout rules.
A new launcher is a new file plus one line in `LAUNCHERS`; nothing outside this package compares
`DistEnv.launcher` to a name: the rest asks DistEnv's neutral facts.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from . import env_vars, single, slurm, torchrun
from .base import DistEnv, check_place
from .polling import STORE_OPS_PER_S, poll_period
from .slurm import expand_nodelist, requeue_target, slurm_port

# Tried in this order; the first that recognises the process wins. torchrun before SLURM: torchrun
# can run inside a SLURM job (one srun task per node, or the batch script), and then its variables
# describe the workers while SLURM's describe the one task that started torchrun. Hand-set env://
# variables before SLURM for the same reason (a script may start its ranks inside an allocation).
# `single` last: it always answers.
LAUNCHERS = (torchrun, env_vars, slurm, single)

# The schedulers whose allocation may surround any launcher: each adds its facts (`around`).
SCHEDULERS = (slurm,)

TORCHRUN, ENV, SLURM, SINGLE = torchrun.NAME, env_vars.NAME, slurm.NAME, single.NAME
_BY_NAME = {launcher.NAME: launcher for launcher in LAUNCHERS}

__all__ = ["DistEnv", "LAUNCHERS", "STORE_OPS_PER_S", "check_gpus", "detect", "expand_nodelist", "poll_period",
           "requeue_target", "slurm_port", "TORCHRUN", "ENV", "SLURM", "SINGLE"]


def detect(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Return this process's DistEnv from `environ` (default os.environ)."""
    environ = os.environ if environ is None else environ
    env = next(found for found in (launcher.detect(environ) for launcher in LAUNCHERS) if found is not None)
    check_place(env)
    for scheduler in SCHEDULERS:
        env = scheduler.around(env, environ)
    return env


def check_gpus(env: DistEnv, visible: int, environ: Mapping[str, str] | None = None) -> list[str]:
    """The launcher's own rules for its tasks and the `visible` GPUs: raises UserError for a layout
    that would mis-assign GPUs; returns warnings to print (none for a launcher without rules)."""
    rules = getattr(_BY_NAME.get(env.launcher), "check_gpus", None)
    return rules(env, visible, os.environ if environ is None else environ) if rules else []

"""Kept import path: `ddp_kit.tasks` moved to `ddp_kit.train.workload`."""
from .train.workload import *  # noqa: F401,F403
from .train.workload import LOSSES  # noqa: F401  (the name the README documents)

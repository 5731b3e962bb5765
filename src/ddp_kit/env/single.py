"""No launcher: a plain `python` process, world size 1. Tried last, it refuses half-set variables
that say a launcher was meant."""
from __future__ import annotations

from collections.abc import Mapping

from ..errors import UserError
from .base import NO_LAUNCHER, DistEnv

NAME = NO_LAUNCHER


def detect(environ: Mapping[str, str]) -> DistEnv:
    """World size 1; never None (the last resort)."""
    if "WORLD_SIZE" in environ and environ["WORLD_SIZE"] not in ("", "1"):
        raise UserError(f"WORLD_SIZE={environ['WORLD_SIZE']} is set but RANK is not",
                        "launch with torchrun, or unset WORLD_SIZE for a single-process run")
    return DistEnv()

"""The grace period an engine gives between SIGTERM and SIGKILL, as the launch templates state it:
DDP_KIT_GRACE_PERIOD_S (the Kubernetes templates set it to the pod's terminationGracePeriodSeconds,
which the process cannot read otherwise). An `around` step under every launcher: the preemption
code compares the time a checkpoint takes with it."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from ..errors import UserError
from .base import DistEnv

VAR = "DDP_KIT_GRACE_PERIOD_S"


def around(env: DistEnv, environ: Mapping[str, str]) -> DistEnv:
    """`env` with `grace_period_s` from DDP_KIT_GRACE_PERIOD_S (unchanged when unset or empty)."""
    raw = environ.get(VAR, "").strip()
    if not raw:
        return env
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise UserError(f"{VAR}={environ[VAR]!r} is not a number of seconds",
                        f"set {VAR} to the pod's terminationGracePeriodSeconds, e.g. 30, or unset it")
    return replace(env, grace_period_s=seconds)

"""Kept import path: `ddp_kit.sync` moved to `ddp_kit.reliability.sync_checks`."""
from .reliability.sync_checks import *  # noqa: F401,F403
from .reliability.sync_checks import param_sha256  # noqa: F401  (the name the README documents)

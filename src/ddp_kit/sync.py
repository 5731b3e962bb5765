"""Kept import path: `ddp_kit.sync` moved to `ddp_kit.reliability.sync_checks`."""
from .reliability.sync_checks import *  # noqa: F403 (the old module's public names)
from .reliability.sync_checks import param_sha256

__all__ = ["param_sha256"]  # the name the README documents

"""The reference job, `python -m ddp_kit.train`: a client of the public API (ddp_kit.init, Run)."""
from .command import main

__all__ = ["main"]

"""Kept import path: `ddp_kit.tasks.LOSSES`, the name the README documents, is `ddp_kit.losses.LOSSES`.
What else lived here is the reference job's (ddp_kit.train.workload); the library never imports it."""
from .losses import LOSSES, cross_entropy

__all__ = ["LOSSES", "cross_entropy"]

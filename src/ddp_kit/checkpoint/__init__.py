"""Checkpoints: the commit protocol (checkpointer), the names of every file under a step folder
(layout), durable writes, host staging, safe loading, and the `python -m ddp_kit.checkpoint` CLI."""
from .checkpointer import Checkpointer, Found, rng_state, set_rng_state

__all__ = ["Checkpointer", "Found", "rng_state", "set_rng_state"]

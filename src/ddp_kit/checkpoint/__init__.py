"""Checkpoints: the backend seam (backend: the operations the step boundary uses, BACKENDS by URL
scheme, open_backend), the folder backend and its commit protocol (checkpointer), the object store
backend for URLs through fsspec (object_store; store: reading a store; store_fs: opening a URL), the
names of every file under a step folder (layout), reading a local checkpoints folder (folder), durable
writes, host staging, safe loading, and the `python -m ddp_kit.checkpoint` CLI."""
from .backend import BACKENDS, CheckpointBackend, Found, open_backend
from .checkpointer import Checkpointer, rng_state, set_rng_state

__all__ = ["BACKENDS", "CheckpointBackend", "Checkpointer", "Found", "open_backend", "rng_state", "set_rng_state"]

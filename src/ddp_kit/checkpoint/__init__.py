"""Checkpoints: the backend seam (backend: the operations the step boundary uses, BACKENDS by URL
scheme, open_backend), the folder backend and its commit protocol (checkpointer), the object store
backend for URLs through fsspec (object_store; store: reading a store; store_fs: opening a URL), the
names of every file under a step folder (layout), reading a local checkpoints folder (folder), durable
writes, host staging, safe loading, a model's weights as safetensors (weights: load_weights,
read_weights, save_weights), and the `python -m ddp_kit.checkpoint` CLI."""
from .backend import BACKENDS, CheckpointBackend, Found, open_backend
from .checkpointer import Checkpointer, rng_state, set_rng_state
from .weights import load_weights, read_weights, save_weights

__all__ = ["BACKENDS", "CheckpointBackend", "Checkpointer", "Found", "load_weights", "open_backend", "read_weights",
           "rng_state", "save_weights", "set_rng_state"]

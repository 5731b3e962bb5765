"""Checkpoints: one commit protocol over any storage (a folder, any fsspec URL), the backends the step
boundary saves and resumes through, safe loading, a model's weights as safetensors, and the
`python -m ddp_kit.checkpoint` CLI. docs/architecture.md names the modules."""
from .backend import BACKENDS, STORAGES, CheckpointBackend, Found, open_backend, open_storage
from .checkpointer import Checkpointer, rng_state, set_rng_state
from .weights import load_weights, read_weights, save_weights

__all__ = ["BACKENDS", "STORAGES", "CheckpointBackend", "Checkpointer", "Found", "load_weights", "open_backend",
           "open_storage", "read_weights", "rng_state", "save_weights", "set_rng_state"]

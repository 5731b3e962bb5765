"""Checkpoints: the backend seam (backend: the operations the step boundary uses, STORAGES by URL
scheme, open_storage, open_backend), what a storage can do (storage) and the two there are (a folder:
storage_folder; any fsspec URL: store_fs), the one commit protocol over any of them (steps: commit
order, validity, resume's choice, prune, archive), the backend writing in place (checkpointer) and
the one staging and uploading (object_store), the names of every file under a step (layout),
durable writes, host staging, safe loading, a model's weights as safetensors (weights: load_weights,
read_weights, save_weights), and the `python -m ddp_kit.checkpoint` CLI."""
from .backend import BACKENDS, STORAGES, CheckpointBackend, Found, open_backend, open_storage
from .checkpointer import Checkpointer, rng_state, set_rng_state
from .weights import load_weights, read_weights, save_weights

__all__ = ["BACKENDS", "STORAGES", "CheckpointBackend", "Checkpointer", "Found", "load_weights", "open_backend",
           "open_storage", "read_weights", "rng_state", "save_weights", "set_rng_state"]

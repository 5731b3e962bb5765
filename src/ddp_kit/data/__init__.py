"""Sharded loaders: the global batch split over ranks, epoch reshuffle, resumable position, exact eval.

train_loader.py  TrainLoader and its sampler: world-size independent order, resumable position.
eval.py          eval_loader: every sample exactly once, optionally the same batch count per rank.
workers.py       loader workers: how many, per-batch seeds, stop signals left to the rank.
"""
from .eval import EvalSampler, EvenBatches, eval_loader
from .train_loader import ShardedSampler, TrainLoader, check_sized, per_rank_batch
from .workers import (
                      STOP_SIGNALS,
                      SeededBatch,
                      WorkerLoader,
                      fit_workers,
                      leave_stop_signals_to_parent,
                      mix_seed,
                      worker_init,
)

__all__ = ["EvalSampler", "EvenBatches", "STOP_SIGNALS", "SeededBatch", "ShardedSampler", "TrainLoader", "WorkerLoader",
           "check_sized", "eval_loader", "fit_workers", "leave_stop_signals_to_parent", "mix_seed", "per_rank_batch",
           "worker_init"]

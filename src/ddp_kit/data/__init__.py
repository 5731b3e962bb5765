"""Sharded loaders: the global batch split over ranks, epoch reshuffle, resumable position, exact
eval (every sample exactly once), and the loader workers."""
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

"""Loader workers: how many to start, the seed each micro-batch loads under, and stop signals left to the rank.

A worker loads each micro-batch under a seed from (seed, epoch, rank, position), carried with the
batch's indices (`SeededBatch`), so what a batch draws depends neither on which worker loads it nor
on what ran before a resume. Workers are forked with the stop signals blocked and then take only
their parent rank's (`leave_stop_signals_to_parent`): torchrun and SLURM signal a whole process
group, and a worker killed by SIGTERM would fail the rank before it can save.
"""
from __future__ import annotations

import functools
import hashlib
import os
import random
import signal
import sys
import threading
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset

from ..dist.resources import AutoWorkers


def fit_workers(dataset: Dataset, num_workers: int, batches: int) -> int:
    """The loader workers to start: a count the user set, as set; one ddp_kit chose (AutoWorkers) is
    lowered to 0 for an in-memory TensorDataset (indexing a tensor costs less than handing a batch
    over from another process) and to the batches one epoch has (a worker more never gets one)."""
    if not isinstance(num_workers, AutoWorkers):
        return num_workers
    if isinstance(dataset, torch.utils.data.TensorDataset):
        return 0
    return max(0, min(int(num_workers), batches))


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers; neighbours (epoch 3 and 4, rank 0 and 1) get unrelated streams."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


def _arrive(indices: list[int], seed: int) -> list[int]:
    """Unpickles a `SeededBatch` in a loader worker: seeds the worker's RNGs (as DataLoader does once per
    worker) right before it loads and collates these indices, and hands them on as a plain list."""
    if torch.utils.data.get_worker_info() is not None:
        torch.default_generator.manual_seed(seed)  # CPU only: torch.manual_seed also seeds CUDA (no use in a worker), at 100 us a call
        random.seed(seed)
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
    return indices


class SeededBatch(list):
    """A micro-batch's indices plus the seed the worker that receives it loads it under.

    Seeding on arrival makes a batch's random augmentations a function of (seed, epoch, rank,
    position) alone: not of which worker loads it, nor of what that worker loaded before (with
    persistent workers, earlier epochs; after a resume, nothing). The seed travels with the
    indices because the index queue is the one channel to a worker per batch."""

    def __init__(self, indices: list[int], seed: int):
        super().__init__(indices)
        self.seed = seed

    def __reduce__(self):
        return _arrive, (list(self), self.seed)



STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)


def leave_stop_signals_to_parent() -> None:
    """In a loader worker: a stop signal from anyone but the parent rank is ignored.

    torchrun and SLURM signal a rank's whole process group, workers included; a worker killed by
    SIGTERM makes the rank fail ("DataLoader worker ... is killed by signal") before it can save.
    The rank decides: its SIGTERM still ends the worker (DataLoader's last resort for a stuck
    one), and workers exit by themselves when the rank closes the loader or dies."""
    parent = os.getppid()
    if not hasattr(signal, "sigwaitinfo"):  # macOS, Windows: no sender pid to tell the parent apart
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        return
    # Blocked in every thread, the signals stay pending until the waiter below takes them.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def wait() -> None:
        while True:
            if signal.sigwaitinfo(STOP_SIGNALS).si_pid == parent:
                os._exit(0)  # as DataLoader's own handler does for its parent's SIGTERM

    threading.Thread(target=wait, name="ddp_kit-worker-signals", daemon=True).start()


class WorkerLoader(DataLoader):
    """A DataLoader whose workers are forked with the stop signals blocked. A worker that inherits
    torch's intra-op pool (the rank computed on more than one thread before the fork) starts a
    thread before worker_init_fn runs; forked unblocked, that thread would take a stop signal
    meant for someone else and torch's handler would end the worker. Blocked in the forking thread,
    every thread of the worker starts blocked; a signal that reaches the rank meanwhile is held
    pending for the few milliseconds of the fork, not lost."""

    def _get_iterator(self):
        if self.num_workers == 0 or not hasattr(signal, "pthread_sigmask"):
            return super()._get_iterator()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return super()._get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _init_worker(user_init: Callable[[int], None] | None, worker_id: int) -> None:
    leave_stop_signals_to_parent()
    if user_init is not None:
        user_init(worker_id)


def worker_init(user_init: Callable[[int], None] | None = None) -> Callable[[int], None]:
    """A DataLoader worker_init_fn: `leave_stop_signals_to_parent`, then the user's own (picklable for spawn)."""
    return functools.partial(_init_worker, user_init)


"""Exact evaluation: each rank's share of the evaluation set, every sample exactly once, no padding.

Reduce sums (not means) across ranks. `EvenBatches` gives every rank the same number of batches,
as a sharded model (FSDP) needs, since each forward call is a collective.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from torch.utils.data import DataLoader, Dataset, Sampler

from ..errors import UserError
from .train_loader import check_sized
from .workers import WorkerLoader, fit_workers, worker_init


class EvalSampler(Sampler[int]):
    """Rank r takes samples r, r+W, r+2W, ...: every sample exactly once, no padding, uneven shards allowed."""

    def __init__(self, length: int, world_size: int, rank: int):
        self.indices = range(rank, length, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class EvenBatches(Sampler[list[int]]):
    """This rank's exact share in as many batches as the largest share needs (at most `batch_size`
    each): every rank makes the same number of forward calls, as a sharded model needs."""

    def __init__(self, length: int, world_size: int, rank: int, batch_size: int):
        self.indices = range(rank, length, world_size)
        most = -(-length // world_size)  # the largest share
        self.count = -(-most // batch_size)
        if length // world_size < self.count:  # the smallest share decides: the same verdict on every rank
            raise UserError(f"the evaluation set ({length} samples, batch {batch_size}) cannot be split into "
                            f"{self.count} non-empty batches on each of {world_size} ranks, as a sharded model needs "
                            f"(every rank makes the same forward calls)",
                            "use a larger evaluation batch_size, or at least as many samples as ranks")

    def __iter__(self) -> Iterator[list[int]]:
        n, k = len(self.indices), self.count
        for i in range(k):
            yield list(self.indices[i * n // k:(i + 1) * n // k])

    def __len__(self) -> int:
        return self.count


def eval_loader(dataset: Dataset, *, batch_size: int, world_size: int, rank: int, num_workers: int = 0,
                pin_memory: bool = False, collate_fn=None, worker_init_fn: Callable[[int], None] | None = None,
                even_batches: bool = False) -> DataLoader:
    """A loader over this rank's exact share of `dataset`. Reduce sums (not means) across ranks.
    `even_batches`: the same number of batches on every rank (EvenBatches)."""
    length = check_sized(dataset)
    sampling = ({"batch_sampler": EvenBatches(length, world_size, rank, batch_size)} if even_batches else
                {"batch_size": batch_size, "sampler": EvalSampler(length, world_size, rank)})
    batches = len(sampling["batch_sampler"]) if even_batches else -(-len(sampling["sampler"]) // batch_size)
    num_workers = fit_workers(dataset, num_workers, batches)
    return WorkerLoader(dataset, **sampling, num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate_fn,
                        worker_init_fn=worker_init(worker_init_fn),
                        persistent_workers=num_workers > 0)  # evaluated every epoch: no new workers each time

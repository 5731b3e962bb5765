"""The training loader: the global batch split over ranks, epoch reshuffle, and a resumable position.

Training order is world-size independent: each epoch is one seeded permutation of the dataset;
optimizer step k consumes the contiguous slice perm[k*B:(k+1)*B] of it (B = global batch), and
DistributedSampler's interleaving hands each rank 1/world_size of that slice. So 1 rank and N
ranks see the same global batches, and a checkpoint's data position (samples consumed in the
epoch) means the same thing on any world size. Without workers the random draws come from the main
process's RNG, which checkpoints save; with workers see workers.py.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, Dataset, DistributedSampler, IterableDataset, Sampler, default_collate

from ..errors import UserError
from .workers import SeededBatch, WorkerLoader, fit_workers, mix_seed, worker_init


def per_rank_batch(global_batch: int, world_size: int, grad_accum: int = 1) -> int:
    """The micro-batch one rank loads per forward pass; refuses a batch that does not split evenly."""
    parts = world_size * grad_accum
    if global_batch % parts:
        lo = max(parts, global_batch // parts * parts)
        raise UserError(
            f"batch_size {global_batch} (global) does not divide into world_size {world_size} x grad_accum {grad_accum}",
            f"use a multiple of {parts}, e.g. batch_size {lo}")
    return global_batch // parts


def check_sized(dataset: Dataset) -> int:
    """The dataset's length; refuses what cannot be sharded by index (a stream, or no __len__)."""
    name = type(dataset).__name__
    shard_it_yourself = ("shard it yourself by rank and worker (run.rank, run.world_size, "
                         "torch.utils.data.get_worker_info()) and use its DataLoader without run.prepare, "
                         "or make it a map-style Dataset with __getitem__ and __len__")
    if isinstance(dataset, IterableDataset):
        sized = "a sized" if hasattr(dataset, "__len__") else "an unsized"
        raise UserError(f"{name} is {sized} IterableDataset: ddp_kit shards a dataset by index and cannot split "
                        f"a stream over ranks", shard_it_yourself)
    try:
        return len(dataset)
    except TypeError:
        raise UserError(f"{name} has no __len__: ddp_kit needs the dataset's size to shard it over ranks",
                        "give the dataset a __len__") from None


class _SeededBatches(Sampler[list[int]]):
    """The sharded sampler's micro-batches; for workers, each tagged with a seed from (seed, epoch, rank, position).

    Without workers nothing is tagged: the batch loads in the main process from its RNG streams,
    which a checkpoint saves, so a resume repeats those draws as they were."""

    def __init__(self, sampler: ShardedSampler, micro_batch: int, tag: bool):
        self.sampler = sampler
        self.micro_batch = micro_batch
        self.tag = tag

    def __iter__(self) -> Iterator[list[int]]:
        s = self.sampler
        stride = self.micro_batch * s.num_replicas  # global samples per micro-step
        for i, indices in enumerate(BatchSampler(s, self.micro_batch, drop_last=True)):
            yield SeededBatch(indices, mix_seed(s.seed, s.epoch, s.rank, s.skip_samples + i * stride)) if self.tag else indices

    def __len__(self) -> int:
        return len(self.sampler) // self.micro_batch


class ShardedSampler(DistributedSampler):
    """DistributedSampler whose epoch can start part-way, `skip_samples` global samples in."""

    def __init__(self, dataset: Dataset, world_size: int, rank: int, shuffle: bool, seed: int):
        # drop_last=True: a trailing remainder smaller than world_size is dropped, never padded with repeats.
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.skip_samples = 0

    def set_position(self, epoch: int, skip_samples: int) -> None:
        if skip_samples % self.num_replicas:
            raise ValueError(f"position {skip_samples} is not a whole number of per-rank samples")
        self.set_epoch(epoch)
        self.skip_samples = skip_samples

    def __iter__(self) -> Iterator[int]:
        it = super().__iter__()
        for _ in range(self.skip_samples // self.num_replicas):
            next(it, None)
        return it

    def __len__(self) -> int:
        return self.num_samples - self.skip_samples // self.num_replicas



def _indexed_in_place(dataset: Dataset, num_workers: int, collate_fn: Any, pin_memory: bool) -> bool:
    """Whether the micro-batches can be taken by indexing the dataset's own tensors: a plain TensorDataset
    (a subclass may load differently), on the CPU, loaded in this process with the default collate
    and not pinned. The same batches as collating sample by sample (a stack of the same rows), for a
    fraction of the cost: 64 samples of 3x32x32 take ~0.45 ms through __getitem__ and collate, ~1/20 of
    a small model's CPU step, and ~0.05 ms as one index_select per tensor."""
    return (type(dataset) is torch.utils.data.TensorDataset and not num_workers and not pin_memory
            and collate_fn in (None, default_collate) and all(t.device.type == "cpu" for t in dataset.tensors))


class TrainLoader:
    """Iterates one epoch of micro-batches per `iter()`, and moves to the next epoch by itself.

    `epoch` and `position` (global samples consumed in this epoch) are the loader's whole state,
    so a checkpoint can hold them and any world size can continue from them. With num_workers > 0
    each micro-batch is loaded under a seed from (seed, epoch, rank, position), so the random
    augmentations of a resumed run repeat those of an uninterrupted one (with 0, restoring the
    main RNG does that). `worker_init_fn` runs in each worker after ddp_kit's own (which leaves
    stop signals to the rank).

    `resident` (a device): a TensorDataset is copied there once, and each micro-batch is taken by
    indexing it there (the same samples, in the same order, as the DataLoader would collate), with no
    per-step collate, pin or host-to-device copy; the epoch's indices cross once per epoch. A plain
    TensorDataset of CPU tensors that is not pinned for a GPU (a CPU run), with no workers and the
    default collate, is indexed where it is the same way, unasked.
    """

    def __init__(self, dataset: Dataset, *, global_batch: int, world_size: int, rank: int,
                 grad_accum: int = 1, shuffle: bool = True, seed: int = 0, num_workers: int = 0,
                 pin_memory: bool = False, collate_fn=None, worker_init_fn: Callable[[int], None] | None = None,
                 resident: torch.device | None = None):
        size = check_sized(dataset)
        num_workers = fit_workers(dataset, num_workers, size // global_batch * grad_accum)
        # Workers' batches are pinned by the DataLoader's own thread, off the step. Without workers the pin
        # would run on the step, a second host copy before the device copy: the batch is copied as it is.
        pin_in_loader = pin_memory and num_workers > 0
        self._tensors: list[torch.Tensor] | None = None
        if resident is not None:
            if not isinstance(dataset, torch.utils.data.TensorDataset) or num_workers or collate_fn not in (None, default_collate):
                raise UserError(f"device_data keeps a TensorDataset on the device; this loader has a "
                                f"{type(dataset).__name__}{' with workers' if num_workers else ''}"
                                f"{' and its own collate_fn' if collate_fn not in (None, default_collate) else ''}",
                                "use device_data only for an in-memory TensorDataset with num_workers=0, or drop it")
            self._tensors = [t.to(resident) for t in dataset.tensors]
        elif _indexed_in_place(dataset, num_workers, collate_fn, pin_memory):
            self._tensors = list(dataset.tensors)
        self._epoch_index: tuple[torch.Tensor, ...] = ()
        self.micro_batch = per_rank_batch(global_batch, world_size, grad_accum)
        self.global_batch = global_batch
        self.world_size = world_size
        self.grad_accum = grad_accum
        self.sampler = ShardedSampler(dataset, world_size, rank, shuffle, seed)
        self.epoch = 0
        self.position = 0
        # Called around each batch fetch when set (by ddp_kit.init's step boundary): progress and timing.
        self.on_fetch: Callable[[], None] | None = None
        self.on_batch: Callable[[], None] | None = None
        self.on_end: Callable[[], None] | None = None
        self._uncounted = False  # the batch last handed out is not in `position` yet (see commit)
        self._moves = 0  # load_state_dict calls: one during an epoch (a live recovery at a fetch) restarts it
        # Persistent workers keep their RNG across epochs, which is harmless here: every batch
        # reseeds it. The generator keeps DataLoader from drawing the workers' base seed from
        # the global RNG at each iter(), which would shift the main stream, and a resume's extra iter() more so.
        batches = _SeededBatches(self.sampler, self.micro_batch, tag=num_workers > 0)
        self._loader = WorkerLoader(dataset, batch_sampler=batches,
                                 num_workers=num_workers, pin_memory=pin_in_loader, collate_fn=collate_fn,
                                 persistent_workers=num_workers > 0, worker_init_fn=worker_init(worker_init_fn),
                                 generator=torch.Generator().manual_seed(mix_seed(seed, rank)))
        self.steps_per_epoch = size // global_batch
        if self.steps_per_epoch == 0:
            raise UserError(f"batch_size {global_batch} is larger than the training set ({len(dataset)} samples)",
                            f"use batch_size {max(world_size * grad_accum, len(dataset) // 4 // (world_size * grad_accum) * world_size * grad_accum)} or less")

    @property
    def dataset(self) -> Dataset:
        return self._loader.dataset

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank (whole optimizer steps only), as a DataLoader's len()."""
        return self.steps_per_epoch * self.grad_accum

    def left(self) -> int:
        """Micro-batches left in the current epoch (fewer than len() after a mid-epoch resume)."""
        return (self.steps_per_epoch * self.global_batch - self.position) // (self.micro_batch * self.world_size)

    def __iter__(self) -> Iterator:
        if self.on_fetch is not None:
            self.on_fetch()  # a step boundary still due runs first (it counts what the step used)
        # A batch handed out and never stepped on is not consumed: `next(iter(loader))` to peek at
        # the batch size (as the DDP tutorial's Trainer does) leaves the position where it was.
        self._uncounted = False
        moved = True
        while moved:  # once, unless the fetch hook moved the position (a replica group's live recovery, parallel/ft.py)
            moved, moves = False, self._moves
            self.sampler.set_position(self.epoch, self.position)
            left = self.left()
            if left == 0:
                self.epoch, self.position = self.epoch + 1, 0
                return
            batches = iter(self._loader) if self._tensors is None else self._resident_batches()
            for i in range(left):
                if i:
                    self.commit()
                    if self.on_fetch is not None:
                        self.on_fetch()
                    if self._moves != moves:
                        moved = True  # continue from the new position, in its epoch
                        break
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                if self.on_batch is not None:
                    self.on_batch()
                self._uncounted = True
                yield batch
        self.commit()
        if self.on_end is not None:
            self.on_end()

    def _resident_batches(self) -> Iterator[list[torch.Tensor]]:
        """The rest of this epoch's micro-batches, indexed on the device; a list, as default_collate
        makes of a TensorDataset's tuples."""
        order = list(self._loader.batch_sampler)
        if not order:
            return iter(())
        host = torch.tensor(order, dtype=torch.long)
        device = self._tensors[0].device
        if device.type == "cuda":
            host = host.pin_memory()
        # The pinned source stays referenced until the next epoch: the copy may still be in flight.
        self._epoch_index = (host, host.to(device, non_blocking=True))
        return ([t.index_select(0, row) for t in self._tensors] for row in self._epoch_index[1])

    def commit(self) -> None:
        """Count the batch last handed out as consumed. Called when the next one is asked for, when
        the epoch ends, and by the step boundary, which checkpoints the position. At the epoch's
        last batch the loader rolls over to the next epoch: a caller who stops right after it (max_steps,
        a checkpoint) sees the next epoch's start. Only whole global batches are used: a tail that
        cannot fill one is skipped."""
        if not self._uncounted:
            return
        self._uncounted = False
        self.position += self.micro_batch * self.world_size
        if self.position >= self.steps_per_epoch * self.global_batch:
            self.epoch, self.position = self.epoch + 1, 0

    def sample_batch(self) -> Any:
        """The first micro-batch of the dataset, collated as the loader does (a model's input example)."""
        return self._loader.collate_fn([self.dataset[i] for i in range(self.micro_batch)])

    def state_dict(self) -> dict:
        """The position after every batch handed out so far (the last one too: whoever asks for the
        state took it). The step boundary commits before it saves, so this is that same position."""
        epoch, position = self.epoch, self.position
        if self._uncounted:
            position += self.micro_batch * self.world_size
            if position >= self.steps_per_epoch * self.global_batch:
                epoch, position = epoch + 1, 0
        return {"epoch": epoch, "position": position, "global_batch": self.global_batch,
                "seed": self.sampler.seed, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> str | None:
        """Restore the position; returns a one-line note when exact continuation is impossible."""
        self.epoch = int(state["epoch"])
        self._uncounted = False
        self._moves += 1
        position = int(state["position"])
        note = None
        if int(state.get("seed", self.sampler.seed)) != self.sampler.seed:
            note = f"checkpoint data seed {state['seed']} differs from this run's {self.sampler.seed}: the data order changes from here"
        if int(state.get("global_batch", self.global_batch)) != self.global_batch or position % (self.micro_batch * self.world_size):
            note = (f"checkpoint position {position} (global batch {state.get('global_batch')}) does not fit global batch "
                    f"{self.global_batch} on {self.world_size} ranks: restarting epoch {self.epoch} from its beginning")
            position = 0
        self.position = position
        return note


"""Sharded loaders: the global batch split over ranks, epoch reshuffle, resumable position, exact eval.

Training order is world-size independent: each epoch is one seeded permutation of the dataset;
optimizer step k consumes the contiguous slice perm[k*B:(k+1)*B] of it (B = global batch), and
DistributedSampler's interleaving hands each rank 1/world_size of that slice. So 1 rank and N
ranks see the same global batches, and a checkpoint's data position (samples consumed in the
epoch) means the same thing on any world size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from .errors import UserError


def per_rank_batch(global_batch: int, world_size: int, grad_accum: int = 1) -> int:
    """The micro-batch one rank loads per forward pass; refuses a batch that does not split evenly."""
    parts = world_size * grad_accum
    if global_batch % parts:
        lo = max(parts, global_batch // parts * parts)
        raise UserError(
            f"batch_size {global_batch} (global) does not divide into world_size {world_size} x grad_accum {grad_accum}",
            f"use a multiple of {parts}, e.g. --batch_size {lo}")
    return global_batch // parts


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


class TrainLoader:
    """Iterates one epoch of micro-batches per `iter()`, and moves to the next epoch by itself.

    `epoch` and `position` (global samples consumed in this epoch) are the loader's whole state,
    so a checkpoint can hold them and any world size can continue from them.
    """

    def __init__(self, dataset: Dataset, *, global_batch: int, world_size: int, rank: int,
                 grad_accum: int = 1, shuffle: bool = True, seed: int = 0, num_workers: int = 0,
                 pin_memory: bool = False, collate_fn=None):
        self.micro_batch = per_rank_batch(global_batch, world_size, grad_accum)
        self.global_batch = global_batch
        self.world_size = world_size
        self.grad_accum = grad_accum
        self.sampler = ShardedSampler(dataset, world_size, rank, shuffle, seed)
        self.epoch = 0
        self.position = 0
        self._loader = DataLoader(dataset, batch_size=self.micro_batch, sampler=self.sampler, drop_last=True,
                                  num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate_fn,
                                  persistent_workers=num_workers > 0)
        self.steps_per_epoch = len(dataset) // global_batch
        if self.steps_per_epoch == 0:
            raise UserError(f"batch_size {global_batch} is larger than the training set ({len(dataset)} samples)",
                            f"use --batch_size {max(world_size * grad_accum, len(dataset) // 4 // (world_size * grad_accum) * world_size * grad_accum)} or less")

    @property
    def dataset(self) -> Dataset:
        return self._loader.dataset

    def __len__(self) -> int:
        """Micro-batches left in the current epoch (whole optimizer steps only)."""
        return (self.steps_per_epoch * self.global_batch - self.position) // (self.micro_batch * self.world_size)

    def __iter__(self) -> Iterator:
        self.sampler.set_position(self.epoch, self.position)
        left = len(self)
        if left == 0:
            self.epoch, self.position = self.epoch + 1, 0
            return
        for i, batch in enumerate(self._loader):
            self.position += self.micro_batch * self.world_size
            if i == left - 1:
                # Roll over before handing out the epoch's last batch, so that a caller who stops
                # right after it (max_steps, a checkpoint) already sees the next epoch's start.
                # Only whole global batches are used: a tail that cannot fill one is skipped.
                self.epoch, self.position = self.epoch + 1, 0
                yield batch
                return
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "global_batch": self.global_batch,
                "seed": self.sampler.seed, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> str | None:
        """Restore the position; returns a one-line note when exact continuation is impossible."""
        self.epoch = int(state["epoch"])
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


class EvalSampler(Sampler[int]):
    """Rank r takes samples r, r+W, r+2W, ...: every sample exactly once, no padding, uneven shards allowed."""

    def __init__(self, length: int, world_size: int, rank: int):
        self.indices = range(rank, length, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def eval_loader(dataset: Dataset, *, batch_size: int, world_size: int, rank: int, num_workers: int = 0,
                pin_memory: bool = False, collate_fn=None) -> DataLoader:
    """A loader over this rank's exact share of `dataset`. Reduce sums (not means) across ranks."""
    return DataLoader(dataset, batch_size=batch_size, sampler=EvalSampler(len(dataset), world_size, rank),
                      num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate_fn)


# ---- built-in datasets --------------------------------------------------------------------------------

@dataclass(frozen=True)
class DataSpec:
    train: Dataset
    test: Dataset
    input_shape: tuple[int, ...]
    num_classes: int


def _digits(seed: int) -> DataSpec:
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    x = (x - 0.3) / 0.4
    y = torch.tensor(y, dtype=torch.long)
    # A fixed split (seed 0 regardless of the run's seed) so every run evaluates on the same 360 images.
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    test_idx, train_idx = perm[:360], perm[360:]
    ds = torch.utils.data.TensorDataset
    return DataSpec(ds(x[train_idx], y[train_idx]), ds(x[test_idx], y[test_idx]), (1, 8, 8), 10)


def _synthetic(seed: int, size: int, shape=(3, 32, 32), classes: int = 10) -> DataSpec:
    """Learnable random data: labels come from a fixed random linear teacher."""
    g = torch.Generator().manual_seed(4321)
    n_test = max(size // 4, 1)
    x = torch.randn(size + n_test, *shape, generator=g)
    teacher = torch.randn(int(torch.tensor(shape).prod()), classes, generator=g)
    y = (x.flatten(1) @ teacher).argmax(1)
    ds = torch.utils.data.TensorDataset
    return DataSpec(ds(x[:size], y[:size]), ds(x[size:], y[size:]), tuple(shape), classes)


_TV_FILES = {
    "mnist": ("MNIST/raw", "train-images-idx3-ubyte (and the other three MNIST files)"),
    "cifar10": ("cifar-10-batches-py", "data_batch_1..5 and test_batch (the python version of CIFAR-10)"),
}


def _torchvision(name: str, root: str, download: bool) -> DataSpec:
    from pathlib import Path

    import torchvision
    from torchvision import transforms as T

    sub, what = _TV_FILES[name]
    expected = Path(root) / sub
    if not Path(root).exists() and not download:
        raise UserError(f"data_root {root!r} does not exist; {name} expects {what} in {str(expected)!r}",
                        "copy the files there, point --data_root at them, or add --download true")
    if name == "mnist":
        tf = T.Compose([T.ToTensor(), T.Normalize((0.1307,), (0.3081,))])
        cls, shape = torchvision.datasets.MNIST, (1, 28, 28)
        make = lambda train: cls(root, train=train, download=download, transform=tf)  # noqa: E731
    else:
        norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
        train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
        test_tf = T.Compose([T.ToTensor(), norm])
        cls, shape = torchvision.datasets.CIFAR10, (3, 32, 32)
        make = lambda train: cls(root, train=train, download=download, transform=train_tf if train else test_tf)  # noqa: E731
    try:
        return DataSpec(make(True), make(False), shape, 10)
    except RuntimeError as exc:
        raise UserError(f"{name} files not found under {str(expected)!r} ({exc})",
                        f"put {what} there, or add --download true to fetch them") from None


DATASETS = ("digits", "mnist", "cifar10", "synthetic")


def build_dataset(name: str, data_root: str = "./data", download: bool = False, seed: int = 0,
                  synthetic_size: int = 4096) -> DataSpec:
    if name == "digits":
        return _digits(seed)
    if name == "synthetic":
        return _synthetic(seed, synthetic_size)
    if name in _TV_FILES:
        return _torchvision(name, data_root, download)
    raise UserError(f"unknown dataset {name!r}", f"choose one of {', '.join(DATASETS)}")

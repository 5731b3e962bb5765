"""Built-in datasets: scikit-learn's bundled digits (the default: real data, no download), a
learnable synthetic set, and MNIST / CIFAR-10 read from a local folder in torchvision's layout."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from .errors import UserError


@dataclass(frozen=True)
class DataSpec:
    train: Dataset
    test: Dataset
    input_shape: tuple[int, ...]
    num_classes: int


def _load_digits():
    """scikit-learn's bundled 8x8 digits as (x float64 [1797, 64], y int64), read from the file it
    ships: importing sklearn costs 1-2 s of every process's startup (scipy comes with it), more than
    the whole default job trains. load_digits is the fallback should a release move the file."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise UserError("the default dataset (digits) ships with scikit-learn, which is not installed",
                        "pip install scikit-learn, or choose --dataset synthetic")
    for root in spec.submodule_search_locations or ():
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    return load_digits(return_X_y=True)


def _digits(seed: int) -> DataSpec:
    x, y = _load_digits()  # bundled with scikit-learn: no download
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
                        "copy the files there, point --data_root at them, or add --download true",
                        local=True)  # data may be node-local: the rank that misses it says so
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
                        f"put {what} there, or add --download true to fetch them", local=True) from None


# One registry: name -> builder(data_root, download, seed, synthetic_size, **dataset_args).
REGISTRY = {
    "digits": lambda root, download, seed, size: _digits(seed),
    "mnist": lambda root, download, seed, size: _torchvision("mnist", root, download),
    "cifar10": lambda root, download, seed, size: _torchvision("cifar10", root, download),
    "synthetic": lambda root, download, seed, size: _synthetic(seed, size),
}
DATASETS = tuple(REGISTRY)


def build_dataset(name: str, data_root: str = "./data", download: bool = False, seed: int = 0,
                  synthetic_size: int = 4096) -> DataSpec:
    if name not in REGISTRY:
        raise UserError(f"unknown dataset {name!r}", f"choose one of {', '.join(DATASETS)}, or pkg.module:function")
    return REGISTRY[name](data_root, download, seed, synthetic_size)

"""CIFAR-10 from data_root, in torchvision's layout (cifar-10-batches-py), with crop and flip augmentation."""
from __future__ import annotations

from ._spec import DataSpec
from ._torchvision import load


def cifar10(data_root: str, download: bool, seed: int, synthetic_size: int) -> DataSpec:
    return load("cifar10", data_root, download)

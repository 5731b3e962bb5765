"""MNIST from data_root, in torchvision's layout (MNIST/raw)."""
from __future__ import annotations

from ._spec import DataSpec
from ._torchvision import load


def mnist(data_root: str, download: bool, seed: int, synthetic_size: int) -> DataSpec:
    return load("mnist", data_root, download)

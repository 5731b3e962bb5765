"""Learnable random 3x32x32 images in 10 classes, synthetic_size of them (labels from a fixed linear teacher)."""
from __future__ import annotations

import torch

from ._spec import DataSpec


def synthetic(data_root: str, download: bool, seed: int, synthetic_size: int) -> DataSpec:
    return _synthetic(synthetic_size)


def _synthetic(size: int, shape=(3, 32, 32), classes: int = 10) -> DataSpec:
    g = torch.Generator().manual_seed(4321)
    n_test = max(size // 4, 1)
    x = torch.randn(size + n_test, *shape, generator=g)
    teacher = torch.randn(int(torch.tensor(shape).prod()), classes, generator=g)
    y = (x.flatten(1) @ teacher).argmax(1)
    ds = torch.utils.data.TensorDataset
    return DataSpec(ds(x[:size], y[:size]), ds(x[size:], y[size:]), tuple(shape), classes)

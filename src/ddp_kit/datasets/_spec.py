"""What a built-in dataset returns: its two splits and what a built-in model needs to fit them."""
from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import Dataset


@dataclass(frozen=True)
class DataSpec:
    train: Dataset
    test: Dataset
    input_shape: tuple[int, ...]
    num_classes: int

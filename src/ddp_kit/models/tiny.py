"""A 16-unit MLP for tests: the fastest model that still learns."""
from __future__ import annotations

import math

from torch import nn


def tiny(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 16), nn.ReLU(), nn.Linear(16, num_classes))

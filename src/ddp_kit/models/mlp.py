"""The MNIST example's MLP: flatten, Linear(in, 256), ReLU, Linear(256, classes); input size from the data."""
from __future__ import annotations

import math

from torch import nn


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 256) -> nn.Module:
    """784-256-10 on MNIST."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))

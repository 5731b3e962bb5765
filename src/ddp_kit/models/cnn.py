"""A small conv net with BatchNorm: conv 3x3, BN, ReLU, global average pool, linear."""
from __future__ import annotations

from torch import nn


def cnn(input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))

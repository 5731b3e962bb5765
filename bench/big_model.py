"""A model made to outgrow a capped GPU, for gpu_check.py's `fsdp_fit` part:

    --model big_model:deep_mlp --model_args '{"width": 4096, "depth": 24}'   (with PYTHONPATH=bench)

`depth` Linear(width, width) + ReLU blocks in a ModuleList (ddp_kit's default FSDP units) between an
input and an output projection. At width 4096, depth 24 it has 415M parameters: 6.6 GB of fp32
weights, gradients and AdamW state, a whole-model footprint DDP must hold on the GPU."""
from __future__ import annotations

import math

from torch import nn


class DeepMLP(nn.Module):
    def __init__(self, features: int, num_classes: int, width: int, depth: int):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth))
        self.out = nn.Linear(width, num_classes)

    def forward(self, x):
        x = self.inp(x.flatten(1))
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def deep_mlp(width: int = 4096, depth: int = 24, input_shape: tuple[int, ...] = (3, 32, 32),
             num_classes: int = 10) -> nn.Module:
    """Defaults fit `--dataset synthetic` (3x32x32 images, 10 classes)."""
    return DeepMLP(math.prod(input_shape), num_classes, width, depth)

"""Built-in models: the MNIST example's MLP, a CIFAR-style ResNet-18, and a tiny model for tests."""
from __future__ import annotations

import math

import torch
from torch import nn

from .errors import UserError

def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 256) -> nn.Module:
    """Flatten -> Linear(in, 256) -> ReLU -> Linear(256, classes): 784-256-10 on MNIST."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))


def tiny(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 16), nn.ReLU(), nn.Linear(16, num_classes))


def cnn(input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Module:
    """A small conv net with BatchNorm: conv 3x3 -> BN -> ReLU -> global average pool -> linear."""
    return nn.Sequential(nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))


def resnet18(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 with the CIFAR stem: a 3x3 stride-1 first conv and no max-pool."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


# One registry: name -> builder(input_shape, num_classes, **model_args).
REGISTRY = {"mlp": mlp, "resnet18": resnet18, "tiny": tiny, "cnn": cnn}
MODELS = tuple(REGISTRY)


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int = 0, **model_args) -> nn.Module:
    """Build `name` with weights drawn from `seed`, identical on every rank."""
    if name not in REGISTRY:
        raise UserError(f"unknown model {name!r}", f"choose one of {', '.join(MODELS)}, or pkg.module:function")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return REGISTRY[name](input_shape, num_classes, **model_args)

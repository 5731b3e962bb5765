"""torchvision's ResNet-18 with the CIFAR stem: a 3x3 stride-1 first conv and no max-pool."""
from __future__ import annotations

from torch import nn


def resnet18(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    import torchvision  # here, not at the top: only a run that builds this model pays for the import

    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model

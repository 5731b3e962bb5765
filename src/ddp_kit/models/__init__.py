"""Built-in models, one file each: `models/NAME.py` opens with a one-line docstring (the help
text) and defines `NAME(input_shape, num_classes, **model_args) -> nn.Module`. Adding a model is
adding its file; this face finds every such module (not those starting with "_"), in name order.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import UserError
from ..registry import one_file_each

# One registry: name -> builder(input_shape, num_classes, **model_args); DESCRIPTIONS: name -> one line.
REGISTRY, DESCRIPTIONS = one_file_each(__name__, __path__, "(input_shape, num_classes, **model_args)")
MODELS = tuple(REGISTRY)


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int = 0, **model_args) -> nn.Module:
    """Build `name` with weights drawn from `seed`, identical on every rank."""
    if name not in REGISTRY:
        raise UserError(f"unknown model {name!r}", f"choose one of {', '.join(MODELS)}, or pkg.module:function")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return REGISTRY[name](input_shape, num_classes, **model_args)


__all__ = ["DESCRIPTIONS", "MODELS", "REGISTRY", "build_model"]

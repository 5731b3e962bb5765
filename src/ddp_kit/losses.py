"""Built-in losses: name -> function(model, batch) returning a scalar loss, or (loss, {"name": value}).

A loss owns the forward pass (it calls the model), so that one function fits any batch layout;
the values of the metrics dict are averaged over ranks in training and evaluation. A loss that takes a
`metrics` keyword is called with metrics=False on the training steps no log line shows (the reference
job's loop): its metrics cost device work only where they are read.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .errors import UserError


def cross_entropy(model: nn.Module, batch, *, metrics: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Classification on (inputs, targets) batches; reports accuracy too."""
    if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
        raise UserError(f"the default loss cross_entropy needs (inputs, targets) batches; this dataset yields "
                        f"{type(batch).__name__} batches", "pass --loss pkg.module:function that takes (model, batch)")
    x, y = batch
    out = model(x)
    loss = F.cross_entropy(out.float(), y)
    return loss, ({"accuracy": (out.argmax(1) == y).float().mean()} if metrics else {})  # four kernels: asked only when read


LOSSES: dict[str, Callable] = {"cross_entropy": cross_entropy}
DESCRIPTIONS = {name: (fn.__doc__ or "").strip().splitlines()[0] for name, fn in LOSSES.items()}

__all__ = ["DESCRIPTIONS", "LOSSES", "cross_entropy"]

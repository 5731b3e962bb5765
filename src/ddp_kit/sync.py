"""Cross-rank agreement: fingerprints of parameters, and checks that every rank holds the same ones."""
from __future__ import annotations

import hashlib

import torch
from torch import nn

from .dist import DistContext, all_gather_object


def param_sha256(model: nn.Module) -> str:
    """sha256 over every parameter's bytes, in name order: equal iff the weights are bitwise equal."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(p.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def disagreeing_ranks(ctx: DistContext, value) -> dict[int, object]:
    """Gather `value` from every rank; return {rank: value} for the ranks that differ from rank 0 (empty if all agree)."""
    values = all_gather_object(ctx, value)
    return {r: v for r, v in enumerate(values) if v != values[0]}

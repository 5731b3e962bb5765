"""Digests of a model's weights under any strategy: sha256 for bitwise equality, per-tensor sums
for a cheap comparison across ranks or replica groups."""
from __future__ import annotations

import hashlib

import torch
from torch import nn

from .fsdp import full_tensor


def param_sha256(model: nn.Module) -> str:
    """sha256 over every parameter's bytes, in name order: equal iff the weights are bitwise equal.
    A sharded (FSDP) model's parameters are gathered whole, one at a time (never the whole model on
    one device): every rank must call it."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        h.update(name.encode())
        whole = full_tensor(p.detach())
        h.update(whole.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        del whole
    return h.hexdigest()


# Elements per slice: the float64 working copy stays under 2 x 32 MiB whatever the tensor's size (a
# whole 128k x 2048 embedding in float64 would be 2 GiB, twice over for |x|).
CHUNK = 1 << 22


def _sums(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    out = torch.zeros(2, dtype=torch.float64, device=t.device)
    for i in range(0, flat.numel(), CHUNK):
        part = flat[i:i + CHUNK].double()
        out[0] += part.sum()
        out[1] += part.abs().sum()
    return out


def checksums(tensors: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Per tensor: (sum, sum of |x|) in float64, in slices of CHUNK elements (the same order on every
    rank, so equal weights give equal bits). Cheap, and bit-sensitive enough to catch drift."""
    device = tensors[0][1].device if tensors else None  # a step count on the CPU joins the weights' device
    rows = [_sums(t.to(device)) for _, t in tensors]
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)

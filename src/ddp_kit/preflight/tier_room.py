"""The room the memory tier needs in a node's tmpfs, as a lower bound, so that a host is never named for room the
tier does not need (the tier itself checks the exact size at its first save, checkpoint/memory_tier.py).

Each local rank keeps COPIES copies of its whole state, and as many of a peer's (the same local rank of the
previous node) when there are several nodes. A rank's state is known two ways:

    from the last checkpoint   its size over the world size: exact for sharded state, less than DDP's
    at a first start           this rank's parameters, and its optimizers' state: what they hold, or, before their
                               first step made it, the moments a known optimizer keeps per parameter (Adam's two,
                               SGD's momentum); an optimizer not listed counts only what it holds"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..parallel.fsdp import nbytes

COPIES = 2  # per rank and kind (checkpoint/memory_tier.COPIES): the one being written and the last complete one


def from_checkpoint(ckpt_bytes: int, world_size: int, local_world_size: int, num_nodes: int) -> int:
    """A node's need from the last checkpoint's size."""
    kinds = 2 if num_nodes > 1 else 1
    return COPIES * kinds * local_world_size * ckpt_bytes // max(world_size, 1)


def from_state(sizes: Sequence[int], hosts: Sequence[str], host: str, num_nodes: int) -> int:
    """`host`'s need from every rank's state bytes (`sizes`, in rank order; `hosts`: each rank's host): its own
    ranks' copies, and a peer's for each of them (at least the smallest rank's state)."""
    own = [s for s, h in zip(sizes, hosts) if h == host]
    peers = len(own) * min(sizes) if num_nodes > 1 and sizes else 0
    return COPIES * (sum(own) + peers)


def _moments(opt: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    """The tensors the size of a parameter that `opt` keeps per parameter once it stepped (a lower bound)."""
    optim = torch.optim
    if isinstance(opt, (optim.Adam, optim.AdamW, optim.NAdam, optim.RAdam, optim.Adamax, optim.Adadelta, optim.Rprop)):
        return 2
    if isinstance(opt, (optim.RMSprop, optim.Adagrad)):
        return 1
    if isinstance(opt, optim.SGD):
        return 1 if group.get("momentum") else 0
    return 0


def state_bytes(modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """This rank's parameters and optimizer state in bytes (its shards under FSDP), as the tier will copy them."""
    seen: dict[int, torch.Tensor] = {id(p): p for m in modules for p in m.parameters()}
    total = nbytes(seen.values())
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                held = opt.state.get(p)
                total += nbytes(held.values()) if held else _moments(opt, group) * nbytes([p])
    return total

"""Refusing to checkpoint weights that are not finite, so NaN weights never become `latest` and push
the last finite checkpoints out (keep_last)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..dist import DistContext
from ..dist.collectives import all_true
from ..errors import UserError
from ..parallel.fsdp import local
from . import layout

_HINT = "lower lr, try amp off, or check the data; a rerun resumes from the last checkpoint"


def refuse_nonfinite(ctx: DistContext, step: int, shared: dict[str, Any], sharded: dict[str, Any] | None,
                     last: Callable[[], str]) -> None:
    """Raise a UserError naming the first non-finite tensor (collective when `sharded` is given);
    `last()` names the last checkpoint for the message."""
    if sharded is not None:
        bad = [f"{name}.{k}" for name, st in sharded.items()  # flat (a model's); an optimizer's is nested
               for k in nonfinite_tensors({k: local(v) for k, v in st.items()})]
        if not all_true(ctx, not bad):  # shards differ: the ranks agree on one verdict
            raise UserError(f"checkpoint {layout.step_name(step)} not saved: the model's weights are not finite"
                            f"{f' ({bad[0]} on rank {ctx.rank})' if bad else ' (on another rank)'}; last "
                            f"checkpoint: {last()}", _HINT, verdict=True)
    # Every rank holds the same weights, so every rank reaches the same verdict. Flat state dicts
    # (a model's, under any name) are checked; nested ones (an optimizer's) are not.
    bad = [k if name == "model" else f"{name}.{k}" for name, st in shared.items() if isinstance(st, dict)
           for k in nonfinite_tensors(st)]
    if bad:
        raise UserError(f"checkpoint {layout.step_name(step)} not saved: the model's weights are not finite "
                        f"({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}); last checkpoint: {last()}", _HINT)


def nonfinite_tensors(state: dict[str, Any]) -> list[str]:
    """Names of the floating tensors in `state` holding NaN or inf. One flag per tensor, computed on
    its device and stacked, then read once per device (on a GPU one host sync, not one per tensor)."""
    named: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel():
            named.setdefault(v.device, []).append((k, v))
    bad = []
    for items in named.values():
        finite = torch.stack([torch.isfinite(v).all() for _, v in items]).tolist()
        bad += [k for (k, _), ok in zip(items, finite) if not ok]
    return bad

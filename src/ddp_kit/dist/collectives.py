"""The control plane's collectives: a few numbers, flags, digests and small objects between ranks.

All take the distributed context explicitly, run on its control group (gloo beside NCCL, off the
GPU stream), cost a fixed number of bytes per rank where they can (digests by min/max), and at world
size 1 return at once without a tensor. DDP's gradient all-reduce, the data plane, is not here.
"""
from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist

from ..errors import Unavailable, UserError

if TYPE_CHECKING:
    from .group import DistContext

__all__ = ["all_gather_object", "all_reduce_sum", "all_same", "all_true", "barrier", "broadcast_object",
           "gather_object", "rank0_verdict", "set_collective_timeout"]


def set_collective_timeout(ctx: DistContext, seconds: float) -> None:
    """Change the timeout of every later collective, on the default and the control group (e.g.
    shorter after startup)."""
    if ctx.world_size > 1 and seconds > 0:
        setter = getattr(tdist, "set_timeout", None) or tdist.distributed_c10d._set_pg_timeout
        setter(timedelta(seconds=seconds))
        if ctx.control_group is not None:
            setter(timedelta(seconds=seconds), group=ctx.control_group)


def barrier(ctx: DistContext) -> None:
    if ctx.world_size > 1:
        if ctx.control_group is not None:
            tdist.barrier(group=ctx.control_group)
        elif ctx.backend == "nccl":
            tdist.barrier(device_ids=[ctx.device.index])
        else:
            tdist.barrier()


def all_reduce_sum(ctx: DistContext, values: list[float]) -> list[float]:
    """Sum a few numbers over ranks, in float64 so counts stay exact. At world size 1 the numbers
    themselves: no tensor (on an NCCL run it would go to the GPU and back, two host syncs)."""
    if ctx.world_size == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=ctx.control_device)
    tdist.all_reduce(t, group=ctx.control_group)
    return t.tolist()


def all_gather_object(ctx: DistContext, obj: Any) -> list[Any]:
    if ctx.world_size == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    tdist.all_gather_object(out, obj, group=ctx.control_group)
    return out


def gather_object(ctx: DistContext, obj: Any) -> list[Any] | None:
    """Every rank's `obj` on rank 0 only (None elsewhere): for what is per-rank by nature."""
    if ctx.world_size == 1:
        return [obj]
    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    tdist.gather_object(obj, out, dst=0, group=ctx.control_group)
    return out


def all_same(ctx: DistContext, blob: bytes) -> bool:
    """Whether every rank holds the same `blob`, in one all-reduce of 16 bytes whatever the world
    size: the min and the max of a 64-bit digest (the control plane stays O(1) per rank)."""
    if ctx.world_size == 1:
        return True
    digest = int.from_bytes(hashlib.sha256(blob).digest()[:8], "little", signed=True)
    t = torch.tensor([digest, -digest], dtype=torch.int64, device=ctx.control_device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=ctx.control_group)
    high, neg_low = t.tolist()
    return high == -neg_low


def all_true(ctx: DistContext, flag: bool) -> bool:
    """Whether `flag` holds on every rank: one all-reduce (MIN) of 4 bytes whatever the world size."""
    if ctx.world_size == 1:
        return flag
    t = torch.tensor([int(bool(flag))], dtype=torch.int32, device=ctx.control_device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MIN, group=ctx.control_group)
    return bool(t.item())


def broadcast_object(ctx: DistContext, obj: Any, src: int = 0) -> Any:
    if ctx.world_size == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=src, group=ctx.control_group)
    return box[0]


def rank0_verdict(ctx: DistContext, check) -> Any:
    """Run `check()` on rank 0 only; every rank returns its result or raises its UserError, so the
    job stops together with one message."""
    out = None
    if ctx.is_main:
        try:
            out = ("ok", check())
        except UserError as err:
            err.at(ctx.rank)
            out = ("error", (err.message, err.hint, err.rank, err.host, err.retryable))
    kind, value = broadcast_object(ctx, out)
    if kind == "error":
        message, hint, rank, host, retryable = value
        verdict = (Unavailable if retryable else UserError)(message, hint, rank=rank, verdict=True)
        verdict.host = host
        raise verdict
    return value

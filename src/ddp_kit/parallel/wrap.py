"""The entry to the strategies: `wrap_model` checks the options against the strategy, wraps the
model with it (device placement, DDP or FSDP2, SyncBN) and compiles it; `sync_gradients` is the
accumulation context of whichever strategy wrapped a model.

The helpers that lived here stay importable from this module (and from `ddp_kit.wrap`): DDP's
in ddp.py, AMP's in precision.py, the device's in device.py.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ..dist import DistContext
from .ddp import ddp_local_forward, settle_ddp_buckets, sync_ddp_buffers, unwrap, unwrap_ddp
from .device import kernel_settings, to_device
from .fsdp import FSDP_OPTIONS, accumulate, check_strategy, is_sharded, shard
from .precision import autocast, bf16_warning, check_amp, grad_scaler
from .strategy import option_keywords, strategy, strategy_of

# Kept import paths: everything that was importable from here (and from ddp_kit.wrap) before the split.
__all__ = ["FSDP_OPTIONS", "accumulate", "autocast", "bf16_warning", "check_amp", "check_strategy", "ddp_local_forward",
           "grad_scaler", "is_sharded", "kernel_settings", "settle_ddp_buckets", "shard", "sync_ddp_buffers",
           "sync_gradients", "to_device", "unwrap", "unwrap_ddp", "wrap_model"]


def wrap_model(model: nn.Module, ctx: DistContext, *, sync_bn: bool = False, compile: bool = False,
               channels_last: bool = False, find_unused_parameters: bool = False,
               ddp: dict[str, Any] | None = None, strategy: str = "ddp", fsdp: dict[str, Any] | None = None,
               amp: str = "off", **options: dict[str, Any] | None) -> nn.Module:
    """Move `model` to the context's device and wrap it in DDP when there is more than one rank
    (strategy "ddp"), or shard it with FSDP2 over every rank, one included (strategy "fsdp", fsdp.py).

    `ddp`: DDP's own options (bucket_cap_mb, static_graph, gradient_as_bucket_view, ...). By default
    gradients are views into DDP's buckets (gradient_as_bucket_view): one gradient copy less in memory
    and no copy into the buckets each step. `fsdp`: fsdp.shard's options (blocks, cpu_offload,
    reshard_after_forward); `amp` "bf16" gives FSDP its mixed-precision policy. `options`: another
    strategy's options dict under its keyword (Strategy.options_keyword)."""
    unknown = sorted(set(options) - option_keywords())
    if unknown:  # as Python words it for a keyword the signature lacks
        raise TypeError(f"wrap_model() got an unexpected keyword argument '{unknown[0]}'")
    chosen = _lookup(strategy)
    chosen.check_options(sync_bn=sync_bn, amp=amp, cpu_offload=bool((fsdp or {}).get("cpu_offload")), device=ctx.device,
                         ddp={**(ddp or {}), "find_unused_parameters": find_unused_parameters})
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = chosen.wrap(model, ctx, sync_bn=sync_bn, find_unused_parameters=find_unused_parameters, ddp=ddp,
                        fsdp=fsdp, amp=amp, **options)
    return torch.compile(model) if compile else model


_lookup = strategy  # the keyword `strategy` shadows the lookup inside wrap_model


def sync_gradients(model: nn.Module, sync: bool):
    """Context for one micro-step: skip DDP's all-reduce (FSDP's reduce-scatter and reshard) unless
    `sync` (the last micro-step)."""
    if sync:  # the last micro-step runs as any step does, under every strategy (Strategy.accumulate):
        return nullcontext()  # no lookup of the wrapper on the path of every step (8 us measured)
    held = strategy_of(model)
    return held.accumulate(model, sync) if held is not None else _lookup("ddp").accumulate(model, sync)

"""The DDP strategy: a full copy of the model per rank, gradients all-reduced (world size > 1 only).

Besides the wrapping: finding the user's module under the wrappers (`unwrap`), no_sync for
accumulation, rank 0's buffers for every rank (`sync_ddp_buffers`), and the throw-away step that
makes DDP settle its gradient buckets on resume (`settle_ddp_buckets`). Library code: plain arguments.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import UserError
from ..options import Option
from .device import to_device
from .strategy import Strategy, article, foreign_keys


@dataclass(frozen=True)
class DDPStrategy(Strategy):
    def check_options(self, *, sync_bn: bool, amp: str | None = None, cpu_offload: bool = False,
                      device: Any = None, ddp: dict | None = None) -> None:
        if cpu_offload:
            raise UserError("cpu_offload is an FSDP option; this run's strategy is ddp", "use strategy fsdp, or drop cpu_offload")

    def check_config(self, values: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        given = foreign_keys(self.name, values, defaults)
        if given:
            other = given[0][0]  # the options of one strategy at a time
            keys = [f"--{k}" for s, k in given if s is other]
            one = len(keys) == 1
            raise UserError(f"{' and '.join(keys)} {f'is {article(other.label)} {other.label} option' if one else f'are {other.label} options'}; "
                            f"this run's strategy is ddp", f"add --strategy {other.name}, or drop {'it' if one else 'them'}")

    def wrap(self, model: nn.Module, ctx: Any, *, sync_bn: bool = False, find_unused_parameters: bool = False,
             ddp: dict[str, Any] | None = None, **_: Any) -> nn.Module:
        model = model.to(ctx.device)
        if sync_bn and ctx.world_size > 1:
            if ctx.device.type == "cpu":  # torch's SyncBatchNorm raises on CPU tensors at the first forward
                raise UserError("sync_bn needs GPUs: torch's SyncBatchNorm does not run on CPU with more than one rank",
                                "drop sync_bn on CPU (each rank keeps its own BatchNorm statistics)")
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if ctx.world_size > 1:
            device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            options = {"gradient_as_bucket_view": True, "find_unused_parameters": find_unused_parameters, **(ddp or {})}
            try:
                model = DDP(model, device_ids=device_ids, **options)
            except TypeError as exc:
                raise UserError(f"DDP refused the options {sorted(ddp or {})}: {exc}",
                                "see torch.nn.parallel.DistributedDataParallel for the options it takes") from None
        return model

    def holds(self, model: nn.Module) -> bool:
        return unwrap_ddp(model) is not None

    def settle(self, model: nn.Module, batch: Any, device: Any) -> None:
        settle_ddp_buckets(model, batch, device)

    def accumulate(self, model: nn.Module, sync: bool):
        inner = unwrap_ddp(model)
        if sync or inner is None:
            return nullcontext()
        return inner.no_sync()


# DDP's own options: run.prepare(ddp={...}) (any other keyword of torch's DistributedDataParallel passes too).
OPTIONS = (
    Option("static_graph", False, "DDP static_graph: the set of used parameters never changes between steps (enables "
           "more overlap).", key="static_graph", resumable=True),
    Option("bucket_cap_mb", 25.0, "DDP gradient bucket size in MiB: larger buckets, fewer all-reduces.",
           key="bucket_cap_mb", resumable=True),
    Option("sync_bn", False, "Convert BatchNorm layers to SyncBatchNorm when world size > 1.", key="sync_bn",
           own_keyword=True),
    Option("gradient_as_bucket_view", True),
    Option("find_unused_parameters", False),
)
STRATEGY = DDPStrategy(name="ddp", label="DDP", sharded=False, options=OPTIONS)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's own module under any DDP / torch.compile wrappers (FSDP2 shards the module in place)."""
    while True:
        if isinstance(model, DDP):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def unwrap_ddp(model: nn.Module) -> DDP | None:
    while not isinstance(model, DDP):
        if not hasattr(model, "_orig_mod"):
            return None
        model = model._orig_mod
    return model


def sync_ddp_buffers(model: nn.Module) -> None:
    """Every rank gets rank 0's buffers (BatchNorm's running statistics) now, as DDP itself would at
    the next training forward; collective. Each rank updates its statistics from its own batches, so
    without this an eval (or a checkpoint) would see N different models. DDP is then told its
    buffers are in sync, so no forward until the next training one broadcasts them: an eval forward
    on the wrapped model is local, and a rank with an empty eval shard leaves no one waiting."""
    ddp = unwrap_ddp(model)
    if ddp is None or not getattr(ddp, "broadcast_buffers", False) or not getattr(ddp, "modules_buffers", None):
        return
    if hasattr(ddp, "_assign_modules_buffers"):
        ddp._assign_modules_buffers()  # as DDP's own sync does first: a module may have reassigned a buffer
    # As DDP's own sync: an in-place copy into a buffer a saved graph holds is not a modification to it.
    keep = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
    with torch.no_grad(), (keep(tuple(ddp.modules_buffers)) if keep else nullcontext()):
        buffers = [b.detach() for b in ddp.modules_buffers]
        # one coalesced broadcast per call, as DDP's own buffer sync; a bucket of 256 MiB
        tdist._broadcast_coalesced(ddp.process_group, buffers, 256 * 2**20, 0)
    ddp_local_forward(model)


def ddp_local_forward(model: nn.Module) -> None:
    """The next forward of a DDP model skips DDP's buffer broadcast (its buffers agree already)."""
    ddp = unwrap_ddp(model)
    if ddp is not None:
        ddp.require_forward_param_sync = False


def settle_ddp_buckets(model: nn.Module, batch, device: torch.device) -> bool:
    """Run one throw-away forward/backward so that DDP rebuilds its gradient buckets now.

    DDP lays gradients out in buckets by parameter order for the first iteration, then rebuilds
    them in the order gradients became ready. With more than 2 ranks the ring all-reduce's sum
    order depends on that layout, so a resumed run must use the rebuilt layout from its first real
    step, as the uninterrupted run does, to stay bit-identical. The ready order depends on the
    graph, not on the loss, so the sum of the outputs serves. How the model takes a batch is not
    known here: the calls a training loop would make are tried first without gradients on the
    plain module (a failed try leaves DDP untouched); when none fits, nothing is done (False).
    Eval mode keeps BatchNorm statistics untouched; the gradients are discarded.
    """
    ddp = unwrap_ddp(model)
    if ddp is None:
        return False
    module = unwrap(model)
    was_training = module.training
    module.eval()
    try:
        batch = to_device(batch, device)
        for call in _calls(batch):
            try:
                with torch.no_grad():
                    if _output_sum(call(module)) is None:
                        continue
            except Exception:
                continue
            total = _output_sum(call(model))
            if total.requires_grad:
                total.backward()
            return True
        return False
    finally:
        module.train(was_training)
        for p in module.parameters():
            p.grad = None


def _calls(batch):
    """Ways a loop feeds a batch to a model: inputs first of a tuple, the whole thing, or a dict's keys."""
    if isinstance(batch, (list, tuple)) and batch:
        yield lambda m: m(batch[0])
        yield lambda m: m(*batch)
    if isinstance(batch, dict):
        yield lambda m: m(**batch)
    yield lambda m: m(batch)


def _output_sum(out) -> torch.Tensor | None:
    """The sum of every floating tensor in a model's output (tensor, tuple, dict, dataclass-like)."""
    if isinstance(out, torch.Tensor):
        return out.float().sum() if out.is_floating_point() else None
    if isinstance(out, dict):
        parts = list(out.values())
    elif isinstance(out, (list, tuple)):
        parts = list(out)
    else:
        parts = list(vars(out).values()) if hasattr(out, "__dict__") else []
    sums = [s for s in (_output_sum(p) for p in parts) if s is not None]
    return torch.stack(sums).sum() if sums else None

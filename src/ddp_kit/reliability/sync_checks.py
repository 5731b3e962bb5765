"""Cross-rank agreement: startup facts, periodic parameter checksums, and the main_only() guard.

Every check gathers the same data on every rank, so every rank reaches the same verdict and
stops together; rank 0 prints the one message.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from ..dist import DistContext
from ..dist.collectives import all_same, broadcast_object, gather_object
from ..errors import UserError
from ..parallel.digest import checksums, param_sha256  # noqa: F401 (param_sha256: ddp_kit.sync and ddp_kit.reliability name it here)
from ..parallel.fsdp import local

# ---- startup agreement ---------------------------------------------------------------------------

def shapes_digest(model: nn.Module) -> str:
    """A short digest of every parameter's name, shape and dtype."""
    blob = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters())
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_agreement(ctx: DistContext, facts: dict[str, Any], details: dict[str, dict] | None = None) -> None:
    """Stop every rank, with one message, unless all ranks hold the same `facts`.

    `details` maps a fact name to a dict whose differing entries explain the fact (e.g. the config
    itself behind its hash); only the entries that differ are printed.
    """
    if all_same(ctx, json.dumps(facts, sort_keys=True, default=str).encode()):
        return
    # Only on a mismatch: rank 0's facts go to every rank (a fixed size per rank), each rank finds its
    # own differences, rank 0 gathers them and every rank raises the same line.
    ref = broadcast_object(ctx, {"facts": facts, "details": details or {}} if ctx.is_main else None)
    mine = []
    for key, value in facts.items():
        if value == ref["facts"].get(key):
            continue
        own, theirs = (details or {}).get(key), ref["details"].get(key)
        if isinstance(own, dict) and isinstance(theirs, dict):
            diff = [f"{k}={own.get(k)!r} (rank 0: {theirs.get(k)!r})" for k in sorted(set(own) | set(theirs))
                    if own.get(k) != theirs.get(k)]
            mine.append(f"rank {ctx.rank} {key}: {', '.join(diff[:4])}")
        else:
            mine.append(f"rank {ctx.rank} {key}={value!r} (rank 0: {ref['facts'].get(key)!r})")
    gathered = gather_object(ctx, mine or None)
    problems = broadcast_object(ctx, [p for ps in gathered if ps for p in ps] if ctx.is_main else None)
    raise UserError(f"ranks disagree at startup, before step 1: {'; '.join(problems[:6])}",
                    "start every rank with the same config, code, library versions and data", verdict=True)


# ---- periodic consistency -----------------------------------------------------------------------

def _per_rank_buffers(model: nn.Module) -> set[str]:
    """Buffers each rank may legitimately hold its own value of: the running statistics of norm
    layers that are not synchronised (BatchNorm, InstanceNorm with running stats). Each rank updates
    them from its own batch; DDP only overwrites them with rank 0's at the next forward."""
    out = set()
    for prefix, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._NormBase) and not isinstance(mod, nn.SyncBatchNorm):
            out.update(f"{prefix}.{b}" if prefix else b for b in ("running_mean", "running_var"))
    return out


def state_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What must be equal on every rank: every parameter, and every floating buffer except the
    running statistics of unsynchronised norm layers (SyncBatchNorm's are compared).

    Under FSDP a sharded parameter is held once, by the rank that owns each shard: there is no
    second copy to disagree with, so it is left out; replicated parameters and buffers are compared."""
    skip = _per_rank_buffers(model)
    params = [(n, local(p)) for n, p in model.named_parameters()
              if not any(pl.is_shard() for pl in getattr(p, "placements", ()))]
    return params + [(n, local(b)) for n, b in model.named_buffers() if b.is_floating_point() and n not in skip]


def optimizer_steps(optimizers: dict[str, torch.optim.Optimizer]) -> list[tuple[str, torch.Tensor]]:
    """Each optimizer's step count (its first parameter's), as a tensor every rank must agree on:
    under FSDP the one part of the sharded optimizer state that is the same on every rank."""
    out = []
    for name, opt in optimizers.items():
        steps = [s["step"] for s in opt.state.values() if isinstance(s.get("step"), torch.Tensor)]
        if steps:
            out.append((f"{name}.step", local(steps[0])))
    return out


def check_consistency(ctx: DistContext, model: nn.Module, step: int, fix: str = "error",
                      extra: list[tuple[str, torch.Tensor]] = ()) -> str | None:
    """Compare parameter/buffer checksums (and the `extra` tensors, e.g. optimizer_steps) across
    ranks. On divergence: raise (fix='error') or re-broadcast rank 0's values (fix='broadcast') and
    return a warning line."""
    if ctx.world_size == 1:
        return None
    compared = state_tensors(model) + list(extra)
    table = checksums(compared).cpu()  # on a GPU, the one device->host read of a sync-check step
    if all_same(ctx, table.numpy().tobytes()):
        return None
    # Only on a mismatch: rank 0's table goes to every rank (a fixed size per rank), each rank finds
    # its own differing tensors, rank 0 gathers the names and every rank gets the same verdict.
    ref = table.to(ctx.control_device).clone()
    tdist.broadcast(ref, src=0, group=ctx.control_group)
    names = [n.removeprefix("module.").removeprefix("_orig_mod.") for n, _ in compared]
    rows = (table != ref.cpu()).any(dim=1).nonzero().flatten().tolist() if ctx.rank else []
    gathered = gather_object(ctx, (ctx.rank, [names[i] for i in rows]) if rows else None)
    bad: dict[int, list[str]] = broadcast_object(ctx, dict(g for g in gathered if g) if ctx.is_main else None)
    where = "; ".join(f"rank {r}: {', '.join(ns[:3])}{' ...' if len(ns) > 3 else ''}" for r, ns in bad.items())
    if fix == "broadcast":
        with torch.no_grad():
            for _, t in compared:
                if t.device.type == "cpu" and ctx.backend == "nccl":  # an optimizer step count under NCCL
                    held = t.detach().clone()
                    tdist.broadcast(held, src=0, group=ctx.control_group)
                    t.copy_(held)
                else:
                    tdist.broadcast(t.data, src=0)
        return f"parameters diverged from rank 0 at step {step} ({where}); re-broadcast from rank 0"
    raise UserError(f"parameters diverged across ranks at step {step} (sync check): {where}",
                    "a rank updated its weights differently (non-deterministic code on one rank, a skipped step, "
                    "a buffer changed on one rank only); sync_fix broadcast repairs it instead", verdict=True)


# ---- main_only guard ------------------------------------------------------------------------------

# Every public collective torch.distributed has, found by name: torch adds variants (2.14's FSDP
# gathers with all_gather_single, a name the list once written here did not have).
_COLLECTIVES = tuple(n for n in dir(tdist) if n[:1].islower() and callable(getattr(tdist, n))
                     and n.startswith(("all_", "reduce", "gather", "scatter", "broadcast", "barrier", "monitored_barrier")))
_FSDP_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")


class CollectiveInMainOnly(RuntimeError):
    pass


_inside = threading.local()  # .depth: main_only blocks this thread is in (rank 0's own code)


def in_main_only() -> bool:
    return getattr(_inside, "depth", 0) > 0



def refusal(what: str, rank: int, fsdp: bool = False) -> CollectiveInMainOnly:
    return CollectiveInMainOnly(
        f"{what} inside main_only() on rank {rank}: the other ranks skip this block and would wait forever; "
        f"move the collective out of main_only() or run it on every rank"
        + ("; an FSDP model's forward and a DTensor's full_tensor() gather from every rank: evaluate on every "
           "rank, or take run.full_state_dict(model) on every rank before main_only() and load it into a plain copy"
           if fsdp else ""))


class _RefuseTorchCollectives(TorchDispatchMode):
    """Collectives torch starts by itself (DDP's buffer broadcast, FSDP's and DTensor's gathers, as in
    full_tensor) never pass through a torch.distributed name, but every one is a c10d operator: this
    mode sees each operator this thread dispatches and refuses those, before anything is sent."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank


def _refuse_c10d(self, func, types, args=(), kwargs=None):
    if func.namespace in ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"):
        raise refusal(f"torch's own collective {func.name()} (started by DDP, FSDP or a DTensor)", self.rank,
                      fsdp="all_gather" in func.name() or "allgather" in func.name())
    return func(*args, **(kwargs or {}))


# Set after the class is made: a __torch_dispatch__ in the class body is wrapped by torch to disable
# dynamo, which imports torch._dynamo (1.5 s) the first time rank 0 enters main_only(). Nothing
# compiled runs this function.
_RefuseTorchCollectives.__torch_dispatch__ = _refuse_c10d


@contextmanager
def main_only(ctx: DistContext) -> Iterator[bool]:
    """`with main_only(ctx) as main: if main: ...` runs rank-0-only code in which any collective
    raises at once instead of leaving the other ranks waiting until the timeout.

    Refused on the thread that entered the block (another thread, such as an async checkpoint's,
    is not rank-0-only code): calls through a `torch.distributed.<name>` collective, and every c10d
    operator dispatched, which covers the collectives DDP, FSDP and DTensors start by themselves.
    A DDP-wrapped model's forward runs on its own module here: DDP would first broadcast rank 0's
    buffers to ranks that are not there. Every aten operator in the block passes through Python
    (the dispatch mode), and torch.compile does not compile under it: keep the block's work small
    (a long evaluation belongs on every rank, with run.eval_loader).
    """
    if not ctx.is_main or ctx.world_size == 1:
        yield ctx.is_main
        return
    _patches.enter()
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        with _RefuseTorchCollectives(ctx.rank):
            yield True
    finally:
        _inside.depth -= 1
        _patches.leave()


class _Patches:
    """torch.distributed's collectives and DDP.forward, replaced while any main_only block is open
    (counted: blocks on two threads, or nested, restore in any order). The replacements ask
    in_main_only(), which is per thread: another thread, or a reference to one kept after the
    block, goes to the original."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open = 0
        self._saved: dict[str, Any] = {}
        self._ddp_forward: Any = None

    def enter(self) -> None:
        with self._lock:
            self._open += 1
            if self._open > 1:
                return
            self._saved = {name: getattr(tdist, name) for name in _COLLECTIVES if hasattr(tdist, name)}
            for name, fn in self._saved.items():
                setattr(tdist, name, _refusing(name, fn))
            self._ddp_forward = DDP.forward
            DDP.forward = _local_forward(self._ddp_forward)

    def leave(self) -> None:
        with self._lock:
            self._open -= 1
            if self._open:
                return
            DDP.forward = self._ddp_forward
            for name, fn in self._saved.items():
                setattr(tdist, name, fn)


_patches = _Patches()


def _refusing(name: str, fn: Any) -> Any:
    def collective(*args, **kwargs):
        if not in_main_only():
            return fn(*args, **kwargs)
        raise refusal(f"torch.distributed.{name} called", tdist.get_rank() if tdist.is_initialized() else 0,
                      fsdp=name in _FSDP_COLLECTIVES)
    return collective


def _local_forward(ddp_forward: Any) -> Any:
    def forward(self, *inputs, **kwargs):
        if not in_main_only():
            return ddp_forward(self, *inputs, **kwargs)
        if self.device_ids:  # what DDP's forward does first: the inputs go to the module's device
            from torch.distributed.utils import _to_kwargs

            moved, moved_kwargs = _to_kwargs(inputs, kwargs, torch.device(self.device_type, self.device_ids[0]),
                                             self.use_side_stream_for_tensor_copies)
            inputs, kwargs = moved[0], moved_kwargs[0]
        return self.module(*inputs, **kwargs)
    return forward

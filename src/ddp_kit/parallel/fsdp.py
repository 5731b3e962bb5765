"""The FSDP2 strategy: parameters, gradients and optimizer state sharded over the ranks.

`shard()` applies torch's `fully_shard` to each block of the model, then to the root. The block
policy (`blocks`) decides which submodules become their own unit: one unit's parameters are
gathered for its forward/backward and freed after, so peak memory is about one unit's full
weights plus 1/N of the rest. The default policy:

    every child of an nn.ModuleList (the usual list of transformer blocks), if the model has one;
    else every direct child of the root that holds parameters.

Override it with a callable `blocks(module) -> bool` or a list of class names ("Block").

Everything else that differs from DDP lives here too: the option rules (FSDPStrategy), the sharded state dicts of models and
their optimizers (torch.distributed.checkpoint's get/set_state_dict), and the local byte counts
behind the per-rank memory report. Library code: plain arguments, no config.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..options import Option
from .strategy import Strategy, article, foreign_keys, strategy


def _block_names(value: str) -> list[str] | None:
    return [b.strip() for b in value.split(",") if b.strip()] or None


# shard()'s keyword options: run.prepare(fsdp={...}); --fsdp_<name> in the reference job
OPTIONS = (
    Option("blocks", "", "fsdp: comma-separated module class names that each become one FSDP unit (e.g. Block). "
           "Empty: each child of an nn.ModuleList, else each direct child with parameters.", key="fsdp_blocks",
           resumable=True, parse=_block_names),
    Option("cpu_offload", False, "fsdp, CUDA only: keep the sharded parameters, gradients and optimizer state in "
           "host memory (the optimizer step runs on the CPU).", key="fsdp_cpu_offload", resumable=True),
    Option("reshard_after_forward", True, "fsdp: free each unit's gathered weights after its forward (gathered again "
           "for the backward); false keeps them (more memory, less communication).",
           key="fsdp_reshard_after_forward", resumable=True),
)
FSDP_OPTIONS = tuple(o.name for o in OPTIONS)


@dataclass(frozen=True)
class FSDPStrategy(Strategy):
    def check_options(self, *, sync_bn: bool, amp: str | None = None, cpu_offload: bool = False,
                      device: torch.device | None = None, ddp: dict | None = None) -> None:
        if sync_bn:
            raise UserError(f"sync_bn does not combine with strategy {self.name} (SyncBatchNorm is a DDP-era layer; FSDP leaves "
                            "BatchNorm per rank)", "drop sync_bn, or use strategy ddp")
        if amp == "fp16":
            raise UserError(f"amp=fp16 does not combine with strategy {self.name} here (its GradScaler does not handle sharded "
                            "gradients)", "use amp bf16 (FSDP's MixedPrecisionPolicy), or strategy ddp")
        if cpu_offload and device is not None and device.type != "cuda":
            raise UserError(f"{self.name} cpu_offload moves parameters and optimizer state from the GPU to host memory; this run "
                            "is on cpu, where they already are", "drop cpu_offload on CPU")
        set_ddp = {k for k, v in (ddp or {}).items() if v not in (None, False)}  # DDP options given a value
        if set_ddp:
            raise UserError(f"DDP options {sorted(set_ddp)} do not apply to strategy {self.name}",
                            "drop them, or use strategy ddp")

    def check_config(self, values: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        given = foreign_keys(self.name, values, defaults)
        if given:
            other = given[0][0]  # the options of one strategy at a time
            keys = [f"--{k} {values[k]}" for s, k in given if s is other]
            one = len(keys) == 1
            raise UserError(f"{', '.join(keys)} {f'is {article(other.label)} {other.label} option' if one else f'are {other.label} options'} and "
                            f"do{'es' if one else ''} not combine with --strategy {self.name}",
                            f"drop it, or use --strategy {other.name}")
        if values["amp"] == "fp16":
            raise UserError(f"--amp fp16 does not combine with --strategy {self.name} (its GradScaler does not handle sharded "
                            "gradients)", "use --amp bf16 (FSDP's MixedPrecisionPolicy), or --strategy ddp")

    def wrap(self, model: nn.Module, ctx: Any, *, amp: str = "off", fsdp: dict[str, Any] | None = None,
             **_: Any) -> nn.Module:
        # Not moved whole: fully_shard moves one unit at a time to the device and keeps only its
        # shard there (or in host memory under cpu_offload), so the whole model never has to fit on
        # one GPU. Sharded at world 1 too (a mesh of one): the debug run takes the code path of N
        # ranks, and cpu_offload lets one GPU train a model whose state does not fit on it.
        options = self.own_options(fsdp)
        return shard(model, ctx.device, ctx.world_size, amp=amp, **options)

    def holds(self, model: nn.Module) -> bool:
        return is_sharded(model)

    def accumulate(self, model: nn.Module, sync: bool):
        while hasattr(model, "_orig_mod"):  # torch.compile's wrapper
            model = model._orig_mod
        return accumulate(model, sync)

    def state_dicts(self, models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, Any]:
        return state_dicts(models, optimizers)

    def load_state_dicts(self, models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer],
                         saved: set[str], read: Callable[[dict], None]) -> None:
        load_state_dicts(models, optimizers, saved, read)


STRATEGY = FSDPStrategy(name="fsdp", label="FSDP", sharded=True, options=OPTIONS)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    while hasattr(model, "_orig_mod"):  # torch.compile's wrapper
        model = model._orig_mod
    return isinstance(model, FSDPModule)


def check_strategy(name: str, *, sync_bn: bool, amp: str | None = None, cpu_offload: bool = False,
                   device: torch.device | None = None, ddp: dict | None = None) -> None:
    """One line and a hint for what does not combine with the strategy `name`, before anything is built."""
    strategy(name).check_options(sync_bn=sync_bn, amp=amp, cpu_offload=cpu_offload, device=device, ddp=ddp)


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The default policy (see the module docstring)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if lists:
        return [child for ml in lists for child in ml if any(True for _ in child.parameters())]
    return [child for child in model.children() if any(True for _ in child.parameters())]


def _chosen(model: nn.Module, blocks: Callable[[nn.Module], bool] | Iterable[str] | None) -> list[nn.Module]:
    if blocks is None:
        return default_blocks(model)
    if not callable(blocks):
        names = set(blocks)
        found = {type(m).__name__ for m in model.modules()}
        unknown = sorted(names - found)
        if unknown:
            raise UserError(f"fsdp blocks {unknown} name no module class in this model",
                            f"name classes it has, e.g. {', '.join(sorted(found)[:6])}")
        blocks = lambda m: type(m).__name__ in names
    return [m for m in model.modules() if m is not model and blocks(m)]


def _tied_outside(model: nn.Module, units: list[nn.Module]) -> dict[int, tuple[str, str]]:
    """Units holding a parameter that is also used outside them (tied weights, e.g. an embedding
    shared with the output layer): {id(unit): (the parameter's name inside, a name outside)}.
    A unit's parameters are sharded by that unit and gathered only around its own forward, so a
    module outside it would see a shard."""
    # A module reused under several names (a block run twice, an alias `self.last = self.blocks[-1]`)
    # is one unit under all of them: each name counts as inside.
    prefixes: dict[int, list[str]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(m), []).append(n + ".")
    uses: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        uses.setdefault(id(p), []).append(name)
    out: dict[int, tuple[str, str]] = {}
    for unit in units:
        mine = tuple(prefixes[id(unit)])
        for all_names in uses.values():
            inside = [n for n in all_names if n.startswith(mine)]
            outside = [n for n in all_names if not n.startswith(mine)]
            if inside and outside:
                out[id(unit)] = (inside[0], outside[0])
                break
    return out


def _units(model: nn.Module, blocks: Callable[[nn.Module], bool] | Iterable[str] | None) -> list[nn.Module]:
    """The chosen units, checked for tied weights: the default policy leaves a unit that shares a
    parameter with the rest of the model to its parent (the root), an explicit choice is refused."""
    units = _chosen(model, blocks)
    tied = _tied_outside(model, units)
    if tied and blocks is not None:
        inside, outside = next(iter(tied.values()))
        raise UserError(f"fsdp blocks split tied weights: {inside} is also used as {outside}, outside its unit",
                        "choose blocks that hold every use of a shared parameter, or leave the modules "
                        "that share it out of the blocks (the root unit then holds them)")
    return [u for u in units if id(u) not in tied]


def shard(model: nn.Module, device: torch.device, world_size: int, *, amp: str = "off", cpu_offload: bool = False,
          reshard_after_forward: bool = True,
          blocks: Callable[[nn.Module], bool] | Iterable[str] | None = None, mesh: Any = None) -> nn.Module:
    """`fully_shard` each block, then the root, over one mesh of every rank (the process group must exist),
    or over `mesh` where given (a 2-D mesh of replicas x shards: HSDP, hsdp.py).

    bf16: parameters are gathered and computed in bf16, gradients reduced in fp32, the sharded
    master weights and optimizer state stay fp32 (FSDP's MixedPrecisionPolicy). `cpu_offload` keeps
    the sharded parameters, gradients and optimizer state in (pinned) host memory; the optimizer
    step runs on the CPU. `reshard_after_forward=False` keeps each unit's gathered weights from the
    forward to the backward (ZeRO-2 like: less communication, more memory)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if mesh is None:
        mesh = init_device_mesh(device.type, (world_size,))
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
                               "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    if amp == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = _units(model, blocks)
    # Innermost first: fully_shard of a unit takes the parameters no inner unit already holds.
    depth = {id(m): len(name.split(".")) for name, m in model.named_modules()}
    for unit in sorted(units, key=lambda m: -depth.get(id(m), 0)):
        fully_shard(unit, **options)
    fully_shard(model, **options)
    return model


@contextmanager
def accumulate(model: nn.Module, sync: bool) -> Iterator[None]:
    """Around a non-final micro-step (sync=False): no reduce-scatter (gradients add up unsharded)
    and no reshard after its backward (the weights stay gathered: the next forward needs no
    all-gather). Both are switched back on when the block ends, so the last micro-step, inside
    the block or not, reduces and reshards as usual."""
    if sync:
        yield
        return
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


# ---- state for torch.distributed.checkpoint -------------------------------------------------------

def _owner(optimizer: torch.optim.Optimizer, models: dict[str, nn.Module]) -> nn.Module:
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for model in models.values():
        if any(id(p) in mine for p in model.parameters()):
            return model
    raise UserError("an optimizer registered for checkpointing holds none of the registered model's parameters",
                    "create the optimizer from the model run.prepare returned: optimizer = AdamW(model.parameters())")


def state_dicts(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, Any]:
    """{name: sharded state dict} of each model and optimizer, keyed by parameter names (not ids),
    as DCP saves them: every rank holds (and writes) its own shards."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {name: get_model_state_dict(m) for name, m in models.items()}
    for name, opt in optimizers.items():
        out[name] = get_optimizer_state_dict(_owner(opt, models), opt)
    return out


def load_state_dicts(models: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer],
                     saved: set[str], read: Callable[[dict], None]) -> None:
    """Fill this rank's shards from a checkpoint whose (flattened) keys are `saved`: `read(template)`
    loads into the template in place (DCP reshards: a checkpoint written by N ranks loads on M)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    template = state_dicts(models, optimizers)
    # torch makes the template's optimizer state for every parameter (one step with zero gradients);
    # a parameter that never had a gradient has none in the checkpoint, and keeps none.
    for name in optimizers:
        state = template[name].get("state", {})
        for fqn in [f for f, st in state.items() if not any(f"{name}.state.{f}.{k}" in saved for k in st)]:
            del state[fqn]
    read(template)
    for name, m in models.items():
        set_model_state_dict(m, template[name])
    for name, opt in optimizers.items():
        set_optimizer_state_dict(_owner(opt, models), opt, template[name])


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes(tensors: Iterable[Any]) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors if isinstance(t, torch.Tensor))


def memory_bytes(models: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes (its shards under FSDP)."""
    params = [p for m in models for p in m.parameters()]
    return {"param_bytes": nbytes(params), "grad_bytes": nbytes(p.grad for p in params),
            "optim_bytes": nbytes(v for opt in optimizers for s in opt.state.values() for v in s.values())}


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """`p` whole, on every rank (an all-gather when it is sharded: collective, every rank must call
    it for the same tensor). Shards offloaded to the CPU are gathered on the mesh's device: NCCL
    cannot gather CPU tensors."""
    if not hasattr(p, "full_tensor"):
        return p
    mesh_type = p.device_mesh.device_type
    return (p.to(mesh_type) if p.device.type != mesh_type else p).full_tensor()


def full_state_dict(model: nn.Module, keep: bool = True) -> dict[str, Any]:
    """The model's state_dict with whole tensors in CPU memory, gathered one tensor at a time (never
    the whole model on one device). Collective under FSDP: every rank calls it; `keep=False` takes
    part in the gathers and returns {} (rank 0 alone needs the copy, e.g. to save it)."""
    out: dict[str, Any] = {}
    for name, t in model.state_dict().items():
        whole = full_tensor(t.detach()) if isinstance(t, torch.Tensor) else t
        if keep:
            out[name] = whole.to("cpu", copy=True) if isinstance(whole, torch.Tensor) else whole
        del whole
    return out

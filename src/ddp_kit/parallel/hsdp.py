"""The HSDP strategy: FSDP2 over a 2-D mesh of replicas x shards (hybrid sharding).

Plain FSDP shards over every rank, so each block's all-gather (forward and backward) and the
gradients' reduce-scatter cross the network between nodes. HSDP lays the ranks out as a mesh of
`replicate` rows of `shard` ranks: parameters, gradients and optimizer state are sharded within a
row, and each row holds a whole copy. The gathers and the reduce-scatter stay in the row; only the
gradient shards are all-reduced across rows. By default a row is one node (shard = the ranks on a
node, replicate = the number of nodes), so the per-layer traffic never leaves the node.

Ranks are numbered node by node (torchrun, srun's block distribution), so a row of `shard`
consecutive ranks lies inside a node when `shard` divides the ranks per node. The sizes come from
`mesh_shape`, a pure function of the world and of facts every rank agrees on (`node_facts`): every
rank reaches the same verdict, and a layout that would make rows span nodes without the user naming
the shard size is refused in one line.

Everything else is FSDP's (fsdp.py), called, not copied: the block policy, mixed precision,
accumulation, the sharded DCP state dicts (which reshard on load: a checkpoint of one mesh resumes
on another, or on another world size, or under no process group for `python -m ddp_kit.checkpoint
export`). Library code: plain arguments, no config.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..options import Option
from . import fsdp
from .fsdp import FSDPStrategy, is_sharded

MESH_DIMS = ("replicate", "shard")  # the mesh's dimension names, outer first


def _size(key: str):
    def check(value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"config key '{key}' must be a number of ranks >= 1, or 0 to choose it; got {value!r}",
                            f"e.g. --{key} 0")
    return check


# hsdp={...} in run.prepare; --hsdp_<name> in the reference job. FSDP's own options (blocks,
# cpu_offload, reshard_after_forward) are shared: the same --fsdp_* keys, in the same dict.
OPTIONS = (
    Option("shard", 0, "hsdp: ranks per shard group (a mesh row, holding one whole copy of the model). 0: the ranks "
           "on a node (or world / hsdp_replicate). Naming it lets a group span nodes.", key="hsdp_shard",
           resumable=True, check=_size("hsdp_shard")),
    Option("replicate", 0, "hsdp: number of shard groups (replicas; the gradient all-reduce runs across them). 0: "
           "world size / shard size.", key="hsdp_replicate", resumable=True, check=_size("hsdp_replicate")),
    *fsdp.OPTIONS,
)


@dataclass(frozen=True)
class NodeFacts:
    """What every rank agrees on about the nodes (one reduction in `node_facts`)."""

    fewest: int  # the fewest ranks on any node
    most: int  # the most ranks on any node
    node_major: bool  # every rank is numbered node by node: rank = node_rank * ranks per node + local_rank


def mesh_shape(world_size: int, nodes: NodeFacts, shard: int = 0, replicate: int = 0) -> tuple[int, int]:
    """(replicate, shard) for `world_size` ranks; 0 means "choose". Refused in one line when the two do
    not multiply to the world size, or when the shard groups would span nodes and the user did not
    name the shard size (naming it is asking for that)."""
    for key, value in (("hsdp_shard", shard), ("hsdp_replicate", replicate)):
        _size(key)(value)
    if shard and replicate and shard * replicate != world_size:
        raise UserError(f"hsdp mesh {replicate} x {shard} (replicate x shard) has {replicate * shard} ranks, and the "
                        f"world has {world_size}", "make --hsdp_replicate times --hsdp_shard equal the world size, "
                        "or leave one at 0 to have it chosen")
    for key, value in (("hsdp_shard", shard), ("hsdp_replicate", replicate)):
        if value and world_size % value:
            raise UserError(f"--{key} {value} does not divide the world size {world_size}",
                            f"choose a divisor of {world_size}, or 0 to have it chosen")
    if shard:
        return world_size // shard, shard
    if replicate:
        size = world_size // replicate
    elif nodes.fewest != nodes.most:
        raise UserError(f"hsdp shards within a node by default, and the nodes run different numbers of ranks "
                        f"({nodes.fewest} to {nodes.most})", "launch as many ranks on every node, or set --hsdp_shard")
    else:
        size = nodes.most
    if size > nodes.fewest or nodes.fewest % size or not nodes.node_major:
        why = (f"groups of {size} ranks would span nodes of {nodes.fewest}" if nodes.node_major else
               "the ranks are not numbered node by node, so a group of consecutive ranks would span nodes")
        raise UserError(f"hsdp shard groups must stay inside a node unless asked: {why}",
                        f"set --hsdp_replicate to the number of nodes (or a multiple), or set --hsdp_shard {size} "
                        "to shard across nodes on purpose" + ("" if nodes.node_major else
                                                              "; or launch with torchrun or srun --distribution=block"))
    return world_size // size, size


def node_facts(ctx: Any) -> NodeFacts:
    """The nodes as every rank sees them: one all-reduce (max) of three numbers over the control group."""
    env = ctx.env
    mine = NodeFacts(env.local_world_size, env.local_world_size,
                     env.rank == env.node_rank * env.local_world_size + env.local_rank)
    if env.world_size == 1:
        return mine
    import torch.distributed as tdist

    t = torch.tensor([mine.most, -mine.fewest, int(not mine.node_major)], dtype=torch.int64, device=ctx.control_device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=ctx.control_group)
    most, neg_fewest, misplaced = (int(v) for v in t.tolist())
    return NodeFacts(fewest=-neg_fewest, most=most, node_major=not misplaced)


def build_mesh(device: torch.device, replicate: int, shard: int) -> Any:
    """The 2-D mesh: row r holds ranks r*shard .. (r+1)*shard - 1 (the process group must exist)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (replicate, shard), mesh_dim_names=MESH_DIMS)


def hybrid_shard(model: nn.Module, ctx: Any, *, amp: str = "off", shard: int = 0, replicate: int = 0,
                 **fsdp_options: Any) -> nn.Module:
    """fsdp.shard over the 2-D mesh that `mesh_shape` chooses (every rank calls it)."""
    try:
        rows, size = mesh_shape(ctx.world_size, node_facts(ctx), shard, replicate)
    except UserError as exc:
        exc.verdict = True  # every rank refuses together, from the same reduced facts: said once
        raise
    return fsdp.shard(model, ctx.device, ctx.world_size, amp=amp, mesh=build_mesh(ctx.device, rows, size),
                      **fsdp_options)


def mesh_of(model: nn.Module) -> Any:
    """The device mesh a sharded model's parameters live on (None for a plain model)."""
    return next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)


@dataclass(frozen=True)
class HSDPStrategy(FSDPStrategy):
    def check_config(self, values: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        super().check_config(values, defaults)
        for o in OPTIONS[:2]:
            o.value(values[o.key])

    def wrap(self, model: nn.Module, ctx: Any, *, amp: str = "off", fsdp: dict[str, Any] | None = None,
             hsdp: dict[str, Any] | None = None, **_: Any) -> nn.Module:
        if fsdp:
            raise UserError(f"fsdp options {sorted(fsdp)} were given with strategy hsdp, which takes them in its own dict",
                            "pass hsdp={...} instead of fsdp={...} (the same names, plus shard and replicate)")
        options = self.own_options(hsdp)
        self.check_options(sync_bn=False, cpu_offload=bool(options.get("cpu_offload")), device=ctx.device)
        return hybrid_shard(model, ctx, amp=amp, **options)

    def holds(self, model: nn.Module) -> bool:
        mesh = mesh_of(model) if is_sharded(model) else None
        return mesh is not None and mesh.ndim == 2


STRATEGY = HSDPStrategy(name="hsdp", label="HSDP", sharded=True, options=OPTIONS)

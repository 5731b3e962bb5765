"""The fault-tolerant strategy "ft": DDP inside a replica group, torchft between the groups.

Each replica group is a launch of its own (env/replicas.py): its ranks are the process group and
all-reduce gradients over it as DDP does; then torchft's manager averages them across the replica
groups of the current quorum. When a group dies, the others discard at most the step under way and
go on with the groups left (the lighthouse drops the dead one after its heartbeat timeout); when it
comes back, it joins the next quorum and receives the weights, optimizer state, data position and
step count live from a peer (torchft's HTTP transport), with no checkpoint read.

One step of a replica (this rank's member of the quorum: Replica, parallel/ft_replica.py), driven by the
step boundary (parallel/ft_steps.py):

    the loader's fetch     `begin_step`: a quorum (synchronous, so a recovering group is healed
                           before it draws its batch, and its step counts with the others')
    backward               DDP's comm hook: all-reduce in the group, then across groups (torchft)
    optimizer.step()       gated: runs only if every rank of this group got through the step without
                           an error, its cross-group all-reduce included (`should_commit`); otherwise
                           the step is discarded on every rank of the group; the LR schedulers follow

`should_commit` is a vote among the ranks of one group (its manager server counts them), not across
the groups: each group decides for itself. Groups can decide differently (a cross-group all-reduce
that failed in one group and not in another), and are then one step apart. That does not last
unseen: the next quorum they share compares their step counts and heals the one behind live from
one ahead (torchft's max_step rule), which ft_steps reports as a recovery and follows with a
weights check; and at the end of the job a group claims the result only with the weights of the
group that finished first (FtHooks.may_report).

DDP's buckets are never rebuilt (find_unused_parameters), as torchft requires: a group that
restarts must lay its gradients out as the running ones do. Tested with torchft-nightly
2026.10.26 and torch 2.14.1 (the `ft` extra pins it): torchft 0.2.0 crashes in its comm hook after
a lost replica.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import UserError
from .ddp import OPTIONS as DDP_OPTIONS
from .ddp import unwrap_ddp
from .ft_replica import Replica, Timeouts
from .strategy import Strategy

INSTALL = "pip install 'ddp_kit[ft]' (torchft-nightly==2026.10.26)"
RESULTS = "DDP_KIT_FT_RESULTS"  # the launch's results folder (launch/ft.py names it too)
# torchft's Rust side logs every quorum and commit at INFO on stderr: several lines per step.
QUIET_RUST = ("RUST_LOG", "warn")


def _comm_hook(replica: Replica, group: Any) -> Callable:
    """The group's mean (DDP's all-reduce over the group's ranks), then the mean across replica groups."""
    size = replica.group_size

    # No annotations: DDP checks a hook's by value, and this module's are strings (__future__).
    def hook(_state, bucket):
        buf = bucket.buffer()
        if size > 1:
            tdist.all_reduce(buf, group=group)
            buf.div_(size)
        work = replica.manager.allreduce(buf)
        # A failed all-reduce (a group was lost) is not an error here: the manager knows, and the
        # commit decision discards this step; raising would end this healthy group too.
        if not work.wait():
            return _done(buf)
        fut = work.get_future()
        inner = getattr(fut, "_fut", None)  # torchft's managed future wraps the one DDP must wait on
        return inner if inner is not None else fut
    return hook


def _done(t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut


class _EraQuorums:
    """torchft's ManagerClient for one group's manager, whose quorum ids stay unique when the lighthouse is
    restarted (launch/ft.py brings a dead one back on the same port).

    A new lighthouse numbers its quorums from 1 again. torchft's manager reconfigures the cross-group process
    group only when the quorum id changes, and rendezvouses under a store prefix named by it: a reused id
    either skips a reconfiguration the new members need, or meets the stale keys of an earlier one (gloo's
    connect then times out; measured with 3 groups). So the id each group acts on is a digest of the
    lighthouse's id, the members and the quorum's step count, taken anew whenever (id, members) changes,
    and kept while it does not. Every member of a quorum computes the same one: either all of them were in
    the previous quorum (same id and members), or the quorum changed for all of them. Without a restart it
    changes exactly when the lighthouse's id does."""

    def __init__(self, client: Any):
        self._client = client
        self._seen: tuple[int, tuple[str, ...]] | None = None
        self._id = -1

    def _quorum(self, **kwargs: Any) -> Any:
        quorum = self._client._quorum(**kwargs)
        seen = (int(quorum.quorum_id), tuple(sorted(quorum.replica_ids)))
        if seen != self._seen:
            self._seen = seen
            digest = hashlib.sha256(repr((*seen, int(quorum.max_step))).encode()).digest()
            self._id = int.from_bytes(digest[:8], "big") & ((1 << 62) - 1)
        return _Renumbered(quorum, self._id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class _Renumbered:
    """A torchft QuorumResult with another quorum_id (_EraQuorums)."""

    def __init__(self, quorum: Any, quorum_id: int):
        self._quorum, self.quorum_id = quorum, quorum_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._quorum, name)


def _manager(ctx: Any, timeouts: Timeouts, replica: Replica) -> Any:
    try:
        os.environ.setdefault(*QUIET_RUST)  # read once, when torchft's Rust side starts logging
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
    except ImportError:
        raise UserError("strategy 'ft' needs torchft, which is not installed", INSTALL) from None
    env = ctx.env
    if not env.lighthouse:
        raise UserError("strategy 'ft' needs a lighthouse, and TORCHFT_LIGHTHOUSE is not set",
                        "launch with python -m ddp_kit.launch ft --groups N ... (it starts one), or set "
                        "TORCHFT_LIGHTHOUSE=http://host:29510 to a running torchft_lighthouse")
    if not (env.master_addr and env.master_port):
        raise UserError("strategy 'ft' needs its replica group's rendezvous store (MASTER_ADDR and MASTER_PORT), and "
                        "this process has none", "launch each replica group with torchrun, or all of them with "
                        "python -m ddp_kit.launch ft --groups N")
    pg_timeout = timedelta(seconds=timeouts.collective_s)
    pg = ProcessGroupNCCL(timeout=pg_timeout) if ctx.device.type == "cuda" else ProcessGroupGloo(timeout=pg_timeout)
    try:
        manager = Manager(pg=pg, min_replica_size=1, use_async_quorum=False,
                          load_state_dict=replica._load_state_dict, state_dict=replica._state_dict,
                          rank=ctx.rank, world_size=ctx.world_size,
                          store_addr=env.master_addr, store_port=env.master_port,
                          lighthouse_addr=env.lighthouse, replica_id=f"group{env.replica_group}",
                          timeout=pg_timeout, quorum_timeout=timedelta(seconds=timeouts.quorum_s),
                          connect_timeout=timedelta(seconds=timeouts.connect_s), quorum_retries=timeouts.quorum_retries)
    except Exception as exc:  # the lighthouse or the group's store cannot be reached: one line
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"replica group {env.replica_group} could not join the lighthouse at {env.lighthouse}: {first}",
                        "check that python -m ddp_kit.launch ft (or torchft_lighthouse) is running and reachable "
                        "from this node") from None
    manager._client = _EraQuorums(manager._client)  # quorum ids that survive a restarted lighthouse
    return manager


@dataclass(frozen=True)
class FaultTolerant(Strategy):
    def check_options(self, *, sync_bn: bool, amp: str | None = None, cpu_offload: bool = False,
                      device: Any = None, ddp: dict | None = None) -> None:
        if cpu_offload:
            raise UserError("cpu_offload is an FSDP option; this run's strategy is ft", "drop cpu_offload")
        if sync_bn:
            raise UserError("sync_bn does not combine with strategy ft: BatchNorm statistics would be synchronised "
                            "within a replica group only", "drop sync_bn (each rank keeps its own statistics)")
        if (ddp or {}).get("static_graph"):
            raise UserError("static_graph does not combine with strategy ft: DDP would rebuild its buckets, and a "
                            "restarted group's gradients would be laid out differently", "drop static_graph")

    def wrap(self, model: nn.Module, ctx: Any, *, ddp: dict[str, Any] | None = None, **_: Any) -> nn.Module:
        results, timeouts = os.environ.get(RESULTS, ""), Timeouts.from_environ(os.environ)
        replica = Replica(manager=None, group=ctx.env.replica_group, groups=ctx.env.replica_groups,
                          group_size=ctx.world_size, device=ctx.device, results=Path(results) if results else None,
                          join_timeout_s=timeouts.join_s)
        replica.manager = _manager(ctx, timeouts, replica)
        model = model.to(ctx.device)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        options = {**(ddp or {}), "find_unused_parameters": True}  # buckets never rebuilt (module docstring)
        options.pop("static_graph", None)
        wrapped = DDP(model, device_ids=device_ids, **options)
        wrapped.register_comm_hook(None, _comm_hook(replica, wrapped.process_group))
        wrapped._ddp_kit_replica = replica
        return wrapped

    def holds(self, model: nn.Module) -> bool:
        return replica_of(model) is not None

    def accumulate(self, model: nn.Module, sync: bool):
        return nullcontext() if sync else unwrap_ddp(model).no_sync()

    def step_hooks(self, models: list[Any], env: Any, attached: list[Any]) -> list[Any]:
        from .ft_steps import step_hooks  # torchft's quorum at the step boundary
        return step_hooks([r for r in map(replica_of, models) if r is not None], attached)


def replica_of(model: nn.Module) -> Replica | None:
    inner = unwrap_ddp(model)
    return getattr(inner, "_ddp_kit_replica", None) if inner is not None else None


STRATEGY = FaultTolerant(name="ft", label="fault-tolerant DDP (torchft)", sharded=False, keyword="ddp",
                         options=tuple(o for o in DDP_OPTIONS if o.name in ("bucket_cap_mb", "gradient_as_bucket_view")))

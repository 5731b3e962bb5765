"""The fault-tolerant strategy "ft": DDP inside a replica group, torchft between the groups.

Each replica group is a launch of its own (env/replicas.py): its ranks are the process group and
all-reduce gradients over it as DDP does; then torchft's manager averages them across the replica
groups of the current quorum. When a group dies, the others discard at most the step under way and
go on with the groups left (the lighthouse drops the dead one after its heartbeat timeout); when it
comes back, it joins the next quorum and receives the weights, optimizer state, data position and
step count live from a peer (torchft's HTTP transport), with no checkpoint read.

One step of a replica, driven by the step boundary (parallel/ft_steps.py):

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
import time
import types
from collections.abc import Callable, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
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
from .strategy import Strategy

INSTALL = "pip install 'ddp_kit[ft]' (torchft-nightly==2026.10.26)"
RESULTS = "DDP_KIT_FT_RESULTS"  # the launch's results folder (launch/ft.py names it too)
# torchft's Rust side logs every quorum and commit at INFO on stderr: several lines per step.
QUIET_RUST = ("RUST_LOG", "warn")


@dataclass(frozen=True)
class Timeouts:
    """Seconds; the defaults suit loopback and a LAN (docs/strategies.md, "Fault-tolerant training")."""

    collective_s: float = 10.0  # a cross-group all-reduce, should_commit, the live recovery's transfer
    quorum_s: float = 60.0  # one quorum: longer than a step, or groups split into two quorums
    connect_s: float = 10.0  # the lighthouse and the group's manager server
    join_s: float | None = None  # the lighthouse's join timeout, where the launcher states it (launch/ft.py)

    @property
    def quorum_retries(self) -> int:
        """How often the group's manager server asks the lighthouse again within one quorum timeout when
        the request fails (torchft's manager.rs: it waits timeout / (retries + 1), connects anew, asks
        again): about once a second, so that a lighthouse the launcher restarted (launch/ft.py) is found
        again while the quorum is still waited for."""
        return max(1, round(self.quorum_s))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Timeouts:
        read = lambda key, default: float(environ.get(key, "") or default)
        join = environ.get("DDP_KIT_FT_JOIN_TIMEOUT_S", "")
        return cls(read("DDP_KIT_FT_TIMEOUT_S", cls.collective_s), read("DDP_KIT_FT_QUORUM_TIMEOUT_S", cls.quorum_s),
                   read("DDP_KIT_FT_CONNECT_TIMEOUT_S", cls.connect_s), float(join) if join else None)


@dataclass
class Replica:
    """This rank's member of the torchft quorum and what the step boundary asks of it. One per
    process, made by the strategy's wrap; the counters are what metrics.jsonl reports."""

    manager: Any
    group: int
    groups: int
    group_size: int
    device: Any = "cpu"  # where the cross-group control tensors go (NCCL moves GPU tensors only)
    in_step: bool = False  # a quorum was formed for the step under way
    decision: bool | None = None  # this step's should_commit, once asked
    joined: bool = False
    participants: int = 0  # replica groups in the current quorum
    discarded: int = 0  # steps this group ran and threw away (total)
    quorum_s: float = 0.0  # seconds spent forming quorums since the last take_window
    pause_s: float = 0.0  # seconds the steps waited beyond the usual since the last take (FtHooks.counts)
    recoveries: list[dict] = field(default_factory=list)  # live recoveries of this group: step, seconds, source
    events: list[dict] = field(default_factory=list)  # for metrics.jsonl, taken by the boundary
    gated: list[Any] = field(default_factory=list)  # the optimizers whose step waits for the commit decision
    schedules: list[Any] = field(default_factory=list)  # the LR schedulers whose step follows that decision
    # The last optimizer step was discarded, and neither a new step nor an epoch has begun since: a
    # scheduler.step() now belongs to the discarded step (see gate_schedule).
    discarding: bool = False
    # The boundary's live state (the registered objects and counters) for a recovering peer, and
    # how to take one in: set by parallel/ft_steps.py.
    state_fn: Callable[[], dict] | None = None
    load_fn: Callable[[dict], None] | None = None
    # Called when a gated optimizer step is discarded: torch's step hooks, which drive a loop that
    # never calls run.step(), do not run then, and the step must still end at the boundary.
    on_discard: Callable[[], None] | None = None
    # Where the groups of one launch record that they finished the job (launch/ft.py sets RESULTS);
    # None for groups launched by hand.
    results: Path | None = None
    join_timeout_s: float | None = None  # the lighthouse's (launch/ft.py), named when a group was left out
    _healing_since: float | None = None

    # ---- the quorum -------------------------------------------------------------------------------

    def begin_step(self, timeout_s: float | None = None) -> None:
        """Form this step's quorum (once per step). A group that is behind is healed in here."""
        if self.in_step:
            return
        self.in_step, self.decision, self.discarding = True, None, False
        started = time.monotonic()
        self._healing_since = started
        timeout_s = None if timeout_s is None else max(timeout_s, 1.0)
        with _manager_calls(self.group, timeout_s):
            self.manager.start_quorum(timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
        took = time.monotonic() - started
        self.quorum_s += took
        before, self.participants = self.participants, self.manager.num_participants()
        if before and self.participants != before:
            self.events.append({"event": "quorum", "participants": self.participants, "was": before,
                                "quorum_s": round(took, 3)})

    def commit(self) -> bool:
        """This step counts in this group (every rank of it got through it, its share of the cross-group
        all-reduce included): torchft's should_commit, a vote inside the group, asked once per step
        whatever the number of optimizers. Another group may decide otherwise (module docstring)."""
        if self.decision is None:
            if not self.in_step:  # an optimizer step with no forward through the model: nothing to agree on
                self.begin_step()
            with _manager_calls(self.group):
                self.decision = bool(self.manager.should_commit())
            self.discarding = not self.decision
            if not self.decision:
                self.discarded += 1
        return self.decision

    def end_step(self) -> bool:
        """The step boundary: whether the step that just ended counts. The next one forms a new quorum."""
        counted = self.commit() if self.in_step else True
        self.in_step, self.decision = False, None
        return counted

    def step(self) -> int:
        """Optimizer steps committed by the quorum (a recovered group's count is its peer's)."""
        return int(self.manager.current_step())

    def set_step(self, step: int) -> None:
        """After a resume from a durable checkpoint: the quorum compares this count to heal the groups behind."""
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.group_size * self.groups})

    # ---- live recovery -----------------------------------------------------------------------------

    def _state_dict(self) -> dict:
        return {"ddp_kit": self.state_fn() if self.state_fn else {}, "group": self.group}

    def _load_state_dict(self, state: dict) -> None:
        if self.load_fn is not None:
            self.load_fn(state["ddp_kit"])
        took = time.monotonic() - (self._healing_since or time.monotonic())
        self.recoveries.append({"source_group": state.get("group"), "seconds": round(took, 3)})

    # ---- across groups -----------------------------------------------------------------------------

    def agree_max(self, *values: int) -> list[int]:
        """The largest of each value over the groups of the current quorum (collective across them, at
        the same step); this group's own when a group is lost on the way (that step is discarded anyway)."""
        if self.groups == 1:
            return list(values)
        t = torch.tensor([float(v) for v in values], device=self.device)
        work = self.manager.allreduce(t, reduce_op=tdist.ReduceOp.MAX)
        if not work.wait() or self.manager.errored():
            return list(values)
        return [max(v, int(x)) for v, x in zip(values, t.tolist())]

    def leads(self) -> bool:
        """This group is the first of the current quorum (the one that requeues a stopped job)."""
        return self.groups == 1 or self.manager.participating_rank() == 0

    def gate(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step() runs only when the quorum commits this step (the call a script makes is
        unchanged: the instance's step is replaced, torch's hooks run inside the original)."""
        if any(o is optimizer for o in self.gated):
            return
        original = optimizer.step

        def step(_optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if self.commit():
                return original(*args, **kwargs)
            if self.on_discard is not None:
                self.on_discard()
            return None
        # An LR scheduler made before this wrapped the step to see it called; keep its mark, or it warns
        # that the step was replaced (it still sees every committed step through the original).
        if getattr(original, "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True
        # A bound method, as torch's own: an LR scheduler made after this wraps `step.__func__`.
        optimizer.step = types.MethodType(step, optimizer)
        self.gated.append(optimizer)

    def gate_schedule(self, scheduler: Any) -> None:
        """scheduler.step() is skipped after a discarded optimizer step, so that the schedule counts the
        steps that count (a per-step schedule stays at the step count, in checkpoints too). A step called
        after the loader ran out (a per-epoch schedule) is not the discarded step's: it runs.

        The instance's class becomes a subclass of its own, under the same name: an LR scheduler's
        state_dict() is its __dict__, where a replaced `step` would be saved (and a checkpoint would no
        longer load into a plain scheduler)."""
        if any(s is scheduler for s in self.schedules):
            return
        cls = type(scheduler)
        replica = self

        def step(self_: Any, *args: Any, **kwargs: Any) -> Any:
            if replica.discarding:
                return None
            return cls.step(self_, *args, **kwargs)
        scheduler.__class__ = type(cls.__name__, (cls,), {"step": step, "__module__": cls.__module__,
                                                          "__qualname__": cls.__qualname__})
        self.schedules.append(scheduler)

    def epoch_ended(self) -> None:
        """The loader ran out: what steps now (a per-epoch schedule) is not the last step's."""
        self.discarding = False

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


@contextmanager
def _manager_calls(group: int, quorum_s: float | None = None):
    """torchft's calls to this group's manager server (hosted by the group's rank 0): when it is gone,
    its group rank 0 died, and the failure policy should name that rank rather than print an RPC error.
    quorum_s: the timeout of the quorum asked for here, when it is not the configured one."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        if "timeout" in first.lower() or "deadline" in first.lower():
            what = (f"DDP_KIT_FT_QUORUM_TIMEOUT_S, {Timeouts.from_environ(os.environ).quorum_s:g}s" if quorum_s is None
                    else f"{quorum_s:g}s")
            raise RuntimeError(f"replica group {group} got no quorum in time ({what}): the lighthouse or the other "
                               f"groups did not answer; Timed out: {first}") from exc
        if "lighthouse" in first.lower():  # the manager server answered: its request to the lighthouse failed
            raise RuntimeError(f"replica group {group} cannot reach torchft's lighthouse "
                               f"({os.environ.get('TORCHFT_LIGHTHOUSE', '?')}): {first}") from exc
        raise RuntimeError(f"replica group {group}'s manager server on its rank 0 does not answer (remote process "
                           f"exited?): {first}") from exc


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

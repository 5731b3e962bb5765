"""One rank's member of torchft's quorum under strategy ft (parallel/ft.py): Replica, what the strategy's
wrap, its comm hook and the step boundary's hooks (parallel/ft_steps.py) ask of it (the quorum, the commit
vote, live recovery, agreement across the replica groups, the gated optimizer and LR scheduler steps), and
the Timeouts its calls to torchft run under. It imports neither of those modules: both import it."""
from __future__ import annotations

import os
import time
import types
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from ..errors import UserError


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

"""What the step boundary does differently when the ranks are one replica group among several
(strategy "ft", parallel/ft.py): a rank is not a replica.

- A rank that fails still ends its own group (fail-fast, the watchdog and peer loss work within
  the group's process group, as always); the other groups go on, and its launcher restarts it.
- Each step starts with a quorum (at the loader's fetch); a step the quorum does not commit is
  discarded: the optimizer did not step, the step is not counted, and its batches are lost (not
  redone: the loader has moved on, as torchft's own sampler does).
- A restarted group recovers live: at `join` (before a checkpoint would be read) it takes a peer's
  registered objects, data position and step count, and its first step is checked against the
  others' weights.
- A fresh start (every group at step 0) waits, up to the startup timeout, until every group has
  joined, so that step 1 has every group, as an uninterrupted run and its resume both need.
- A stop signal is agreed across the groups too, so that every group saves the same step.
- A group that finishes the job records it (step and weights' digest) in the launch's results folder
  (launch/ft.py). A group that finds the job finished by another while it was away (it comes back
  alone, or its quorum shrinks to those left) ends without a result, and a group claims one (its
  summary.json) only with the finished group's step and weights: no group trains the last steps
  alone and reports weights that no other group has.
- metrics.jsonl gains participants, steps discarded, quorum and pause time per record, and one
  event per quorum change, recovery and discarded step; summary.json the totals.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..dist.collectives import broadcast_object
from ..errors import UserError
from ..hooks import STOP_PRIORITY, Boundary, StepHooks
from .digest import checksums, param_sha256

if TYPE_CHECKING:
    from .ft_replica import Replica

WAIT_NOTE_S = 5.0  # a fresh start waiting this long for the other groups says so, once


def step_hooks(replicas: list[Replica], attached: list[StepHooks]) -> list[StepHooks]:
    """The hook set of the replica member of a model just prepared with strategy ft; a second one is
    refused (each would have its own quorum)."""
    if len(replicas) + sum(isinstance(h, FtHooks) for h in attached) > 1:
        raise UserError("a second model was prepared with strategy ft: each would have its own quorum",
                        "wrap the models in one nn.Module and prepare that once")
    return [FtHooks(r) for r in replicas]


def _behind(r: Replica) -> str:
    """Why a running group was behind the quorum it just joined."""
    why = "it discarded or missed a step the others committed: each group decides its own commits"
    if r.groups >= 3 and r.join_timeout_s is not None:
        why += (f", and a group later than the lighthouse's join timeout ({r.join_timeout_s:g}s) at a quorum is left "
                f"out of it")
    return why


class FtHooks(StepHooks):
    """Strategy ft at the step boundary: this rank's member of its replica group's quorum."""

    across_groups = True

    def __init__(self, replica: Replica):
        self.replica = replica
        self.last_commit_t: float | None = None
        self.usual_s: float | None = None
        self.check_next = False  # a group recovered live: every group compares weights at the next stop check
        self.from_disk = False  # a recovery at the next quorum is from behind this group's checkpoint
        self.said_count = False
        self.claimed: bool | None = None

    def attach(self, b: Boundary) -> None:
        """The replica's live state is the boundary's registered objects."""
        replica = self.replica
        replica.state_fn = lambda: {"objects": b.state.state_dict(), "done": b.steps.done}
        replica.load_fn = lambda state: self._take_live_state(b, state)
        replica.on_discard = lambda: setattr(b.steps, "pending", not b.steps.explicit)  # the boundary still ends the step
        b.on_log.append(lambda record: record.update(self._window()))

    def gate(self, obj: object, scheduler: bool) -> None:
        """The optimizer steps only if the quorum commits; a schedule follows the same decision."""
        if scheduler:
            self.replica.gate_schedule(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            self.replica.gate(obj)

    def _take_live_state(self, b: Boundary, state: dict[str, Any]) -> None:
        notes = b.state.load_state_dict(state["objects"], "a peer replica group's live state")
        b.steps.done = int(state["done"])
        b.steps.jumped = True  # the loader's epoch is the peer's now
        b.restart_window(b.steps.done)
        b.progress.enter(b.progress.phase, b.steps.done)
        for note in notes:
            b.say(f"ddp_kit: warning: {note}")

    def restore(self, b: Boundary) -> bool:
        """Join the quorum before the first step. True: this group was behind a running peer and has
        recovered its state live (no checkpoint is to be read)."""
        r = self.replica
        if r.joined:
            return False
        r.joined = True
        if not b.loaders:
            raise UserError("strategy 'ft' forms each step's quorum when the loader from run.prepare fetches a batch, "
                            "and this run has none: the quorum would come after the gradients were exchanged",
                            "pass the training DataLoader to run.prepare(model, loader, optimizer, strategy='ft')")
        if not r.gated:
            raise UserError("strategy 'ft' decides at each step whether the optimizer step counts, and no optimizer is "
                            "registered", "pass the optimizer to run.prepare(model, loader, optimizer) or "
                            "run.resume(optimizer=optimizer)")
        started, said = time.monotonic(), False
        # A fresh start waits for every group, up to the startup timeout. A group its launcher restarted
        # takes the first quorum the lighthouse gives it, and waits for it as long as the other groups
        # live, up to the same timeout: the lighthouse holds its request while another group heartbeats
        # without asking (busy in an evaluation, a synchronous checkpoint, a long step: it asks at its next
        # batch, and then both are in), and answers at once with this group alone when no other group
        # heartbeats (they finished, or died): a majority of the live groups is needed (lighthouse.rs).
        restarted = b.ctx.env.restart_count > 0
        wanted, patience = (1 if restarted else r.groups), b.ctx.timeout_s
        while True:
            b.progress.enter("quorum", b.steps.done)
            r.begin_step(timeout_s=patience - (time.monotonic() - started) + 1.0)
            if r.recoveries and r.step() > 0:
                self._recovered(b, r.recoveries[-1], "no checkpoint read")
                r.events.clear()
                return True
            waited = time.monotonic() - started
            if r.participants >= wanted or waited > patience:
                break
            if not said and waited > WAIT_NOTE_S:
                said = True
                b.say(f"ddp_kit: waiting for the other replica groups at the lighthouse {b.ctx.env.lighthouse}: "
                      f"{r.participants} of {r.groups} joined (up to {patience:.0f}s, then the groups present start)")
            r.in_step = False
            time.sleep(0.2)
        r.recoveries.clear()  # step 0's weight sync between fresh groups is not a recovery
        r.events.clear()  # nor is the other groups' arrival
        if r.participants < r.groups:  # the others may be gone because they finished the job
            self._unless_finished(b)
        return False

    def _recovered(self, b: Boundary, rec: dict[str, Any], how: str) -> None:
        r = self.replica
        rec["step"] = b.steps.done
        b.say(f"ddp_kit: replica group {r.group} recovered live from group {rec['source_group']} at step "
              f"{b.steps.done} in {rec['seconds']:.2f}s ({how}); {r.participants} of {r.groups} groups train")
        b.write({"event": "recovery", "step": b.steps.done, **rec})
        self.check_next = True

    def restored_from_disk(self, b: Boundary) -> None:
        """After the join, when no peer's state was taken live (a checkpoint was read, or none was found):
        the quorum compares this step count (a group behind is healed at the next quorum), which the first
        step forms anew, in every group alike."""
        self.replica.set_step(b.steps.done)
        self.replica.in_step = False
        self.from_disk = True

    def before_batch(self, b: Boundary) -> None:
        """This step's quorum (and the join, for a script that never resumes); a group behind recovers
        here, before its batch."""
        r = self.replica
        if not r.joined:
            self.restore(b)
        if r.in_step:
            return
        b.progress.enter("quorum", b.steps.done + 1)
        seen = len(r.recoveries)
        r.begin_step()
        from_disk, self.from_disk = self.from_disk, False
        for rec in r.recoveries[seen:]:  # behind the others: healed at this quorum
            if r.step() > 0:  # (at step 0: torchft's first weight sync between fresh groups, not a recovery)
                self._recovered(b, rec, "after its own checkpoint" if from_disk else _behind(r))
        shrank = any(e["participants"] < e["was"] for e in r.events)
        for event in r.events:
            b.write({**event, "step": b.steps.done + 1})
        r.events.clear()
        if shrank and r.participants < r.groups:  # a group that left may have finished the job
            self._unless_finished(b)

    def epoch_ended(self, b: Boundary) -> None:
        self.replica.epoch_ended()

    def counts(self, b: Boundary) -> bool:
        """Whether the step that just ended counts (False: discarded by the quorum; its batches stay consumed)."""
        r = self.replica
        if not r.in_step:  # a step that formed no quorum (an optimizer stepped without a fetch): asked now
            r.begin_step()
        ok = r.end_step()
        now = time.monotonic()
        if not ok:
            b.write({"event": "step_discarded", "step": b.steps.done + 1, "participants": r.participants})
            return False
        last, usual = self.last_commit_t, self.usual_s
        if last is not None:
            gap = now - last
            if usual is not None and gap > 3 * usual + 0.25:  # a quorum change, not a slow step's noise
                r.pause_s += gap - usual
                b.write({"event": "replica_pause", "step": b.steps.done + 1, "paused_s": round(gap - usual, 3),
                         "participants": r.participants, "discarded_total": r.discarded})
            self.usual_s = gap if usual is None else min(gap, 0.8 * usual + 0.2 * gap)
        self.last_commit_t = now
        return True

    def after_step(self, b: Boundary) -> None:
        """After a counted step: the step count agrees with the quorum's."""
        r = self.replica
        if r.step() != b.steps.done and not self.said_count:
            self.said_count = True
            b.say(f"ddp_kit: warning: replica group {r.group} counts {b.steps.done} steps and its quorum {r.step()}: a "
                  f"step was counted that the quorum discarded (or the reverse)")

    def _check_weights(self, b: Boundary) -> None:
        r = self.replica
        if not b.modules or r.groups == 1:
            return
        mine = checksums([(n, p) for n, p in b.modules[0].named_parameters()]).reshape(-1).to(r.device)
        top = mine.clone()
        low = -mine
        ok_top = r.manager.allreduce(top, reduce_op=torch.distributed.ReduceOp.MAX).wait()
        ok_low = r.manager.allreduce(low, reduce_op=torch.distributed.ReduceOp.MAX).wait()
        if not (ok_top and ok_low) or r.manager.errored():
            return  # a group was lost on the way: the next quorum starts over
        equal = torch.equal(top, mine) and torch.equal(-low, mine)
        b.write({"event": "replica_weights_checked", "step": b.steps.done, "equal": equal,
                 "participants": r.participants})
        if not equal:
            b.say(f"ddp_kit: warning: after a replica group joined at step {b.steps.done}, the groups' weights differ "
                  f"(replica group {r.group}'s checksums are not every group's): the live recovery did not bring "
                  f"the same weights; stop the job and resume it from its last checkpoint")

    def agree_stop(self, b: Boundary, signum: int, due: int) -> tuple[int, int]:
        """A stop signal seen by any group stops every group after this same step, and a timed checkpoint
        due in any group is taken by all (each group's clock is its own: a save in one group alone would
        leave the others waiting in its next exchange). The same exchange says whether a group recovered
        live since the last one: then every group compares weights. All of it is collective across the
        groups of the quorum, at steps every group reaches: symmetric by design. (At a stop it is asked
        once more after the save: every group has saved before anyone requeues, which ends the job.)"""
        prio, recovered, due_any = self.replica.agree_max(STOP_PRIORITY.index(signum), int(self.check_next), int(due))
        self.check_next = False
        if recovered:
            self._check_weights(b)
        return STOP_PRIORITY[prio], int(due_any)

    def may_requeue(self, b: Boundary) -> bool:
        return bool(self.replica.leads())  # one group requeues the job

    def _window(self) -> dict[str, Any]:
        r = self.replica
        out = {"participants": r.participants, "steps_discarded": r.discarded, "quorum_s": round(r.quorum_s, 4),
               "paused_s": round(r.pause_s, 3), "recoveries": len(r.recoveries)}
        r.quorum_s = r.pause_s = 0.0
        return out

    def _unless_finished(self, b: Boundary) -> None:
        """End this group without a result if another group has finished the job (collective in the
        group: its rank 0 reads, every rank acts alike)."""
        r = self.replica
        record = broadcast_object(b.ctx, _finished(r.results, r.group) if b.ctx.is_main else None)
        if record is None:
            return
        b.say(f"ddp_kit: replica group {r.group} ends without a result: replica group {record['group']} finished the "
              f"job at step {record['step']} while this group was away (it is at step {b.steps.done}), and no group is "
              f"left to take the final weights from; the result is group {record['group']}'s (its run folder's "
              f"summary.json and last checkpoint)")
        b.write({"event": "ended_without_result", "step": b.steps.done, "finished_by": record["group"],
                 "finished_at": record["step"]})
        b.steps.stopped = True  # no final checkpoint, no summary: nothing here is the job's
        b.steps.exit_code = 0
        raise SystemExit(0)

    def may_report(self, b: Boundary) -> bool:
        """Whether this group may report the job done (write summary.json), asked by rank 0, which
        writes it: only with the step and weights of a group that finished before it. Then its own record
        goes into the results folder for the groups after it. Once per process; True without a results
        folder (groups launched by hand) or on the other ranks."""
        r = self.replica
        if r.results is None or not b.ctx.is_main:
            return True
        if self.claimed is not None:
            return self.claimed
        digest = param_sha256(b.modules[0]) if b.modules else None
        record = _finished(r.results, r.group)
        ok = record is None or (record["step"] == b.steps.done and record.get("param_sha256") == digest)
        self.claimed = ok
        if record is not None and not ok:
            b.say(f"ddp_kit: replica group {r.group} ends without a result: replica group {record['group']} finished "
                  f"the job at step {record['step']}, and this group's weights at step {b.steps.done} are not its; no "
                  f"summary.json here, the result is group {record['group']}'s")
            return False
        mine = {"group": r.group, "step": b.steps.done, "param_sha256": digest}
        tmp = r.results / f".group{r.group}.json.{os.getpid()}"
        tmp.write_text(json.dumps(mine))
        os.replace(tmp, r.results / f"group{r.group}.json")
        return True

    def summary(self, b: Boundary) -> dict[str, Any]:
        r = self.replica
        return {"replica_group": r.group, "replica_groups": r.groups, "steps_discarded": r.discarded,
                "live_recoveries": list(r.recoveries)}

    def close(self, b: Boundary) -> None:
        self.replica.shutdown()


# ---- the job's result: which groups hold it -------------------------------------------------------

def _finished(folder: Path | None, but: int) -> dict[str, Any] | None:
    """The record of a group other than `but` that finished the job (the lowest group's), or None."""
    if folder is None:
        return None
    for path in sorted(folder.glob("group*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):  # being written (it is renamed into place), or not ours
            continue
        if isinstance(record, dict) and record.get("group") != but:
            return record
    return None

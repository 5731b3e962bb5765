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
from typing import Any

import torch

from ..dist.collectives import broadcast_object
from ..errors import UserError
from ..reliability.preemption import PRIORITY
from ..reliability.recipe import is_scheduler
from ..reliability.sync_checks import checksums, param_sha256

# The StepBoundary (boundary.py) whose part this is; not imported, so that the parts sit below it.
Boundary = Any
Replica = Any  # parallel.ft.Replica (not imported: torch's DDP and torchft stay out of the boundary's imports)

WAIT_NOTE_S = 5.0  # a fresh start waiting this long for the other groups says so, once


def attach(b: Boundary, replica: Replica) -> None:
    """Make `replica` part of the boundary: its live state is the boundary's registered objects."""
    b.replica = replica
    replica.state_fn = lambda: {"objects": b.state.state_dict(), "done": b.done}
    replica.load_fn = lambda state: _take_live_state(b, state)
    replica.on_discard = lambda: setattr(b, "pending", not b.explicit)  # the boundary still ends the step
    b.on_log.append(lambda record: record.update(_window(b)))
    for optimizer in b.optimizers:  # registered before the model was prepared
        replica.gate(optimizer)
    for obj in b.state.objects.values():  # and the schedules over them
        if is_scheduler(obj):
            replica.gate_schedule(obj)
    b.replica_seen = {"last_commit_t": None, "usual_s": None, "check_next": False}


def attach_models(b: Boundary, chosen: Any, models: list) -> None:
    """After run.prepare wrapped `models` with `chosen`: attach the replica member of a fault-tolerant
    strategy's model; refuse a second one, and a strategy that nothing averages across replica groups."""
    env = b.ctx.env
    for model in models:
        replica = chosen.replica(model)
        if replica is None:
            continue
        if b.replica is not None:
            raise UserError("a second model was prepared with strategy ft: each would have its own quorum",
                            "wrap the models in one nn.Module and prepare that once")
        attach(b, replica)
    if env.replica_groups > 1 and b.replica is None:
        raise UserError(f"this process is replica group {env.replica_group} of {env.replica_groups}, and its model was "
                        f"prepared with strategy {chosen.name}, which nothing averages across the groups: each would "
                        f"train a model of its own on 1/{env.replica_groups} of the data",
                        "pass strategy='ft' to run.prepare (--strategy ft), or launch without python -m ddp_kit.launch ft")


def _take_live_state(b: Boundary, state: dict) -> None:
    notes = b.state.load_state_dict(state["objects"], "a peer replica group's live state")
    b.done = int(state["done"])
    b.records.restart_window(b.done)
    b.progress.enter(b.progress.phase, b.done)
    for note in notes:
        b.say(f"ddp_kit: warning: {note}")


def join(b: Boundary) -> bool:
    """Join the quorum before the first step. True: this group was behind a running peer and has
    recovered its state live (no checkpoint is to be read)."""
    r = b.replica
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
        b.progress.enter("quorum", b.done)
        r.begin_step(timeout_s=patience - (time.monotonic() - started) + 1.0)
        if r.recoveries and r.step() > 0:
            _recovered(b, r.recoveries[-1], "no checkpoint read")
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
        _unless_finished(b)
    return False


def _behind(r: Replica) -> str:
    """Why a running group was behind the quorum it just joined."""
    why = "it discarded or missed a step the others committed: each group decides its own commits"
    if r.groups >= 3 and r.join_timeout_s is not None:
        why += (f", and a group later than the lighthouse's join timeout ({r.join_timeout_s:g}s) at a quorum is left "
                f"out of it")
    return why


def _recovered(b: Boundary, rec: dict, how: str) -> None:
    r = b.replica
    rec["step"] = b.done
    b.say(f"ddp_kit: replica group {r.group} recovered live from group {rec['source_group']} at step {b.done} in "
          f"{rec['seconds']:.2f}s ({how}); {r.participants} of {r.groups} groups train")
    b.write({"event": "recovery", "step": b.done, **rec})
    b.replica_seen["check_next"] = True


def resumed_from_disk(b: Boundary) -> None:
    """After the join, when no peer's state was taken live (a checkpoint was read, or none was found):
    the quorum compares this step count (a group behind is healed at the next quorum), which the first
    step forms anew, in every group alike."""
    b.replica.set_step(b.done)
    b.replica.in_step = False
    b.replica_seen["from_disk"] = True  # a recovery at the next quorum is from behind this checkpoint


def begin(b: Boundary) -> None:
    """At the loader's fetch: this step's quorum (and the join, for a script that never resumes)."""
    r = b.replica
    if not r.joined:
        join(b)
    if r.in_step:
        return
    b.progress.enter("quorum", b.done + 1)
    seen = len(r.recoveries)
    r.begin_step()
    from_disk = b.replica_seen.pop("from_disk", False)
    for rec in r.recoveries[seen:]:  # behind the others: healed at this quorum
        if r.step() > 0:  # (at step 0: torchft's first weight sync between fresh groups, not a recovery)
            _recovered(b, rec, "after its own checkpoint" if from_disk else _behind(r))
    shrank = any(e["participants"] < e["was"] for e in r.events)
    for event in r.events:
        b.write({**event, "step": b.done + 1})
    r.events.clear()
    if shrank and r.participants < r.groups:  # a group that left may have finished the job
        _unless_finished(b)


def counted(b: Boundary) -> bool:
    """At the boundary: whether the step that just ended counts (False: discarded by the quorum)."""
    r = b.replica
    if not r.in_step:  # a step that formed no quorum (an optimizer stepped without a fetch): asked now
        r.begin_step()
    ok = r.end_step()
    seen, now = b.replica_seen, time.monotonic()
    if not ok:
        b.write({"event": "step_discarded", "step": b.done + 1, "participants": r.participants})
        return False
    last, usual = seen["last_commit_t"], seen["usual_s"]
    if last is not None:
        gap = now - last
        if usual is not None and gap > 3 * usual + 0.25:  # a quorum change, not a slow step's noise
            r.pause_s += gap - usual
            b.write({"event": "replica_pause", "step": b.done + 1, "paused_s": round(gap - usual, 3),
                     "participants": r.participants, "discarded_total": r.discarded})
        seen["usual_s"] = gap if usual is None else min(gap, 0.8 * usual + 0.2 * gap)
    seen["last_commit_t"] = now
    return True


def after_step(b: Boundary) -> None:
    """After a counted step: the step count agrees with the quorum's."""
    r = b.replica
    if r.step() != b.done and not b.replica_seen.get("said_count"):
        b.replica_seen["said_count"] = True
        b.say(f"ddp_kit: warning: replica group {r.group} counts {b.done} steps and its quorum {r.step()}: a step "
              f"was counted that the quorum discarded (or the reverse)")


def _check_weights(b: Boundary) -> None:
    r = b.replica
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
    b.write({"event": "replica_weights_checked", "step": b.done, "equal": equal, "participants": r.participants})
    if not equal:
        b.say(f"ddp_kit: warning: after a replica group joined at step {b.done}, the groups' weights differ "
              f"(replica group {r.group}'s checksums are not every group's): the live recovery did not bring "
              f"the same weights; stop the job and resume it from its last checkpoint")


def agree_stop(b: Boundary, signum: int, due: bool = False) -> tuple[int, bool]:
    """A stop signal seen by any group stops every group after this same step, and a timed checkpoint
    due in any group is taken by all (each group's clock is its own: a save in one group alone would
    leave the others waiting in its next exchange). The same exchange says whether a group recovered
    live since the last one: then every group compares weights. All of it is collective across the
    groups of the quorum, at steps every group reaches: symmetric by design."""
    if b.replica is None:
        return signum, due
    prio, recovered, due = b.replica.agree_max(PRIORITY.index(signum), int(b.replica_seen["check_next"]), int(due))
    b.replica_seen["check_next"] = False
    if recovered:
        _check_weights(b)
    return PRIORITY[prio], bool(due)


def _window(b: Boundary) -> dict[str, Any]:
    r = b.replica
    out = {"participants": r.participants, "steps_discarded": r.discarded, "quorum_s": round(r.quorum_s, 4),
           "paused_s": round(r.pause_s, 3), "recoveries": len(r.recoveries)}
    r.quorum_s = r.pause_s = 0.0
    return out


# ---- the job's result: which groups hold it -------------------------------------------------------

def _finished(folder: Path | None, but: int) -> dict | None:
    """The record of a group other than `but` that finished the job (the lowest group's), or None."""
    if folder is None:
        return None
    for path in sorted(folder.glob("group*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):  # being written (it is renamed into place), or not ours
            continue
        if record.get("group") != but:
            return record
    return None


def _unless_finished(b: Boundary) -> None:
    """End this group without a result if another group has finished the job (collective in the
    group: its rank 0 reads, every rank acts alike)."""
    r = b.replica
    record = broadcast_object(b.ctx, _finished(r.results, r.group) if b.ctx.is_main else None)
    if record is None:
        return
    b.say(f"ddp_kit: replica group {r.group} ends without a result: replica group {record['group']} finished the job "
          f"at step {record['step']} while this group was away (it is at step {b.done}), and no group is left to take "
          f"the final weights from; the result is group {record['group']}'s (its run folder's summary.json and last "
          f"checkpoint)")
    b.write({"event": "ended_without_result", "step": b.done, "finished_by": record["group"],
             "finished_at": record["step"]})
    b.stopped = True  # no final checkpoint, no summary: nothing here is the job's
    b.exit_code = 0
    raise SystemExit(0)


def claim(b: Boundary) -> bool:
    """Whether this group may report the job done (write summary.json), asked by rank 0, which
    writes it: only with the step and weights of a group that finished before it. Then its own record
    goes into the results folder for the groups after it. Once per process; True without a results
    folder (groups launched by hand) or on the other ranks."""
    r = b.replica
    if r is None or r.results is None or not b.ctx.is_main:
        return True
    if "claim" in b.replica_seen:
        return b.replica_seen["claim"]
    digest = param_sha256(b.modules[0]) if b.modules else None
    record = _finished(r.results, r.group)
    ok = record is None or (record["step"] == b.done and record.get("param_sha256") == digest)
    b.replica_seen["claim"] = ok
    if not ok:
        b.say(f"ddp_kit: replica group {r.group} ends without a result: replica group {record['group']} finished the "
              f"job at step {record['step']}, and this group's weights at step {b.done} are not its; no summary.json "
              f"here, the result is group {record['group']}'s")
        return False
    mine = {"group": r.group, "step": b.done, "param_sha256": digest}
    tmp = r.results / f".group{r.group}.json.{os.getpid()}"
    tmp.write_text(json.dumps(mine))
    os.replace(tmp, r.results / f"group{r.group}.json")
    return True


def summary(b: Boundary) -> dict[str, Any]:
    r = b.replica
    if r is None:
        return {}
    return {"replica_group": r.group, "replica_groups": r.groups, "steps_discarded": r.discarded,
            "live_recoveries": list(r.recoveries)}

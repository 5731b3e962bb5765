"""sync_fix rollback: the sync check found that the ranks' weights differ. With 3 or more replicas the majority
(reliability/sdc.py) names the ranks that differ and their hosts, and every rank rolls back, in this process, to
the newest checkpoint (durable, or the memory tier's copy) at or before the last step the ranks agreed on. Not to
the majority's weights: in DDP the corrupt rank's gradients entered every rank's update since the flip.

Everything registered is restored by resume.restore (models, optimizers, schedulers, the loaders' position, the
RNG, the step count), and the loop goes on: a loader from run.prepare continues from the restored position at its
next batch (TrainLoader's moves), run.step() and run.steps_done give the restored step, run.epochs reads the
loader's epoch anew. What came after the agreed step is suspect: the durable steps move to the archive (as at a
resume from an older step), metrics.jsonl's records of them too, and the memory tier's newer copies are dropped.

The run ledger gets a rollback line. A host whose ranks disagree a second time in the run (its rollback lines)
ends the attempt with verdict infrastructure naming it (errors.Unhealthy), which the health gate leaves out at the
next start where the launcher can (preflight/leave.py). No majority (2 replicas, a tie), or no checkpoint old
enough: every rank stops with one line, once what came after the agreement is set aside as at a rollback (the
durable steps archived, the other tiers' newer copies dropped), so that the rerun resumes where the ranks agreed,
never from a copy taken after the flip (each rank its own memory copy, the corrupt one's too). docs/sdc.md."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..dist.collectives import all_same, broadcast_object, rank0_verdict
from ..errors import Unhealthy, UserError
from ..parallel.digest import checksums
from ..reliability.sdc import Divergence, divergence
from ..reliability.sync_checks import state_tensors
from ..run_account import LEDGER
from ..run_account_records import read
from .checkpoint_io import archive_folder
from .resume import restore

if TYPE_CHECKING:  # the core imports its parts: they name what they use of it (protocol.py), not the core
    from ..hooks import Tier
    from .protocol import Boundary


@dataclass(frozen=True)
class Target:
    """The step to roll back to: the tier that holds it, its Found, and the durable tier's newest step at or
    before the agreed one (None: none; the memory tier's copy is newer)."""
    tier: Tier
    found: Any
    durable: int | None


@dataclass(frozen=True)
class Kept:
    """What the tiers hold at or before the agreed step, once what is newer is set aside (set_aside): the durable
    tier's newest step (None: none), another tier's newer copy (its tier and Found; None: none), and whether
    anything newer was set aside."""
    durable: int | None
    copy: tuple[Tier, Any] | None
    moved: bool

    def restart(self, who: str) -> str:
        """'a rerun resumes from step N' (`who`: a rerun, a restart), or starts from the beginning."""
        step = max((s for s in (self.durable, self.copy[1].step if self.copy else None) if s is not None), default=None)
        return f"{who} resumes from step {step}" if step is not None else f"{who} starts from the beginning"


def check(b: Boundary, done: int, extra: list[tuple[str, torch.Tensor]]) -> bool:
    """The sync check at step `done` under sync_fix rollback: False when the ranks agree; True once every
    rank has rolled back. Collective; raises, on every rank alike, when it cannot roll back (also at the clean
    end: the loop is over, ending.py), once what came after the agreement is set aside: a rerun resumes where
    the ranks agreed, never from a suspect copy."""
    d = detect(b, done, extra)
    if d is None:
        return False
    agreed = b.steps.synced  # the previous check, or where this attempt (or a rollback) restored one state
    if not d.vote.majority:
        kept = set_aside(b, agreed)
        raise UserError(f"parameters diverged across ranks at step {done} (sync check): {d.where()}; {d.no_majority()}"
                        f"{_moved(kept, agreed)}",
                        f"{kept.restart('a rerun')}; with 3 or more ranks the majority names the rank and every rank rolls "
                        f"back (sync_fix rollback); if it repeats, check the hosts' GPUs (nvidia-smi -q -d ECC)",
                        verdict=True)
    before, repeated = _disagreed_before(b, d)
    kept = set_aside(b, agreed)
    if repeated:  # the same ranks at the same step, on other hosts: what follows the ranks is the program
        raise UserError(f"parameters diverged across ranks at step {done} (sync check): {d.who()}, as at {repeated} "
                        f"on other hosts; a divergence that follows the ranks to other hosts at the same step is the "
                        f"program's (code or data that differs by rank), not a device's{_moved(kept, agreed)}",
                        "look for what differs by rank between the steps (an update only one rank makes, a rank's own "
                        "random seed in the model, a buffer set from rank-local data); sync_fix error stops at the "
                        "first divergence", verdict=True)
    if before:
        raise _again(d, before, kept)
    if b.steps.finishing:  # the loop is over: the steps since `agreed` cannot be trained again in this process
        raise UserError(f"parameters diverged across ranks at step {done} (checked before the final checkpoint), "
                        f"silent data corruption suspected: {d.who()}; the training loop has ended, so the final "
                        f"checkpoint is not saved{_moved(kept, agreed)}",
                        f"{kept.restart('a rerun')} and trains the steps after it again; if it repeats, check that "
                        f"host's GPU (nvidia-smi -q -d ECC)", verdict=True)
    target = _target(b, kept)
    if target is None:
        raise _nothing_agreed(b, d, agreed, kept)
    roll_back(b, d, agreed, target)
    return True


def _moved(kept: Kept, agreed: int) -> str:
    """'; the checkpoints after step N are set aside ...' when set_aside moved any, for the line that stops."""
    return (f"; the checkpoints after step {agreed} are set aside (moved to the archive, memory copies dropped)"
            if kept.moved else "")


def _nothing_agreed(b: Boundary, d: Divergence, agreed: int, kept: Kept) -> UserError:
    """No checkpoint at or before the agreed step: the line says why, and what a rerun does."""
    every, ckpt_every = b.policy.sync_check_every, b.policy.ckpt_every
    found = f"parameters diverged across ranks at step {d.step} (sync check), silent data corruption suspected: {d.who()}"
    divides = isinstance(ckpt_every, int) and ckpt_every > 0 and every % ckpt_every == 0
    how = "" if divides else f"make ckpt_every a divisor of sync_check_every (e.g. ckpt_every {every}), or "
    if agreed == 0:  # the first check of a fresh start: the ranks agreed at step 0 only, and no checkpoint holds it
        later = ("a divergence at a later sync check rolls back in process" if divides else
                 f"for a later sync check to roll back in process, {how}turn on mem_ckpt_every {every}")
        return UserError(f"{found}; this is the run's first sync check: the ranks agreed only at the start, which no "
                         f"checkpoint holds, so there is no agreed state to roll back to{_moved(kept, agreed)}",
                         f"{kept.restart('a rerun')}; {later}; if it repeats, check that host's GPU (nvidia-smi -q -d "
                         f"ECC)", verdict=True)
    return UserError(f"{found}; no checkpoint at or before step {agreed} (the last step the ranks agreed) to roll "
                     f"back to{_moved(kept, agreed)}",
                     f"{kept.restart('a rerun')}; to roll back in process next time, {how}turn on mem_ckpt_every "
                     f"{every}", verdict=True)


def detect(b: Boundary, done: int, extra: list[tuple[str, torch.Tensor]]) -> Divergence | None:
    """None when every rank holds the same checksum table; else the vote (reliability/sdc.py). Collective."""
    if b.ctx.world_size == 1:
        return None
    compared = _compared(b, extra)
    table = checksums(compared).cpu()  # on a GPU, the one device->host read of a sync-check step
    if all_same(b.ctx, table.numpy().tobytes()):
        return None
    return divergence(b.ctx, table, [n for n, _ in compared], done)


def _compared(b: Boundary, extra: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Every registered model's compared tensors (named model<i>.<name> when there are several), then `extra`."""
    out = []
    for i, model in enumerate(b.models):
        prefix = f"model{i}." if len(b.models) > 1 else ""
        out += [(prefix + n.removeprefix("module.").removeprefix("_orig_mod."), t) for n, t in state_tensors(model)]
    return out + list(extra)


def set_aside(b: Boundary, agreed: int) -> Kept:
    """What came after step `agreed` may hold the corruption: the durable steps move to the archive (rank 0;
    `latest` names the newest step kept, removed when none, before any move; every rank waits), and another
    tier's newer copy is dropped. Returns what the tiers still hold at or before `agreed`. Collective."""
    def warn(msg: str) -> None:
        b.say(f"ddp_kit: warning: {msg}")

    if b.rd is None:  # no run folder: no checkpoint of any tier
        return Kept(None, None, False)
    rd = b.rd
    for tier in b.tiers:
        tier.wait()  # a save still being written is complete: it is listed, or moved aside, whole
    steps = _durable_steps(b)
    kept = max((s for s in steps if s <= agreed), default=None)
    best: tuple[Tier, Any] | None = None
    suspect: list[Tier] = []
    for tier in b.tiers[1:]:  # each find is collective: every rank asks every tier
        found = tier.find(b, kept, warn)  # its newest copy above the durable one, if any
        if found is not None and found.step <= agreed:
            best = (tier, found) if best is None or found.step > best[1].step else best
        elif found is not None:
            suspect.append(tier)  # its newest copy is after the agreement (an older one is not asked for)
    for tier in suspect:
        tier.clear()  # each rank its own copy: the corrupt rank's too
    newer = any(s > agreed for s in steps)
    if newer:
        ckpt = b.checkpointer()
        rank0_verdict(b.ctx, lambda: ckpt.archive(kept, archive_folder(ckpt, rd)))
    return Kept(kept, best, newer or bool(suspect))


def _target(b: Boundary, kept: Kept) -> Target | None:
    """The newest complete step `kept` names across the tiers; None when no tier holds one."""
    if kept.copy is not None:
        return Target(kept.copy[0], kept.copy[1], kept.durable)
    if kept.durable is None:
        return None
    warn = lambda msg: b.say(f"ddp_kit: warning: {msg}")
    durable = b.checkpointer().find("auto", warn)  # `kept`, or an older valid one when it is damaged (said)
    return Target(b.tiers[0], durable, kept.durable) if durable is not None else None


def _durable_steps(b: Boundary) -> list[int]:
    """The committed steps at the durable location, newest first (rank 0 lists them, every rank gets them)."""
    location = b.checkpointer().location

    def listing() -> list[int]:
        from ..checkpoint import steps
        from ..checkpoint.storage_registry import open_storage

        return steps.committed(steps.objects(open_storage(location)))
    return list(rank0_verdict(b.ctx, listing))


def roll_back(b: Boundary, d: Divergence, agreed: int, target: Target) -> None:
    """Every rank restores `target` and goes on from its step; said once, and told to the ledger."""
    if b.policy.log_every and b.steps.done > b.records.last_log[1]:
        b.log()  # the abandoned steps' record (moved aside below); their time stays in the ledger's window
    meta = restore(b, target.tier, target.found, None, settle=False, say=False)
    step = b.steps.done
    if not target.tier.durable:  # not durable until saved durably, as at a resume from the memory tier
        b.steps.saved = target.durable if target.durable is not None else -1
    b.steps.resumed_from, b.steps.resumed_path = step, target.found.path
    b.steps.synced = step  # the ranks agree here from now on
    b.steps.jumped = True  # run.epochs reads the loader's epoch anew
    b.steps.owed = set()  # saves the abandoned step deferred to the epoch's end
    for tier in b.tiers[1:]:
        tier.continues_from(step)
    if b.writer is not None and b.rd is not None:
        b.writer.supersede(step, b.rd.archive)  # metrics.jsonl describes one run: the steps trained again are not in it twice
    where = "the last step the ranks agreed" if step == agreed else f"the newest checkpoint at or before step {agreed}, the last step the ranks agreed"
    copy = f"; from {target.found.path}" if not target.tier.durable else ""  # the memory tier's words for its copy
    b.say(f"ddp_kit: silent data corruption suspected at step {d.step}: {d.who()}; rolled back to step {step} "
          f"({where}{copy}); {d.step - step} step{'s' if d.step - step != 1 else ''} to train again")
    b.tell({"event": "rollback", "step": d.step, "to": step, "lost": d.step - step, "agreed": agreed,
            "ranks": list(d.suspects), "hosts": [d.hosts[r] for r in d.suspects], "majority": list(d.vote.majority),
            "tier": target.tier.name})
    for hook in b.hooks:  # as after run.resume: the services see the step go back (keep_best's scores, the trackers)
        hook.resumed(b, meta)


def _disagreed_before(b: Boundary, d: Divergence) -> tuple[dict[str, str], str]:
    """({host: when} for the suspect hosts whose ranks disagreed with the majority before in this run, and where
    the same ranks disagreed at the same step before on other hosts ('' if never: on the same host, a fault that
    stays there, a stuck memory cell, repeats as a program would; the host is left out first, and a repeat
    elsewhere tells): the run ledger's rollback lines, read by rank 0; every rank gets the same."""
    hosts, ranks = d.suspect_hosts(), list(d.suspects)

    def seen() -> tuple[dict[str, str], str]:
        try:
            records = read(b.rd.path / LEDGER)[0] if b.rd is not None else []
        except OSError:  # no ledger: nothing known before
            records = []
        out: dict[str, str] = {}
        repeated = ""
        for r in records:
            if r.get("event") == "rollback" and isinstance(r.get("hosts"), list):
                for h in r["hosts"]:
                    if h in hosts:
                        out.setdefault(h, f"step {r.get('step')} of attempt {r.get('attempt')}")
                if r.get("step") == d.step and r.get("ranks") == ranks and not set(r["hosts"]) & set(hosts):
                    repeated = repeated or f"step {d.step} of attempt {r.get('attempt')}"
        return out, repeated
    before, repeated = broadcast_object(b.ctx, seen() if b.ctx.is_main else None)
    return before, repeated


def _again(d: Divergence, before: dict[str, str], kept: Kept) -> Unhealthy:
    """The second disagreement of a host: the attempt ends naming it (verdict infrastructure), once what came
    after the agreement is set aside."""
    hosts = list(before)
    then = "; ".join(f"{h} at {when}" for h, when in before.items())
    return Unhealthy(f"silent data corruption suspected at step {d.step}, a second time on {', '.join(hosts)}: "
                     f"{d.who()} (the first: {then}); {kept.restart('a restart')}",
                     f"drain {', '.join(hosts)} and check its GPU (nvidia-smi -q -d ECC, Xid lines in its kernel log); "
                     f"the health gate leaves it out at the next start where the launcher can (SLURM, elastic torchrun); "
                     f"if it then repeats at step {d.step} on other hosts, it is the program's and says so",
                     hosts)

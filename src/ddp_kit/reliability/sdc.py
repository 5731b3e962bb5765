"""Silent data corruption: when the sync check finds that the ranks' weights differ, which rank is wrong.

Every rank's whole checksum table (sync_checks: parameters, buffers, optimizer steps) is one vote; ranks
with identical tables form a group, and a group of more than half the ranks is taken as the truth. The
ranks outside it, and their hosts, are named. With 2 replicas, or a tie (2-2), no group is a majority and
nothing tells which side is wrong. The rollback that follows is the step boundary's (boundary/rollback.py;
docs/sdc.md).

Only on a mismatch: a 16-character digest per rank to every rank (the vote is the same everywhere), the
reference rank's table to every rank, and each differing rank's tensor names and host to rank 0, which
sends the verdict to all."""
from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from ..dist import DistContext
from ..dist.collectives import all_gather_object, broadcast_object, gather_object
from ..preflight.peers import host_name

SHOWN = 3  # tensor names said per rank


@dataclass(frozen=True)
class Vote:
    """The ranks whose tables form a strict majority (empty: no majority), and every other rank."""
    majority: tuple[int, ...]
    minority: tuple[int, ...]


def vote(tables: Sequence[Hashable]) -> Vote:
    """`tables[r]` is rank r's whole checksum table (or its digest): ranks with equal tables are one group,
    and the group of more than half the ranks is the majority. Without one, every rank is in `minority`."""
    groups: dict[Hashable, list[int]] = {}
    for rank, table in enumerate(tables):
        groups.setdefault(table, []).append(rank)
    best = max(groups.values(), key=len, default=[])
    if 2 * len(best) <= len(tables):
        return Vote((), tuple(range(len(tables))))
    return Vote(tuple(best), tuple(r for r in range(len(tables)) if r not in best))


@dataclass(frozen=True)
class Divergence:
    """What the vote found at a sync check: who differs from the reference rank (the majority's first rank,
    rank 0 without a majority), on which tensors, on which host."""
    step: int
    vote: Vote
    reference: int
    differ: dict[int, tuple[str, ...]]  # rank: the tensors whose checksums differ from the reference's
    hosts: dict[int, str]  # rank: its host, for every rank in `differ`
    world_size: int

    @property
    def suspects(self) -> tuple[int, ...]:
        return tuple(sorted(self.differ))

    def suspect_hosts(self) -> list[str]:
        return list(dict.fromkeys(self.hosts[r] for r in self.suspects))

    def names(self, rank: int) -> str:
        ns = self.differ[rank]
        return ", ".join(ns[:SHOWN]) + (" ..." if len(ns) > SHOWN else "")

    def who(self) -> str:
        """'rank 2 (host nodeb) disagrees with ranks 0,1,3 on fc1.weight' (the majority's view)."""
        others = ",".join(map(str, self.vote.majority))
        if len(self.suspects) == 1:
            r = self.suspects[0]
            return f"rank {r} (host {self.hosts[r]}) disagrees with ranks {others} on {self.names(r)}"
        ranks = ", ".join(f"{r} (host {self.hosts[r]})" for r in self.suspects)
        return (f"ranks {ranks} disagree with ranks {others} ("
                + "; ".join(f"rank {r} on {self.names(r)}" for r in self.suspects) + ")")

    def where(self) -> str:
        """'rank 1 (host nodea): fc1.weight' per rank that differs from rank 0 (no majority)."""
        return "; ".join(f"rank {r} (host {self.hosts[r]}): {self.names(r)}" for r in self.suspects)

    def no_majority(self) -> str:
        if self.world_size == 2:
            return "with 2 replicas there is no majority to tell which rank is wrong"
        return f"no majority among the {self.world_size} replicas to tell which rank is wrong (no group of ranks agrees)"


def divergence(ctx: DistContext, table: torch.Tensor, names: Sequence[str], step: int) -> Divergence:
    """The vote over every rank's `table` (checksums, on the CPU, one row per name) and who differs from
    the reference rank. Collective; call it only once the tables are known to differ."""
    digest = hashlib.sha256(table.numpy().tobytes()).hexdigest()[:16]
    v = vote(all_gather_object(ctx, digest))
    reference = v.majority[0] if v.majority else 0
    ref = table.to(ctx.control_device).clone()
    tdist.broadcast(ref, src=reference, group=ctx.control_group)
    rows = (table != ref.cpu()).any(dim=1).nonzero().flatten().tolist() if ctx.rank != reference else []
    mine = (ctx.rank, tuple(names[i] for i in rows), host_name()) if rows else None
    gathered = gather_object(ctx, mine)
    found = broadcast_object(ctx, [g for g in gathered if g] if ctx.is_main and gathered else None)
    return Divergence(step, v, reference, {r: ns for r, ns, _ in found}, {r: h for r, _, h in found}, ctx.world_size)

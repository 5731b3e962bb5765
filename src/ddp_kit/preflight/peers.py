"""The gate's checks between nodes: which ranks share a host, each host's clock against rank 0's, and the
links between hosts timed point to point, each compared with its peers' median. Collective: every rank
calls each function, in the same order; only a host's first rank (its leader) sends or samples for it."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from ..dist import DistContext
from ..dist.collectives import all_gather_object, barrier
from ..env.facts import host_name  # this host's one name (the ledger's and the verdicts' too)
from .results import Result

LINK_SLOW = 0.25  # a link (or a host's links) below this share of the median link is named
LINK_FLOOR_S = 0.02  # ... and only when its transfer took this long: below it, scheduling noise decides
LINK_PEERS = 3  # a single slow link is named only against the median of at least this many other links
CLOCK_BOUND_S = 2.0  # the run lease and the ledger's times tolerate this much between hosts


@dataclass(frozen=True)
class Layout:
    hosts: tuple[str, ...]  # every rank's host, in rank order
    rank: int

    @property
    def host(self) -> str:
        return self.hosts[self.rank]

    @property
    def leaders(self) -> list[int]:
        """The first rank of each host, in rank order."""
        first: dict[str, int] = {}
        for r, h in enumerate(self.hosts):
            first.setdefault(h, r)
        return list(first.values())

    @property
    def is_leader(self) -> bool:
        return self.rank in self.leaders


def layout(ctx: DistContext) -> Layout:
    return Layout(tuple(all_gather_object(ctx, host_name())), ctx.rank)


def clock(ctx: DistContext, lay: Layout, bound_s: float = CLOCK_BOUND_S, rounds: int = 3) -> list[Result]:
    """Each host's wall clock against the others': every rank reads its clock as a barrier releases it, a few
    times, and the reading closest to rank 0's counts (a barrier releases the ranks within a round trip). The
    reference is the median host's clock (with three hosts or more: the odd one out is named, rank 0's host
    too); with two, rank 0's, and the line says that either may be the one off."""
    t0 = time.perf_counter()
    best: list[float] | None = None
    for _ in range(rounds):
        barrier(ctx)
        now = all_gather_object(ctx, time.time())
        offsets = [t - now[0] for t in now]
        best = offsets if best is None else [min(a, b, key=abs) for a, b in zip(best, offsets)]
    assert best is not None
    return judge_clocks({lay.hosts[r]: best[r] for r in lay.leaders}, bound_s, time.perf_counter() - t0)


def judge_clocks(offsets: dict[str, float], bound_s: float = CLOCK_BOUND_S, spent: float = 0.0) -> list[Result]:
    """Results from {host: its clock less the first host's}, the first host being rank 0's."""
    hosts = list(offsets)
    if len(hosts) < 2:
        return []
    ref = statistics.median(offsets.values()) if len(hosts) >= 3 else offsets[hosts[0]]
    against = "the median host's" if len(hosts) >= 3 else f"{hosts[0]}'s (of two hosts either may be the one off)"
    out = []
    for h, off in offsets.items():
        if len(hosts) < 3 and h == hosts[0]:
            continue
        d = off - ref
        out.append(Result("clock", h, abs(d) <= bound_s, f"{abs(d):.1f} s {'ahead of' if d > 0 else 'behind'} {against}",
                          f"within {bound_s:g} s", value=d, seconds=spent))
    return out


def links(ctx: DistContext, lay: Layout, nbytes: int, rounds: int, reps: int = 3) -> list[Result]:
    """The links between hosts, timed: in round k each host's leader sends `nbytes` to the leader k hosts
    on and receives from the one k hosts back (rounds 1..`rounds`: 1 is a ring, N-1 every pair), timed by
    the receiver from a common barrier, best of `reps` (the send and the receive finish together: the time is
    the slower of the two, each side's own link). Then each host's sending and receiving are compared with the
    links that do not touch it: a host slow in all its links is named; a single slow link names both ends."""
    leaders = lay.leaders
    n = len(leaders)
    if n < 2:
        return [Result("network", lay.host, True, "one host: no link between hosts to time", skipped=True)]
    dev = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    me = leaders.index(ctx.rank) if lay.is_leader else None
    send = torch.ones(nbytes // 4, dtype=torch.float32, device=dev) if me is not None else None
    take = torch.empty_like(send) if send is not None else None
    seen: dict[tuple[str, str], float] = {}  # (from host, to host) -> seconds, on the receiver
    t_all = time.perf_counter()
    for k in range(1, min(rounds, n - 1) + 1):
        for _ in range(reps):
            barrier(ctx)
            if me is None or send is None or take is None:
                continue
            dst, src = leaders[(me + k) % n], leaders[(me - k) % n]
            t0 = time.perf_counter()
            # One batch: under NCCL an isend and an irecv issued apart run in order on one stream, and every
            # leader's send would wait for a receive queued behind its peer's send (a circle, over 4 MiB).
            reqs = tdist.batch_isend_irecv([tdist.P2POp(tdist.isend, send, dst), tdist.P2POp(tdist.irecv, take, src)])
            for req in reqs:
                req.wait()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            took = time.perf_counter() - t0
            key = (lay.hosts[src], lay.host)
            seen[key] = min(seen.get(key, took), took)
    spent = time.perf_counter() - t_all
    gathered: dict[tuple[str, str], float] = {}
    for part in all_gather_object(ctx, seen):
        gathered.update(part)
    return judge_links(gathered, nbytes, spent)


def judge_links(seconds: dict[tuple[str, str], float], nbytes: int, spent: float = 0.0) -> list[Result]:
    """Results from the timed links {(from, to): seconds}. A host is named when every link it sends on (or
    receives on) is below LINK_SLOW of the median of the links that do not touch it: a host slow both ways
    would otherwise drag the median of all links down with it. With two hosts no link avoids either: the
    median of both is the reference, and of one slow direction the sender is named (a shaped or failing
    uplink is the usual cause; its egress cannot be told from the receiver's ingress). A slow link between
    hosts not named names both ends, when at least LINK_PEERS other links give the reference."""
    mbps = {k: nbytes / 2**20 / max(s, 1e-9) for k, s in seconds.items()}
    overall = statistics.median(mbps.values())

    def ref(h: str) -> float:
        apart = [v for k, v in mbps.items() if h not in k]
        return statistics.median(apart) if apart else overall

    def slow(k: tuple[str, str], against: float) -> bool:
        return mbps[k] < LINK_SLOW * against and seconds[k] >= LINK_FLOOR_S

    hosts = list(dict.fromkeys(h for k in seconds for h in k))
    out: list[Result] = []
    named: set[str] = set()
    for side in ("sends", "receives"):
        for h in hosts:
            mine = [k for k in mbps if (k[0] if side == "sends" else k[1]) == h and not named & set(k) - {h}]
            against = ref(h)
            if h in named or not mine or not all(slow(k, against) for k in mine):
                continue
            peers = ", ".join(k[1] if side == "sends" else k[0] for k in mine)
            rate = statistics.median(mbps[k] for k in mine)
            out.append(Result("network", h, False, f"{side} at {rate:.1f} MB/s ({'to' if side == 'sends' else 'from'} "
                              f"{peers})", f"about {against:.0f} MB/s (the median of the links apart from it)",
                              value=rate, seconds=spent))
            named.add(h)
    for k in mbps:
        # A single link is judged against at least LINK_PEERS others: against one or two (two hosts, or three
        # with one already named) a scheduling stall on a busy machine reads as a slow link and names a healthy pair.
        others = [v for o, v in mbps.items() if o != k and not named & set(o)]
        if named & set(k) or len(others) < LINK_PEERS:
            continue
        among = statistics.median(others)
        if slow(k, among):
            for h in k:
                out.append(Result("network", h, False, f"{mbps[k]:.1f} MB/s", f"about {among:.0f} MB/s (the median "
                                  f"of the other links)", f"{k[0]} -> {k[1]}", value=mbps[k], seconds=spent))
    if not out:
        out = [Result("network", h, True, f"{statistics.median(v for k, v in mbps.items() if h in k):.0f} MB/s",
                      value=statistics.median(v for k, v in mbps.items() if h in k), seconds=spent) for h in hosts]
    return out

"""The ranks of one rendezvous round agree on the prefix of their keys, whatever the store kept from
earlier rounds (torchrun's agent store lives across them) and whatever restart count each was told:
threads of this process as ranks, each with its own client of a real TCPStore served here."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as tdist

from ddp_kit.dist.rounds import round_prefix


@pytest.fixture
def server():
    store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store


def client(server) -> tdist.TCPStore:
    return tdist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=30))


def one_round(server, world_size: int, ranks=None, delays=None, timeout_s: float = 20.0) -> dict[int, object]:
    """round_prefix on each of `ranks` (default: all) at once, rank r after delays[r] seconds; what each
    returned (or raised)."""
    ranks = range(world_size) if ranks is None else ranks
    out: dict[int, object] = {}

    def rank(r: int) -> None:
        store = client(server)
        time.sleep((delays or {}).get(r, 0.0))
        try:
            out[r] = round_prefix(store, r, world_size, timeout_s)
        except Exception as exc:
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s + 10)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return out


def agreed(out: dict[int, object]) -> str:
    values = set(out.values())
    assert len(values) == 1 and all(isinstance(v, str) for v in values), out
    return values.pop()  # type: ignore[return-value]


def test_every_rank_of_a_round_gets_one_prefix_and_each_round_its_own(server):
    seen = []
    # rank 0 first, rank 0 last, rank 0 in between: the later rounds find the earlier rounds' keys there
    for delays in ({}, {0: 0.3}, {1: 0.3, 3: 0.3}, {r: 0.05 * (4 - r) for r in range(4)}):
        seen.append(agreed(one_round(server, 4, delays=delays)))
    assert len(set(seen)) == len(seen), seen


def test_a_round_cut_short_leaves_nothing_the_next_round_takes(server):
    """Ranks 1 and 2 of a round joined and died before rank 0 came: the next round (a replaced node,
    a restart counted by some agents only) still meets on one prefix of its own."""
    first = agreed(one_round(server, 3))
    for r in (1, 2):
        client(server).set(f"ddp_kit/round/join/{r}", f"dead{r}")
    second = agreed(one_round(server, 3, delays={0: 0.0, 1: 0.4, 2: 0.2}))
    assert second != first


def test_the_world_may_grow_or_shrink_between_rounds(server):
    prefixes = [agreed(one_round(server, n)) for n in (2, 3, 2)]
    assert len(set(prefixes)) == 3


def test_a_rank_that_never_comes_is_named_by_rank_0_within_the_bound(server):
    started = time.monotonic()
    out = one_round(server, 3, ranks=[0, 1], timeout_s=1.5)
    assert time.monotonic() - started < 10
    assert isinstance(out[0], TimeoutError) and str(out[0]).startswith("rank 2 did not come within 1.5s"), out
    assert isinstance(out[1], TimeoutError), out  # the round never formed: no rank leaves it with a prefix


def test_a_follower_whose_rank_0_never_comes_gives_up_within_the_bound(server):
    out = one_round(server, 2, ranks=[1], timeout_s=1.0)
    assert isinstance(out[1], TimeoutError) and "rank 0 did not answer" in str(out[1]), out


def test_a_single_rank_needs_no_store():
    assert round_prefix(None, 0, 1, 1.0)

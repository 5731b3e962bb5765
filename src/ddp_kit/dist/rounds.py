"""Which rendezvous round this process belongs to: the prefix of ddp_kit's keys in the rendezvous store
(the process group's own, fail-fast's, the watchdog's), the same for every rank of one round of the job
and for no rank of another.

A count each process is told cannot name the round. torchrun counts restarts per agent
(TORCHELASTIC_RESTART_COUNT, pytorch/pytorch#108158): a node that replaces a lost one starts at 0
while the survivors are at 1; an agent whose workers were still healthy when another node's failed
re-joins without counting; a node that joins an elastic job starts at 0 whatever the others count.
Ranks that named their keys after it looked for each other under different keys and never met.

What the ranks of one round do share is the store, and global rank 0. Rank 0 makes a token (a fresh
uuid) and hands it to each other rank in answer to a nonce that rank made for this call, so no rank
can read an earlier round's answer, whatever the store kept (torchrun's agent store lives across
rounds; a store rank 0 hosts is new every round):

    rank r > 0   sets  join/<r> = <its nonce>, waits for answer/<nonce>, sets ack/<token>/<r>
    rank 0       waits until every join/<r> exists, answers each nonce it reads there (an earlier
                 round's left-over nonce too, harmlessly) until every rank has acked this token

Three store round trips for a rank, a few for rank 0, once per process; every wait is bounded.
"""
from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

KEYS = "ddp_kit/round/"  # outside every round's prefix: the handshake itself


def prefix_of(token: str) -> str:
    """The prefix of the keys of the round named `token`."""
    return f"ddp_kit/round_{token}/"


def round_prefix(store: Any, rank: int, world_size: int, timeout_s: float) -> str:
    """The prefix of this round's keys in `store` (a client of the job's rendezvous store). Every rank
    of the round calls it; each returns the same value. Raises TimeoutError when a rank does not come
    within `timeout_s` (rank 0 names which)."""
    if world_size < 2:
        return prefix_of("single")
    token = _lead(store, world_size, timeout_s) if rank == 0 else _follow(store, rank, timeout_s)
    return prefix_of(token)


def _follow(store: Any, rank: int, timeout_s: float) -> str:
    nonce = uuid.uuid4().hex
    answer = f"{KEYS}answer/{nonce}"
    store.set(f"{KEYS}join/{rank}", nonce)
    try:
        store.wait([answer], timedelta(seconds=timeout_s))
    except Exception as exc:
        raise TimeoutError(f"rank 0 did not answer within {timeout_s:g}s ({exc})") from None
    token = _text(store.get(answer))
    store.set(f"{KEYS}ack/{token}/{rank}", nonce)
    try:
        store.delete_key(answer)  # read once; a store that lives across rounds keeps no more than it must
    except Exception:
        pass  # hygiene only
    return token


def _lead(store: Any, world_size: int, timeout_s: float) -> str:
    token = uuid.uuid4().hex
    deadline = time.monotonic() + timeout_s
    joins = [f"{KEYS}join/{r}" for r in range(1, world_size)]
    acks = [f"{KEYS}ack/{token}/{r}" for r in range(1, world_size)]
    try:  # the first round of a store: until every rank has set its key (later ones find them at once)
        store.wait(joins, timedelta(seconds=timeout_s))
    except Exception:
        raise TimeoutError(f"{_missing(store, joins)} did not come within {timeout_s:g}s") from None
    answered: set[str] = set()
    pause = 0.002
    while True:
        nonces = [_text(v) for v in store.multi_get(joins)]
        new = sorted(set(nonces) - answered)
        if new:
            store.multi_set([f"{KEYS}answer/{n}" for n in new], [token] * len(new))
            answered.update(new)
        if store.check(acks):
            return token
        if time.monotonic() > deadline:
            raise TimeoutError(f"{_missing(store, acks)} did not come within {timeout_s:g}s")
        time.sleep(pause)  # a rank whose join still holds an earlier round's nonce has yet to set its own
        pause = min(2 * pause, 0.05)


def _missing(store: Any, keys: list[str]) -> str:
    """The ranks (the keys' last part) whose key is not in the store: "rank 3", "ranks 3, 5" (8 named)."""
    try:
        gone = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
    except Exception:
        return "some ranks"
    more = f" and {len(gone) - 8} more" if len(gone) > 8 else ""
    return f"rank{'s' if len(gone) > 1 else ''} {', '.join(gone[:8])}{more}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

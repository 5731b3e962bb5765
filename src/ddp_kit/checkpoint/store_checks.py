"""The object store backend's startup checks, made by every rank together at its first find or save:
every rank opened the store (a node without the client is named), rank 0 holds the location's lease
(run_lease.py), and every rank reads back an object rank 0 wrote (a missing bucket, no credentials,
a node that cannot reach the store: one line before anything is written).
"""
from __future__ import annotations

import os
import socket

from ..dist import DistContext
from ..dist.collectives import all_true, broadcast_object, gather_object, rank0_verdict
from ..errors import Unavailable, UserError
from . import layout
from .lease import LEASE_TTL_S, LeaseKeeper
from .run_lease import take_lease
from .store_fs import Store, describe, refusal, unreachable


def check_every_rank(ctx: DistContext, where: Store | None, problem: UserError | None,
                     lease_ttl_s: float = LEASE_TTL_S) -> LeaseKeeper | None:
    """Collective: every rank opened the store (a node without s3fs is named), rank 0 takes the
    location's lease (lease.py: another job writing here is refused before anything is written), then
    probe. Returns rank 0's lease keeper (None on the other ranks)."""
    if ctx.world_size > 1 and not all_true(ctx, problem is None):
        mine = None if problem is None else (ctx.rank, socket.gethostname(), problem.message, problem.hint,
                                             isinstance(problem, Unavailable))
        gathered = gather_object(ctx, mine)  # the list on rank 0, None on the others
        r, host, message, hint, flaky = broadcast_object(ctx, next(g for g in gathered if g) if gathered is not None else None)
        err = (Unavailable if flaky else UserError)(message, hint, rank=r, verdict=True)  # a retryable one stays so
        err.host = host
        raise err
    if problem is not None:
        raise problem
    if where is None:  # the store is missing only when opening it failed, and then `problem` says why
        raise ValueError("check_every_rank: no store, and no problem saying why")
    keeper = take_lease(ctx, where, lease_ttl_s)
    try:
        probe(ctx, where)
    except BaseException:
        if keeper is not None:
            keeper.release()
        raise
    return keeper


def probe(ctx: DistContext, where: Store) -> None:
    """Rank 0 writes a small object, every rank reads it back, rank 0 deletes it: a missing bucket, no
    credentials, a read-only bucket, or a node that cannot reach the store is one line now."""
    def write() -> str:
        token = os.urandom(8).hex()
        try:
            where.fs.pipe_file(where.path(layout.PROBE_PREFIX + token), token.encode())
        except Exception as exc:  # whatever the client raises: said in one line with the URL
            raise refusal(where.url, exc, "written") from None
        return token

    token = rank0_verdict(ctx, write)
    name = where.path(layout.PROBE_PREFIX + token)
    flaky = False  # the store did not answer this rank (a timeout, 503 SlowDown): a restart may cure it
    try:
        seen = where.fs.cat_file(name).decode() == token
        why = "it read back different bytes"
    except Exception as exc:
        seen, why, flaky = False, describe(exc), unreachable(exc)

    def delete() -> None:
        try:
            where.fs.rm_file(name)
        except Exception as exc:
            raise refusal(where.url, exc, "cleaned up (deleting an object failed)") from None

    if ctx.world_size > 1 and not all_true(ctx, seen):
        rank0_verdict(ctx, delete)
        gathered = gather_object(ctx, None if seen else (ctx.rank, socket.gethostname(), why, flaky))  # None off rank 0
        blind = broadcast_object(ctx, [g for g in gathered if g] if gathered is not None else None)
        r, host, why, flaky = blind[0]
        more = f" (and {len(blind) - 1} more rank(s))" if len(blind) > 1 else ""
        raise (Unavailable if flaky else UserError)(f"rank {r} on {host}{more} cannot read checkpoint location {where.url!r}, which rank 0 "
                        f"wrote ({why})", "give every node the same credentials and endpoint (environment, "
                        "~/.aws, DDP_KIT_STORAGE_OPTIONS) and a route to the store", verdict=True)
    if ctx.world_size == 1 and not seen:
        raise refusal(where.url, RuntimeError(why), "read back")
    rank0_verdict(ctx, delete)

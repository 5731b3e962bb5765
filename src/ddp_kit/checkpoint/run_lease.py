"""A job's hold on its checkpoint location, taken and watched collectively: rank 0 takes the location's
lease (lease.py) for every rank at the first find or save, and before each commit asks whether another
job has taken the location over. The folder backend (folder_lease.py) and the object store's
(object_store.py) share it.
"""
from __future__ import annotations

from typing import Any

from ..dist import DistContext
from ..dist.collectives import rank0_verdict
from ..dist.launch_token import launch_of
from ..errors import UserError
from .lease import LEASE_TTL_S, LeaseKeeper, identity
from .store_fs import Store, refusal


def holder(ctx: DistContext) -> dict[str, Any]:
    """This job as its lease records it (rank 0), with its launch token where it has a unique one."""
    launch = launch_of(ctx.env)
    return identity(ctx.env.job_id, ctx.env.batch_job_id, ctx.env.restart_count, launch.id if launch.unique else None)


def take_lease(ctx: DistContext, where: Store, lease_ttl_s: float = LEASE_TTL_S) -> LeaseKeeper | None:
    """Collective: rank 0 takes the location's lease (lease.py), or every rank raises its one line.
    Returns rank 0's keeper (None on the other ranks)."""
    keeper = None

    def take() -> None:
        nonlocal keeper  # stays on rank 0
        try:
            keeper = LeaseKeeper(where, holder(ctx), lease_ttl_s)
        except UserError:
            raise
        except Exception as exc:  # a missing bucket, no credentials, a read-only bucket: said as the probe says it
            raise refusal(where.url, exc, "written") from None

    rank0_verdict(ctx, take)
    return keeper


def lease_stop(location: str, keeper: LeaseKeeper | None) -> tuple[str, str] | None:
    """Rank 0, before a commit: (message, hint) when another job has taken this location over."""
    try:
        taker = keeper.lost() if keeper is not None else None
    except Exception:  # the store cannot be listed now: the commit's own writes will say why
        return None
    if taker is None:
        return None
    return (f"another job took over checkpoint location {location} ({taker}) after this job stopped "
            f"renewing its lease; this job stops without committing, so as not to overwrite its checkpoints",
            "make sure one job at a time writes a location (give each its own ckpt_dir); then rerun")

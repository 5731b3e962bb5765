"""The step boundary's one door to the checkpoint package: which backend a run folder gets, and
what a new lineage moves aside. Everything the boundary saves or resumes goes through these two
functions and the backend they return (checkpoint.backend.CheckpointBackend), so a storage backend
is chosen here, by the location's scheme, and nowhere else."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..checkpoint.backend import ArchivesOnItsStore, CheckpointBackend, Found, open_backend, scheme_of
from ..checkpoint.layout import ARCHIVE, step_name
from ..dist import DistContext
from ..run_folder import RunDir
from .policy import Policy
from .run_writer import RunWriter


def open_checkpointer(ctx: DistContext, rd: RunDir, policy: Policy) -> CheckpointBackend:
    """The backend at policy.ckpt_dir (a folder or a URL), else at run_dir/checkpoints."""
    location = policy.ckpt_dir if policy.ckpt_dir is not None else rd.checkpoints
    # Another run folder may name the same ckpt_dir: one writer by lease. run_dir/checkpoints is the run's own.
    return open_backend(location, ctx, one_writer=policy.ckpt_dir is not None, keep_last=policy.keep_last,
                        async_save=policy.async_ckpt,
                        timeout_s=ctx.timeout_s, write_delay_s=policy.ckpt_write_delay_s,
                        upload_timeout_s=policy.ckpt_upload_timeout_s)


def tier_location(ckpt: CheckpointBackend) -> str:
    """The durable location as the memory tier names its job: a folder by its real path, a URL as is."""
    return ckpt.location if scheme_of(ckpt.location) else os.path.realpath(ckpt.location)


def archive_folder(ckpt: CheckpointBackend, rd: RunDir) -> str | Path:
    """Where abandoned steps go: run_dir/archive for run_dir/checkpoints, else beside the steps on
    their own storage (a store's <url>/archive, a ckpt_dir folder's archive/): moving stays a rename
    on one file system, or a copy within one store."""
    if isinstance(ckpt, ArchivesOnItsStore):  # only object_store's backend is
        return ckpt.archive_location()
    root = Path(ckpt.location)
    return rd.archive if root == rd.checkpoints else root / ARCHIVE


def archive_lineage(ckpt: CheckpointBackend, rd: RunDir, writer: RunWriter, fresh_start: bool,
                    resumed_from: int | None, resumed_path: Path | str | None, say: Callable[[str], None],
                    from_memory: bool = False, durable: int | None = None) -> None:
    """One lineage per run folder: a fresh start (resume='never') or a resume from an older
    checkpoint moves what it abandons (higher steps, their metrics) to run_dir/archive/<time>/.
    Rank 0 only."""
    if resumed_from is None and not fresh_start:
        if ckpt.latest() is None:
            writer.supersede(None, rd.archive)  # a first run: earlier metrics without checkpoints are not ours
        return
    # The memory tier's copies are this location's lineage by construction (memory_tier.job_key); `durable`:
    # the durable tier's newest step when the resume came from memory.
    ours = resumed_from is not None and (from_memory or resumed_path is not None and ckpt.owns(Found(resumed_path, resumed_from)))
    # A checkpoint from another folder starts a new lineage here: whatever this folder held is abandoned.
    into = archive_folder(ckpt, rd)
    # A step resumed from memory is not on the durable tier (yet): `latest` keeps naming the durable step.
    keep = (durable if from_memory else resumed_from) if ours else None
    moved = ckpt.archive(keep, into)
    writer.supersede(resumed_from if ours else None, rd.archive)
    if moved:
        say(f"ddp_kit: moved checkpoint(s) {', '.join(step_name(s) for s in moved)} of an abandoned run "
            f"to {into}/")

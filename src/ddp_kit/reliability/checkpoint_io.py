"""The step boundary's one door to the checkpoint package: which checkpointer a run folder gets,
and what a new lineage moves aside. Everything the boundary saves or resumes goes through these
two functions (and the Checkpointer they return), so a storage backend is wired here alone."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.layout import archive_abandoned
from ..dist import DistContext
from .outputs import RunWriter
from .policy import Policy
from .run_dir import RunDir


def open_checkpointer(ctx: DistContext, rd: RunDir, policy: Policy) -> Checkpointer:
    return Checkpointer(ctx, rd.checkpoints, keep_last=policy.keep_last, async_save=policy.async_ckpt,
                        timeout_s=ctx.timeout_s, write_delay_s=policy.ckpt_write_delay_s)


def archive_lineage(rd: RunDir, writer: RunWriter, fresh_start: bool, resumed_from: int | None,
                    resumed_path: Path | None, say: Callable[[str], None]) -> None:
    """One lineage per run folder: a fresh start (resume='never') or a resume from an older
    checkpoint moves what it abandons (higher steps, their metrics) to run_dir/archive/<time>/.
    Rank 0 only."""
    if resumed_from is None and not fresh_start:
        if not (rd.checkpoints / "latest").exists():
            writer.supersede(None, rd.archive)  # a first run: earlier metrics without checkpoints are not ours
        return
    ours = resumed_path is not None and resumed_path.resolve().parent == rd.checkpoints.resolve()
    # A checkpoint from another folder starts a new lineage here: whatever this folder held is abandoned.
    moved = archive_abandoned(rd.checkpoints, resumed_from if ours else None, rd.archive)
    writer.supersede(resumed_from if ours else None, rd.archive)
    if moved:
        say(f"ddp_kit: moved checkpoint(s) {', '.join(f'step_{s}' for s in moved)} of an abandoned run "
            f"to {rd.archive}/")

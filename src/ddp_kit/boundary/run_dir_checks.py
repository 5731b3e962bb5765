"""The run folder before any work: writable, locked for this job, the same folder on every rank;
and where a hang or crash leaves its stacks (`hang_folder`)."""
from __future__ import annotations

import socket
from pathlib import Path

from ..checkpoint.backend import scheme_of
from ..dist import DistContext
from ..dist.collectives import all_true, broadcast_object, gather_object, rank0_verdict
from ..errors import UserError
from ..run_folder import (
    NODE_ERRNOS,
    NotWritable,
    RunDir,
    RunLock,
    check_writable,
    new_token,
    remove_token,
    run_identity,
    sees_token,
    write_token,
)


def prepare_run_dir(ctx: DistContext, rd: RunDir, gate_checks_ckpt: bool = False) -> tuple[RunLock | None, str]:
    """Before any work: the folder is writable, no other job uses it, and every rank sees the folder
    checkpoints are written into: run_dir, or ckpt_dir when that is a folder. With ckpt_dir a URL the
    store is probed when its backend opens (store_checks.probe) and run_dir may be each node's own.
    Returns rank 0's lock (None elsewhere) and the run's identity, rank 0's, on every rank.

    `gate_checks_ckpt`: the health gate runs next and checks ckpt_dir on every node; a ckpt_dir that refuses
    rank 0 as a node's storage does (read-only, an I/O error) is left to it (named with its host, verdict
    infrastructure, the host left out where the launcher allows), not refused here as a mistake of the job's
    (exit 2, never retried). A permission or a path under a file is the job's: refused here as before."""
    lock = None
    shared = rd.path if rd.ckpt_dir is None else None if scheme_of(rd.ckpt_dir) else Path(rd.ckpt_dir)

    def rank0() -> tuple[str, str, bool]:
        nonlocal lock  # stays on rank 0: only the token travels
        check_writable(rd.path)
        refused = False
        if shared is not None and shared != rd.path:
            try:
                check_writable(shared, "ckpt_dir")
            except NotWritable as err:
                if not (gate_checks_ckpt and err.errno in NODE_ERRNOS):  # a permission or a path: the job's mistake
                    raise
                refused = True
        lock = RunLock(rd.path / ".lock", ctx.env.job_id).acquire()
        token = new_token()
        write_token(shared, token) if ctx.world_size > 1 and shared is not None and not refused else None
        return token, run_identity(rd.path), refused

    token, run, refused = rank0_verdict(ctx, rank0)
    if refused:
        shared = None  # the gate names it (above): no token to look for
    if rd.ckpt_dir is not None and ctx.is_main:
        print(f"ddp_kit: checkpoints go to {rd.ckpt_dir} (ckpt_dir); metrics.jsonl, summary.json and hang reports "
              f"stay in run_dir {str(rd.path)!r} on each node's own disk (metrics and summary: rank 0's)", flush=True)
    if ctx.world_size > 1 and shared is not None:
        sees = sees_token(shared, token)
        everyone = all_true(ctx, sees)  # 4 bytes per rank; who is blind is asked only if someone is
        if ctx.is_main:
            remove_token(shared, token)
        if not everyone:
            gathered = gather_object(ctx, None if sees else (ctx.rank, socket.gethostname()))
            blind = broadcast_object(ctx, [g for g in gathered or [] if g] if ctx.is_main else None)
            r, host = blind[0]
            more = f" (and {len(blind) - 1} more rank(s))" if len(blind) > 1 else ""
            what = "run_dir" if rd.ckpt_dir is None else "ckpt_dir"
            raise UserError(f"{what} {str(shared)!r} is not one shared folder: rank {r} on {host}{more} cannot see a "
                            f"file rank 0 wrote there; checkpoints need every rank to write into the same folder",
                            f"put {what} on storage every node mounts (an absolute path), or checkpoints on an object "
                            f"store: ckpt_dir=s3://BUCKET/PREFIX (--ckpt_dir), with a local run_dir on each node")
    return lock, run

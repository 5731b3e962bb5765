"""Failure policy: what a rank prints and which exit code it uses when something goes wrong.

One ladder serves the reference job and a user's own script (through `ddp_kit.init()`):

1. A `UserError`: one line, printed once for the job (by the rank whose failure stands, or by
   each rank with a local problem of its own), exit 2; exit 1 for an `errors.Unavailable` (a storage
   endpoint that refuses, times out or throttles: a restart may cure it).
2. The hang watchdog already declared a hang: this error is its echo; exit 3.
3. Another rank posted its failure first: this error (a broken connection) follows from it; the
   reporter rank says which rank failed; exit 1.
4. A communication error with no posted failure: find the peer that vanished (crash dump, stale
   heartbeat) and name it; exit 1.
5. Anything else is this rank's own failure: its traceback, printed by this rank only, CUDA notes
   when it is a CUDA error, posted so that the other ranks stop within seconds; exit 1.

Exit codes: 0 done, 1 failed, 2 user error, 3 hang, 75 preempted (rerun to resume), 130 Ctrl-C.
"""
from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable

from ..dist import DistContext, hosts_store
from ..dist.failfast import LINGER_S, peer_failure, post, same_error, say_stop
from ..errors import UserError
from ..exit_codes import EXIT_FAILED, EXIT_HANG, EXIT_INTERRUPTED, EXIT_PEER_FAILED, EXIT_PREEMPTED, EXIT_USER_ERROR
from .peer_loss import diagnose_peer_loss, is_comm_error

__all__ = ["EXIT_FAILED", "EXIT_HANG", "EXIT_INTERRUPTED", "EXIT_PEER_FAILED", "EXIT_PREEMPTED", "EXIT_USER_ERROR",
           "handle", "linger"]


def linger(ctx: DistContext) -> None:
    """The store host stays a moment after posting a failure, so the others read it (see LINGER_S)."""
    if hosts_store(ctx.env):
        time.sleep(LINGER_S)


def handle(err: BaseException, ctx: DistContext, step: int, phase: str, hang_dir: str, *,
           hang_declared: bool = False, notes: Callable[[BaseException], list[str]] | None = None,
           found: list[str] | None = None) -> int:
    """Print what this rank should say about `err` (see the module docstring) and return the exit code.
    `found`: gets the line naming a vanished peer, when a communication error was traced to one.

    The caller has already silenced its fail-fast thread and its stop-signal handling: this process
    handles its own failure, and its exit code is decided here."""
    if isinstance(err, UserError):
        err.at(ctx.rank)
        stands = post(ctx.store, ctx.rank, step, phase, err)
        # Once for the job: the rank whose failure stands prints it; a rank with a different local
        # problem (another missing file) prints its own too.
        if stands is None or stands["rank"] == ctx.rank or (err.local and not same_error(stands, err)):
            print(err.line(), file=sys.stderr, flush=True)
        linger(ctx)
        return err.exit_code  # 2; 1 for a problem a restart may cure (errors.Unavailable: storage not answering)
    if hang_declared:  # the hang report is out; this error is its echo
        time.sleep(30)  # the watchdog ends the process with the hang exit code
        return EXIT_HANG
    failed = peer_failure(ctx.store, ctx.rank)
    if failed:  # another rank failed first; this error (a broken connection) follows from it
        say_stop(ctx.rank, failed)
        return EXIT_PEER_FAILED
    if is_comm_error(err):  # perhaps a peer died without posting: find it and name it
        line = diagnose_peer_loss(ctx.store, ctx.rank, ctx.world_size, hang_dir)
        if line:
            if ctx.is_main or "stopping:" in line:
                print(line, file=sys.stderr, flush=True)
            if found is not None:
                found.append(line)
            return EXIT_PEER_FAILED
    # Posted first, so that the same error raised on every rank at once (a bug after the loop) is
    # printed by one of them. The launcher's SIGTERM to the survivors is ignored by a closing
    # process (preemption.py), so this one still gets to print after the others have stopped.
    stands = post(ctx.store, ctx.rank, step, phase, err)
    if stands is None or stands["rank"] == ctx.rank or not same_error(stands, err):
        print(f"ddp_kit: error: rank {ctx.rank} failed at step {step} in {phase}: {type(err).__name__}: {err}\n"
              + "".join(traceback.format_exception(err)), file=sys.stderr, flush=True)
        if notes is not None and is_cuda_error(err):
            for line in notes(err):
                print(f"ddp_kit: [rank {ctx.rank}] {line}", file=sys.stderr, flush=True)
    else:
        say_stop(ctx.rank, stands)
    linger(ctx)
    return EXIT_FAILED


def is_cuda_error(err: BaseException) -> bool:
    """Whether `err` came from CUDA, NCCL or cuDNN (then the caller's notes, by default the doctor's
    findings, are printed beside it)."""
    text = f"{type(err).__name__}: {err}"
    return any(k in text for k in ("CUDA", "cuda", "NCCL", "OutOfMemoryError", "cuDNN", "CUBLAS"))

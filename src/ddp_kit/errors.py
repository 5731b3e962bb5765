"""Errors a user can cause, and how they reach the console: one line, once, exit code 2."""
from __future__ import annotations

import socket
import sys
import time

from .exit_codes import EXIT_FAILED
from .exit_codes import EXIT_USER_ERROR as EXIT_USER_ERROR  # its old home: `from ddp_kit.errors import` still works


class UserError(Exception):
    """A problem the user can fix. `str()` is the one line we print: what happened; hint: how to fix it.

    `local=True` (or a `rank`) marks a problem of this rank's own view of the world (a file missing
    on one node, a GPU it lacks): the rank that hit it prints it, with its rank and host, because
    the others may never see it. Otherwise every rank reaches the same verdict and it is printed
    once for the whole job.

    `verdict=True` marks an error that every rank raises together, after a collective decided it
    (a sync check, a startup disagreement): the others are about to raise it too, so fail-fast
    gives them a moment instead of announcing it a second time (failfast.ECHO_GRACE_S).
    """

    retryable = False  # Unavailable (below): a restart may cure it
    exit_code = EXIT_USER_ERROR  # Unavailable: EXIT_FAILED

    def __init__(self, message: str, hint: str = "", rank: int | None = None, local: bool = False,
                 verdict: bool = False):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.rank = rank
        self.local = local or rank is not None
        self.verdict = verdict
        self.host: str | None = None

    def at(self, rank: int, host: str | None = None) -> UserError:
        """Stamp the rank (and host) that saw a local problem; returns self."""
        if self.local:
            self.rank = rank if self.rank is None else self.rank
            self.host = host or socket.gethostname()
        return self

    def line(self) -> str:
        where = ""
        if self.rank is not None:
            where = f"[rank {self.rank}{f' on {self.host}' if self.host else ''}] "
        hint = f" (hint: {self.hint})" if self.hint else ""
        return f"ddp_kit: error: {where}{self.message}{hint}"


class Unavailable(UserError):
    """Something outside the program failed in a way a restart may cure: a storage endpoint that refuses
    connections, times out or throttles (503 SlowDown) when an attempt starts or resumes. Said like a
    UserError (one line with a hint, once), but the attempt exits 1, retryable (verdict infrastructure):
    the engine restarts it instead of failing the job."""

    retryable = True
    exit_code = EXIT_FAILED


class Unhealthy(Unavailable):
    """The pre-flight health gate found a host unfit (preflight/): said once for the job, with the hosts it
    names and what was done about them. Exit 1, retryable (verdict infrastructure, naming the hosts): a
    restart elsewhere, or once the host recovered, may pass; exit 2 where the job cannot go on without them
    (an elastic job left below its minimum of nodes)."""

    def __init__(self, message: str, hint: str, hosts: list[str], exit_code: int = EXIT_FAILED):
        super().__init__(message, hint, verdict=True)
        self.hosts = hosts
        self.exit_code = exit_code
        self.retryable = exit_code == EXIT_FAILED


# A job-wide error is printed by rank 0 alone, and torchrun stops every worker once one exits. So the
# others wait this long for rank 0 to get there before they exit: on a busy machine rank 0 reached the
# same line after rank 1 had exited and torchrun had already stopped it (CI, stop 53), and nothing was said.
# Rank 0's exit ends the wait early (torchrun stops the rest), so it costs time only where rank 0 never
# gets there. 15 s, not 5: the ranks' start-up (each imports torch) can differ by seconds on a loaded machine.
ECHO_WAIT_S = 15.0


def hold_for_rank0(err: UserError, rank: int) -> None:
    """Before a silent rank exits on a job-wide error: give rank 0 the time to print it."""
    if rank != 0 and not err.local:
        time.sleep(ECHO_WAIT_S)


def report_user_error(err: UserError, rank: int) -> None:
    """Print `err` once for the whole job: by the rank that saw a local problem, or by rank 0."""
    if err.local:
        err.at(rank)
    if err.local or rank == 0:
        print(err.line(), file=sys.stderr, flush=True)

"""Errors a user can cause, and how they reach the console: one line, once, exit code 2."""
from __future__ import annotations

import sys


class UserError(Exception):
    """A problem the user can fix. `str()` is the one line we print: what happened; hint: how to fix it.

    `rank` is set when only that rank hit the problem (a missing file on one node); such an
    error is printed by that rank. Otherwise rank 0 prints it and the others stay quiet.
    """

    def __init__(self, message: str, hint: str = "", rank: int | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.rank = rank

    def line(self) -> str:
        where = f"[rank {self.rank}] " if self.rank is not None else ""
        hint = f" (hint: {self.hint})" if self.hint else ""
        return f"ddp_kit: error: {where}{self.message}{hint}"


EXIT_USER_ERROR = 2


def report_user_error(err: UserError, rank: int) -> None:
    """Print `err` once for the whole job: by the rank at fault, or by rank 0."""
    if err.rank is not None or rank == 0:
        print(err.line(), file=sys.stderr, flush=True)

"""sys.excepthook while a Run is open: an error that ends the script goes through the failure policy
(crash.py) of the step boundary; while joining (no boundary yet) a UserError is one line."""
from __future__ import annotations

import sys
from types import TracebackType
from typing import TYPE_CHECKING

from ..errors import UserError, hold_for_rank0, report_user_error
from ..exit_codes import EXIT_USER_ERROR

if TYPE_CHECKING:  # the core imports its parts: they name what they use of it (protocol.py), not the core
    from .protocol import Boundary



class Failures:
    """sys.excepthook while a Run is open: the failure policy (crash.py) decides what this rank
    prints and its exit code. While joining (no step boundary yet) only a UserError is handled: one line."""

    def __init__(self, boundary: Boundary | None, rank: int = 0):
        self.boundary = boundary
        self.rank = boundary.ctx.rank if boundary is not None else rank
        self.active = True
        self.previous = sys.excepthook
        sys.excepthook = self

    def __call__(self, kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
        if not self.active:
            self.previous(kind, err, tb)
            return
        if self.boundary is None and isinstance(self.previous, Failures) and self.previous.boundary is not None:
            self.previous(kind, err, tb)  # a Run is open (a second ddp_kit.init): its policy decides
            return
        if self.boundary is not None:
            # SystemExit from an excepthook sets the exit code; atexit (teardown, no final save) still runs.
            sys.exit(self.boundary.fail(err))
        if not isinstance(err, UserError):
            self.previous(kind, err, tb)
            return
        report_user_error(err, self.rank)
        hold_for_rank0(err, self.rank)
        sys.exit(EXIT_USER_ERROR)

    def uninstall(self) -> None:
        if sys.excepthook is self:
            sys.excepthook = self.previous

"""The one seam at the step boundary: the step state every part reads, and the hooks through which a
strategy or a service takes part in a step without the boundary knowing it by name.

A hook set subclasses `StepHooks` and overrides what it needs; every method's default does nothing
and decides nothing. The boundary (ddp_kit.boundary.core) calls every attached set, in the order
they were attached, at these points:

    attach(b)                   when it joins the boundary
    gate(obj, scheduler)        each optimizer (scheduler=False) or LR scheduler registered, also those
                                registered before the hook was attached
    restore(b) -> bool          at run.resume, before a checkpoint is read: True = the state came from
                                elsewhere (a peer), no checkpoint is read
    restored_from_disk(b)       after run.resume read a checkpoint or found none (not after restore=True)
    before_batch(b)             the loader is about to fetch the next step's first batch
    epoch_ended(b)              the loader's epoch ended
    counts(b) -> bool           the step that just ended counts (False: discarded, not a step)
    after_step(b)               after a counted step
    agree_stop(b, signum, due)  the stop agreement, after the ranks' own (collective where the hook's
                                peers are): returns the signal and whether a timed checkpoint is due
    may_requeue(b) -> bool      whether this process's job may requeue itself at a stop
    may_report(b) -> bool       whether this process may report the run done (write summary.json)
    summary(b) -> dict          keys for summary.json
    event(b, record)            a record of the run: every metrics.jsonl record, and the first step, a
                                resume, an evaluation pass, a log window ("progress")
    close(b)                    at the Run's close, before the process group goes

This module sits below the boundary and the strategies, so both can import it: what a hook may use of
the boundary is `Boundary`, a Protocol, not the class.
"""
from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .data import TrainLoader
    from .dist import DistContext

# The stop signals, from the least demanding to the most: ranks (or replica groups) that saw different
# signals stop on the one that asks for the most, a preemption warning (requeue) over a plain stop over Ctrl-C.
STOP_PRIORITY = (0, signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)


@dataclass
class StepState:
    """Where the run is between two optimizer steps, in one place (the boundary's counters and flags)."""
    done: int = 0  # optimizer steps completed (resumed ones included)
    saved: int = -1  # the step of this attempt's last checkpoint
    last_save_t: float = field(default_factory=time.monotonic)
    last_ckpt_s: float | None = None  # the last committed checkpoint's seconds to commit (grace_period.py)
    grace_warned: bool = False
    exit_code: int = 0  # how this attempt ends: set by a failure and by a stop (attempts.py records it)
    attempt_started: bool = False  # attempts.begin recorded this attempt's start (rank 0)
    resumed_from: int | None = None  # the step a checkpoint (or a peer) gave this attempt
    resumed_path: Path | str | None = None  # a step folder, a URL, or the memory tier's description
    pending: bool = False  # an optimizer stepped since the last boundary (implicit mode)
    owed_save: bool = False  # an epoch's last step deferred its checkpoint to the next batch or epoch
    owed_check: bool = False  # ... and its stop check
    owed_mem: bool = False  # ... and its memory-tier copy
    resumed: bool = False  # run.resume has run: objects registered later would never be restored
    explicit: bool = False  # the loop calls run.step() itself: optimizer hooks count nothing
    stopped: bool = False  # a stop signal was acted on: no final checkpoint at close
    failed: bool = False  # this process ends on an error: no final checkpoint at close
    not_a_step: bool = False  # an optimizer step that is not training (torch's get_state_dict; state_io)
    measure_grads: bool = True  # at the next optimizer step: gradients exist only until zero_grad
    agreed: bool = False  # the startup agreement has run
    ended: bool = False  # the run ledger has this attempt's end line
    jumped: bool = False  # a peer's state replaced this run's mid-epoch (run.epochs reads the loader's epoch anew)


class Phases(Protocol):
    """Where this rank is, as the watchdog sees it (reliability/progress.Progress)."""
    phase: str

    def enter(self, phase: str, step: int | None = None) -> None: ...


class Registered(Protocol):
    """The registered objects (boundary/train_state.TrainState)."""
    objects: dict[str, Any]

    def state_dict(self, skip: frozenset[str] = ...) -> dict[str, Any]: ...

    def load_state_dict(self, shared: dict[str, Any], source: str) -> list[str]: ...


class Boundary(Protocol):
    """What a hook may use of the step boundary."""
    ctx: DistContext
    steps: StepState

    @property
    def progress(self) -> Phases: ...

    @property
    def state(self) -> Registered: ...

    models: list[nn.Module]
    modules: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    loaders: list[TrainLoader]

    def say(self, msg: str) -> None: ...

    def write(self, record: dict[str, Any]) -> None: ...

    @property
    def on_log(self) -> list[Callable[[dict[str, Any]], None]]: ...

    def restart_window(self, step: int) -> None: ...


class StepHooks:
    """A strategy's or a service's part in every step; each method's default does nothing."""

    across_groups = False  # it keeps replica groups in step (strategy ft): other models may join a replica group's run

    def attach(self, b: Boundary) -> None:
        pass

    def gate(self, obj: object, scheduler: bool) -> None:
        pass

    def restore(self, b: Boundary) -> bool:
        return False

    def restored_from_disk(self, b: Boundary) -> None:
        pass

    def before_batch(self, b: Boundary) -> None:
        pass

    def epoch_ended(self, b: Boundary) -> None:
        pass

    def counts(self, b: Boundary) -> bool:
        return True

    def after_step(self, b: Boundary) -> None:
        pass

    def agree_stop(self, b: Boundary, signum: int, due: bool) -> tuple[int, bool]:
        return signum, due

    def may_requeue(self, b: Boundary) -> bool:
        return True

    def may_report(self, b: Boundary) -> bool:
        return True

    def summary(self, b: Boundary) -> dict[str, Any]:
        return {}

    def event(self, b: Boundary, record: dict[str, Any]) -> None:
        pass

    def close(self, b: Boundary) -> None:
        pass

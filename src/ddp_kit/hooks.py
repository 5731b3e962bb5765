"""The one seam at the step boundary: the step state every part reads, and the hooks through which a
strategy or a service takes part in a step without the boundary knowing it by name.

A hook set subclasses `StepHooks` and overrides what it needs; every method's default does nothing
and decides nothing. The boundary (ddp_kit.boundary.core) calls every attached set, in the order
they were attached, at these points:

    attach(b)                   when it joins the boundary
    started(b)                  the attempt starts, before any work (collective: every rank's hooks run it);
                                may refuse the start by raising (the run ledger's crash-loop rule)
    gate(obj, scheduler)        each optimizer (scheduler=False) or LR scheduler registered, also those
                                registered before the hook was attached
    restore(b) -> bool          at run.resume, before a checkpoint is read: True = the state came from
                                elsewhere (a peer), no checkpoint is read
    restored_from_disk(b)       after run.resume read a checkpoint or found none (not after restore=True)
    resumed(b, meta)            run.resume is over, however it ended: `meta` is the resumed checkpoint's
                                meta.json ({} when none was read: a fresh start or a peer's state); also
                                after a rollback (sync_fix rollback) restored an earlier step mid-run
    optimizer_step(b)           an optimizer is about to write the parameters, and again at every run.step
                                (a step whose optimizer was gated off): what still reads them must be done;
                                it may run twice a step, so it must be idempotent
    before_batch(b)             the loader is about to fetch the next step's first batch
    epoch_ended(b)              the loader's epoch ended
    counts(b) -> bool           the step that just ended counts (False: discarded, not a step)
    after_step(b)               after a counted step
    first_step(b)               the first step of this attempt is over (the ranks agreed, timeouts shortened)
    saving(b)                   a durable checkpoint of this step is about to be made (collective: every rank,
                                every durable save: ckpt_every, timed, run.save, a stop's, the final one);
                                what it puts in b.meta goes into this step's meta.json
    agree_stop(b, signum, due)  the stop agreement, after the ranks' own (collective where the hook's
                                peers are): returns the signal and whether a timed checkpoint is due
    may_requeue(b) -> bool      whether this process's job may requeue itself at a stop
    may_report(b) -> bool       whether this process may report the run done (write summary.json)
    summary(b) -> dict          keys for summary.json
    logged(b, record)           a metrics.jsonl record (what rank 0 writes there)
    event(b, record)            a record of the run: every metrics.jsonl record, and the first step, a
                                resume, an evaluation pass, a log window ("progress")
    ending(b, code)             the attempt ends with exit `code` (b.verdict says why, when it failed): once,
                                after the last checkpoint's wait; never raises
    close(b)                    at the Run's close, before the process group goes

A checkpoint tier (`Tier`) is the other seam: the durable checkpoints and the memory tier are two, each
owning its cadence; the boundary saves the tiers due at a step and resume takes the newest complete
step across them.

This module sits below the boundary and the strategies, so both can import it: what a hook may use of
the boundary is `Boundary`, a Protocol, not the class.
"""
from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

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
    # The last step the ranks are known to have held the same weights: a sync check passed there, or a resume or a
    # rollback restored one state (sync_fix rollback goes back to it; every durable checkpoint's meta names it)
    synced: int = 0
    pending: bool = False  # an optimizer stepped since the last boundary (implicit mode)
    owed: set[str] = field(default_factory=set)  # an epoch's last step deferred these tiers' saves to the next batch or epoch
    owed_check: bool = False  # ... and its stop check
    resumed: bool = False  # run.resume has run: objects registered later would never be restored
    explicit: bool = False  # the loop calls run.step() itself: optimizer hooks count nothing
    stopped: bool = False  # a stop signal was acted on: no final checkpoint at close
    finishing: bool = False  # the loop is over (a clean end): a divergence found now cannot be trained again in process
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

    def tell(self, record: dict[str, Any]) -> None: ...  # an event for the hooks (and the ledger) only

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

    def started(self, b: Boundary) -> None:
        pass

    def restored_from_disk(self, b: Boundary) -> None:
        pass

    def resumed(self, b: Boundary, meta: dict[str, Any]) -> None:
        pass

    def optimizer_step(self, b: Boundary) -> None:
        pass

    def before_batch(self, b: Boundary) -> None:
        pass

    def epoch_ended(self, b: Boundary) -> None:
        pass

    def counts(self, b: Boundary) -> bool:
        return True

    def after_step(self, b: Boundary) -> None:
        pass

    def first_step(self, b: Boundary) -> None:
        pass

    def agree_stop(self, b: Boundary, signum: int, due: int) -> tuple[int, int]:
        return signum, due  # due: the stop check's tier level (stopping.py), 0 for none

    def timed_due(self, b: Boundary) -> tuple[str, ...]:
        return ()  # tiers due by this hook's clock (rank 0's counts), saved at the next stop check

    def saving(self, b: Boundary) -> None:
        pass  # a durable checkpoint of this step is about to be made: b.meta may still change (collective)

    def saved(self, b: Boundary, tier: str, seconds: float) -> None:
        pass  # a tier saved this step; the loop waited `seconds` for it

    def may_requeue(self, b: Boundary) -> bool:
        return True

    def may_report(self, b: Boundary) -> bool:
        return True

    def summary(self, b: Boundary) -> dict[str, Any]:
        return {}

    def logged(self, b: Boundary, record: dict[str, Any]) -> None:
        pass

    def event(self, b: Boundary, record: dict[str, Any]) -> None:
        pass

    def ending(self, b: Boundary, code: int) -> None:
        pass

    def close(self, b: Boundary) -> None:
        pass


class Found(Protocol):
    """A complete step a tier holds: its step number and where (a folder, a URL, a description)."""
    step: int

    @property
    def path(self) -> Any: ...


@runtime_checkable
class Tier(Protocol):
    """A checkpoint tier: where the state of a step can be saved and found again, at its own cadence.

    `durable`: a save here is a checkpoint the run may end on (the durable tier, or a second folder); it
    supersedes a copy of the same step in a tier that is not. The boundary asks `due` at every counted step
    (a step that ends an epoch owes its saves to the next batch, as the checkpoint does), and resume asks
    `find` for a step newer than the durable tier's newest, on every rank alike."""
    name: str
    durable: bool

    def due(self, step: int) -> bool: ...

    def save(self, b: Boundary) -> None: ...  # everything registered, at b.steps.done (collective)

    def wait(self) -> None: ...  # a save still being written is complete

    def find(self, b: Boundary, newer_than: int | None, warn: Callable[[str], None]) -> Found | None: ...

    def load(self, found: Any) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]: ...

    def sharded_keys(self, found: Any) -> set[str]: ...

    def load_sharded(self, found: Any, template: dict[str, Any]) -> None: ...

    def clear(self) -> None: ...  # a new lineage (resume='never', a named step): what it holds is abandoned

    def continues_from(self, step: int | None) -> None: ...  # this attempt continues the run from `step`

    def take_blocking(self) -> dict[str, float]: ...  # {progress-window key: seconds the loop waited} since the last call

    def close(self, clean: bool) -> None: ...

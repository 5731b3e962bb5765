"""What the step boundary's parts (and the services) use of it, as a Protocol: the parts are modules
the core calls with itself, so they name this, not the core's class (an arrow back up would make the
core and its parts one knot). The core (core.StepBoundary) is the one implementation."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from ..hooks import Boundary as HookView

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..checkpoint.backend import CheckpointBackend
    from ..hooks import StepHooks, Tier
    from ..parallel.strategy import Strategy
    from ..reliability.numerics import NonFiniteLoss
    from ..reliability.preemption import PreemptFlag
    from ..reliability.progress import Progress
    from ..reliability.verdicts import Verdict
    from ..reliability.watchdog import Watchdog
    from ..run_folder import RunDir
    from .policy import Policy
    from .run_writer import RunWriter
    from .train_state import TrainState


class Boundary(HookView, Protocol):
    """The step boundary as its parts see it."""

    policy: Policy
    flag: PreemptFlag
    rd: RunDir | None
    hang_dir: str
    hooks: list[StepHooks]
    tiers: list[Tier]
    meta: dict[str, Any]
    strategy: Strategy
    config: dict[str, Any] | None
    cuda_notes: Callable[[BaseException], list[str]] | None
    attempt: int
    previous_end: dict[str, Any] | None
    verdict: Verdict | None
    memory: dict[str, int]
    nonfinite: NonFiniteLoss
    records: Any  # records.MetricsRecords (a part: it names this protocol)
    timer: Any
    stop_ahead: Callable[[], tuple[int, int]] | None
    watchdog: Watchdog
    resources: Any  # lifecycle.RunResources

    @property
    def progress(self) -> Progress: ...

    @property
    def state(self) -> TrainState: ...

    @property
    def writer(self) -> RunWriter | None: ...

    @property
    def epoch(self) -> int: ...

    def checkpointer(self) -> CheckpointBackend: ...

    def checkpointer_if_open(self) -> CheckpointBackend | None: ...

    def track(self, obj: Any, name: str | None = None, module: nn.Module | None = None) -> None: ...

    def check_optimizers(self) -> None: ...

    def agree(self, facts: dict[str, Any] | None = None, details: dict[str, dict[str, Any]] | None = None) -> None: ...

    def named(self, kind: type) -> dict[str, Any]: ...

    def sharded(self) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]: ...

    def state_io(self) -> AbstractContextManager[None]: ...

    def collective(self, phase: str) -> AbstractContextManager[None]: ...

    def tell(self, record: dict[str, Any]) -> None: ...

    def save(self) -> None: ...

    def log(self) -> dict[str, Any]: ...

    def stop(self, signum: int) -> NoReturn: ...

    def flush(self) -> None: ...

    def write_summary(self, summary: dict[str, Any]) -> None: ...

    def may_report(self) -> bool: ...

    def fail(self, err: BaseException) -> int: ...


__all__ = ["Boundary"]

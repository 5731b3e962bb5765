"""The per-rank metrics' forward/backward split, measured on the first steps of each log window.

Where the forward starts and ends (and, under DDP, how long its buffer broadcast waits) only module
hooks can tell, and a module with a hook sends every call down torch's slow call path. The split is
read once per log window, so the hooks are registered for the first SAMPLED steps of each window
and removed after them; on the other steps the forward and backward are timed as one stretch, which
the window divides in the proportions the sampled steps had (reliability/metrics.StepTimer).
Sampling the start of a window (not its end) gives every window samples, also one cut short by a
log event the loop asks for (run.log(), the run's end, a stop)."""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..reliability.metrics import StepTimer

# Steps sampled per window: 5 of the default 50. Enough for a stable share (the sampled steps are
# ordinary ones, and the proportions, not the times, are carried to the rest); few enough that the
# hooks' cost (a few microseconds a forward) vanishes in the window's mean.
SAMPLED = 5


class ForwardSplit:
    """The forward hooks of every registered model, on while the current window's first SAMPLED steps run."""

    def __init__(self, timer: StepTimer):
        self.timer = timer
        timer.sampling = True
        self.models: list[nn.Module] = []
        self.handles: list[Any] = []
        self.on = True  # the first window starts sampled; hooks follow as models come

    def add(self, model: nn.Module) -> None:
        self.models.append(model)
        if self.on:
            self.handles += _hook(model, self.timer)

    def after_step(self) -> None:
        """At each step's end (after its log event, which starts a new window): the next step is
        sampled while the window holds fewer than SAMPLED steps."""
        if self.on != (self.timer.steps < SAMPLED):
            self.switch(not self.on)

    def switch(self, on: bool) -> None:
        self.on = self.timer.split = on
        if on:
            for model in self.models:
                self.handles += _hook(model, self.timer)
        else:
            for handle in self.handles:
                handle.remove()
            self.handles.clear()

    def clear(self) -> None:
        self.switch(False)
        self.models.clear()


def _hook(model: nn.Module, timer: StepTimer) -> list[Any]:
    """The forward's end, and under DDP its start: DDP's pre-forward broadcasts rank 0's buffers
    (BatchNorm statistics) to every rank, a wait on the others, booked as comm (the loop's own work
    before the call as other), and the forward is timed from the inner module's start. Only inside
    DDP's call: the inner module alone (an eval) marks nothing."""
    handles = [model.register_forward_hook(lambda *_: timer.hooked("forward"))]
    if not isinstance(model, DDP):
        return handles
    inside = [False]

    def entering(*_: object) -> None:
        timer.hooked("other")
        inside[0] = True

    def inner_start(*_: object) -> None:
        if inside[0]:
            inside[0] = False
            timer.hooked("comm", gpu="forward start")
    return handles + [model.register_forward_pre_hook(entering), model.module.register_forward_pre_hook(inner_start)]

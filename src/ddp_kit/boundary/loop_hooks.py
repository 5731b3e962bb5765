"""The hooks that drive the implicit boundary: an optimizer's pre- and post-step hooks and the loader's
fetch, batch and epoch-end callbacks (registration.py attaches them). They mark the phases the
watchdog and the time split see, and run the boundary a step owes when the loop asks for its next batch."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..parallel.fsdp import memory_bytes

if TYPE_CHECKING:  # the core imports its parts: they name what they use of it (protocol.py), not the core
    from .protocol import Boundary


def stepping(b: Boundary) -> None:
    """An optimizer's pre-hook: backward (and DDP's wait) ended here."""
    if b.steps.not_a_step:
        return
    for hook in b.hooks:
        hook.optimizer_step(b)  # e.g. a copy that still reads what this step writes
    b.progress.enter("optimizer", b.steps.done + 1)  # an error in optimizer.step() is named as being there
    b.timer.mark("backward")
    if b.steps.measure_grads:
        b.steps.measure_grads = False
        b.memory = memory_bytes(b.models, b.optimizers)


def stepped(b: Boundary) -> None:
    """An optimizer's post-hook."""
    if b.steps.not_a_step:
        return
    # The loop's own work after the optimizer step (scheduler.step(), zero_grad) is not forward/backward.
    b.progress.enter("after step", b.steps.done + 1)
    b.timer.mark("optimizer")
    b.steps.pending = not b.steps.explicit


def fetching(b: Boundary) -> None:
    b.flush()
    for hook in b.hooks:
        hook.before_batch(b)
    b.progress.enter("data", b.steps.done + 1)
    b.timer.mark("other")


def epoch_end(b: Boundary) -> None:
    # The loop's own work between epochs (eval, a per-epoch scheduler) is a slow phase, not a hang.
    b.progress.enter("between epochs")
    for hook in b.hooks:
        hook.epoch_ended(b)


def fetched(b: Boundary) -> None:
    b.timer.mark("data")
    b.progress.enter("forward/backward")

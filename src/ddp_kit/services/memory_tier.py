"""The memory tier as a service: a checkpoint tier in node memory (/dev/shm), each rank's state copied on
to a rank of the next node (checkpoint/memory_tier.py does the copying), every `mem_ckpt_every` steps.

It is a hooks.Tier (its cadence, its saves, the newest complete copy at resume; its close at the end
frees the node's memory on a clean end and leaves it to the restart otherwise) and a hooks.StepHooks:
before an optimizer writes the parameters, the copy that still reads them is finished. Off (None) at 0 or
without a run folder (the copies belong to the run folder's checkpoint location)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..boundary.protocol import Boundary as Whole
from ..hooks import Boundary, StepHooks
from ..options import Option, every_or_auto
from ..service_registry import Service

OPTIONS = (
    Option("mem_ckpt_every", 0, key="mem_ckpt_every", resumable=True, check=every_or_auto("mem_ckpt_every"), auto=True,
           help="Optimizer steps between memory-tier checkpoints: each rank's state copied into node memory (/dev/shm, or DDP_KIT_MEM_DIR), and on to a rank of the next node; a restart resumes from the newest of them when it is newer than the durable checkpoint (0: off; auto: the interval from the copy's measured cost and the failure rate, docs/cadence.md)."),
)


class MemoryCopies:
    """This job's memory tier on this node, opened at its first use (collective: a gloo group of its own)."""

    name = "memory"
    durable = False  # a durable checkpoint of the same step supersedes its copy

    def __init__(self, b: Whole, every: int | str):
        self.b, self.every = b, every
        self._tier: Any = None

    def tier(self) -> Any:
        if self._tier is None:
            from ..boundary.checkpoint_io import tier_location
            from ..checkpoint.memory_tier import MemoryTier

            b = self.b
            self._tier = MemoryTier(b.ctx, tier_location(b.checkpointer()), b.resources.run_id or "")
        return self._tier

    # ---- the Tier ---------------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return isinstance(self.every, int) and step % self.every == 0  # auto: due by time (services/cadence.py)

    def save(self, b: Boundary) -> None:
        if b.steps.saved != b.steps.done:  # the durable tier holds this step already
            from ..boundary.saving import save_memory

            save_memory(self.b, self.tier())

    def wait(self) -> None:
        if self._tier is not None and self._tier.copying is not None:
            self._tier.wait_copy()

    def find(self, b: Boundary, newer_than: int | None, warn: Callable[[str], None]) -> Any:
        return self.tier().find(newer_than, warn)

    def load(self, found: Any) -> Any:
        return self.tier().load(found)

    def sharded_keys(self, found: Any) -> set[str]:
        return self.tier().sharded_keys(found)  # type: ignore[no-any-return]

    def load_sharded(self, found: Any, template: dict[str, Any]) -> None:
        self.tier().load_sharded(found, template)

    def clear(self) -> None:
        self.tier().clear()

    def continues_from(self, step: int | None) -> None:
        self.tier().continues_from(step)

    def take_blocking(self) -> dict[str, float]:
        return {"mem_s": self._tier.take_blocking()} if self._tier is not None else {}

    def close(self, clean: bool) -> None:
        if self._tier is not None:  # a clean end frees the node's memory; a failed one leaves it to the restart
            self._tier.close(clean=clean)



class CopyBeforeUpdate(StepHooks):
    """An optimizer step waits for the copy that still reads what it writes."""

    def __init__(self, copies: MemoryCopies):
        self.copies = copies

    def optimizer_step(self, b: Boundary) -> None:
        self.copies.wait()


def make(b: Any, settings: Mapping[str, Any]) -> tuple[MemoryCopies, CopyBeforeUpdate] | None:
    every = settings["mem_ckpt_every"]
    if not every or b.rd is None:
        return None
    copies = MemoryCopies(b, every)
    return copies, CopyBeforeUpdate(copies)


SERVICE = Service("memory_tier", OPTIONS, make)

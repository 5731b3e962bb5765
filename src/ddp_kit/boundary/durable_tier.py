"""The durable tier: the checkpoints in run_dir/checkpoints or at ckpt_dir (a folder or a URL), every
`ckpt_every` steps and every `ckpt_every_s` seconds (the time is agreed at the stop check: stopping.py).
It is the tier a run may end on: its save at a step supersedes any other tier's copy of that step, its
`latest` is the floor the other tiers' copies must beat at resume, and `resume=` names its steps. The
backend itself is the boundary's (checkpointer()), opened at its first use."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..options import AUTO
from . import grace_period

if TYPE_CHECKING:
    from ..hooks import Boundary


class DurableTier:
    name = "durable"
    durable = True

    def __init__(self, b: Any):
        self.b = b

    @property
    def every(self) -> int | str:
        return self.b.policy.ckpt_every  # type: ignore[no-any-return]

    def due(self, step: int) -> bool:
        every = self.b.policy.ckpt_every
        return bool(every) and every != AUTO and step % every == 0  # auto: due by time (services/cadence.py)

    def save(self, b: Boundary) -> None:
        b.save()  # type: ignore[attr-defined]

    def wait(self) -> None:
        self.b.checkpointer().wait()

    def find(self, b: Boundary, newer_than: int | None, warn: Callable[[str], None]) -> Any:
        found = self.b.checkpointer().find(self.b.policy.resume, warn=warn)
        return found if found is not None and (newer_than is None or found.step > newer_than) else None

    def load(self, found: Any) -> Any:
        return self.b.checkpointer().load(found)

    def sharded_keys(self, found: Any) -> set[str]:
        return self.b.checkpointer().sharded_keys(found)  # type: ignore[no-any-return]

    def load_sharded(self, found: Any, template: dict[str, Any]) -> None:
        self.b.checkpointer().load_sharded(found, template)

    def clear(self) -> None:
        pass  # a new lineage moves its steps aside (checkpoint_io.archive_lineage), rank 0, after the resume

    def continues_from(self, step: int | None) -> None:
        pass

    def take_blocking(self) -> dict[str, float]:
        return {}  # each save's blocking time is its own "checkpoint" record

    def close(self, clean: bool) -> None:
        ckpt = self.b.checkpointer_if_open()
        if ckpt is not None:
            ckpt.close()  # never leave with an async save half-written; frees its host buffers
            grace_period.note_timings(self.b)  # the last (async) save's time, while metrics.jsonl is open

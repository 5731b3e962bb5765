"""What a checkpoint holds: the objects a run registered by name, each with state_dict/load_state_dict.

A model is saved unwrapped (no DDP `module.` prefix, no compile wrapper), so `model.pt` loads
into a plain model anywhere. A loader from `run.prepare` saves its data position. Everything else
(optimizer, LR scheduler, GradScaler, the user's own objects) saves what its `state_dict()` returns.
RNG states are per rank and live beside, not in here (checkpoint.rng_state).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import UserError
from ..parallel.ddp import unwrap


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class TrainState:
    """Named stateful objects, in registration order."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self._own: dict[str, Any] = {}  # what is saved and loaded: a model unwrapped (once, when added)

    def clear(self) -> None:
        self.objects.clear()
        self._own.clear()

    def __bool__(self) -> bool:
        return bool(self.objects)

    def add(self, name: str, obj: Any) -> None:
        if not _stateful(obj):
            raise UserError(f"cannot checkpoint {name}={type(obj).__name__}: it has no state_dict()/load_state_dict()",
                            "pass objects with both methods (a model, optimizer, scheduler, GradScaler, or your own "
                            "class that defines them)")
        held = self.objects.get(name)
        if held is not None and not self.holds(obj):
            raise UserError(f"two different objects registered for checkpointing under the name {name!r}",
                            "give each its own keyword in run.resume(...)")
        self.objects[name] = obj
        self._own[name] = unwrap(obj) if isinstance(obj, nn.Module) else obj

    def next_name(self, base: str) -> str:
        """`base`, or `base_1`, `base_2`, ... if taken: the first model is "model", as in model.pt."""
        name, i = base, 0
        while name in self.objects:
            i += 1
            name = f"{base}_{i}"
        return name

    def holds(self, obj: Any) -> bool:
        """`obj` is registered; a model counts as registered when its DDP wrapper is (and back)."""
        target = unwrap(obj) if isinstance(obj, nn.Module) else obj
        return any(o is target for o in self._own.values())

    def state_dict(self, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
        return {name: o.state_dict() for name, o in self._own.items() if name not in skip}

    def load_state_dict(self, shared: dict[str, Any], source: str, skip: frozenset[str] = frozenset()) -> list[str]:
        """Restore every registered object (but `skip`) from `shared`; returns notes (e.g. a data
        position that could not be kept). A missing or unfitting entry is a one-line UserError."""
        missing = [n for n in self.objects if n not in shared and n not in skip]
        if missing:
            saved = sorted(k for k in shared if k != "loop")
            raise UserError(f"checkpoint {source} has no state for {', '.join(missing)} (it holds: {', '.join(saved)})",
                            "register the same objects under the same names as the run that saved it, or start over "
                            "with resume='never' or a new run_dir")
        notes = []
        for name, obj in self.objects.items():
            if name in skip:
                continue
            target = self._own[name]
            try:
                note = target.load_state_dict(shared[name])
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                raise UserError(f"checkpoint {source} does not fit {name} ({type(obj).__name__}): "
                                f"{str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}",
                                "use a new run_dir, or resume='never' to start over in this one") from None
            if isinstance(note, str):
                notes.append(note)
        return notes

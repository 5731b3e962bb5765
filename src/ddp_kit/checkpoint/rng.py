"""Per-rank RNG state for a checkpoint: what a rank saves of its random generators, and restoring it."""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """This process's RNG states: Python's, the CPU generator's and its own GPU's only (the current
    device), so a checkpoint of the torchrun layout (every GPU visible) resumes in the srun layout
    (one GPU per task) and back."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    initialized: Callable[[], bool] = torch.cuda.is_initialized  # torch leaves it unannotated
    if torch.cuda.is_available() and initialized():
        state["cuda_own"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"].cpu())
    if not torch.cuda.is_available():
        return
    if "cuda_own" in state:
        torch.cuda.set_rng_state(state["cuda_own"].cpu())
    elif "cuda" in state:  # older checkpoints: every visible GPU's state; take this process's own
        states = state["cuda"]
        torch.cuda.set_rng_state(states[min(torch.cuda.current_device(), len(states) - 1)].cpu())


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x

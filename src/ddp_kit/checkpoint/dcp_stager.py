"""Whether the installed torch's DCP stager can be kept across asynchronous saves, and making one."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def reusable_stager(device: torch.device) -> Any:
    """A DCP stager to keep across async saves: it copies each tensor into the host copy it made at
    the first save (page-locked on a GPU, so the copies queue with one wait for all), where DCP's
    default makes fresh pageable memory every time. None where the installed torch's stager does not
    keep its copies from one save to the next (torch 2.11's clears them after each; older ones lack
    it): DCP then stages as before. Close it after the last save."""
    try:
        import inspect

        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import async_save
        if "async_stager" not in inspect.signature(async_save).parameters:
            return None
        if not _stager_reuses(DefaultStager, StagingOptions):
            return None
        gpu = device.type == "cuda"
        return DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=False,
                                            use_non_blocking_copy=gpu))
    except (ImportError, TypeError, ValueError):  # a torch without it, or with other options
        return None


def _stager_reuses(stager_type: Callable[..., Any], options_type: Callable[..., Any]) -> bool:
    """Whether a stager's second copy of the same tensor lands where its first did (probed on the CPU;
    a stager that fails the probe is not used). The types are the installed torch's, whose signatures
    differ between versions: whatever does not fit fails the probe."""
    try:
        probe, t = stager_type(options_type(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                            use_non_blocking_copy=False)), torch.zeros(4)
        try:
            first: torch.Tensor = probe.stage({"t": t})["t"]
            again: torch.Tensor = probe.stage({"t": t})["t"]
            return again.data_ptr() == first.data_ptr()
        finally:
            probe.close()
    except Exception:
        return False

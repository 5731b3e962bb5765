"""Host staging of a state for saving: CPU copies of nested tensor states, and on a GPU one
page-locked buffer per file that the asynchronous save copies into without stalling training."""
from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

ALIGN = 64  # bytes: every view into a host buffer starts aligned for any dtype


PAGE = mmap.PAGESIZE  # 64 KiB on some ARM servers (GH200): registrations must not share a page


class HostBuffer:
    """One page-locked host buffer at its exact size (to the page), for the GPU tensors of one file.

    Registered with cudaHostRegister rather than taken from torch's pinned allocator, which rounds
    each allocation up to a power of two (up to 2x the state page-locked). The registered range is
    whole pages of our own allocation, so it never overlaps another registration (which fails). If
    registration fails anyway the buffer stays pageable (the copies are then synchronous, and still
    correct) and CUDA's last-error is cleared, so it is not reported against a later kernel. GPU-only."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        size = -(-max(nbytes, 1) // PAGE) * PAGE
        self._raw = torch.empty(size + PAGE, dtype=torch.uint8)
        start = -self._raw.data_ptr() % PAGE
        self.data = self._raw[start:start + size]
        self.pinned = int(_cudart().cudaHostRegister(self.data.data_ptr(), size, 0)) == 0
        if not self.pinned:
            _clear_cuda_error()

    def release(self) -> None:
        if getattr(self, "pinned", False):
            self.pinned = False
            _cudart().cudaHostUnregister(self.data.data_ptr())

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # at interpreter exit CUDA may be gone already
            pass


def _cudart() -> Any:
    """torch's binding of the CUDA runtime (torch.cuda.cudart has no annotations: typed here)."""
    runtime: Callable[[], Any] = torch.cuda.cudart
    return runtime()


def _clear_cuda_error() -> None:
    """cudaGetLastError from the CUDA runtime torch loaded (its Python binding lacks it)."""
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass


def tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def _aligned(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def snapshot(obj: Any, reuse: Any = None, host: HostBuffer | None = None) -> tuple[Any, HostBuffer | None]:
    """A CPU copy of every tensor in a nested state, so training can go on while it is written;
    returns it with the host buffer that holds its GPU tensors.

    GPU tensors are copied (asynchronously) into views of one flat page-locked buffer, `host` when it
    is large enough (the caller keeps it for the next snapshot of the same state), so `torch.save`
    of the result writes one storage per file. CPU tensors are cloned; `reuse` is the previous
    snapshot of the same structure, whose CPU buffers are overwritten in place (already-touched
    memory copies several times faster than fresh allocations).
    """
    gpu = [t for t in tensors_in(obj) if t.device.type == "cuda"]
    views: list[torch.Tensor] = []
    if gpu:
        need = sum(_aligned(t) for t in gpu)
        if host is None or host.nbytes < need:
            host = HostBuffer(need)
        offset = 0
        for t in gpu:
            nbytes = t.numel() * t.element_size()
            view = host.data[offset:offset + nbytes].view(t.dtype).view(t.shape)
            views.append(view.copy_(t.detach(), non_blocking=host.pinned))
            offset += _aligned(t)
    return _copy(obj, reuse, iter(views)), host


def _copy(obj: Any, reuse: Any, views: Iterator[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cuda":
            return next(views)
        if isinstance(reuse, torch.Tensor) and reuse.shape == obj.shape and reuse.dtype == obj.dtype:
            return reuse.copy_(obj.detach())
        return obj.detach().clone()
    if isinstance(obj, dict):
        prev = reuse if isinstance(reuse, dict) else {}
        return {k: _copy(v, prev.get(k), views) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        same: Sequence[Any] = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        return type(obj)(_copy(v, r, views) for v, r in zip(obj, same))
    return obj


def to_host(obj: Any) -> Any:
    """Every GPU tensor of a nested state copied to CPU (CPU tensors as they are): what a synchronous
    save writes, so that model.pt loads with a plain torch.load on a machine with no GPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type == "cuda" else obj
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj

"""A memory-tier copy's place in node memory: the room left in the tmpfs (its free space, and what a
container's memory limit leaves), a slot (one copy's folder and its data file, mapped and kept across
saves), and which of a rank's slots holds the newest sealed copy. memory_tier.py decides what goes
in them; memory_copy.py owns the format.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from . import memory_copy as mc
from . import memory_root as mr


class CopyLost(Exception):
    """One copy could not be made or taken (its message says why): a warning, and the next copy is tried."""


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MB" if n < 2**30 else f"{n / 2**30:,.2f} GB"


def _room(folder: Path, cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes this process can still put in `folder`'s tmpfs: its free space, and, in a container with a
    memory limit (cgroup v2), what the limit leaves: tmpfs pages count against it, and statvfs does not
    show that (a pod's memory volume without a sizeLimit reports the node's memory)."""
    try:
        st = os.statvfs(folder)
    except OSError:  # the folder is gone (removed under the job): no room until it is made again
        return 0
    free = st.f_bavail * st.f_frsize
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        used = int((cgroup / "memory.current").read_text())
        if limit != "max":
            # The page cache of files read is counted in memory.current but given back under pressure;
            # tmpfs pages (shmem, counted in `file` too) are not.
            try:
                stat = dict(line.split()[:2] for line in (cgroup / "memory.stat").read_text().splitlines() if " " in line)
            except OSError:
                stat = {}
            reclaimable = max(int(stat.get("file", 0)) - int(stat.get("shmem", 0)), 0)
            free = min(free, max(int(limit) - used + reclaimable, 0))
    except (OSError, ValueError):
        pass
    return free


def _mapped(path: Path, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over a new file at `path`, `nbytes` long, shared with the file (its pages are the
    tmpfs's: allocated here, so that a full tmpfs fails now, as CopyLost, not with SIGBUS later).
    The file is created exclusively and never through a link."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if nbytes:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise CopyLost(f"the tmpfs cannot hold {_mb(nbytes)} more ({exc.strerror})") from None
    finally:
        os.close(fd)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


class _Slot:
    """One copy's folder and its mapped data file, kept across saves (already-touched pages copy fast)."""

    def __init__(self, folder: Path):
        self.folder, self.pinned = folder, False
        self.buf: torch.Tensor | None = None

    def open(self, nbytes: int, pin: bool) -> torch.Tensor:
        """Unmark the copy (no manifest: not usable while written) and map its data file at `nbytes`."""
        try:
            os.mkdir(self.folder, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise CopyLost(f"cannot make {self.folder.name} ({exc.strerror})") from None
        try:
            (self.folder / mc.MANIFEST).unlink(missing_ok=True)
            if self.buf is not None and (self.buf.numel() != nbytes or not (self.folder / mc.DATA).exists()):
                self.release()  # another size, or the file was removed under the mapping: map a new one
            if self.buf is None:
                self.buf = _mapped(self.folder / mc.DATA, nbytes)
                if pin and nbytes:  # GPU only: the device-to-host copy then runs at full speed, asynchronously
                    from .staging import _cudart
                    self.pinned = int(_cudart().cudaHostRegister(self.buf.data_ptr(), nbytes, 0)) == 0
        except OSError as exc:
            raise CopyLost(f"cannot write {self.folder.name} ({exc.strerror})") from None
        assert self.buf is not None
        return self.buf

    def release(self) -> None:
        if self.pinned and self.buf is not None:
            from .staging import _cudart
            _cudart().cudaHostUnregister(self.buf.data_ptr())
        self.buf, self.pinned = None, False


def _newest(slots: list[_Slot]) -> int | None:
    steps = []
    for slot in slots:
        try:
            steps.append(int(json.loads(mr.read_private(slot.folder / mc.MANIFEST))["step"]))
        except (OSError, ValueError, KeyError, TypeError):
            steps.append(-1)
    return steps.index(max(steps)) if max(steps) >= 0 else None

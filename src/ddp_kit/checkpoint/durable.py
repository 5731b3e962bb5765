"""Durable file writes: fsync'd writes that checksum as they go, atomic replacement, directory fsync,
checksums of written files, and telling a full disk from other write errors."""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer


class _HashingWriter(io.RawIOBase):
    """A write-only stream that checksums what passes through it, so no second read is needed.

    Each chunk is hashed in a helper thread while this thread writes it (both release the GIL on
    large buffers), and `write` returns only when both are done: the chunk may be a view of a
    buffer torch frees afterwards, so it is never held past the call and never copied.
    """

    def __init__(self, f: IO[bytes]):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self._todo: queue.SimpleQueue[ReadableBuffer | None] = queue.SimpleQueue()  # None: no more chunks
        self._done: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._t = threading.Thread(target=self._hash, daemon=True)
        self._t.start()

    def _hash(self) -> None:
        while (chunk := self._todo.get()) is not None:
            self.sha.update(chunk)
            self._done.put(True)

    def writable(self) -> bool:
        return True

    def write(self, b: ReadableBuffer) -> int:
        self._todo.put(b)
        n = self.f.write(b)
        self._done.get()
        self.size += memoryview(b).nbytes  # in bytes, whichever buffer type torch hands over
        return n

    def digest(self) -> str:
        self._todo.put(None)
        self._t.join()
        return self.sha.hexdigest()


def dump(raw: IO[bytes], obj: Any, as_json: bool, delay_s: float = 0.0) -> dict[str, Any]:
    """torch.save `obj` (or dump it as JSON) into the stream `raw`, checksumming as it goes; return
    {size, sha256}. The stream's owner makes it durable (storage.Storage.open_write)."""
    w = _HashingWriter(raw)
    if as_json:
        w.write(json.dumps(obj, indent=1, sort_keys=True).encode())
    else:
        # torch.FileLike names IO[bytes], but torch.save takes any object with write() (its docs say so)
        torch.save(obj, w)  # type: ignore[arg-type]
    if delay_s:
        time.sleep(delay_s)  # test hook: make the window for a kill-during-save wide
    return {"size": w.size, "sha256": w.digest()}


def write_durable(path: Path, obj: Any, delay_s: float = 0.0) -> dict[str, Any]:
    """torch.save `obj` (or dump JSON for dicts destined to .json) durably; return {size, sha256}."""
    with open(path, "wb") as raw:
        digest = dump(raw, obj, path.suffix == ".json", delay_s)
        raw.flush()
        os.fsync(raw.fileno())
    return digest


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256_of(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            sha.update(chunk)
    return sha.hexdigest()


def file_digest(path: Path) -> dict[str, Any]:
    """{size, sha256} of a file already on disk, as a manifest records it."""
    return {"size": path.stat().st_size, "sha256": sha256_of(path)}


def disk_full(exc: BaseException | None) -> bool:
    """ENOSPC/EDQUOT anywhere in the chain: torch.save's zip writer re-raises a write error as a
    RuntimeError ("unexpected pos ...") with the OSError as its context."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False

"""A checkpoint storage on a folder every rank mounts (storage.Storage): rename-capable, read and
written in place, durable by fsync."""
from __future__ import annotations

import fnmatch
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

from . import layout
from .durable import fsync_dir
from .storage import Storage


class FolderStorage:
    """The objects of a local (or mounted) folder, `root`, by their paths relative to it."""

    can_rename = True
    object_word = "file"

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.location = str(self.root)
        self.local_root: Path | None = self.root

    def __repr__(self) -> str:
        return f"FolderStorage({self.location!r})"

    def locate(self, rel: str) -> str:
        return str(self.root / rel) if rel else str(self.root)

    def _path(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    @contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        path = self._path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Through .<name>.tmp and a rename (`latest`: .latest.tmp, layout.LATEST_TMP), then fsync."""
        path = self._path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
        fsync_dir(path.parent)

    def read_bytes(self, rel: str) -> bytes:
        return self._path(rel).read_bytes()

    def put(self, local: Path, rel: str) -> None:
        with self.open_write(rel) as fh, open(local, "rb") as src:
            shutil.copyfileobj(src, fh, 1 << 22)

    def get(self, rel: str, local: Path) -> None:
        shutil.copyfile(self._path(rel), local)

    def listing(self, prefix: str = "") -> dict[str, int]:
        top = self._path(prefix)
        if not top.is_dir():
            return {}
        out = {}
        for folder, _, files in os.walk(top):
            for name in files:
                path = Path(folder) / name
                try:
                    out[path.relative_to(self.root).as_posix()] = path.stat().st_size
                except FileNotFoundError:  # removed while listed
                    continue
        return out

    def remove(self, rels: list[str]) -> None:
        """Files go at once; a folder is renamed out of the way (.trash_<name>) at once and deleted in
        the background: unlinking ~100 MB costs ~20 ms."""
        doomed = []
        for rel in rels:
            path = self._path(rel)
            if path.is_dir() and not path.is_symlink():
                trash = path.with_name(layout.TRASH_PREFIX + path.name)
                if path.name.startswith(layout.TRASH_PREFIX):
                    trash = path
                else:
                    shutil.rmtree(trash, ignore_errors=True)
                    os.replace(path, trash)
                doomed.append(trash)
            else:
                path.unlink(missing_ok=True)
        if doomed:
            threading.Thread(target=_delete, args=(doomed,), name="ddp_kit-ckpt-retain", daemon=True).start()

    def rename(self, src: str, dst: str) -> None:
        os.replace(self._path(src), self._path(dst))

    def sync(self, rel: str = "") -> None:
        fsync_dir(self._path(rel))

    def move_to(self, rel: str, other: Storage, dst: str) -> None:
        """A rename (`other` is a folder on the same file system: run_dir/archive, or ckpt_dir/archive)."""
        if other.local_root is None:
            raise ValueError(f"cannot move {self.locate(rel)} to {other.location}: not a folder")
        target = other.local_root / dst
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self._path(rel), target)

    def sibling(self, location: str) -> Storage | None:
        return None if "://" in location else FolderStorage(location)


class FolderFS:
    """The few fsspec file system calls the one-writer lease makes (lease.py), on a folder, without
    fsspec (an optional dependency): a plain-path ckpt_dir holds its lease like a URL does."""

    is_folder = True  # lease.py: create by link(2), replace by rename

    def invalidate_cache(self, path: str | None = None) -> None:
        pass

    def glob(self, pattern: str) -> list[str]:
        folder, name = os.path.split(pattern)
        try:
            return [os.path.join(folder, n) for n in os.listdir(folder) if fnmatch.fnmatchcase(n, name)]
        except FileNotFoundError:
            return []

    def cat_file(self, path: str) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    def modified(self, path: str) -> datetime:
        return datetime.fromtimestamp(os.stat(path).st_mtime, tz=timezone.utc)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def pipe_file(self, path: str, data: bytes, mode: str = "overwrite") -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "xb" if mode == "create" else "wb") as fh:
            fh.write(data)

    def rm_file(self, path: str) -> None:
        os.unlink(path)


def _delete(folders: list[Path]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def open_folder_storage(location: str) -> FolderStorage:
    """The STORAGES factory for a plain path."""
    return FolderStorage(location)

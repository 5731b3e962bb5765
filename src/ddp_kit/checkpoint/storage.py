"""What a checkpoint storage is: the few things it can do, and nothing about steps, manifests or the
order of a commit (steps.py owns those, once, for every storage). As torch's DCP keeps its
FileSystemBase (create a stream, rename, mkdir, exists, remove) apart from its writer.

A storage is one location (a folder, a URL) holding objects named by relative paths ("latest",
"step_3/model.pt"). It says what it can do through two flags:

    can_rename   a prefix can be renamed whole and atomically: a step is then written under its .tmp_
                 name and renamed into place at its commit (a local or mounted folder); without it the
                 step is written under its own name and its manifest, written last, is the commit
    local_root   where the objects lie on this machine's file system (every rank mounts it), or None:
                 a backend then writes and reads the files in place, instead of staging them on a
                 node-local disk and uploading them (an object store, file:// included)

Two storages: storage_folder.FolderStorage (a folder: rename, local) and store_fs.Store (any fsspec
URL: no rename, not local). A new one is one file implementing Storage, and one line in
storage_registry.STORAGES keyed by URL scheme.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Protocol, runtime_checkable


@runtime_checkable
class Storage(Protocol):
    """One checkpoint location: objects by relative path. Every method may raise the storage's own
    errors (OSError, a client's); a missing object raises FileNotFoundError."""

    @property
    def location(self) -> str:
        """The location as a message names it: the folder's path, or the URL."""
        ...

    @property
    def can_rename(self) -> bool:
        ...

    @property
    def local_root(self) -> Path | None:
        ...

    @property
    def object_word(self) -> str:
        """What a message calls one entry: "file" (a folder) or "object" (a store)."""
        ...

    def locate(self, rel: str) -> str:
        """How a message (and a resume's Found) names object or prefix `rel`: its path or its URL."""
        ...

    def open_write(self, rel: str) -> AbstractContextManager[IO[bytes]]:
        """A stream that creates or replaces `rel` (its prefixes made as needed); whole and durable
        once the context exits without error (a folder: fsync'd; a store: uploaded)."""
        ...

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Replace `rel` atomically: a reader sees the old bytes or the new ones, never a part."""
        ...

    def read_bytes(self, rel: str) -> bytes:
        ...

    def put(self, local: Path, rel: str) -> None:
        """Upload (or copy) the local file `local` to `rel`, durably."""
        ...

    def get(self, rel: str, local: Path) -> None:
        """Download (or copy) `rel` to the local file `local`."""
        ...

    def listing(self, prefix: str = "") -> dict[str, int]:
        """{relative path: size} of every object under `prefix` (all when ""), listed now: never from a
        cache (other processes write here too). A location that does not exist lists empty."""
        ...

    def remove(self, rels: list[str]) -> None:
        """Remove each object or whole prefix; missing ones are no error. May return before the bytes
        are gone, once no listing shows them."""
        ...

    def rename(self, src: str, dst: str) -> None:
        """Rename prefix `src` to `dst` (not existing) whole and atomically. Only when can_rename."""
        ...

    def sync(self, rel: str = "") -> None:
        """Make the names written under prefix `rel` durable (a folder: fsync it); a no-op on a store."""
        ...

    def move_to(self, rel: str, other: Storage, dst: str) -> None:
        """Move prefix `rel` to `dst` on `other`, a location of the same storage: a rename where the
        storage has one, else a copy of every object, then their removal."""
        ...

    def sibling(self, location: str) -> Storage | None:
        """Another location of the same storage (a resume from a step elsewhere on the same store);
        None when `location` is not one this storage can open."""
        ...

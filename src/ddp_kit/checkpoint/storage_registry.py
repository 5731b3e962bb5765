"""The registry of storages by the location's URL scheme (a plain path: "", a folder; a URL, file://
included: fsspec), and the opening of a location's storage through it.

Adding a storage is one new module with a class implementing storage.Storage and a factory
`open_<x>(location) -> Storage`, and one line in STORAGES. The registry names the factory by its
import path rather than importing it, so that a storage's optional dependency (fsspec, s3fs) is
imported only by a run that uses it. Nothing outside the storage module asks which one it is: the
backend and the protocol go by its flags (a rename-capable HDFS commits by rename like a folder;
a node-local NVMe tier mounted everywhere writes in place like one).
"""
from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from pathlib import Path

from ..errors import UserError
from .storage import Storage

# scheme -> "module:factory"; factory(location: str) -> storage.Storage, refusing a bad location in one line
_FSSPEC = "ddp_kit.checkpoint.store_fs:open_store"
STORAGES: dict[str, str] = {
    "": "ddp_kit.checkpoint.storage_folder:open_folder_storage",  # a plain path: a folder every rank mounts
    # file:// takes the object store's code path on a local (or mounted) folder: no rename, no fsync
    **dict.fromkeys(("file", "s3", "gs", "gcs", "az", "abfs", "abfss", "memory"), _FSSPEC),
}
BACKENDS = STORAGES  # its earlier name

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme_of(location: str | Path) -> str:
    """The URL scheme of a checkpoint location, lower-cased; "" for a plain path."""
    found = None if isinstance(location, Path) else _SCHEME.match(str(location))
    return found.group(1).lower() if found else ""


def _factory(location: str | Path) -> Callable[[str], Storage]:
    scheme = scheme_of(location)
    if scheme not in STORAGES:
        raise UserError(f"unknown checkpoint location scheme {scheme!r} in {str(location)!r}: this ddp_kit "
                        f"stores checkpoints in folders and in {', '.join(f'{s}://' for s in sorted(STORAGES) if s)} "
                        f"locations", "pass a folder path or one of those URLs as ckpt_dir")
    module, factory = STORAGES[scheme].split(":")
    opener: Callable[[str], Storage] = getattr(importlib.import_module(module), factory)
    return opener


def open_storage(location: str | Path) -> Storage:
    """The storage at `location` (a folder path or a URL). An unknown scheme, or a location its storage
    cannot open (a client not installed, a URL with no bucket), is refused in one line."""
    return _factory(location)(str(location))

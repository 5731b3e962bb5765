"""One writer per checkpoint folder: the in-place backend (checkpointer.Checkpointer) holding the same
lease as an object store location (lease.py), kept as <folder>/.lease.<generation>.

run_dir/.lock keeps two jobs out of one run folder, but not out of one `ckpt_dir` that two run folders
name (a shared NFS or Lustre path): both would resume each other's newest step and commit into one
folder, `latest` flipping between them. So rank 0 takes the folder's lease at the first collective call
(find or save), before anything is written; a second job is refused in one line naming the holder, as
on a URL, and a holder taken over (frozen for longer than the ttl) stops at its next commit without
committing. The lease is written through storage_folder.FolderFS: no fsspec needed.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..dist import DistContext
from ..errors import UserError
from . import layout, steps
from .checkpointer import Checkpointer, _td
from .found import Found
from .lease import LEASE_TTL_S, LeaseKeeper
from .run_lease import lease_stop, take_lease
from .storage import Storage
from .storage_folder import FolderFS
from .store_fs import Store

_STOP = "stop"


def open_leased_folder(ctx: DistContext, location: str | Path | Storage, upload_timeout_s: float | None = None,
                       lease_ttl_s: float = LEASE_TTL_S, **options: Any) -> LeasedFolder:
    """The backend for a storage every rank mounts (backend.open_backend). `upload_timeout_s` is an
    object store's: this backend commits without uploads."""
    return LeasedFolder(ctx, location, lease_ttl_s=lease_ttl_s, **options)


class LeasedFolder(Checkpointer):
    """Checkpointer, with the folder's lease taken before the first find or save and checked before
    every commit."""

    def __init__(self, ctx: DistContext, ckpt_root: str | Path | Storage, lease_ttl_s: float = LEASE_TTL_S,
                 **options: Any):
        super().__init__(ctx, ckpt_root, **options)
        self.lease_ttl_s = lease_ttl_s
        self._checked = False
        self._lease: LeaseKeeper | None = None  # rank 0's

    def _check(self) -> None:
        """Collective, once: rank 0 takes the folder's lease, or every rank raises its one line."""
        if not self._checked:
            where = Store(FolderFS(), str(self.root), self.location)
            self._lease = take_lease(self.ctx, where, self.lease_ttl_s)
            self._checked = True

    def find(self, resume: str, warn: Callable[[str], None]) -> Found | None:
        self._check()
        return super().find(resume, warn)

    def save(self, step: int, shared: dict[str, Any], per_rank: dict[str, Any], meta: dict[str, Any],
             sharded: dict[str, Any] | None = None) -> None:
        self._check()
        super().save(step, shared, per_rank, meta, sharded)

    def _finish(self, step: int, tmp: Path, files: dict[str, Any]) -> bool | None:
        """Checkpointer's commit, unless another job took the folder over: then every rank stops."""
        key = f"ddp_kit/ckpt/{layout.step_name(step)}/committed"
        store = self.ctx.store
        files = self._gather(step, files)
        if self.ctx.is_main:
            stop = lease_stop(self.location, self._lease)
            if stop is None:
                steps.commit(self.storage, step, self._manifest(step, files))
                self.prune(step)
            outcome = "1" if stop is None else _STOP + json.dumps(list(stop))
            if store:
                store.set(key, outcome)
        elif store:
            store.wait([key], _td(self.timeout_s))  # see Checkpointer._finish
            outcome = store.get(key).decode()
        else:
            outcome = "1"
        if outcome.startswith(_STOP):
            message, hint = json.loads(outcome[len(_STOP):])
            raise UserError(message, hint, verdict=True)
        return None

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._lease is not None:  # after the last commit: the next job may start at once
                self._lease.release()
                self._lease = None

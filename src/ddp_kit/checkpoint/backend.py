"""The checkpoint backend seam: what the step boundary asks of a run's checkpoint storage, and
open_backend, which picks the backend for a location's storage. The registry of storages by URL
scheme (STORAGES, scheme_of, open_storage) is storage_registry.py's, and Found is found.py's; both
are named here too.

Three layers, each knowing only the one below:
- **a storage** (storage.Storage): what one location can do. Open a stream for write and read,
  list, remove, rename or not (`can_rename`), and whether every rank reads and writes it in place
  (`local_root`). storage_folder.FolderStorage (rename, local) and store_fs.Store (any fsspec URL:
  no rename, not local).
- **the commit protocol** (steps.py), once for every storage: the order of a commit's writes, which
  steps are committed and valid, resume's choice, prune, archive; `python -m ddp_kit.checkpoint`
  reads through it too.
- **a backend** (CheckpointBackend, below): the save of one run's ranks. checkpointer.Checkpointer
  writes each rank's files in place on a storage with a `local_root`; object_store's stages them on
  a node-local disk and uploads them (with retries, a lease, a startup probe) to one without.

Adding a storage is one new module and one line in STORAGES (storage_registry.py says how).

What every backend must guarantee (the readers rely on nothing else):
- **Atomic visibility.** A step counts only once its manifest (layout.MANIFEST) is present and every
  file it names is there with the size and sha256 it records. Readers (find, the CLI) trust nothing
  else, so a crash at any point of a save leaves at most files that no manifest vouches for. The one
  commit order (steps.commit): every file under the step's staging name, then `latest`, then the
  manifest, then (where the storage can rename) the staged folder renamed into place. `latest`
  first, so that a kill between the two never leaves a complete step above `latest` (which resume
  would take for an abandoned run's).
- **`latest` bounds resume from above.** Steps above the one `latest` names belong to an abandoned
  run and are never chosen; `latest` may name a step that is not (yet) valid, and find then falls
  back to the newest valid step below it, saying so through `warn`.
- **Durability.** Once `save` (or, when asynchronous, `wait`) has returned on every rank, the step
  survives the processes: fsync'd on a file system, every upload completed on an object store.
- **No training collectives.** Ranks report their files to rank 0 through the rendezvous store, so
  an asynchronous save never issues a collective that could interleave with the training loop's.
  `save`, `find` and `load_sharded` are called by every rank at the same point.
- **Opening is local.** A factory does no collective: one rank may open a backend alone (to read
  `latest`). Checks that need every rank (an object store's probe) run at the first `find` or `save`.
- **Nothing committed is lost by accident.** `prune` never removes the newest committed step and
  removes only leftovers and steps beyond `keep_last`, never the kept-best ones the newest step's meta
  names (steps.KEEP_BEST, services/keep_best.py); `archive` moves steps aside, never deletes.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import UserError
from .found import Found
from .storage import Storage
from .storage_registry import BACKENDS, STORAGES, _factory, open_storage, scheme_of

__all__ = ["BACKENDS", "STORAGES", "ArchivesOnItsStore", "CheckpointBackend", "Found", "open_backend", "open_storage",
           "scheme_of"]


@runtime_checkable
class CheckpointBackend(Protocol):
    """The operations the step boundary uses, at one checkpoint location of one run."""

    location: str  # where the steps live, as the user named it (for messages)

    def save(self, step: int, shared: dict[str, Any], per_rank: dict[str, Any], meta: dict[str, Any],
             sharded: dict[str, Any] | None = None) -> None:
        """Commit step `step` (collective). `shared`: identical on every rank, written once; `per_rank`:
        this rank's own; `sharded`: FSDP's state dicts, different on every rank. Asynchronous backends
        return once the state is copied off the device; the next save (or wait) waits for the commit."""

    def wait(self) -> None:
        """Block until a pending save is committed; re-raise its error here."""

    def take_timings(self) -> list[dict[str, float]]:
        """The saves committed since the last call, oldest first: {"step", "blocking_s" (the loop's
        wait in save), "commit_s" (from save to the commit)} (boundary/grace_period.py records them)."""

    def claim(self) -> None:
        """Take the location's one-writer lease now (collective; once): before anything else reads or
        writes the run's state, e.g. a resume from the memory tier, which never calls find."""

    def find(self, resume: str, warn: Callable[[str], None]) -> Found | None:
        """The step to resume from (collective): "auto" the newest valid one (at most `latest`, damaged
        ones reported through `warn`), "never" None, else the named step, refused in one line if invalid."""

    def load(self, found: Found) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
        """(shared state, this rank's own state or None, meta) of `found`, on CPU."""

    def sharded_keys(self, found: Found) -> set[str]:
        """The flattened keys of the sharded state `found` holds (empty when it holds none)."""

    def load_sharded(self, found: Found, template: dict[str, Any]) -> None:
        """Fill `template` (this rank's sharded state dicts) from `found`, whatever world size wrote it."""

    def latest(self) -> int | None:
        """The step the `latest` pointer names; None when there is none (nothing committed here)."""

    def latest_name(self) -> str:
        """The step `latest` names, as a message says it ("step_12", or "none yet")."""

    def owns(self, found: Found) -> bool:
        """Whether `found` is one of this location's steps (a resume from elsewhere starts a new lineage)."""

    def prune(self, newest: int) -> None:
        """Keep the newest `keep_last` steps up to `newest` (itself always) and the kept-best ones its meta
        names, and drop a killed save's leftovers."""

    def archive(self, keep_upto: int | None, into: str | Path) -> list[int]:
        """Move every step above `keep_upto` (all when None) to `into`/<time>/ on the same storage, with
        `latest` pointing at `keep_upto` (or removed) first; returns the steps moved."""

    def close(self) -> None:
        """At the run's end: wait for a pending save (re-raising its error), then free what saves kept."""


@runtime_checkable
class ArchivesOnItsStore(Protocol):
    """A backend whose abandoned steps go beside them on its own store (object_store's), not into a folder."""

    def archive_location(self) -> str:
        """Where `archive` moves steps to on this backend's store (<url>/archive)."""


def open_backend(location: str | Path, ctx: Any, one_writer: bool = True, **options: Any) -> CheckpointBackend:
    """The backend for `location` (a folder path or a URL), built with `options` (keep_last, async_save,
    timeout_s, write_delay_s, upload_timeout_s): ranks write in place on a storage every rank mounts,
    else stage and upload. An unknown scheme is refused in one line at once; a location its storage
    cannot open, at the first collective call (find or save), by every rank together. `one_writer=False`:
    a folder only this run folder names (run_dir/checkpoints, which run_dir/.lock already guards) needs
    no lease."""
    opener = _factory(location)
    try:
        storage: Storage | None = opener(str(location))
    except UserError:  # the object store backend says it at its first collective call
        storage = None
    if storage is not None and storage.local_root is not None and not one_writer:
        from .checkpointer import Checkpointer

        return Checkpointer(ctx, storage, **{k: v for k, v in options.items() if k not in ("upload_timeout_s", "lease_ttl_s")})
    if storage is not None and storage.local_root is not None:  # with the same one-writer lease as a URL
        from .folder_lease import open_leased_folder

        return open_leased_folder(ctx, storage, **options)
    from .object_store import open_object_store

    return open_object_store(ctx, storage if storage is not None else str(location), **options)

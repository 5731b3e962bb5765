"""The object store checkpoint backend (s3://, gs://, az://, file://, memory://, through fsspec): the
in-place backend's save (checkpointer.py: host snapshot, per-rank files, checksums posted through the
rendezvous store), staged on a node-local disk and uploaded: no shared disk needed. The commit is
the same (steps.commit), on a storage without rename.

    every rank   writes its files into a node-local staging folder (under $TMPDIR, one per run and
                 rank); the loop waits only for that (async_ckpt: only for the host copy)
                 uploads them to <url>/step_<N>/ in the writer thread, each retried with backoff,
                 and posts {file: size, sha256} (or why its upload failed) through the rendezvous store
    rank 0       checks that every object is listed with its size, commits (steps.commit: `latest`, then
                 the manifest), then prunes (orphans, keep_last), then tells the others
    resume       rank 0 lists the store, trusts `latest` as the upper bound, checks a step's manifest
                 and sizes against the listing, downloads it into a node-local cache and verifies
                 the checksums there; every other rank downloads what it reads and verifies it too

A crash at any point leaves only objects no manifest vouches for (steps.prune removes them). A save
whose upload fails is not committed: one line, and training goes on; the run stops only when no
checkpoint has committed for `upload_timeout_s` (Policy.ckpt_upload_timeout_s).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..dist import DistContext
from ..dist.collectives import rank0_verdict
from ..errors import UserError
from . import layout, steps
from .checkpointer import Checkpointer, _td
from .found import Found
from .lease import LEASE_TTL_S, LeaseKeeper
from .run_lease import lease_stop
from .storage import Storage
from .storage_folder import FolderStorage
from .store_checks import check_every_rank
from .store_fs import Store, describe, open_store, refusal, unreachable

UPLOADS = 4  # objects one rank sends at once
UPLOAD_TRIES = 4  # per object; the pauses between tries double from BACKOFF_S (1, 2, 4 s)
BACKOFF_S = 1.0
SLOW_UPLOAD_S = 5.0  # a save that waits this long for the previous upload says so
_ERROR = ".upload_error/rank"  # posted instead of a rank's files when its upload failed
_FAILED, _STOP = "failed", "stop"


def open_object_store(ctx: DistContext, location: Storage | str, keep_last: int = 3, async_save: bool = False,
                      timeout_s: float = 600.0, write_delay_s: float = 0.0,
                      upload_timeout_s: float = 1800.0, lease_ttl_s: float = LEASE_TTL_S) -> ObjectStoreCheckpointer:
    """The BACKENDS factory for URLs. Opening is local (a rank may open the backend alone, to read
    `latest`); the checks that need every rank (the client installed on every node, probe) run at
    the first collective call, find or save, which resume makes before step 1."""
    return ObjectStoreCheckpointer(ctx, location, keep_last=keep_last, async_save=async_save, timeout_s=timeout_s,
                                   write_delay_s=write_delay_s, upload_timeout_s=upload_timeout_s,
                                   lease_ttl_s=lease_ttl_s)


def local_area(url: str, rank: int | None) -> Path:
    """This process's node-local folder for `url` (rank `rank`'s saves being uploaded), or with rank None
    the node's download cache, which the ranks of a node share (steps.fetch: one download per node).
    The staging folder names its process: a second job refused on the same node must not touch the
    first one's uploads. The host is in the name in case TMPDIR is on a shared file system."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:12]
    base = Path(tempfile.gettempdir()) / f"ddp_kit-{os.getuid()}"
    if rank is None:
        return base / f"{digest}-{socket.gethostname()}-cache"
    return base / f"{digest}-{socket.gethostname()}-rank{rank}-pid{os.getpid()}"


def _remove_dead_staging(area: Path) -> None:
    """The staging folders of this URL and rank left by processes of this host that have exited."""
    head = area.name.rsplit("-pid", 1)[0] + "-pid"
    for other in area.parent.glob(head + "*") if area.parent.is_dir() else ():
        pid = other.name[len(head):]
        if other != area and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(other, ignore_errors=True)


class _GaveUp(Exception):
    """A write of a commit failed every try (its message: why)."""


class ObjectStoreCheckpointer(Checkpointer):
    """Checkpoints of one run at an fsspec URL. `root` is this rank's node-local staging folder;
    `location` the URL."""

    ships_in_background = True
    private_staging = True

    def __init__(self, ctx: DistContext, where: Storage | str, keep_last: int = 3, async_save: bool = False,
                 timeout_s: float = 600.0, write_delay_s: float = 0.0, upload_timeout_s: float = 1800.0,
                 lease_ttl_s: float = LEASE_TTL_S):
        self._problem: UserError | None = None
        if isinstance(where, str):
            try:
                where = open_store(where)
            except UserError as err:  # said at the first collective call (check_every_rank), or by latest()
                self._problem = err
        if not isinstance(where, (str, Store)):  # the lease and the probe speak fsspec
            raise ValueError(f"{where.location}: the upload backend needs an fsspec store")
        url = where.url if isinstance(where, Store) else where
        self.local = local_area(url, ctx.rank)
        shutil.rmtree(self.local, ignore_errors=True)
        _remove_dead_staging(self.local)  # a killed process's uploads never resume: its staging goes
        # Not emptied here: another rank of this node may be downloading into it already. Whatever a
        # killed process left is verified before use (steps.fetch) and emptied at the first save.
        self.cache = local_area(url, None)
        super().__init__(ctx, FolderStorage(self.local / "stage"), keep_last=keep_last, async_save=async_save,
                         timeout_s=timeout_s, write_delay_s=write_delay_s)
        self._store, self.location = (where if isinstance(where, Store) else None), url
        self._checked = False
        self._lease: LeaseKeeper | None = None  # rank 0's, from the first collective call on
        self.lease_ttl_s = lease_ttl_s
        self.upload_timeout_s = upload_timeout_s
        self._last_commit = time.monotonic()  # the bound on failed uploads counts from here
        self._last_name: str | None = None
        self._fetched: dict[str, Path] = {}  # step URL -> its verified download

    @property
    def store(self) -> Store:
        if self._store is None:
            raise self._problem or ValueError(f"{self.location}: no store")
        return self._store

    @property
    def storage(self) -> Storage:
        """The location's storage (the staging folder is self.stage)."""
        return self.store

    def _check(self) -> None:
        """Collective, once: see check_every_rank."""
        if not self._checked:
            self._lease = check_every_rank(self.ctx, self._store, self._problem, self.lease_ttl_s)
            self._checked = True

    # ---- saving: staging and shipping (the rest is Checkpointer's) ----------------------------------

    def save(self, step: int, shared: dict[str, Any], per_rank: dict[str, Any], meta: dict[str, Any],
             sharded: dict[str, Any] | None = None) -> None:
        self._check()
        if self._fetched or self.cache.exists():  # resumed: what was downloaded for it is not needed again
            shutil.rmtree(self.cache, ignore_errors=True)  # every rank has loaded (a save is collective)
            self._fetched.clear()
        super().save(step, shared, per_rank, meta, sharded)

    def _stage_rel(self, step: int) -> str:
        return layout.step_name(step)  # this rank's own local folder: nothing else is ever read there

    def _open_tmp(self, step: int) -> Path:
        """This rank's own empty staging folder: no other rank writes or waits for it."""
        tmp = self._stage_path(step)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def _gather_timeout_s(self) -> float:
        # the others' uploads (and rank 0's commit) may take the whole bound; a lost rank is the
        # peer-loss watchdog's to report, sooner
        return self.timeout_s + (self.upload_timeout_s or 86400.0)

    def _finish(self, step: int, tmp: Path, files: dict[str, Any]) -> bool:
        """Upload this rank's files, then rank 0 commits (manifest, then `latest`) or gives the step
        up; every rank returns whether it committed, or raises when the run must stop."""
        key = f"ddp_kit/ckpt/{layout.step_name(step)}/committed"
        try:
            error = self._upload(step, tmp, files)
            gathered = self._gather(step, {f"{_ERROR}{self.ctx.rank}": error} if error else files)
            if self.ctx.is_main:
                errors = [v for k, v in sorted(gathered.items()) if k.startswith(_ERROR)]
                taken = self._lease_lost()
                outcome = taken or self._outcome(step, errors or self._publish(step, gathered))
                if self.ctx.store:
                    self.ctx.store.set(key, outcome)
            elif self.ctx.store:
                self.ctx.store.wait([key], _td(self._gather_timeout_s()))
                outcome = self.ctx.store.get(key).decode()
            else:
                outcome = "1"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if outcome.startswith(_STOP):
            message, hint = json.loads(outcome[len(_STOP):])
            raise UserError(message, hint, verdict=True)
        return outcome != _FAILED

    def _upload(self, step: int, tmp: Path, files: dict[str, Any]) -> str | None:
        """This rank's files to the step's staging name on the store (<url>/step_<N>/: no rename); None,
        or why one of them did not get there."""
        name = steps.staging_name(self.storage, step)
        names = [n for n in files if (tmp / n).is_file()]

        def one(n: str) -> str | None:
            return self._put(lambda: self.storage.put(tmp / n, f"{name}/{n}"), self.storage.locate(f"{name}/{n}"))

        with ThreadPoolExecutor(UPLOADS, thread_name_prefix="ddp_kit-ckpt-put") as pool:
            return next((e for e in pool.map(one, names) if e), None)

    def _put(self, action: Callable[[], Any], url: str) -> str | None:
        """Run one upload, retried with backoff; None, or the reason it failed every time."""
        if self.write_delay_s:
            time.sleep(self.write_delay_s)  # test hook: a window to kill a rank mid-upload
        for attempt in range(1, UPLOAD_TRIES + 1):
            try:
                action()
                return None
            except Exception as exc:  # any client error: retried, then reported; never raised into the loop
                why = describe(exc)
                if attempt == UPLOAD_TRIES:
                    return f"upload of {url} failed {UPLOAD_TRIES} times (last: {why})"
                pause = BACKOFF_S * 2 ** (attempt - 1)
                print(f"ddp_kit: warning: [rank {self.ctx.rank}] upload of {url} failed ({why}); retrying in "
                      f"{pause:g}s (try {attempt + 1} of {UPLOAD_TRIES})", file=sys.stderr, flush=True)
                time.sleep(pause)
        return None

    def _attempt(self, action: Callable[[], object], url: str) -> None:
        """steps.commit's writes, each retried (_put); raises _GaveUp when one fails every time."""
        error = self._put(action, url)
        if error:
            raise _GaveUp(error)

    def _publish(self, step: int, files: dict[str, Any]) -> list[str]:
        """Rank 0: the commit (steps.commit), once every object the manifest names is listed with its
        size; then prune. Returns [] once committed, else [why not]."""
        name = layout.step_name(step)
        staged = steps.staging_name(self.storage, step)
        manifest = self._manifest(step, files)
        try:
            have = self.storage.listing(staged)
        except Exception as exc:
            return [f"listing {self.storage.locate(staged)} failed ({describe(exc)})"]
        for rel, want in sorted(manifest["files"].items()):
            if have.get(f"{staged}/{rel}") != want["size"]:
                got = "missing" if f"{staged}/{rel}" not in have else f"{have[f'{staged}/{rel}']} bytes, not {want['size']}"
                return [f"{self.storage.locate(f'{staged}/{rel}')} is {got} on the store after its upload"]
        try:
            before = steps.read_latest(self.storage)
        except Exception:  # only for putting `latest` back should the manifest fail: not a reason to fail
            before = None
        try:
            steps.commit(self.storage, step, manifest, attempt=self._attempt)
        except _GaveUp as gave_up:
            if before is not None:  # best effort: resume would fall back to it all the same, with a warning
                self._put(lambda: steps.point_latest(self.storage, layout.step_name(before)),
                          self.storage.locate(layout.LATEST))
            return [str(gave_up)]
        self._commit_at[step] = time.monotonic()  # commit_s ends here: manifest and `latest` are up
        try:
            self.prune(step)
        except Exception as exc:  # committed all the same; the next save's prune tries again
            print(f"ddp_kit: warning: pruning {self.location} after {name} failed ({describe(exc)}); the next "
                  f"checkpoint tries again", file=sys.stderr, flush=True)
        return []

    def _lease_lost(self) -> str | None:
        """Rank 0, before a commit: a stop when another job has taken this location over (lease.py)."""
        stop = lease_stop(self.location, self._lease)
        return None if stop is None else _STOP + json.dumps(list(stop))

    def _outcome(self, step: int, errors: list[str]) -> str:
        """Rank 0's word to every rank: "1" (committed), failed (training goes on), or stop."""
        name, now = layout.step_name(step), time.monotonic()
        if not errors:
            self._last_commit, self._last_name = now, name
            return "1"
        waited = now - self._last_commit
        last = self._last_name or self.latest_name()
        if self.upload_timeout_s and waited > self.upload_timeout_s:
            return _STOP + json.dumps([
                f"no checkpoint has committed to {self.location} for {waited:.0f}s (ckpt_upload_timeout_s "
                f"{self.upload_timeout_s:g}); {name} failed too: {errors[0]}",
                f"check the store (endpoint, credentials, quota, network) or raise ckpt_upload_timeout_s; rerun "
                f"the same command to resume (last committed: {last})"])
        print(f"ddp_kit: warning: checkpoint {name} was not committed to {self.location}: {errors[0]}; training "
              f"goes on and the next checkpoint tries again (the run stops after ckpt_upload_timeout_s "
              f"{self.upload_timeout_s:g}s without a commit; last committed: {last})", file=sys.stderr, flush=True)
        return _FAILED

    def wait(self) -> None:
        """Block until the pending upload is committed (saying so when that takes a while)."""
        pending = self._thread
        if pending is not None and pending.is_alive():
            pending.join(SLOW_UPLOAD_S)
            if pending.is_alive() and self.ctx.is_main:
                step = layout.step_name(int(pending.name.rsplit("-", 1)[-1]))
                print(f"ddp_kit: waiting for the upload of {step} "
                      f"to {self.location} (still running after {SLOW_UPLOAD_S:g}s)", file=sys.stderr, flush=True)
        super().wait()

    def close(self) -> None:
        try:
            super().close()
        finally:
            shutil.rmtree(self.local, ignore_errors=True)
            if self._checked or self._fetched:  # a job refused at startup leaves the cache to the job holding the URL
                shutil.rmtree(self.cache, ignore_errors=True)  # every rank has long finished loading
            if self._lease is not None:  # after the last upload: the next job may start at once
                self._lease.release()
                self._lease = None

    def prune(self, newest: int) -> None:
        """See steps.prune: orphans, objects no manifest names, and steps beyond keep_last go."""
        steps.prune(self.storage, newest, self.keep_last)

    # ---- the pointer and the lineage ---------------------------------------------------------------

    def latest(self) -> int | None:
        return steps.read_latest(self.storage)

    def latest_name(self) -> str:
        try:
            return steps.latest_name(self.storage)
        except Exception as exc:  # said inside other messages: never a second error
            return f"unknown ({describe(exc)})"

    def owns(self, found: Found) -> bool:
        below = self.store.under(str(found.path)) if isinstance(found.path, str) else None
        return below is not None and layout.step_of(below) is not None

    def archive(self, keep_upto: int | None, into: str | Path) -> list[int]:
        """Rank 0 only: see steps.archive_abandoned. The steps go to <url>/archive/<time>/ (an `into`
        elsewhere than on this store is not the same storage, and is not used)."""
        below = self.store.under(into) if isinstance(into, str) else None
        target = Store(self.store.fs, self.store.path(below or layout.ARCHIVE), self.store.url_of(below or layout.ARCHIVE))
        return steps.archive_abandoned(self.storage, keep_upto, target)

    def archive_location(self) -> str:
        return self.store.url_of(layout.ARCHIVE)

    # ---- finding and loading -------------------------------------------------------------------------

    def find(self, resume: str, warn: Callable[[str], None]) -> Found | None:
        """Rank 0 picks and verifies the step (steps.choose); every rank gets its choice."""
        self._check()
        def choose() -> tuple[str, int] | None:
            try:
                return steps.choose(self.storage, resume, warn, self.cache)
            except UserError:
                raise
            except Exception as exc:
                raise refusal(self.location, exc, "read") from None

        value = rank0_verdict(self.ctx, choose)
        if not value:
            return None
        path: Path | str = value[0] if "://" in value[0] else Path(value[0])
        if self.ctx.is_main and isinstance(path, str):
            self._fetched[path] = self.cache / layout.step_name(value[1])
        return Found(path, value[1])

    def _local(self, found: Found) -> Found:
        """`found` as a local folder: the node's verified download of what this rank reads (every shared
        file, its own rank file, DCP's metadata; the shards its load plan reads come at load_sharded)."""
        if isinstance(found.path, Path):
            return found
        url = str(found.path)
        if url not in self._fetched:
            own = layout.rank_file(self.ctx.rank)
            self._fetch(found, lambda n: n == own or (layout.rank_of(n) is None and not n.startswith(layout.DCP + "/"))
                        or n == layout.dcp_file(layout.DCP_METADATA))
            self._fetched[url] = self.cache / layout.step_name(found.step)
        return Found(self._fetched[url], found.step)

    def _fetch(self, found: Found, want: Callable[[str], bool]) -> None:
        """Into the node's cache: the files of step `found` (a URL) that `want` admits, verified."""
        url = str(found.path)
        parent, _, name = url.rpartition("/")
        there = self.store.sibling(parent)
        try:
            manifest = steps.read_manifest(there, name) if there is not None else None
            reason = "its manifest is gone" if manifest is None else None
            if there is not None and manifest is not None:
                reason = steps.fetch(there, name, self.cache / layout.step_name(found.step), manifest, want=want)
        except OSError as exc:
            if unreachable(exc):  # the store did not answer: nothing is wrong with the step, and a restart may cure it
                err = refusal(url, exc, "read")
                err.local = True  # this rank's download: it says so, naming itself
                raise err.at(self.ctx.rank) from None
            raise
        if reason:
            raise UserError(f"checkpoint {url} changed while the ranks read it: {reason}",
                            "rerun the same command (resume falls back past a damaged checkpoint)", local=True)

    def load(self, found: Found) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
        return super().load(self._local(found))

    def sharded_keys(self, found: Found) -> set[str]:
        return super().sharded_keys(self._local(found))

    def load_sharded(self, found: Found, template: dict[str, Any],
                     before_read: Callable[[set[str]], None] | None = None) -> None:
        local = self._local(found)
        if local is found:
            return super().load_sharded(found, template, before_read)

        def wanted(names: set[str]) -> None:
            # Only the shard files this rank's load plan reads (on another world size, parts of several).
            self._fetch(found, {layout.dcp_file(n) for n in names}.__contains__)
            if before_read is not None:
                before_read(names)

        super().load_sharded(local, template, before_read=wanted)

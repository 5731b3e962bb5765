"""The in-place checkpoint backend: a run's checkpoints on a storage every rank mounts (a folder),
each rank writing its files where they stay. Names are layout's; the commit protocol is steps.py's;
what any backend must guarantee is in backend.py.

    step_<N>/model.pt        rank 0: the unwrapped model's state_dict (exportable as is)
    step_<N>/train_state.pt  rank 0: optimizer, scheduler, scaler, loop and data position
    step_<N>/rank<R>.pt      every rank: its RNG states
    step_<N>/dcp/            strategy fsdp: the sharded models and optimizers (torch.distributed.checkpoint;
                             every rank writes its own shards, rank 0 the .metadata), instead of
                             their entries in model.pt / train_state.pt
    step_<N>/meta.json       rank 0: step, world size, config and its hash, versions
    step_<N>/manifest.json   rank 0, written last: every file's size and sha256
    latest                   the name of the newest committed step_<N>

Save: every rank writes into the step's staging name (`.tmp_step_<N>/` on a folder) through the
storage, durably; each rank posts its files' checksums to the rendezvous store (thread-safe, so an
async save never issues a collective that could interleave with the training loop's); rank 0 waits
for all of them and commits (steps.commit: `latest`, the manifest, the rename into place), then
prunes. Only a step whose manifest exists and matches its files counts as a checkpoint.
"""
from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch

from ..dist import DistContext
from ..dist.collectives import all_true, rank0_verdict
from ..errors import UserError
from . import dcp_files, layout, steps
from .dcp_stager import _stager_reuses, reusable_stager
from .durable import disk_full, dump
from .finite import nonfinite_tensors, refuse_nonfinite
from .found import Found
from .rng import rng_state, set_rng_state
from .staging import HostBuffer, snapshot, tensors_in, to_host
from .storage import Storage
from .storage_folder import FolderStorage

# Imported from here by tests and older code; they live in their own modules now.
__all__ = ["Checkpointer", "Found", "open_folder", "rng_state", "set_rng_state", "nonfinite_tensors",
           "reusable_stager", "_stager_reuses"]


def open_folder(ctx: DistContext, location: str | Path | Storage, upload_timeout_s: float | None = None,
                **options: Any) -> Checkpointer:
    """The backend for a storage every rank mounts (backend.open_backend: one with a local_root; a
    file:// URL goes through the object store backend instead). `upload_timeout_s` is an object
    store's: this backend commits without uploads."""
    return Checkpointer(ctx, location, **options)


class Checkpointer:
    """Saves and finds checkpoints for one run. `async_save=True` writes in a background thread."""

    def __init__(self, ctx: DistContext, ckpt_root: str | Path | Storage, keep_last: int = 3, async_save: bool = False,
                 timeout_s: float = 600.0, write_delay_s: float = 0.0):
        where = FolderStorage(ckpt_root) if isinstance(ckpt_root, (str, Path)) else ckpt_root
        if where.local_root is None:
            raise ValueError(f"{where.location}: this backend writes in place, on a storage every rank mounts")
        self.ctx, self.root = ctx, where.local_root
        self._storage = where
        self.stage: Storage = where  # where the ranks write a step's files before its commit
        self.location = where.location
        self.keep_last, self.async_save, self.timeout_s = keep_last, async_save, timeout_s
        self.write_delay_s = write_delay_s
        self._thread: threading.Thread | None = None
        # How long each save took (take_timings): when save() began, by step; the loop's blocked
        # time, by step; (step, seconds to commit) appended once committed, by the writer thread too.
        self._started: dict[int, float] = {}
        self.blocking_s: dict[int, float] = {}
        self.committed: list[tuple[int, float]] = []
        self._error: BaseException | None = None
        self._buffers: Any = None  # the previous async snapshot (its CPU buffers are reused)
        self._hosts: dict[str, HostBuffer | None] = {}  # per file kind: the flat page-locked buffer
        self._group: Any = None  # DCP's own gloo group: an async save's collectives never meet training's
        self._stager: Any = None  # DCP's stager kept across async saves (False: this torch has none that reuses)
        self._commit_at: dict[int, float] = {}  # a backend that commits before _finish returns says when

    # Where a save is staged and how it is committed are hooks (_stage_path, _open_tmp, _finish):
    # object_store.py stages on a node-local disk and uploads. With `ships_in_background` even a
    # synchronous save returns once its files are staged, and the rest runs in the writer thread.
    ships_in_background = False
    private_staging = False  # whether each rank stages into a folder of its own (not shared with rank 0)

    @property
    def storage(self) -> Storage:
        """The storage the steps are committed to (and read from)."""
        return self._storage

    # ---- saving -----------------------------------------------------------------------------------

    def save(self, step: int, shared: dict[str, Any], per_rank: dict[str, Any], meta: dict[str, Any],
             sharded: dict[str, Any] | None = None) -> None:
        """Write checkpoint `step`. `shared` is identical on every rank (rank 0 writes it; key "model"
        goes to model.pt); `per_rank` is this rank's own; `sharded` (FSDP's state dicts, different on
        every rank) goes through DCP into dcp/. Returns once committed, or once the state is copied
        to CPU when async."""
        self.wait()  # a second save waits for the first
        started = time.monotonic()
        self._started[step] = started
        refuse_nonfinite(self.ctx, step, shared, sharded, self.latest_name)
        if self.async_save:
            if self.ctx.is_main:  # one flat buffer per file: torch.save writes one storage per file
                prev = self._buffers or {}
                model, self._hosts["model"] = snapshot({k: v for k, v in shared.items() if k == "model"},
                                                       prev, self._hosts.get("model"))
                state, self._hosts["state"] = snapshot({k: v for k, v in shared.items() if k != "model"},
                                                       prev, self._hosts.get("state"))
                shared = {**model, **state}
            else:
                shared = {}
            # kept until the next save: the copies into it may still be running after this returns
            per_rank, self._hosts["rank"] = snapshot(per_rank, None, self._hosts.get("rank"))
            if self.ctx.device.type == "cuda":
                torch.cuda.current_stream(self.ctx.device).synchronize()  # the non-blocking copies must land
            self._buffers = shared
            # DCP copies the shards to CPU here and writes them in its own thread; ours waits for it.
            shards = self._write_sharded(self._open_tmp(step), sharded, now=False) if sharded is not None else None
            self._thread = threading.Thread(target=self._run_async, args=(step, shared, per_rank, meta, shards),
                                            name=f"ddp_kit-ckpt-{step}", daemon=False)
            # measured before the writer starts: on a busy host it may commit before this thread runs on
            self.blocking_s[step] = time.monotonic() - started
            self._thread.start()
        else:
            if self.ctx.device.type == "cuda":  # plain CPU tensors on disk: loadable with no GPU
                shared, per_rank = (to_host(shared) if self.ctx.is_main else {}), to_host(per_rank)
            if self.ships_in_background:  # the loop waits for the local files only
                staged = self._stage(step, shared, per_rank, meta, sharded)
                self._thread = threading.Thread(target=self._run_async, args=(step, {}, {}, meta, None, staged),
                                                name=f"ddp_kit-ckpt-{step}", daemon=False)
                self.blocking_s[step] = time.monotonic() - started
                self._thread.start()
            else:
                self._commit(step, shared, per_rank, meta, sharded)
                self.blocking_s[step] = time.monotonic() - started

    def take_timings(self) -> list[dict[str, float]]:
        """The checkpoints committed since the last call: step, seconds the loop was blocked, seconds
        from save() to the commit (the time a preemption's grace period must cover)."""
        out = []
        while self.committed:
            step, commit_s = self.committed.pop(0)
            out.append({"step": step, "blocking_s": round(self.blocking_s.pop(step, commit_s), 4),
                        "commit_s": round(commit_s, 4)})
        return out

    def _dcp_group(self) -> Any:
        if self._group is None:
            self._group = dcp_files.gloo_group(self.timeout_s)
        return self._group

    def _write_sharded(self, tmp: Path, sharded: dict[str, Any], now: bool) -> Any:
        """Every rank writes its shards into tmp/dcp/: now (DCP's metadata), or from DCP's thread (a Future)."""
        group = self._dcp_group()
        if now:
            return dcp_files.write(tmp, sharded, group, now=True)
        if self._stager is None:
            self._stager = reusable_stager(self.ctx.device) or False
        return dcp_files.write(tmp, sharded, group, now=False, stager=self._stager)

    def _stage_rel(self, step: int) -> str:
        """Where on self.stage step `step` is written before its commit."""
        return steps.staging_name(self.stage, step)

    def _stage_path(self, step: int) -> Path:
        """The local folder step `step` is written into before its commit."""
        return self.root / self._stage_rel(step)

    def _write(self, step: int, rel: str, obj: Any, delay_s: float = 0.0) -> dict[str, Any]:
        """One file of step `step` into its staging name on self.stage, durably; {size, sha256}."""
        with self.stage.open_write(f"{self._stage_rel(step)}/{rel}") as fh:
            return dump(fh, obj, rel.endswith(".json"), delay_s)

    def _open_tmp(self, step: int) -> Path:
        """Rank 0 makes an empty .tmp_step_<N>/ (a killed save's leftovers go); the others wait for it."""
        tmp = self._stage_path(step)
        key = f"ddp_kit/ckpt/{layout.step_name(step)}/ready"
        if self.ctx.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that was killed
            tmp.mkdir(parents=True)
            self.ctx.store.set(key, "1") if self.ctx.store else None
        elif self.ctx.store:
            self.ctx.store.wait([key], _td(self.timeout_s))
        return tmp

    def _run_async(self, step: int, shared: dict[str, Any], per_rank: dict[str, Any], meta: dict[str, Any],
                   shards: Any = None, staged: tuple[Path, dict[str, Any]] | None = None) -> None:
        try:
            self._commit(step, shared, per_rank, meta, shards, staged)
        except BaseException as exc:  # surfaced by wait() on the training thread
            self._error = exc

    def wait(self) -> None:
        """Block until a pending async save is committed; re-raise its error here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        """At the run's end: wait for a pending save (re-raising its error), then let go of the host
        copies kept for the next save, the page-locked ones unregistered now rather than whenever the
        garbage collector gets to them. A later save makes new ones."""
        try:
            self.wait()
        finally:
            for host in self._hosts.values():
                if host is not None:
                    host.release()
            self._hosts.clear()
            self._buffers = None
            if self._stager:
                self._stager.close()
            self._stager = None

    def _commit(self, step: int, shared: dict[str, Any], per_rank: dict[str, Any], meta: dict[str, Any], shards: Any = None,
                staged: tuple[Path, dict[str, Any]] | None = None) -> None:
        """Write (unless `staged` already: the staging folder and this rank's files) and commit step `step`."""
        try:
            stage, files = staged if staged is not None else self._stage(step, shared, per_rank, meta, shards)
            committed = self._finish(step, stage, files)
        except (OSError, RuntimeError) as exc:
            if not disk_full(exc):
                raise
            self._refuse_disk_full(step, shared, per_rank)
        started = self._started.pop(step, None)
        if started is not None and committed is not False:  # list.append is atomic: the writer thread may be here
            self.committed.append((step, self._commit_at.pop(step, time.monotonic()) - started))

    def _stage(self, step: int, shared: dict[str, Any], per_rank: dict[str, Any], meta: dict[str, Any], shards: Any) -> tuple[Path, dict[str, Any]]:
        try:
            return self._write_local(step, shared, per_rank, meta, shards)
        except (OSError, RuntimeError) as exc:
            if not disk_full(exc):
                raise
            self._refuse_disk_full(step, shared, per_rank)

    def _refuse_disk_full(self, step: int, shared: dict[str, Any], per_rank: dict[str, Any]) -> NoReturn:
        # Nothing half-written stays behind; the committed checkpoints are untouched.
        tmp = self._stage_path(step)
        if self.ctx.is_main or self.private_staging:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            (tmp / layout.rank_file(self.ctx.rank)).unlink(missing_ok=True)
        need = _nbytes(shared) + _nbytes(per_rank)
        disk = next(p for p in (tmp, *tmp.parents) if p.exists())
        free = shutil.disk_usage(disk).free
        where = f"{self.location} (staged in {str(tmp.parent)!r})" if self.private_staging else str(self.root)
        # The run stops: a run that cannot checkpoint cannot survive a preemption or a crash, and
        # hours of training with no restart point is the worse surprise. The rerun resumes.
        raise UserError(f"disk full while writing checkpoint {layout.step_name(step)} to {where!r}: it "
                        f"needs about {need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free; last checkpoint: "
                        f"{self.latest_name()}",
                        "free space on that disk, or lower keep_last; then rerun the same command to resume",
                        local=True) from None

    def _write_local(self, step: int, shared: dict[str, Any], per_rank: dict[str, Any], meta: dict[str, Any], shards: Any) -> tuple[Path, dict[str, Any]]:
        """Write this rank's files of step `step` into its staging folder; returns it and {file: size, sha256}.
        `shards`: None, the sharded state dicts to write now, or an async save's Future (DCP writing)."""
        rank, world = self.ctx.rank, self.ctx.world_size
        pending = hasattr(shards, "result")
        tmp = self._stage_path(step) if pending else self._open_tmp(step)
        files: dict[str, Any] = {}
        if shards is not None:
            metadata = shards.result() if pending else self._write_sharded(tmp, shards, now=True)
            files.update(dcp_files.written(tmp, rank, metadata))
        own = layout.rank_file(rank)
        files[own] = self._write(step, own, per_rank, self.write_delay_s)
        if self.ctx.is_main:
            # The two big files are written side by side: serialization, checksums and fsync overlap.
            # model.pt only when a model is registered as "model" (e.g. not for a GAN's two models).
            with ThreadPoolExecutor(2, thread_name_prefix="ddp_kit-ckpt-write") as pool:
                model_f = (pool.submit(self._write, step, layout.MODEL, shared["model"], self.write_delay_s)
                           if "model" in shared else None)
                state_f = pool.submit(self._write, step, layout.TRAIN_STATE,
                                      {k: v for k, v in shared.items() if k != "model"})
                if model_f is not None:
                    files[layout.MODEL] = model_f.result()
                files[layout.TRAIN_STATE] = state_f.result()
            files[layout.META] = self._write(step, layout.META, {**meta, "step": step, "world_size": world})
        return tmp, files

    def _gather(self, step: int, files: dict[str, Any]) -> dict[str, Any]:
        """Every rank posts `files` through the rendezvous store; rank 0 returns everyone's, merged
        (the others their own)."""
        store, world = self.ctx.store, self.ctx.world_size
        key = f"ddp_kit/ckpt/{layout.step_name(step)}"
        if store and world > 1:
            store.set(f"{key}/files/{self.ctx.rank}", json.dumps(files))
        if self.ctx.is_main and store and world > 1:
            # Two round trips whatever the world size: the store answers once every rank has posted.
            keys = [f"{key}/files/{r}" for r in range(1, world)]
            store.wait(keys, _td(self._gather_timeout_s()))
            files = dict(files)
            for posted in store.multi_get(keys):
                files.update(json.loads(posted))
        return files

    def _gather_timeout_s(self) -> float:
        return self.timeout_s

    def _manifest(self, step: int, files: dict[str, Any]) -> dict[str, Any]:
        """The manifest of step `step` from every rank's `files` (rank 0)."""
        expected = files.pop(dcp_files.EXPECTED, [])
        lost = [f for f in expected if f not in files]
        if lost:  # a shard DCP wrote that no rank hashed: never commit a checkpoint resume could not read
            raise RuntimeError(f"checkpoint {layout.step_name(step)}: DCP wrote {lost[:3]} but no rank reported it")
        return {"step": step, "world_size": self.ctx.world_size, "files": files}

    def _finish(self, step: int, tmp: Path, files: dict[str, Any]) -> bool | None:
        """Commit the staged step: rank 0 commits it (steps.commit) and prunes; the others wait for
        it. (A backend whose commit can fail without an error returns False.)"""
        name = layout.step_name(step)
        store = self.ctx.store
        key = f"ddp_kit/ckpt/{name}"
        files = self._gather(step, files)
        if self.ctx.is_main:
            steps.commit(self.storage, step, self._manifest(step, files))
            self.prune(step)
            if store:
                store.set(f"{key}/committed", "1")
        elif store:
            # Waiting here, in the "checkpoint" phase (slow-phase limits), not in the next collective
            # under the hang and collective timeouts: a long model.pt write is not a hang, and no rank
            # leaves (exit, requeue) before the checkpoint it belongs to is committed.
            store.wait([f"{key}/committed"], _td(self.timeout_s))
        return None

    def prune(self, newest: int) -> None:
        """Drop a killed save's leftovers and all but the newest `keep_last` (the one just committed is
        always kept) and the kept-best ones its meta names: see steps.prune. A folder's steps are renamed out of the way at once and deleted
        in the background (FolderStorage.remove)."""
        steps.prune(self.storage, newest, self.keep_last)

    # ---- the pointer and the lineage ---------------------------------------------------------------

    def latest(self) -> int | None:
        return steps.read_latest(self.storage)

    def latest_name(self) -> str:
        return steps.latest_name(self.storage)

    def owns(self, found: Found) -> bool:
        return isinstance(found.path, Path) and found.path.resolve().parent == self.root.resolve()

    def archive(self, keep_upto: int | None, into: str | Path) -> list[int]:
        """Rank 0 only: see steps.archive_abandoned (`into`: a folder on the same file system)."""
        target = self.storage.sibling(str(into))
        if target is None:
            raise ValueError(f"cannot archive the steps of {self.location} into {into}")
        return steps.archive_abandoned(self.storage, keep_upto, target)

    # ---- finding and loading -------------------------------------------------------------------------

    def claim(self) -> None:
        self._check()

    def _check(self) -> None:
        """Where a location has a one-writer lease, take it (collective, once); a plain folder has none."""

    def find(self, resume: str, warn: Callable[[str], None]) -> Found | None:
        """Rank 0 picks the checkpoint to resume from (auto: newest valid); every rank gets its choice."""
        value = rank0_verdict(self.ctx, lambda: steps.choose(self.storage, resume, warn, None))
        return Found(Path(value[0]), value[1]) if value else None

    def load_sharded(self, found: Found, template: dict[str, Any], before_read: Callable[[set[str]], None] | None = None) -> None:
        """Fill `template` (this rank's sharded state dicts) from found/dcp/, whatever world size wrote it
        (`before_read`: told the dcp/ files this rank reads, before they are opened)."""
        folder = _folder(found)
        if not all_true(self.ctx, dcp_files.present(folder)):  # one verdict, before DCP's collectives
            raise UserError(f"checkpoint {found.path} holds no sharded state (dcp/) that every rank can read: it was "
                            f"written with strategy ddp, or is not on storage every rank mounts",
                            "resume it with the strategy that wrote it, or start over with resume='never' or a new run_dir",
                            verdict=True)
        dcp_files.load(folder, template, self._dcp_group(), before_read)

    def sharded_keys(self, found: Found) -> set[str]:
        """The flattened keys a sharded checkpoint holds (e.g. "optimizer.state.fc.weight.exp_avg")."""
        return dcp_files.keys(_folder(found))

    def load(self, found: Found) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
        """(shared state, this rank's per-rank state or None, meta), on CPU: load_state_dict copies each
        tensor to its device once, so the model is never held twice on the GPU."""
        folder = _folder(found)
        shared = torch.load(folder / layout.TRAIN_STATE, map_location="cpu", weights_only=True)
        if (folder / layout.MODEL).exists():
            shared["model"] = torch.load(folder / layout.MODEL, map_location="cpu", weights_only=True)
        own = folder / layout.rank_file(self.ctx.rank)
        per_rank = torch.load(own, map_location="cpu", weights_only=True) if own.exists() else None
        return shared, per_rank, json.loads((folder / layout.META).read_text())


def _folder(found: Found) -> Path:
    """The step folder of `found`. This backend's find() gives a Path; a URL is the object store
    backend's, which hands its local download on (ObjectStoreCheckpointer._local), never the URL."""
    if not isinstance(found.path, Path):
        raise ValueError(f"{found.path}: not a step folder (a URL is read through the object store backend)")
    return found.path


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(obj))


def _td(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)

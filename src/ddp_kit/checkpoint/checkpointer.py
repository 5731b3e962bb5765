"""Rank-aware checkpoints: atomic commit, validation by manifest, resume from the newest valid one.

Layout under `ckpt_root` (usually run_dir/checkpoints):

    step_<N>/model.pt        rank 0: the unwrapped model's state_dict (exportable as is)
    step_<N>/train_state.pt  rank 0: optimizer, scheduler, scaler, loop and data position
    step_<N>/rank<R>.pt      every rank: its RNG states
    step_<N>/dcp/            strategy fsdp: the sharded models and optimizers (torch.distributed.checkpoint;
                             every rank writes its own shards, rank 0 the .metadata), instead of
                             their entries in model.pt / train_state.pt
    step_<N>/meta.json       rank 0: step, world size, config and its hash, versions
    step_<N>/manifest.json   rank 0, written last: every file's size and sha256
    latest                   the name of the newest committed step_<N>

Commit protocol: every rank writes into `.tmp_step_<N>/` and fsyncs; each rank posts its files'
checksums to the rendezvous store (thread-safe, so an async save never issues a collective that
could interleave with the training loop's); rank 0 waits for all of them, writes the manifest,
renames the folder into place, fsyncs, and updates `latest` last. Only a folder whose manifest
exists and matches its files counts as a checkpoint.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .layout import MANIFEST, choose, latest_name, point_latest, step_numbers
from ..dist import DistContext, all_true, rank0_verdict
from .durable import fsync_dir, write_durable
from . import safe_load
from ..errors import UserError
from ..parallel.fsdp import local
from .staging import HostBuffer, snapshot, tensors_in, to_host


def rng_state() -> dict:
    """This process's RNG states: Python's, the CPU generator's and its own GPU's only (the current
    device), so a checkpoint of the torchrun layout (every GPU visible) resumes in the srun layout
    (one GPU per task) and back."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_own"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"].cpu())
    if not torch.cuda.is_available():
        return
    if "cuda_own" in state:
        torch.cuda.set_rng_state(state["cuda_own"].cpu())
    elif "cuda" in state:  # older checkpoints: every visible GPU's state; take this process's own
        states = state["cuda"]
        torch.cuda.set_rng_state(states[min(torch.cuda.current_device(), len(states) - 1)].cpu())


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


@dataclass(frozen=True)
class Found:
    path: Path
    step: int


class Checkpointer:
    """Saves and finds checkpoints for one run. `async_save=True` writes in a background thread."""

    def __init__(self, ctx: DistContext, ckpt_root: str | Path, keep_last: int = 3, async_save: bool = False,
                 timeout_s: float = 600.0, write_delay_s: float = 0.0):
        self.ctx, self.root = ctx, Path(ckpt_root)
        self.keep_last, self.async_save, self.timeout_s = keep_last, async_save, timeout_s
        self.write_delay_s = write_delay_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: Any = None  # the previous async snapshot (its CPU buffers are reused)
        self._hosts: dict[str, HostBuffer | None] = {}  # per file kind: the flat page-locked buffer
        self._group: Any = None  # DCP's own gloo group: an async save's collectives never meet training's
        self._stager: Any = None  # DCP's stager kept across async saves (False: this torch has none that reuses)

    # ---- saving -----------------------------------------------------------------------------------

    def save(self, step: int, shared: dict[str, Any], per_rank: dict[str, Any], meta: dict[str, Any],
             sharded: dict[str, Any] | None = None) -> None:
        """Write checkpoint `step`. `shared` is identical on every rank (rank 0 writes it; key "model"
        goes to model.pt); `per_rank` is this rank's own; `sharded` (FSDP's state dicts, different on
        every rank) goes through DCP into dcp/. Returns once committed, or once the state is copied
        to CPU when async."""
        self.wait()  # a second save waits for the first
        if sharded is not None:
            bad = [f"{name}.{k}" for name, st in sharded.items()  # flat (a model's); an optimizer's is nested
                   for k in nonfinite_tensors({k: local(v) for k, v in st.items()})]
            if not all_true(self.ctx, not bad):  # shards differ: the ranks agree on one verdict
                raise UserError(f"checkpoint step_{step} not saved: the model's weights are not finite"
                                f"{f' ({bad[0]} on rank {self.ctx.rank})' if bad else ' (on another rank)'}; last "
                                f"checkpoint: {latest_name(self.root)}",
                                "lower lr, try amp off, or check the data; a rerun resumes from the last checkpoint",
                                verdict=True)
        # Every rank holds the same weights, so every rank reaches the same verdict. Flat state dicts
        # (a model's, under any name) are checked; nested ones (an optimizer's) are not.
        bad = [k if name == "model" else f"{name}.{k}" for name, st in shared.items() if isinstance(st, dict)
               for k in nonfinite_tensors(st)]
        if bad:  # never let NaN weights become `latest` and push the last finite ones out
            raise UserError(f"checkpoint step_{step} not saved: the model's weights are not finite "
                            f"({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}); last checkpoint: "
                            f"{latest_name(self.root)}",
                            "lower lr, try amp off, or check the data; a rerun resumes from the last checkpoint")
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
            self._thread.start()
        else:
            if self.ctx.device.type == "cuda":  # plain CPU tensors on disk: loadable with no GPU
                shared, per_rank = (to_host(shared) if self.ctx.is_main else {}), to_host(per_rank)
            self._commit(step, shared, per_rank, meta, sharded)

    def _dcp_group(self) -> Any:
        """A gloo group for DCP alone, also at world size 1: its async save needs a CPU backend, and the
        default group is NCCL-only on GPUs. Created on every rank at the same point (first save or load)."""
        import torch.distributed as tdist

        if self._group is None and tdist.is_initialized():
            self._group = tdist.new_group(backend="gloo", timeout=_td(self.timeout_s))
        return self._group

    def _write_sharded(self, tmp: Path, sharded: dict, now: bool) -> Any:
        """Every rank writes its shards into tmp/dcp/: now (DCP's metadata), or from DCP's thread (a Future)."""
        import torch.distributed.checkpoint as dcp

        group = self._dcp_group()
        options = dict(storage_writer=dcp.FileSystemWriter(tmp / "dcp"), process_group=group, no_dist=group is None)
        if now:
            return dcp.save(sharded, **options)
        if self._stager is None:
            self._stager = reusable_stager(self.ctx.device) or False
        return dcp.async_save(sharded, **options, **({"async_stager": self._stager} if self._stager else {}))

    def _open_tmp(self, step: int) -> Path:
        """Rank 0 makes an empty .tmp_step_<N>/ (a killed save's leftovers go); the others wait for it."""
        tmp = self.root / f".tmp_step_{step}"
        key = f"ddp_kit/ckpt/step_{step}/ready"
        if self.ctx.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that was killed
            tmp.mkdir(parents=True)
            self.ctx.store.set(key, "1") if self.ctx.store else None
        elif self.ctx.store:
            self.ctx.store.wait([key], _td(self.timeout_s))
        return tmp

    def latest_name(self) -> str:
        return latest_name(self.root)

    def _run_async(self, *args) -> None:
        try:
            self._commit(*args)
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

    def _commit(self, step: int, shared: dict, per_rank: dict, meta: dict, shards: Any = None) -> None:
        try:
            self._commit_files(step, shared, per_rank, meta, shards)
        except (OSError, RuntimeError) as exc:
            if not _disk_full(exc):
                raise
            # Nothing half-written stays behind; the committed checkpoints are untouched.
            tmp = self.root / f".tmp_step_{step}"
            if self.ctx.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                (tmp / f"rank{self.ctx.rank}.pt").unlink(missing_ok=True)
            need = _nbytes(shared) + _nbytes(per_rank)
            free = shutil.disk_usage(self.root if self.root.exists() else self.root.parent).free
            # The run stops: a run that cannot checkpoint cannot survive a preemption or a crash, and
            # hours of training with no restart point is the worse surprise. The rerun resumes.
            raise UserError(f"disk full while writing checkpoint step_{step} to {str(self.root)!r}: it needs about "
                            f"{need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free; last checkpoint: {latest_name(self.root)}",
                            "free space on that disk, or lower keep_last; then rerun the same command to resume",
                            local=True) from None

    def _commit_files(self, step: int, shared: dict, per_rank: dict, meta: dict, shards: Any) -> None:
        """`shards`: None, the sharded state dicts to write now, or an async save's Future (DCP writing)."""
        rank, world = self.ctx.rank, self.ctx.world_size
        name = f"step_{step}"
        store = self.ctx.store
        key = f"ddp_kit/ckpt/{name}"
        pending = hasattr(shards, "result")
        tmp = self.root / f".tmp_{name}" if pending else self._open_tmp(step)
        files: dict[str, dict] = {}
        if shards is not None:
            metadata = shards.result() if pending else self._write_sharded(tmp, shards, now=True)
            files.update(_dcp_files(tmp, rank, metadata, world))
        files[f"rank{rank}.pt"] = write_durable(tmp / f"rank{rank}.pt", per_rank, self.write_delay_s)
        if self.ctx.is_main:
            # The two big files are written side by side: serialization, checksums and fsync overlap.
            # model.pt only when a model is registered as "model" (e.g. not for a GAN's two models).
            with ThreadPoolExecutor(2, thread_name_prefix="ddp_kit-ckpt-write") as pool:
                model_f = (pool.submit(write_durable, tmp / "model.pt", shared["model"], self.write_delay_s)
                           if "model" in shared else None)
                state_f = pool.submit(write_durable, tmp / "train_state.pt", {k: v for k, v in shared.items() if k != "model"})
                if model_f is not None:
                    files["model.pt"] = model_f.result()
                files["train_state.pt"] = state_f.result()
            files["meta.json"] = write_durable(tmp / "meta.json", {**meta, "step": step, "world_size": world})
        if store and world > 1:
            store.set(f"{key}/files/{rank}", json.dumps(files))
        if self.ctx.is_main and store and world > 1:
            # Two round trips whatever the world size: the store answers once every rank has posted.
            keys = [f"{key}/files/{r}" for r in range(1, world)]
            store.wait(keys, _td(self.timeout_s))
            for posted in store.multi_get(keys):
                files.update(json.loads(posted))
        if self.ctx.is_main:
            expected = files.pop("dcp/.expected", [])
            lost = [f for f in expected if f not in files]
            if lost:  # a shard DCP wrote that no rank hashed: never commit a checkpoint resume could not read
                raise RuntimeError(f"checkpoint step_{step}: DCP wrote {lost[:3]} but no rank reported it")
            write_durable(tmp / MANIFEST, {"step": step, "world_size": world, "files": files})
            if (tmp / "dcp").is_dir():
                fsync_dir(tmp / "dcp")
            fsync_dir(tmp)
            final = self.root / name
            if final.exists():  # same step again (after a resume from an older one): replace it
                trash = self.root / f".trash_{name}"
                shutil.rmtree(trash, ignore_errors=True)
                os.replace(final, trash)
                shutil.rmtree(trash, ignore_errors=True)
            # `latest` first: a kill between the two leaves `latest` naming a folder that is not
            # there yet, and resume falls back to the one before; the other order would leave a
            # complete step_N above `latest` that resume would take for an abandoned run's.
            point_latest(self.root, name)
            os.replace(tmp, final)
            fsync_dir(self.root)
            self._retain(step)
            if store:
                store.set(f"{key}/committed", "1")
        elif store:
            # Waiting here, in the "checkpoint" phase (slow-phase limits), not in the next collective
            # under the hang and collective timeouts: a long model.pt write is not a hang, and no rank
            # leaves (exit, requeue) before the checkpoint it belongs to is committed.
            store.wait([f"{key}/committed"], _td(self.timeout_s))

    def _retain(self, newest: int) -> None:
        """Drop all but the newest `keep_last` (the one just committed is always kept). Old folders are
        renamed out of the way at once and deleted in the background: unlinking ~100 MB costs ~20 ms."""
        for old in [*self.root.glob(".trash_*"), *self.root.glob(".tmp_step_*")]:  # left by a process that exited
            shutil.rmtree(old, ignore_errors=True)                                 # mid-delete or mid-save
        if self.keep_last < 1:
            return
        steps = sorted((s for s in step_numbers(self.root) if s <= newest), reverse=True)
        doomed = []
        for s in steps[max(self.keep_last, 1):]:
            trash = self.root / f".trash_step_{s}"
            os.replace(self.root / f"step_{s}", trash)
            doomed.append(trash)
        if doomed:
            threading.Thread(target=lambda: [shutil.rmtree(d, ignore_errors=True) for d in doomed],
                             name="ddp_kit-ckpt-retain", daemon=True).start()

    # ---- finding and loading -------------------------------------------------------------------------

    def find(self, resume: str, warn: Callable[[str], None]) -> Found | None:
        """Rank 0 picks the checkpoint to resume from (auto: newest valid); every rank gets its choice."""
        value = rank0_verdict(self.ctx, lambda: choose(self.root, resume, warn))
        return Found(Path(value[0]), value[1]) if value else None

    def load_sharded(self, found: Found, template: dict) -> None:
        """Fill `template` (this rank's sharded state dicts) from found/dcp/, whatever world size wrote it."""
        import torch.distributed.checkpoint as dcp

        if not all_true(self.ctx, (found.path / "dcp").is_dir()):  # one verdict, before DCP's collectives
            raise UserError(f"checkpoint {found.path} holds no sharded state (dcp/) that every rank can read: it was "
                            f"written with strategy ddp, or is not on storage every rank mounts",
                            "resume it with the strategy that wrote it, or start over with resume='never' or a new run_dir",
                            verdict=True)
        group = self._dcp_group()
        dcp.load(template, storage_reader=safe_load.reader(found.path / "dcp"), process_group=group,
                 no_dist=group is None)

    def sharded_keys(self, found: Found) -> set[str]:
        """The flattened keys a sharded checkpoint holds (e.g. "optimizer.state.fc.weight.exp_avg")."""
        path = found.path / "dcp"
        return set(safe_load.read_dcp_metadata(path).state_dict_metadata) if path.is_dir() else set()

    def load(self, found: Found) -> tuple[dict, dict | None, dict]:
        """(shared state, this rank's per-rank state or None, meta), on CPU: load_state_dict copies each
        tensor to its device once, so the model is never held twice on the GPU."""
        shared = torch.load(found.path / "train_state.pt", map_location="cpu", weights_only=True)
        if (found.path / "model.pt").exists():
            shared["model"] = torch.load(found.path / "model.pt", map_location="cpu", weights_only=True)
        own = found.path / f"rank{self.ctx.rank}.pt"
        per_rank = torch.load(own, map_location="cpu", weights_only=True) if own.exists() else None
        meta = json.loads((found.path / "meta.json").read_text())
        return shared, per_rank, meta


def _dcp_files(tmp: Path, rank: int, metadata: Any, world: int) -> dict[str, dict]:
    """{relative path: size and sha256} of the DCP files this rank wrote (rank 0: and .metadata).

    DCP names a rank's files __<rank>_<i>.distcp; rank 0 checks against the metadata that the
    ranks' lists together cover every file it names (see _commit_files)."""
    folder = tmp / "dcp"
    mine = sorted(folder.glob(f"__{rank}_*.distcp")) + ([folder / ".metadata"] if rank == 0 else [])
    out = {f"dcp/{f.name}": _file_digest(f) for f in mine}
    if rank == 0:
        # torch 2.11's writer fills storage_data on a copy: the Metadata dcp.save returns has None; the
        # file it wrote has the list (read through the allow-list, as any .metadata)
        storage = metadata.storage_data if metadata.storage_data is not None else \
            safe_load.read_dcp_metadata(folder).storage_data
        out["dcp/.expected"] = sorted({f"dcp/{info.relative_path}" for info in storage.values()})
    return out


def _file_digest(f: Path) -> dict:
    sha = hashlib.sha256()
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            sha.update(chunk)
    return {"size": f.stat().st_size, "sha256": sha.hexdigest()}


def _disk_full(exc: BaseException | None) -> bool:
    """ENOSPC/EDQUOT anywhere in the chain: torch.save's zip writer re-raises a write error as a
    RuntimeError ("unexpected pos ...") with the OSError as its context."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def nonfinite_tensors(state: dict) -> list[str]:
    """Names of the floating tensors in `state` holding NaN or inf. One flag per tensor, computed on
    its device and stacked, then read once per device (on a GPU one host sync, not one per tensor)."""
    named: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel():
            named.setdefault(v.device, []).append((k, v))
    bad = []
    for items in named.values():
        finite = torch.stack([torch.isfinite(v).all() for _, v in items]).tolist()
        bad += [k for (k, _), ok in zip(items, finite) if not ok]
    return bad


def reusable_stager(device: torch.device) -> Any:
    """A DCP stager to keep across async saves: it copies each tensor into the host copy it made at
    the first save (page-locked on a GPU, so the copies queue with one wait for all), where DCP's
    default makes fresh pageable memory every time. None where the installed torch's stager does not
    keep its copies from one save to the next (torch 2.11's clears them after each; older ones lack
    it): DCP then stages as before. Close it after the last save."""
    try:
        import inspect

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        if "async_stager" not in inspect.signature(dcp.async_save).parameters:
            return None
        if not _stager_reuses(DefaultStager, StagingOptions):
            return None
        gpu = device.type == "cuda"
        return DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=False,
                                            use_non_blocking_copy=gpu))
    except (ImportError, TypeError, ValueError):  # a torch without it, or with other options
        return None


def _stager_reuses(stager_type, options_type) -> bool:
    """Whether a stager's second copy of the same tensor lands where its first did (probed on the CPU;
    a stager that fails the probe is not used)."""
    try:
        probe, t = stager_type(options_type(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                            use_non_blocking_copy=False)), torch.zeros(4)
        try:
            first = probe.stage({"t": t})["t"]
            return probe.stage({"t": t})["t"].data_ptr() == first.data_ptr()
        finally:
            probe.close()
    except Exception:
        return False


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(obj))


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)

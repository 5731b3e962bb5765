"""The memory tier: every `mem_ckpt_every` steps each rank copies its whole state into node-local
memory (`/dev/shm`; `DDP_KIT_MEM_DIR` names another tmpfs), and a thread copies it on to a rank of
the next node, so that a lost process costs at most a few steps and a lost node as few.

    <root>/<job>/own-r<R>-s<0|1>/        rank R's two slots: the one being written and the last complete
    <root>/<job>/peer-r<R>-s<0|1>/       the same for rank R of the previous node, received over the network

The root is this user's alone, and which jobs' folders are alive is decided by a lock
(memory_root.py). `<job>` is `<location>-<run>`: digests of the durable checkpoint location and of
the run's identity (made at the run's first start, kept in its run folder), so a restart of the same
run finds its copies, and neither another job nor a new run started at the same place ever does.
Each copy also names its lineage (the attempt that wrote it, the step that attempt resumed from):
a resume takes every rank's copy of a step from one lineage, never a mix.

A copy's format is memory_copy's (JSON and raw bytes: nothing is unpickled), and a copy is used
only once sealed (its sha256 written beside it) and checked against that.

Saving blocks only for the copy of the state into the slot (page-locked on a GPU: the
device-to-host copy); sealing (sha256) and the peer copy run on a thread of their own, on a gloo
group of their own, so they never interleave with the loop's collectives. Ranks of node n send to
the same local rank of node n+1 (the last node to the first): any one node lost, its ranks' state
is on the next one. A copy that cannot be made (the tmpfs full for a moment, a folder removed) is
one warning and the loss of that copy, on both sides of a peer exchange: the two sides tell each
other first whether they can send and take it, so neither waits on the other.

Resume (`find`, collective): every rank lists the copies on its node that are newer than the
durable tier's step; the newest step that every rank's state has a valid copy of in one lineage
wins, each rank taking its own node's copy first, else the holder's over the network. A copy that
is not usable is named once and the next one (or the durable tier) is used.

This module owns the tier's schedule and state (MemoryTier); a copy's slot in the tmpfs is
memory_slot's, the traffic between nodes memory_peer's, and the choice at resume memory_resume's.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from ..dist import DistContext
from ..dist.collectives import all_gather_object, all_true, broadcast_object
from ..errors import UserError
from . import memory_copy as mc
from . import memory_root as mr
from .memory_peer import exchange, transfer
from .memory_resume import _choose, scan, verify
from .memory_root import ENV_DIR, root_dir
from .memory_slot import CopyLost, _mb, _newest, _room, _Slot

COPIES = 2  # per rank and kind: the one being written and the last complete one
__all__ = ["ENV_DIR", "MemFound", "MemoryTier", "job_key", "root_dir"]


def job_key(location: str, run: str) -> str:
    """The memory tier's name for run `run` of the job whose durable checkpoints live at `location`."""
    return f"{hashlib.sha256(location.encode()).hexdigest()[:16]}-{hashlib.sha256(run.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class MemFound:
    """A memory-tier step chosen for resume: `path` says where from, for the resume line."""
    path: str
    step: int
    tier: str  # "memory": every rank's own node held its copy; "peer": some came from another node


def _keep_alive(closed: threading.Event, fd: Callable[[], int]) -> None:
    while not closed.wait(mr.RENEW_S):
        mr.renew(fd())


class MemoryTier:
    """One rank's memory tier for one run of a job. Made at a point every rank reaches (resume, or the
    first memory save): it agrees on this attempt's lineage, and makes its own gloo group when the job
    spans nodes."""

    def __init__(self, ctx: DistContext, location: str, run: str, root: Path | None = None):
        self.ctx, self.run = ctx, run
        self.root = root or root_dir()
        try:
            mr.make_private(self.root)
            self.node = mr.node_id(self.root)
            self.key = job_key(location, run)
            self.dir = self.root / self.key
            self._alive = mr.hold(self.dir)
            if ctx.local_rank == 0:
                mr.remove_abandoned(self.root, self.key)
        except mr.NotPrivate as exc:
            raise UserError(f"the memory tier's folder {self.root} is not yours alone: {exc}",
                            f"remove it, point {ENV_DIR} at a folder of your own (made 0700), or pass mem_ckpt_every=0",
                            local=True) from None
        except OSError as exc:
            raise UserError(f"the memory tier cannot use {self.root}: {exc}",
                            f"point {ENV_DIR} at a writable tmpfs on every node, or pass mem_ckpt_every=0",
                            local=True) from None
        # This attempt's lineage: copies it writes never pair with another attempt's copies of the same step.
        self.lineage = {"attempt": broadcast_object(ctx, uuid.uuid4().hex if ctx.is_main else None), "from": None}
        env = ctx.env
        lw = max(env.local_world_size, 1)
        spans = env.num_nodes > 1 and ctx.world_size == lw * env.num_nodes  # torchrun's layout: nodes of equal size
        self.partner = ((ctx.rank + lw) % ctx.world_size, (ctx.rank - lw) % ctx.world_size) if spans else None
        # Its own group: a thread's sends must never be ordered against the loop's collectives.
        self.group: Any = (tdist.new_group(backend="gloo", timeout=_timeout(ctx)) if ctx.world_size > 1 and env.num_nodes > 1
                      else None)
        self.own = [_Slot(self.dir / f"own-r{ctx.rank}-s{i}") for i in range(COPIES)]
        self.peer = [_Slot(self.dir / f"peer-r{self.partner[1]}-s{i}") for i in range(COPIES)] if self.partner else []
        self.last = _newest(self.own)  # the own slot holding the last complete copy: the next save takes the other
        self.peer_last = _newest(self.peer) if self.peer else None
        self._thread: threading.Thread | None = None
        self.copying: threading.Event | None = None  # set once the last save's deferred copy is done
        self._written: threading.Event | None = None  # set once the last save's copy is sealed
        self.error: BaseException | None = None  # the peer exchange's network failed: no more peer copies
        self.lost: list[str] = []  # copies lost since the last save (said once, at the next save)
        self._failing = False  # the last copy was lost and said: a run of losses is said once
        self._reported = False  # this save's loss is said already
        # The folder's lease on life: touched while the tier lives, not only at saves far apart.
        self._closed = threading.Event()
        threading.Thread(target=_keep_alive, args=(self._closed, lambda: self._alive), daemon=True,
                         name="ddp_kit-mem-alive").start()
        self.sized = False
        self.blocking_s: list[float] = []  # each save's: what the loop waited for it
        self._unlogged_s = 0.0  # the loop's waits since the last `take_blocking`

    def continues_from(self, step: int | None) -> None:
        """The step this attempt resumed from (any tier), recorded in each copy's lineage."""
        self.lineage = {**self.lineage, "from": step}

    # ---- saving -----------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], say: Callable[[str], None],
             later: Callable[[torch.Tensor], bool] | None = None) -> None:
        """Copy `state` into this rank's next slot, then seal it and copy it to the partner node in the
        background. Every rank calls it at the same steps.

        The loop waits for the copy of what may change before the next optimizer step (buffers, RNG,
        any tensor on a GPU); host tensors for which `later(t)` holds (parameters and optimizer state:
        only optimizer.step writes them) are copied by the thread while the next forward and backward
        run, and `wait_copy` (an optimizer pre-step hook) holds the step until they are. A copy that
        cannot be made is a warning (once, until one succeeds again): the previous copy still stands."""
        self.wait()
        try:
            tree, tensors, nbytes = mc.plan(state)
        except mc.NotStorable as exc:
            raise UserError(f"the memory tier cannot hold {exc}: it keeps tensors, numbers, strings, lists and dicts",
                            "make that state_dict() return those, or pass mem_ckpt_every=0") from None
        if not self.sized:
            self._check_room(nbytes, say)
        started = time.monotonic()
        if not self.dir.is_dir():  # removed under the job (a cleanup, RemoveIPC): hold a new one
            os.close(self._alive)
            self._alive = mr.hold(self.dir)
        mr.renew(self._alive)
        slot: _Slot | None = self.own[0 if self.last is None else 1 - self.last]
        assert slot is not None
        cuda = any(t.device.type == "cuda" for t in tensors)
        entries = mc.table(tensors)
        defer = [later is not None and not cuda and later(t) for t in tensors]
        deferred: tuple[list[torch.Tensor], list[list[Any]]] = ([], [])
        manifest: dict[str, Any] | None = None
        try:
            held = slot.buf.numel() if slot.buf is not None else 0
            if nbytes - held > _room(self.dir):
                raise CopyLost(f"the tmpfs has less than {_mb(nbytes - held)} free")
            buf = slot.open(nbytes, pin=cuda)
            mc.fill(buf, [t for t, d in zip(tensors, defer) if not d], [e for e, d in zip(entries, defer) if not d],
                    non_blocking=cuda and slot.pinned)
            if cuda:
                torch.cuda.current_stream(self.ctx.device).synchronize()
            deferred = ([t for t, d in zip(tensors, defer) if d], [e for e, d in zip(entries, defer) if d])
            manifest = {"format": mc.FORMAT, "step": step, "rank": self.ctx.rank, "world_size": self.ctx.world_size,
                        "node": self.node, "node_rank": self.ctx.env.node_rank, "run": self.run,
                        "lineage": self.lineage, "nbytes": nbytes, "tensors": entries, "tree": tree, "meta": meta,
                        "sha256": None}
            self.last = self.own.index(slot)
        except CopyLost as exc:
            self.lost.append(f"its copy of step {step} ({exc})")
            self._report()  # at once: the loop goes on without this copy
            slot = None
        self.copying = threading.Event()
        self._written = threading.Event()
        # The thread runs even without a copy of its own: the partner node's exchange waits for this side's word.
        self._thread = threading.Thread(target=self._finish, args=(step, slot, manifest, deferred, self.copying,
                                                                   self._written),
                                        name=f"ddp_kit-mem-{step}", daemon=True)
        self._thread.start()
        self.blocking_s.append(time.monotonic() - started)
        self._unlogged_s += self.blocking_s[-1]

    def wait_copy(self) -> None:
        """Hold the caller (the optimizer step) until the last save's copy is whole; the wait counts as blocking."""
        copying = self.copying
        if copying is not None and not copying.is_set():
            started = time.monotonic()
            copying.wait()
            self.blocking_s[-1] += time.monotonic() - started
            self._unlogged_s += time.monotonic() - started
        self.copying = None

    def take_blocking(self) -> float:
        """The seconds the loop waited for the tier since the last call (a log window's share)."""
        taken, self._unlogged_s = self._unlogged_s, 0.0
        return taken

    def _check_room(self, nbytes: int, say: Callable[[str], None]) -> None:
        """Once: print what the tier holds per node, and refuse (every rank together) when it cannot fit
        even empty. Each later save checks again that its own copy fits (a lost copy, not a stop)."""
        self.sized = True
        lw = max(self.ctx.env.local_world_size, 1)
        kinds = 2 if self.partner else 1
        need = COPIES * kinds * nbytes * lw
        held = sum(f.stat().st_size for f in self.dir.glob("*/" + mc.DATA))
        free = _room(self.dir) + held
        fits = all_true(self.ctx, need <= free)
        if self.ctx.env.num_nodes > 1 and self.partner is None and self.ctx.world_size > 1:
            say(f"ddp_kit: warning: memory tier: {self.ctx.world_size} ranks on {self.ctx.env.num_nodes} nodes are not nodes of "
                f"equal size with consecutive ranks: no peer copies, a lost node resumes from the durable tier")
        say(f"ddp_kit: memory tier: {COPIES} copies of {_mb(nbytes)} per rank{' and 2 of a peer' if self.partner else ''} "
            f"in {self.dir} ({_mb(need)} per node, {_mb(free)} free there)")
        if not fits:
            raise UserError(f"the memory tier needs {_mb(need)} per node in {self.root} and a node has less free",
                            f"free memory there, point {ENV_DIR} at a larger tmpfs, or pass mem_ckpt_every=0",
                            verdict=True)

    def _finish(self, step: int, slot: _Slot | None, manifest: dict[str, Any] | None,
                deferred: tuple[list[torch.Tensor], list[list[Any]]], copying: threading.Event,
                written: threading.Event) -> None:
        sealed = None
        try:
            if slot is not None and manifest is not None:
                try:
                    assert slot.buf is not None
                    try:
                        mc.fill(slot.buf, *deferred)
                    finally:
                        copying.set()
                    sealed = {**manifest, "sha256": mc.checksum(slot.buf)}
                    mc.write_manifest(slot.folder, sealed)  # the copy exists from here, whole and sealed
                except Exception as exc:  # local: a lost copy; the exchange below still runs for the partner
                    self.lost.append(f"its copy of step {step} ({getattr(exc, 'strerror', None) or exc})")
                    slot.release()  # its folder or file may be gone: the next save maps a new one
                    sealed = None
            copying.set()
            written.set()
            if self.partner is not None and self.error is None:
                self._exchange(slot.buf if sealed is not None and slot is not None else None, sealed)
        except BaseException as exc:  # the network: reported at the next save; the loop's collectives see a lost peer first
            self.error = exc
        finally:
            copying.set()
            written.set()

    def _exchange(self, buf: torch.Tensor | None, manifest: dict[str, Any] | None) -> None:
        """Send this copy to the partner node's rank, receive the previous node's rank's copy into the
        peer slot the next copy takes (memory_peer.exchange)."""
        assert self.partner is not None
        slot = self.peer[0 if self.peer_last is None else 1 - self.peer_last]
        if exchange(self.group, *self.partner, slot, self.dir, buf, manifest, self.lost):
            self.peer_last = self.peer.index(slot)

    def wait(self) -> None:
        """The previous save's seal and peer copy are done. A lost copy is said at once, and a run of
        them once; a failed network stops further peer copies from this rank (its partner is gone)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.copying = None
        if self.error is not None and self.partner is not None:
            print(f"ddp_kit: warning: rank {self.ctx.rank}: the memory tier's copy to the next node failed "
                  f"({str(self.error).splitlines()[0][:160] if str(self.error) else type(self.error).__name__}); "
                  f"no more peer copies from this rank", flush=True)
            self.partner = None
        self._report()
        self._failing, self.lost = bool(self.lost) or self._reported, []
        self._reported = False

    def _report(self) -> None:
        """Say the copies lost so far, unless a run of losses was said already (once until one succeeds)."""
        if self.lost and not self._failing and not self._reported:
            print(f"ddp_kit: warning: rank {self.ctx.rank}: the memory tier lost {'; '.join(self.lost)}; the copies "
                  f"before it and the durable tier still stand (said once until a copy succeeds again)", flush=True)
            self._reported = True

    # ---- resume -----------------------------------------------------------------------------------

    def find(self, after: int | None, warn: Callable[[str], None]) -> MemFound | None:
        """The newest step above `after` (the durable tier's) every rank's state has a usable copy of, all
        of one lineage, with each rank's copy read into memory for `load`; None: resume from the durable
        tier. Copies newer than the step chosen (of any tier) are a branch no attempt continues: forgotten."""
        self.wait()
        floor = -1 if after is None else after
        nodes = all_gather_object(self.ctx, self.node)
        found = [e for es in all_gather_object(self.ctx, scan(self.ctx, self.dir, self.node, self.run, floor)) for e in es]
        for e in found:
            if "why" in e:
                warn(f"memory-tier copy {e['folder']} is not usable ({e['why']}); the next tier is used")
        usable = [e for e in found if "why" not in e]
        while True:
            choice = _choose(usable, nodes, self.ctx.world_size)
            if choice is None:
                self._forget_after(floor)
                return None
            step, sources = choice
            self._held, bad = verify(self.ctx.rank, self.node, sources, nodes)
            if not any(all_gather_object(self.ctx, bool(bad))):
                bad = transfer(self.group, self.ctx.rank, sources, nodes, self._held)
                if not any(all_gather_object(self.ctx, bool(bad))):
                    break
            for folder, why in [b for bs in all_gather_object(self.ctx, bad) for b in bs]:
                warn(f"memory-tier copy {folder} of step {step} is not usable ({why}); the next tier is used")
                usable = [e for e in usable if e["folder"] != folder]
        self._forget_after(step)
        remote = sorted({s["node_rank"] for r, s in enumerate(sources) if s["node"] != nodes[r]})
        peers = sorted({s["node_rank"] for s in sources if s["kind"] == "peer"} | set(remote))
        where = (f"the peer copy on node {', '.join(map(str, peers))}" if peers
                 else "the memory tier (each node's own copy)")
        return MemFound(f"{where} of step {step}", step, "peer" if peers else "memory")

    def _forget_after(self, step: int) -> None:
        """Drop this rank's slots (own, and the peer copies it receives) that hold a step after `step`."""
        for slot in self.own + self.peer:
            try:
                newer = int(json.loads(mr.read_private(slot.folder / mc.MANIFEST))["step"]) > step
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if newer:
                (slot.folder / mc.MANIFEST).unlink(missing_ok=True)
        self.last, self.peer_last = _newest(self.own), (_newest(self.peer) if self.peer else None)

    def load(self, found: MemFound) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
        """(shared state, this rank's own state, meta) of the copy `find` chose, as the durable backends give them."""
        m, buf = self._held.pop(self.ctx.rank)
        state = mc.decode(m, buf)
        self._sharded = state.get("sharded")
        meta = {**m.get("meta", {}), "world_size": m["world_size"]}
        return state["shared"], state.get("per_rank"), meta

    def sharded_keys(self, found: MemFound) -> set[str]:
        return mc.flat_keys(self._sharded) if self._sharded else set()

    def load_sharded(self, found: MemFound, template: dict[str, Any]) -> None:
        mc.fill_template(template, self._sharded, lambda dst, src: dst.copy_(src))

    # ---- the end ----------------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget this rank's copies (a new lineage: resume='never' or a named step): its own slots and
        the peer copies it receives."""
        self.wait()
        self.last = self.peer_last = None
        for slot in self.own + self.peer:
            slot.release()
            shutil.rmtree(slot.folder, ignore_errors=True)

    def close(self, clean: bool) -> None:
        """At the end: a clean end removes this rank's copies (its own, and the peer copies it holds), and
        the last process of the job on the node its folder; a failed one leaves them for the restart, with
        no wait for a peer copy a lost partner never answers."""
        if clean:
            self.wait()
        elif self._written is not None:  # the last copy is whole once it is sealed: local work
            self._written.wait(timeout=30)
        for slot in self.own + self.peer:
            slot.release()
            if clean:
                shutil.rmtree(slot.folder, ignore_errors=True)
        self._closed.set()
        mr.leave(self.dir, self._alive, clean)


def _timeout(ctx: DistContext) -> Any:
    from datetime import timedelta
    return timedelta(seconds=ctx.timeout_s)

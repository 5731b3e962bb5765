"""The memory tier: every `mem_ckpt_every` steps each rank copies its whole state into node-local
memory (`/dev/shm`; `DDP_KIT_MEM_DIR` names another tmpfs), and a thread copies it on to a rank of
the next node, so that a lost process costs at most a few steps and a lost node as few.

    <root>/node_id                       this node's identity (made once): which copies a rank can read
    <root>/<job>/own-r<R>-s<0|1>/        rank R's two slots: the one being written and the last complete
    <root>/<job>/peer-r<R>-s<0|1>/       the same for rank R of the previous node, received over the network
    <root>/<job>/owner.<pid>             one per live process of the job: a job with none left is removed
                                         by the next one that opens the tier on this node

`<job>` is a digest of the durable checkpoint location, so a restart of the same job finds its
copies and another job never does. A copy's format is memory_copy's (JSON and raw bytes: nothing
is unpickled).

Saving blocks only for the copy of the state into the slot (page-locked on a GPU: the
device-to-host copy); sealing (sha256) and the peer copy run on a thread of their own, on a gloo
group of their own, so they never interleave with the loop's collectives. Ranks of node n send to
the same local rank of node n+1 (the last node to the first): any one node lost, its ranks' state
is on the next one.

Resume (`find`, collective): every rank lists the copies on its node that are newer than the
durable tier's step; the newest step that every rank's state has a valid copy of wins, each rank
taking its own node's copy first, else the holder's over the network. A copy that is not usable
is named once and the next one (or the durable tier) is used.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from ..dist import DistContext
from ..dist.collectives import all_gather_object, all_true
from ..errors import UserError
from . import memory_copy as mc

ENV_DIR = "DDP_KIT_MEM_DIR"
DEFAULT_ROOT = "/dev/shm/ddp_kit"
COPIES = 2  # per rank and kind: the one being written and the last complete one


def root_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or DEFAULT_ROOT)


def job_key(location: str) -> str:
    """The memory tier's name for the job whose durable checkpoints live at `location`."""
    return hashlib.sha256(location.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class MemFound:
    """A memory-tier step chosen for resume: `path` says where from, for the resume line."""
    path: str
    step: int
    tier: str  # "memory": every rank's own node held its copy; "peer": some came from another node


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MB" if n < 2**30 else f"{n / 2**30:,.2f} GB"


def _node_id(root: Path) -> str:
    path = root / "node_id"
    try:
        with open(path, "x") as f:
            f.write(uuid.uuid4().hex)
    except FileExistsError:
        pass
    return path.read_text().strip()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_abandoned(root: Path, keep: str) -> None:
    """Other jobs' folders on this node that no live process owns: a job that ended without a clean end."""
    for folder in root.iterdir():
        if folder.name == keep or not folder.is_dir():
            continue
        owners = [p for p in folder.glob("owner.*") if p.name[6:].isdigit()]
        if not any(_alive(int(p.name[6:])) for p in owners):
            shutil.rmtree(folder, ignore_errors=True)


def _mapped(path: Path, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the file at `path`, `nbytes` long, shared with the file (its pages are the
    tmpfs's: allocated here, so that a full tmpfs fails now, in one line, not with SIGBUS later)."""
    if nbytes == 0:
        path.write_bytes(b"")
        return torch.empty(0, dtype=torch.uint8)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise UserError(f"the memory tier cannot hold {_mb(nbytes)} more in {path.parent.parent}: {exc.strerror}",
                        f"free memory there, point {ENV_DIR} at a larger tmpfs, or pass mem_ckpt_every=0") from None
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


class _Slot:
    """One copy's folder and its mapped data file, kept across saves (already-touched pages copy fast)."""

    def __init__(self, folder: Path):
        self.folder, self.pinned = folder, False
        self.buf: torch.Tensor | None = None
        folder.mkdir(parents=True, exist_ok=True)

    def open(self, nbytes: int, pin: bool) -> torch.Tensor:
        """Unmark the copy (no manifest: not usable while written) and map its data file at `nbytes`."""
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / mc.MANIFEST).unlink(missing_ok=True)
        if self.buf is None or self.buf.numel() != nbytes:
            self.release()
            (self.folder / mc.DATA).unlink(missing_ok=True)
            self.buf = _mapped(self.folder / mc.DATA, nbytes)
            if pin and nbytes:  # GPU only: the device-to-host copy then runs at full speed, asynchronously
                from .staging import _cudart
                self.pinned = int(_cudart().cudaHostRegister(self.buf.data_ptr(), nbytes, 0)) == 0
        assert self.buf is not None
        return self.buf

    def release(self) -> None:
        if self.pinned and self.buf is not None:
            from .staging import _cudart
            _cudart().cudaHostUnregister(self.buf.data_ptr())
        self.buf, self.pinned = None, False


def _wait_all(works: list[Any]) -> None:
    for w in works:
        w.wait()


class MemoryTier:
    """One rank's memory tier for one job. Made at a point every rank reaches (resume, or the first
    memory save): it makes its own gloo group when the job spans nodes."""

    def __init__(self, ctx: DistContext, location: str, root: Path | None = None):
        self.ctx = ctx
        self.root = root or root_dir()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.node = _node_id(self.root)
            self.key = job_key(location)
            self.dir = self.root / self.key
            self.dir.mkdir(exist_ok=True)
            (self.dir / f"owner.{os.getpid()}").touch()
            if ctx.local_rank == 0:
                _remove_abandoned(self.root, self.key)
        except OSError as exc:
            raise UserError(f"the memory tier cannot use {self.root}: {exc}",
                            f"point {ENV_DIR} at a writable tmpfs on every node, or pass mem_ckpt_every=0") from None
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
        self._written: threading.Event | None = None  # set once the last save's copy has its manifest
        self.error: BaseException | None = None
        self.sized = False
        self.blocking_s: list[float] = []

    # ---- saving -----------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], say: Callable[[str], None],
             later: Callable[[torch.Tensor], bool] | None = None) -> None:
        """Copy `state` into this rank's next slot, then seal it and copy it to the partner node in the
        background. Every rank calls it at the same steps.

        The loop waits for the copy of what may change before the next optimizer step (buffers, RNG,
        any tensor on a GPU); host tensors for which `later(t)` holds (parameters and optimizer state:
        only optimizer.step writes them) are copied by the thread while the next forward and backward
        run, and `wait_copy` (an optimizer pre-step hook) holds the step until they are."""
        import time
        self.wait()
        try:
            tree, tensors, nbytes = mc.plan(state)
        except mc.NotStorable as exc:
            raise UserError(f"the memory tier cannot hold {exc}: it keeps tensors, numbers, strings, lists and dicts",
                            "make that state_dict() return those, or pass mem_ckpt_every=0") from None
        if not self.sized:
            self._check_room(nbytes, say)
        started = time.monotonic()
        slot = self.own[0 if self.last is None else 1 - self.last]
        cuda = any(t.device.type == "cuda" for t in tensors)
        buf = slot.open(nbytes, pin=cuda)
        entries = mc.table(tensors)
        defer = [later is not None and not cuda and later(t) for t in tensors]
        mc.fill(buf, [t for t, d in zip(tensors, defer) if not d], [e for e, d in zip(entries, defer) if not d],
                non_blocking=cuda and slot.pinned)
        if cuda:
            torch.cuda.current_stream(self.ctx.device).synchronize()
        deferred = ([t for t, d in zip(tensors, defer) if d], [e for e, d in zip(entries, defer) if d])
        manifest = {"format": mc.FORMAT, "step": step, "rank": self.ctx.rank, "world_size": self.ctx.world_size,
                    "node": self.node, "node_rank": self.ctx.env.node_rank, "nbytes": nbytes, "tensors": entries,
                    "tree": tree, "meta": meta, "sha256": None}
        self.last = self.own.index(slot)
        self.copying = threading.Event()
        self._written = threading.Event()
        self._thread = threading.Thread(target=self._finish, args=(slot, manifest, deferred, self.copying, self._written),
                                        name=f"ddp_kit-mem-{step}", daemon=True)
        self._thread.start()
        self.blocking_s.append(time.monotonic() - started)

    def wait_copy(self) -> None:
        """Hold the caller (the optimizer step) until the last save's copy is whole; the wait counts as blocking."""
        copying = self.copying
        if copying is not None and not copying.is_set():
            import time
            started = time.monotonic()
            copying.wait()
            self.blocking_s[-1] += time.monotonic() - started
        self.copying = None

    def _check_room(self, nbytes: int, say: Callable[[str], None]) -> None:
        """Once: print what the tier holds per node, and refuse (every rank together) when it does not fit."""
        self.sized = True
        lw = max(self.ctx.env.local_world_size, 1)
        kinds = 2 if self.partner else 1
        need = COPIES * kinds * nbytes * lw
        held = sum(f.stat().st_size for f in self.dir.glob("*/" + mc.DATA))
        st = os.statvfs(self.dir)
        free = st.f_bavail * st.f_frsize + held
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

    def _finish(self, slot: _Slot, manifest: dict[str, Any], deferred: tuple[list[torch.Tensor], list[list[Any]]],
                copying: threading.Event, written: threading.Event) -> None:
        try:
            assert slot.buf is not None
            try:
                mc.fill(slot.buf, *deferred)
            finally:
                copying.set()
            try:
                mc.write_manifest(slot.folder, manifest)  # complete, not yet sealed
            finally:
                written.set()
            sealed = {**manifest, "sha256": mc.checksum(slot.buf)}
            mc.write_manifest(slot.folder, sealed)
            if self.partner is not None and self.error is None:
                self._exchange(slot.buf, sealed)
        except BaseException as exc:  # reported at the next save; the loop's own collectives see a lost peer first
            self.error = exc

    def _exchange(self, buf: torch.Tensor, manifest: dict[str, Any]) -> None:
        """Send this copy to the partner node's rank, receive the previous node's rank's copy."""
        assert self.partner is not None
        to, frm = self.partner
        blob = torch.frombuffer(bytearray(json.dumps(manifest).encode()), dtype=torch.uint8)
        head = torch.tensor([buf.numel(), blob.numel()], dtype=torch.int64)
        got = torch.empty(2, dtype=torch.int64)
        _wait_all([tdist.isend(head, to, group=self.group), tdist.irecv(got, frm, group=self.group)])
        nbytes, mlen = (int(x) for x in got.tolist())
        slot = self.peer[0 if self.peer_last is None else 1 - self.peer_last]
        inbuf = slot.open(nbytes, pin=False)
        inblob = torch.empty(mlen, dtype=torch.uint8)
        works = [tdist.isend(blob, to, group=self.group), tdist.irecv(inblob, frm, group=self.group)]
        if buf.numel():
            works.append(tdist.isend(buf, to, group=self.group))
        if nbytes:
            works.append(tdist.irecv(inbuf, frm, group=self.group))
        _wait_all(works)
        received = json.loads(bytes(inblob.numpy()).decode())
        if received.get("rank") != frm or mc.checksum(inbuf) != received.get("sha256"):
            raise RuntimeError(f"the peer copy from rank {frm} arrived damaged")
        mc.write_manifest(slot.folder, received)
        self.peer_last = self.peer.index(slot)

    def wait(self) -> None:
        """The previous save's seal and peer copy are done; a failed peer copy is said once, and
        stops further ones on this rank (its partner is gone, or the network is)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.copying = None
        if self.error is not None and self.partner is not None:
            print(f"ddp_kit: warning: rank {self.ctx.rank}: the memory tier's copy to the next node failed "
                  f"({str(self.error).splitlines()[0][:160] if str(self.error) else type(self.error).__name__}); "
                  f"no more peer copies from this rank", flush=True)
            self.partner = None

    # ---- resume -----------------------------------------------------------------------------------

    def _scan(self, after: int) -> list[dict[str, Any]]:
        """This rank's share of the node's copies newer than `after` (the node's local ranks split them)."""
        lw = max(self.ctx.env.local_world_size, 1)
        folders = sorted(p for p in self.dir.iterdir() if p.is_dir() and p.name.startswith(("own-r", "peer-r")))
        out = []
        for i, folder in enumerate(folders):
            if i % lw != self.ctx.local_rank % lw:
                continue
            entry: dict[str, Any] = {"folder": str(folder), "holder": self.ctx.rank, "node": self.node,
                                     "node_rank": self.ctx.env.node_rank, "kind": folder.name.split("-")[0]}
            if not (folder / mc.MANIFEST).exists():
                continue  # being written when its process ended: never complete
            try:
                m = mc.manifest_of(folder)
                mc.check_data(folder, m)
                named = int(folder.name.split("-")[1][1:])
                if m["rank"] != named:
                    raise mc.Unusable(f"its manifest is rank {m['rank']}'s")
                if entry["kind"] == "peer" and m.get("sha256") is None:
                    raise mc.Unusable("a peer copy without its checksum")
            except (mc.Unusable, ValueError) as exc:
                out.append({**entry, "why": str(exc)})
                continue
            if m["step"] > after and m["world_size"] == self.ctx.world_size:
                out.append({**entry, "state_rank": m["rank"], "step": m["step"]})
        return out

    def find(self, after: int | None, warn: Callable[[str], None]) -> MemFound | None:
        """The newest step above `after` (the durable tier's) every rank's state has a usable copy of,
        with each rank's copy read into memory for `load`; None: resume from the durable tier."""
        self.wait()
        floor = -1 if after is None else after
        nodes = all_gather_object(self.ctx, self.node)
        found = [e for es in all_gather_object(self.ctx, self._scan(floor)) for e in es]
        for e in found:
            if "why" in e:
                warn(f"memory-tier copy {e['folder']} is not usable ({e['why']}); the next tier is used")
        usable = [e for e in found if "why" not in e]
        while True:
            choice = _choose(usable, nodes, self.ctx.world_size)
            if choice is None:
                return None
            step, sources = choice
            bad = self._verify(sources, nodes)
            for folder, why in [b for bs in all_gather_object(self.ctx, bad) for b in bs]:
                warn(f"memory-tier copy {folder} of step {step} is not usable ({why}); the next tier is used")
                usable = [e for e in usable if e["folder"] != folder]
            if any(all_gather_object(self.ctx, bool(bad))):
                continue
            self._transfer(sources, nodes)
            remote = sorted({s["node_rank"] for r, s in enumerate(sources) if s["node"] != nodes[r]})
            peers = sorted({s["node_rank"] for s in sources if s["kind"] == "peer"} | set(remote))
            where = (f"the peer copy on node {', '.join(map(str, peers))}" if peers
                     else "the memory tier (each node's own copy)")
            return MemFound(f"{where} of step {step}", step, "peer" if peers else "memory")

    def _verify(self, sources: list[dict[str, Any]], nodes: list[str]) -> list[tuple[str, str]]:
        """Read and check the chosen copies this rank reads: its own (on its node), and the ones it holds
        for a rank on another node. Keeps them in memory for load and the transfer."""
        self._held: dict[int, tuple[dict[str, Any], torch.Tensor]] = {}
        bad = []
        for r, s in enumerate(sources):
            mine = r == self.ctx.rank and s["node"] == self.node
            holds = s["holder"] == self.ctx.rank and s["node"] != nodes[r]
            if not (mine or holds):
                continue
            folder = Path(s["folder"])
            try:
                m = mc.manifest_of(folder)
                if m["step"] != s["step"] or m["rank"] != r:
                    raise mc.Unusable("replaced since it was listed")
                self._held[r] = (m, mc.read_data(folder, m))
            except mc.Unusable as exc:
                bad.append((str(folder), str(exc)))
        return bad

    def _transfer(self, sources: list[dict[str, Any]], nodes: list[str]) -> None:
        """Each copy a rank needs from another node, from its holder, one pair at a time."""
        for r, s in enumerate(sources):
            if s["node"] == nodes[r]:
                continue
            holder = s["holder"]
            if self.ctx.rank == holder:
                m, buf = self._held.pop(r)
                blob = torch.frombuffer(bytearray(json.dumps(m).encode()), dtype=torch.uint8)
                tdist.send(torch.tensor([buf.numel(), blob.numel()], dtype=torch.int64), r, group=self.group)
                tdist.send(blob, r, group=self.group)
                if buf.numel():
                    tdist.send(buf, r, group=self.group)
            elif self.ctx.rank == r:
                head = torch.empty(2, dtype=torch.int64)
                tdist.recv(head, holder, group=self.group)
                blob = torch.empty(int(head[1]), dtype=torch.uint8)
                tdist.recv(blob, holder, group=self.group)
                buf = torch.empty(int(head[0]), dtype=torch.uint8)
                if buf.numel():
                    tdist.recv(buf, holder, group=self.group)
                m = json.loads(bytes(blob.numpy()).decode())
                if mc.checksum(buf) != m.get("sha256"):
                    raise UserError(f"the memory-tier copy of rank {r} arrived damaged from rank {holder}",
                                    "resume again (a restart falls back to the durable tier if it recurs)")
                self._held[r] = (m, buf)

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
        mine = [f"own-r{self.ctx.rank}-"] + ([f"peer-r{self.partner[1]}-"] if self.partner else [])
        for slot in self.own + self.peer:
            slot.release()
        for folder in self.dir.iterdir():
            if folder.is_dir() and folder.name.startswith(tuple(mine)):
                shutil.rmtree(folder, ignore_errors=True)

    def close(self, clean: bool) -> None:
        """At the end: a clean end removes this rank's copies (its own, and the peer copies it holds); a
        failed one leaves them for the restart, with no wait for a peer copy a lost partner never answers."""
        if clean:
            self.wait()
        elif self._written is not None:  # the last copy is whole once its manifest is there: a local write
            self._written.wait(timeout=30)
        for slot in self.own + self.peer:
            slot.release()
            if clean:
                shutil.rmtree(slot.folder, ignore_errors=True)
        (self.dir / f"owner.{os.getpid()}").unlink(missing_ok=True)
        if clean:
            for owner in self.dir.glob("owner.*"):  # the processes of earlier attempts, killed
                if owner.name[6:].isdigit() and not _alive(int(owner.name[6:])):
                    owner.unlink(missing_ok=True)
            try:
                self.dir.rmdir()  # the last rank of the node to leave
            except OSError:
                pass


def _newest(slots: list[_Slot]) -> int | None:
    steps = []
    for slot in slots:
        try:
            steps.append(int(json.loads((slot.folder / mc.MANIFEST).read_text())["step"]))
        except (OSError, ValueError, KeyError, TypeError):
            steps.append(-1)
    return steps.index(max(steps)) if max(steps) >= 0 else None


def _timeout(ctx: DistContext) -> Any:
    from datetime import timedelta
    return timedelta(seconds=ctx.timeout_s)


def _choose(usable: list[dict[str, Any]], nodes: list[str], world: int) -> tuple[int, list[dict[str, Any]]] | None:
    """The newest step with a copy of every rank's state, and for each rank the copy to take: on its
    own node first (its own slot before a peer copy there), else the lowest holder's."""
    by_step: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for e in usable:
        by_step.setdefault(e["step"], {}).setdefault(e["state_rank"], []).append(e)
    for step in sorted(by_step, reverse=True):
        held = by_step[step]
        if all(r in held for r in range(world)):
            return step, [min(held[r], key=lambda e: (e["node"] != nodes[r], e["kind"] != "own", e["holder"]))
                          for r in range(world)]
    return None

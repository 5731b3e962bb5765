"""One writer per checkpoint location on an object store: a lease object that the job's rank 0 creates
with a conditional write, renews while it runs, checks before every commit and deletes at its end.

Two jobs on one URL would destroy each other: the second one's prune deletes the first one's upload in
flight and its `latest` names a lower step, which the first job's next resume then takes. A folder
has run_dir/.lock for this; an object store has no lock, but S3 (If-None-Match), GCS (if-generation-
match 0) and Azure (If-None-Match) all create an object only if it does not exist yet, and fsspec
exposes that as `pipe_file(..., mode="create")`.

    <url>/.lease.<generation>   JSON: the holder (host, pid, job ids), when it last renewed, its ttl

The newest generation holds the location. A job starting finds it and
- creates the next generation when there is none, or when the holder is gone: it released it, it is
  an earlier attempt of this job's own launch (the same launch token, dist/launch_token.py: a torchrun
  restart, a SLURM requeue; a token made at the launch's first start, never a name two jobs can share
  such as torchrun's rdzv_id), it is a dead process of this host's boot and pid namespace (pid and
  start time), or it was watched and did not renew for its ttl. Of two jobs that race for one
  generation, the conditional write lets exactly one win (and a token read back catches a store that
  ignores the condition); the other then finds a live holder.
- is refused in one line naming the holder otherwise, before it writes any checkpoint: at once when the
  holder is a live process on this host, else once it has seen the holder renew (a live holder renews
  every ttl/6; a dead one's record stays as it was for a whole ttl meanwhile, and it is taken over).
A holder that finds a newer generation than its own, or its own record gone or not its own, when it
commits (it stopped renewing long enough to be taken over: a frozen or partitioned node) stops without
committing. At its end a holder marks its record released rather than deleting it, so generation
numbers only grow.

Whether a holder renews is timed on the reader's own monotonic clock, by watching its record change:
no two hosts' wall clocks are ever compared (a starter whose clock runs an hour ahead takes no live
lease). The holder's wall-clock `renewed` is only said in messages. A client whose file system does not
take mode="create" falls back to look, then write, which is not atomic against a job that starts in
the same instant. A folder (a plain path ckpt_dir, NFS or Lustre included) holds its lease the same
way through fsspec's local file system: created with link(2), rewritten by rename.
"""
from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import UserError
from . import layout
from .layout import LEASE_PREFIX
from .store_fs import Store, describe

LEASE_TTL_S = 60.0  # a holder that has not renewed for this long is gone
RENEW_PARTS = 6  # a holder renews every ttl / RENEW_PARTS (10 s)


def lease_name(generation: int) -> str:
    return f"{LEASE_PREFIX}{generation:010d}"


def generation_of(name: str) -> int | None:
    digits = name.rsplit("/", 1)[-1][len(LEASE_PREFIX):] if LEASE_PREFIX in name else ""
    return int(digits) if digits.isascii() and digits.isdigit() else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat): with the boot
    and the pid namespace, it tells a pid from the same number reused by another process."""
    stat = _read(f"/proc/{pid}/stat")
    try:
        return stat.rsplit(")", 1)[1].split()[19] if stat else None
    except IndexError:
        return None


def identity(job_id: str | None, batch_job_id: str | None, restart_count: int = 0,
             launch: str | None = None) -> dict[str, Any]:
    """Who this process is, as the lease records it. A pod recreated under the same name has the same
    hostname and often the same pid numbers: the boot, the pid namespace and the start time say
    whether a recorded pid is really the same process (checked only where all three are known).
    `launch`: the launch token every attempt of this job shares and no other job has
    (dist/launch_token.py; None when there is no such token): an earlier attempt is recognised by it.
    The job ids and the restart count are for the messages only."""
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = None
    return {"host": socket.gethostname(), "pid": os.getpid(), "boot_id": _read("/proc/sys/kernel/random/boot_id"),
            "pidns": pidns, "start": _start_time(os.getpid()),
            "job_id": job_id if job_id not in (None, "", "none") else None, "batch_job_id": batch_job_id or None,
            "restart_count": int(restart_count or 0), "launch": launch or None,
            # the launcher that may restart this process (torchrun's agent): while it lives, an exited holder
            # is between two attempts of its job, not gone
            "parent": os.getppid(), "parent_start": _start_time(os.getppid())}


def newest(store: Store) -> tuple[int, dict[str, Any]] | None:
    """(generation, record) of the newest lease under the location; None when there is none. A record
    that cannot be read (being written, or a writer killed half-way) counts as renewed when the object
    was last modified: its ttl runs out like any other's."""
    store.fs.invalidate_cache(store.root)
    try:
        names = store.fs.glob(store.path(LEASE_PREFIX + "*"))
    except FileNotFoundError:
        return None
    gens = sorted((g for n in names if (g := generation_of(str(n))) is not None), reverse=True)
    for g in gens:
        path = store.path(lease_name(g))
        try:
            record = json.loads(store.fs.cat_file(path))
            if isinstance(record, dict):
                return g, record
        except FileNotFoundError:  # deleted since the listing (an old generation cleaned up)
            continue
        except ValueError:
            pass
        try:
            modified = store.fs.modified(path).timestamp()
        except Exception:  # a file system that does not say: as if just written
            modified = time.time()
        return g, {"renewed": modified, "unreadable": True}
    return None


def _same_process_space(record: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether pids in `record` name processes this one can see: the same host, boot and pid namespace."""
    return all(record.get(k) is not None and record.get(k) == me.get(k) for k in ("host", "boot_id", "pidns"))


def _alive(record: dict[str, Any]) -> bool:
    """Whether the recorded process still runs (same process space only): its pid with its start time."""
    pid = record.get("pid")
    return isinstance(pid, int) and _start_time(pid) is not None and _start_time(pid) == record.get("start")


def _is_me(record: dict[str, Any], me: dict[str, Any]) -> bool:
    return _same_process_space(record, me) and record.get("pid") == me.get("pid") and record.get("start") == me.get("start")


def gone_why(record: dict[str, Any], me: dict[str, Any]) -> str | None:
    """Why the holder of `record` no longer holds the location, from the record alone; None when it
    does or may (then only watching it tells: _watch). Never from the holder's wall clock."""
    if record.get("released"):
        return "a job that has released it"
    here = _same_process_space(record, me)
    if here and _alive(record):
        return None  # a live process on this host, whatever it says
    if me.get("launch") and record.get("launch") == me["launch"] and not _is_me(record, me):
        return f"an earlier attempt of this job (launch {me['launch']})"  # a torchrun restart, a requeue
    if here:
        parent = {"pid": record.get("parent"), "start": record.get("parent_start")}
        if str(record.get("launch") or "").startswith("torchrun") and _alive(parent):
            return None  # its agent lives: a restart of that job is coming (watch it, as any live holder)
        return f"process {record.get('pid')} on this host, which has exited"
    return None


def describe_holder(record: dict[str, Any], now: float) -> str:
    jobs = ", ".join(f"{k.replace('_', ' ')} {record[k]}" for k in ("job_id", "batch_job_id") if record.get(k))
    age = now - float(record.get("renewed", now))
    return (f"host {record.get('host', '?')}, pid {record.get('pid', '?')}{', ' + jobs if jobs else ''}, "
            f"renewed {max(age, 0):.0f}s ago")


def _is_folder(store: Store) -> bool:
    """Whether the location is a folder (storage_folder.FolderFS, or fsspec's local file system)."""
    if getattr(store.fs, "is_folder", False):
        return True
    try:
        from fsspec.implementations.local import LocalFileSystem
    except ImportError:
        return False
    return isinstance(store.fs, LocalFileSystem)


def create_only(store: Store, path: str, body: bytes) -> bool:
    """Write `path` only if no object is there; whether this call created it."""
    try:
        if _is_folder(store):  # link(2) fails if the name exists: atomic, and whole (NFS included)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            with open(tmp, "wb") as f:
                f.write(body)
            try:
                os.link(tmp, path)
            finally:
                os.unlink(tmp)
            return True
        try:
            store.fs.pipe_file(path, body, mode="create")
        except TypeError:  # a client without conditional writes: look, then write (the read-back decides)
            if store.fs.exists(path):
                return False
            store.fs.pipe_file(path, body)
        return True
    except FileExistsError:
        return False
    except OSError as exc:  # S3: 409 ConditionalRequestConflict, a conditional write racing another
        if "Conflict" in str(exc) or "Precondition" in str(exc) or getattr(exc, "errno", None) == errno.EINVAL:
            return False
        raise


def _record(me: dict[str, Any], ttl_s: float, generation: int, token: str, **more: Any) -> bytes:
    """`renewed` (this host's wall clock) is for people; `renewals` makes every renewal a change a
    watcher sees, whatever the clocks."""
    return json.dumps({**me, "generation": generation, "token": token, "renewed": time.time(), "ttl_s": ttl_s,
                       **more}).encode()


def _overwrite(store: Store, path: str, body: bytes) -> None:
    """Replace the object at `path` whole: one PUT on a store; on a folder a new file renamed over it,
    so that a reader never sees half a record."""
    if not _is_folder(store):
        store.fs.pipe_file(path, body)
        return
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp) if os.path.exists(tmp) else None
        raise


def _observe(store: Store) -> tuple[int, bytes | None] | None:
    """What a watcher compares: the newest generation and its bytes (None: unreadable, or deleted
    since the listing); None when there is no lease at all."""
    store.fs.invalidate_cache(store.root)
    try:
        names = store.fs.glob(store.path(LEASE_PREFIX + "*"))
    except FileNotFoundError:
        return None
    gens = sorted((g for n in names if (g := generation_of(str(n))) is not None), reverse=True)
    if not gens:
        return None
    try:
        return gens[0], bytes(store.fs.cat_file(store.path(lease_name(gens[0]))))
    except FileNotFoundError:
        return gens[0], None


def _read_record(store: Store, generation: int) -> dict[str, Any] | None:
    try:
        record = json.loads(store.fs.cat_file(store.path(lease_name(generation))))
        return record if isinstance(record, dict) else None
    except (FileNotFoundError, ValueError):
        return None


def _watch(store: Store, held: int, record: dict[str, Any], me: dict[str, Any], say: Callable[[str], None]) -> str | None:
    """Watch the lease until its record changes (None: the holder renewed, or a third job took it:
    alive) or stays as it is for the holder's whole ttl, timed on this process's monotonic clock (why
    it is gone). About ttl / RENEW_PARTS for a live holder, the ttl for a dead one."""
    ttl = max(float(record.get("ttl_s", LEASE_TTL_S)), 0.1)
    first = _observe(store)
    deadline = time.monotonic() + ttl + min(1.0, ttl / RENEW_PARTS)
    say(f"ddp_kit: checkpoint location {store.url} is held by {describe_holder(record, time.time())}; waiting up to "
        f"{deadline - time.monotonic():.0f}s to see whether that job is still alive")
    while time.monotonic() < deadline:
        time.sleep(min(ttl / RENEW_PARTS / 4, max(deadline - time.monotonic(), 0.0)))
        seen = _observe(store)
        if seen is None:
            return "a job whose lease is gone"
        if seen != first:
            found = newest(store)
            if found is not None and found[0] == seen[0] and found[1].get("released"):
                return "a job that has released it"
            return None  # renewed (or taken by a third job): alive
    return f"{record.get('host', '?')} pid {record.get('pid', '?')}, which did not renew for {ttl:g}s while watched"


def acquire(store: Store, me: dict[str, Any], ttl_s: float = LEASE_TTL_S,
            say: Callable[[str], None] | None = None) -> tuple[int, str]:
    """Take the location for this job (rank 0, before anything is written); returns the generation held
    and this holder's token. Refused in one line, naming the holder, when another job holds it."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    for _ in range(5):  # a race lost to a job that then exits at once: look again
        found = newest(store)
        gen = 1
        if found is not None:
            held, record = found
            why = gone_why(record, me)
            if why is None and not (_same_process_space(record, me) and _alive(record)):
                # Maybe a job that died elsewhere (an evicted pod comes back on another node with no
                # launch token of its own), maybe one that runs: a live holder renews within RENEW_PARTS
                # of its ttl, a dead one never again. Watch it that long rather than refuse (exit 2:
                # never retried) or take it at once.
                why = _watch(store, held, record, me, say)
            if why is None:
                raise UserError(
                    f"checkpoint location {store.url!r} is in use by another job ({describe_holder(record, time.time())}): "
                    f"two jobs writing one location delete each other's checkpoints",
                    f"give this job its own ckpt_dir, or stop the other job; a job that stops renewing its lease "
                    f"(.lease.* under the location) for {float(record.get('ttl_s', ttl_s)):g}s is taken over")
            if "earlier attempt" not in why and "released" not in why:  # restarts and clean ends are not news
                say(f"ddp_kit: taking over checkpoint location {store.url} from {why}")
            gen = held + 1
        token = secrets.token_hex(8)
        # A store that ignores the condition (an S3-compatible server, an old client) lets two writers
        # both "create": the one whose token is read back holds it, the other looks again.
        if create_only(store, store.path(lease_name(gen)), _record(me, ttl_s, gen, token)):
            if (_read_record(store, gen) or {}).get("token") != token:
                continue
            for old in range(max(1, gen - 3), gen):  # older generations: no longer anyone's (numbers only grow)
                try:
                    store.fs.rm_file(store.path(lease_name(old)))
                except OSError:
                    pass
            return gen, token
    raise UserError(f"checkpoint location {store.url!r}: could not take its lease (other jobs keep taking it)",
                    "make sure only one job writes this location")


def abort_incomplete_uploads(store: Store) -> int:
    """Abort the multipart uploads of this location's steps that an earlier attempt started and never
    finished (killed midway): invisible to listings, billed all the same. Only S3 keeps them (s3fs
    aborts the ones that fail in its process); called by the lease holder, so none is another job's
    (a location nested under this one, e.g. replica_<g>/, is left alone). Returns how many were aborted."""
    call = getattr(store.fs, "call_s3", None)
    if call is None:
        return 0
    bucket, key, _ = store.fs.split_path(store.root)
    prefix = key.rstrip("/") + "/"
    aborted = 0
    marker: dict[str, str] = {}  # where the next page of the listing starts
    while True:
        page = call("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marker)
        for upload in page.get("Uploads", []):
            head = upload["Key"][len(prefix):].split("/", 1)[0]
            if layout.step_of(head) is None:
                continue
            call("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            aborted += 1
        if not page.get("IsTruncated"):
            return aborted
        marker = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}


def taken_by(store: Store, generation: int, token: str) -> dict[str, Any] | None:
    """None while this holder's record (`generation`, `token`) is the newest lease; else the record that
    replaced it (a newer generation, or its own overwritten), or {} when it is gone altogether."""
    found = newest(store)
    if found is not None and found[0] > generation:
        return found[1]
    mine = _read_record(store, generation)
    if mine is None or mine.get("token") != token or mine.get("released"):
        return mine if mine is not None and not mine.get("released") else {}
    return None


class LeaseKeeper:
    """Rank 0's lease: renewed every ttl/RENEW_PARTS by a daemon thread, checked at each commit, marked
    released at close (not deleted: generation numbers only grow, so a holder taken over while frozen
    never finds itself the newest again)."""

    def __init__(self, store: Store, me: dict[str, Any], ttl_s: float = LEASE_TTL_S):
        self.store, self.me, self.ttl_s = store, me, ttl_s
        self.generation, self.token = acquire(store, me, ttl_s)
        self._lock = threading.Lock()  # one writer of our record at a time: renewal or release
        self._released = False
        self._renewals = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="ddp_kit-ckpt-lease", daemon=True)
        self._thread.start()
        try:
            abort_incomplete_uploads(store)
        except Exception as exc:  # housekeeping: never a reason not to train
            print(f"ddp_kit: warning: could not abort incomplete uploads under {store.url} ({describe(exc)}); "
                  f"a lifecycle rule on the bucket removes them (docs/checkpoints.md: object storage)", file=sys.stderr, flush=True)

    def _write(self, **more: Any) -> bool:
        """Rewrite our record (renewed now) if it is still ours; whether it was."""
        with self._lock:
            if self._released or taken_by(self.store, self.generation, self.token) is not None:
                return False  # never re-create or overwrite a lease we no longer hold
            self._renewals += 1
            _overwrite(self.store, self.store.path(lease_name(self.generation)),
                       _record(self.me, self.ttl_s, self.generation, self.token, renewals=self._renewals, **more))
            return True

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / RENEW_PARTS):
            try:
                if not self._write():
                    return  # the next commit says so (lost())
            except Exception as exc:  # the store is unreachable for now: the uploads will say so too
                print(f"ddp_kit: warning: renewing the lease on {self.store.url} failed ({describe(exc)}); "
                      f"trying again in {self.ttl_s / RENEW_PARTS:g}s", file=sys.stderr, flush=True)

    def lost(self) -> str | None:
        """Before a commit: None while this job holds the location, else who took it over."""
        record = taken_by(self.store, self.generation, self.token)
        if record is None:
            return None
        return describe_holder(record, time.time()) if record else "its lease object was removed"

    def release(self) -> None:
        self._stop.set()
        try:
            self._write(released=True)
        except Exception:  # the next job takes over once the ttl has passed
            pass
        with self._lock:
            self._released = True
        self._thread.join(timeout=5)

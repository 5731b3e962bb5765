"""One writer per checkpoint location on an object store: a lease object that the job's rank 0 creates
with a conditional write, renews while it runs, checks before every commit and deletes at its end.

Two jobs on one URL would destroy each other: the second one's prune deletes the first one's upload in
flight and its `latest` names a lower step, which the first job's next resume then takes. A folder
has run_dir/.lock for this; an object store has no lock, but S3 (If-None-Match), GCS (if-generation-
match 0) and Azure (If-None-Match) all create an object only if it does not exist yet, and fsspec
exposes that as `pipe_file(..., mode="create")`.

    <url>/.lease.<generation>   JSON: the holder (host, pid, job ids), when it last renewed, its ttl

The newest generation holds the location. A job starting finds it and
- creates the next generation when there is none, or when the holder is gone: its lease was not
  renewed for its ttl, it is a dead process on this host, or it is an earlier attempt of this same job
  (a torchrun restart or a SLURM requeue: the same job id). Of two jobs that race for one generation,
  the conditional write lets exactly one win; the other then finds a live holder.
- is refused in one line naming the holder otherwise, before it writes any checkpoint: at once when the
  holder is a live process on this host, else once it has seen the holder renew (a live holder renews
  every ttl/6; a dead one's ttl runs out meanwhile, and it is taken over).
A holder that finds a newer generation than its own when it commits (it stopped renewing long enough
to be taken over: a frozen or partitioned node) stops without committing.

Staleness compares the holder's wall clock with the reader's: clocks must agree within a small part of
the ttl (NTP does). A client whose file system does not take mode="create" falls back to look, then
write, which is not atomic against a job that starts in the same instant.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any

from ..errors import UserError
from .layout import LEASE_PREFIX
from .store_fs import Store, describe

LEASE_TTL_S = 60.0  # a holder that has not renewed for this long is gone
RENEW_PARTS = 6  # a holder renews every ttl / RENEW_PARTS (10 s)


def lease_name(generation: int) -> str:
    return f"{LEASE_PREFIX}{generation:010d}"


def generation_of(name: str) -> int | None:
    digits = name.rsplit("/", 1)[-1][len(LEASE_PREFIX):] if LEASE_PREFIX in name else ""
    return int(digits) if digits.isascii() and digits.isdigit() else None


def identity(job_id: str | None, batch_job_id: str | None) -> dict[str, Any]:
    """Who this process is, as the lease records it."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "job_id": job_id if job_id not in (None, "", "none") else None, "batch_job_id": batch_job_id or None}


def newest(store: Store) -> tuple[int, dict] | None:
    """(generation, record) of the newest lease under the location; None when there is none. A record
    that cannot be read (being written) counts as a fresh one of an unknown holder."""
    store.fs.invalidate_cache(store.root)
    try:
        names = store.fs.glob(store.path(LEASE_PREFIX + "*"))
    except FileNotFoundError:
        return None
    gens = sorted((g for n in names if (g := generation_of(str(n))) is not None), reverse=True)
    for g in gens:
        try:
            return g, json.loads(store.fs.cat_file(store.path(lease_name(g))))
        except FileNotFoundError:  # deleted since the listing (released, or an old generation cleaned up)
            continue
        except ValueError:
            return g, {"renewed": time.time()}
    return None


def gone_why(record: dict, me: dict, now: float) -> str | None:
    """Why the holder of `record` no longer holds the location (None: it does)."""
    for key in ("job_id", "batch_job_id"):
        if me.get(key) and record.get(key) == me[key]:
            return f"an earlier attempt of this job ({key.replace('_', ' ')} {me[key]})"
    if record.get("host") == me["host"] and isinstance(record.get("pid"), int) and not _alive(record["pid"]):
        return f"process {record['pid']} on this host, which has exited"
    age = now - float(record.get("renewed", 0))
    ttl = float(record.get("ttl_s", LEASE_TTL_S))
    if age > ttl:
        return f"{record.get('host', '?')} pid {record.get('pid', '?')}, which last renewed {age:.0f}s ago (ttl {ttl:g}s)"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def describe_holder(record: dict, now: float) -> str:
    jobs = ", ".join(f"{k.replace('_', ' ')} {record[k]}" for k in ("job_id", "batch_job_id") if record.get(k))
    age = now - float(record.get("renewed", now))
    return (f"host {record.get('host', '?')}, pid {record.get('pid', '?')}{', ' + jobs if jobs else ''}, "
            f"renewed {max(age, 0):.0f}s ago")


def create_only(store: Store, path: str, body: bytes) -> bool:
    """Write `path` only if no object is there; whether this call created it."""
    try:
        from fsspec.implementations.local import LocalFileSystem

        if isinstance(store.fs, LocalFileSystem):  # O_EXCL: atomic on a local or mounted folder
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "xb") as f:
                f.write(body)
            return True
        try:
            store.fs.pipe_file(path, body, mode="create")
        except TypeError:  # a client without conditional writes: look, then write
            if store.fs.exists(path):
                return False
            store.fs.pipe_file(path, body)
        return True
    except FileExistsError:
        return False


def _record(me: dict, ttl_s: float, generation: int) -> bytes:
    return json.dumps({**me, "generation": generation, "renewed": time.time(), "ttl_s": ttl_s}).encode()


def _here_and_alive(record: dict, me: dict) -> bool:
    return record.get("host") == me["host"] and isinstance(record.get("pid"), int) and _alive(record["pid"])


def _watch(store: Store, held: int, record: dict, say) -> str | None:
    """Wait until the holder of generation `held` renews (None: it is alive) or its ttl runs out (why
    it is gone). At most ttl / RENEW_PARTS plus a margin for a live holder, the ttl for a dead one."""
    ttl = float(record.get("ttl_s", LEASE_TTL_S))
    renewed = float(record.get("renewed", 0))
    deadline = time.monotonic() + min(max(renewed + ttl - time.time(), 0.0), ttl) + 1.0
    say(f"ddp_kit: checkpoint location {store.url} is held by {describe_holder(record, time.time())}; waiting up to "
        f"{deadline - time.monotonic():.0f}s to see whether that job is still alive")
    while time.monotonic() < deadline:
        time.sleep(min(ttl / RENEW_PARTS / 4, max(deadline - time.monotonic(), 0.0)))
        found = newest(store)
        if found is None:
            return "a job that has released it"
        if found[0] != held or float(found[1].get("renewed", 0)) != renewed:
            return None  # renewed (or taken by a third job): alive
    return gone_why(record, {"host": None}, time.time() + 1.0) or f"{record.get('host', '?')} pid {record.get('pid', '?')}, which stopped renewing"


def acquire(store: Store, me: dict, ttl_s: float = LEASE_TTL_S, say=None) -> int:
    """Take the location for this job (rank 0, before anything is written); returns the generation held.
    Refused in one line, naming the holder, when another job holds it."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    for _ in range(5):  # a race lost to a job that then exits at once: look again
        found = newest(store)
        gen = 1
        if found is not None:
            held, record = found
            why = gone_why(record, me, time.time())
            if why is None and not _here_and_alive(record, me):
                # Maybe a job that just died elsewhere (an evicted pod comes back on another node with
                # no job id of its own): a live holder renews within RENEW_PARTS of its ttl, a dead one
                # never again. Watch it that long rather than refuse (exit 2: never retried) at once.
                why = _watch(store, held, record, say)
            if why is None:
                raise UserError(
                    f"checkpoint location {store.url!r} is in use by another job ({describe_holder(record, time.time())}): "
                    f"two jobs writing one location delete each other's checkpoints",
                    f"give this job its own ckpt_dir, or stop the other job; a job that stops renewing its lease "
                    f"(.lease.* under the location) for {float(record.get('ttl_s', ttl_s)):g}s is taken over")
            if "earlier attempt" not in why:  # a requeue or restart taking its own lease back is not news
                say(f"ddp_kit: taking over checkpoint location {store.url} from {why}")
            gen = held + 1
        if create_only(store, store.path(lease_name(gen)), _record(me, ttl_s, gen)):
            for old in range(max(1, gen - 3), gen):  # older generations: no longer anyone's
                try:
                    store.fs.rm_file(store.path(lease_name(old)))
                except (FileNotFoundError, OSError):
                    pass
            return gen
    raise UserError(f"checkpoint location {store.url!r}: could not take its lease (other jobs keep taking it)",
                    "make sure only one job writes this location")


def abort_incomplete_uploads(store: Store) -> int:
    """Abort the multipart uploads under the location that an earlier attempt started and never finished
    (killed midway): invisible to listings, billed all the same. Only S3 has them as separate objects
    (s3fs aborts the ones that fail in its process); called by the lease holder, so none is another
    job's. Returns how many were aborted."""
    call = getattr(store.fs, "call_s3", None)
    if call is None:
        return 0
    bucket, key, _ = store.fs.split_path(store.root)
    aborted, marker = 0, {}
    while True:
        page = call("list_multipart_uploads", Bucket=bucket, Prefix=key.rstrip("/") + "/", **marker)
        for upload in page.get("Uploads", []):
            call("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            aborted += 1
        if not page.get("IsTruncated"):
            return aborted
        marker = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}


def taken_by(store: Store, generation: int) -> dict | None:
    """None while `generation` is still the newest lease; else the record of the one that took over."""
    found = newest(store)
    if found is None or found[0] <= generation:
        return None
    return found[1]


class LeaseKeeper:
    """Rank 0's lease: renewed every ttl/RENEW_PARTS by a daemon thread, checked at each commit, deleted at close."""

    def __init__(self, store: Store, me: dict, ttl_s: float = LEASE_TTL_S):
        self.store, self.me, self.ttl_s = store, me, ttl_s
        self.generation = acquire(store, me, ttl_s)
        try:
            abort_incomplete_uploads(store)
        except Exception as exc:  # housekeeping: never a reason not to train
            print(f"ddp_kit: warning: could not abort incomplete uploads under {store.url} ({describe(exc)}); "
                  f"a lifecycle rule on the bucket removes them (README: object storage)", file=sys.stderr, flush=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="ddp_kit-ckpt-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / RENEW_PARTS):
            try:
                if taken_by(self.store, self.generation) is not None:
                    return  # the commit says so (lost()); renewing a lease we lost would mislead a reader
                self.store.fs.pipe_file(self.store.path(lease_name(self.generation)),
                                        _record(self.me, self.ttl_s, self.generation))
            except Exception as exc:  # the store is unreachable for now: the uploads will say so too
                print(f"ddp_kit: warning: renewing the lease on {self.store.url} failed ({describe(exc)}); "
                      f"trying again in {self.ttl_s / RENEW_PARTS:g}s", file=sys.stderr, flush=True)

    def lost(self) -> str | None:
        """Before a commit: None while this job holds the location, else who took it over."""
        record = taken_by(self.store, self.generation)
        return None if record is None else describe_holder(record, time.time())

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            if taken_by(self.store, self.generation) is None:
                self.store.fs.rm_file(self.store.path(lease_name(self.generation)))
        except Exception:  # the next job takes over once the ttl has passed
            pass

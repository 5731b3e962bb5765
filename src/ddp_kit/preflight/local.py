"""The gate's node-local checks that need no GPU: a folder writable with room for the next checkpoint,
and the memory tier's tmpfs with room for its copies. One node's answer each (its first rank asks):
a folder may be another filesystem, or not mounted, on one node only."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from .results import Result

PROBE_BYTES = 1 << 20  # written, synced and removed: a folder that takes this takes a small file too
ROOM_MARGIN = 1.1  # room for the last checkpoint plus a tenth: a checkpoint grows a little with its step's metadata


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.1f} GiB"


def _probe(folder: Path, nbytes: int) -> str | None:
    """None when `nbytes` could be written to a new file in `folder`, synced and removed; else why not."""
    path = folder / f".ddp_kit-health-{os.uname().nodename}-{os.getpid()}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view, chunk = memoryview(bytes(min(nbytes, 1 << 20))), 0
            while chunk < nbytes:
                chunk += os.write(fd, view[: nbytes - chunk])
            os.fsync(fd)
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    return None


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists: where the folder would be made. The gate makes nothing: a
    folder it made would be there before the job decided to make it (a failed start leaves no checkpoints/),
    and the memory tier makes its own root private (memory_root.py)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def folder(check: str, path: str | Path, host: str, need_bytes: int = 0) -> Result:
    """`path` (or, before it exists, the folder it would be made in) takes a file, and has room for
    `need_bytes` more (the last checkpoint's size; 0: none yet). Never raises: a storage error is the finding."""
    t0 = time.perf_counter()
    try:
        return _folder(check, Path(path), host, need_bytes, t0)
    except OSError as err:  # EIO, ESTALE, EACCES from a stat on the way: the node's storage, named
        return Result(check, host, False, f"cannot read it: {type(err).__name__}: {err.strerror or err}",
                      "a folder this user can write", str(path), seconds=time.perf_counter() - t0)


def _folder(check: str, path: Path, host: str, need_bytes: int, t0: float) -> Result:
    where = _existing(path)
    if not where.is_dir():
        return Result(check, host, False, f"{where} is not a folder", "a folder this user can write", str(path),
                      seconds=time.perf_counter() - t0)
    why = _probe(where, PROBE_BYTES)
    if why is not None:
        kind = fs_type(where)
        on = f" (on {kind}, shared by the hosts)" if kind in NETWORK_FS else ""
        return Result(check, host, False, f"not writable: {why}{on}", "a folder this user can write", str(path),
                      seconds=time.perf_counter() - t0, shared=bool(on))
    free = shutil.disk_usage(where).free
    need = int(need_bytes * ROOM_MARGIN)
    if need and free < need:
        return Result(check, host, False, f"{_mib(free)} free", f"room for the last checkpoint's {_mib(need_bytes)}",
                      str(path), value=float(free), seconds=time.perf_counter() - t0)
    return Result(check, host, True, f"writable, {_mib(free)} free", detail=str(path), value=float(free),
                  seconds=time.perf_counter() - t0)


# File systems that every host mounts from elsewhere: a failure there is the storage's, not the host's
NETWORK_FS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "glusterfs", "wekafs",
                        "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "9p", "virtiofs", "fuse.ceph-fuse"})


def fs_type(path: Path) -> str:
    """The type of the file system `path` is on (/proc/self/mounts: the longest mount point above it)."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    real, best, kind = os.path.realpath(path), "", ""
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def memory_root() -> Path:
    """Where the memory tier keeps this user's copies on this node (checkpoint/memory_root.py's rule)."""
    from ..checkpoint.memory_root import root_dir

    return root_dir()


def _held(root: Path) -> int:
    """The bytes of the copies under the tier's root (this user's alone)."""
    total = 0
    for top, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except OSError:
                continue
    return total


def tmpfs_room(host: str, need_bytes: int, root: Path | None = None) -> Result:
    """The memory tier's tmpfs takes a file and has room for `need_bytes` (its copies, estimated from the
    last checkpoint; at a first start only the probe's megabyte is known). What this user's copies already
    hold there counts as room: the tier reuses its own slots (memory_tier.py counts them the same way)."""
    t0 = time.perf_counter()
    named = root or memory_root()
    need = max(need_bytes, PROBE_BYTES)
    try:
        where = _existing(named)
        free = shutil.disk_usage(where).free + _held(named)
    except OSError as err:
        return Result("shm", host, False, f"cannot read it: {err.strerror or err}", "a tmpfs for the memory tier",
                      str(named), seconds=time.perf_counter() - t0)
    why = _probe(where, min(need, PROBE_BYTES)) if free >= PROBE_BYTES else f"{_mib(free)} free"
    if why is not None or free < need:
        return Result("shm", host, False, why if why and "free" not in why else f"{_mib(free)} free",
                      f"room for the memory tier's copies, {_mib(need)}", str(named), value=float(free),
                      seconds=time.perf_counter() - t0)
    return Result("shm", host, True, f"{_mib(free)} free", detail=str(named), value=float(free),
                  seconds=time.perf_counter() - t0)


"""The memory tier's place on a node: a folder private to this user, the node's identity, and which
jobs' folders are alive.

    <root>                    /dev/shm/ddp_kit-<uid> (DDP_KIT_MEM_DIR names another): made 0700, and refused
                              unless it is a folder of this user that nobody else can write into. /dev/shm is
                              every user's: a shared root would let anyone plant a copy a job then resumes,
                              or a link a job then writes through.
    <root>/node_id            this node's identity (made once): which copies a rank can read
    <root>/<job>/.alive       every live process of the job holds a shared flock on it and touches it
                              every RENEW_S while it runs

A job's folder is abandoned, and removed by the next job that opens the tier on the node, when no
process holds its lock and it was last touched more than KEEP_S ago. A lock is the kernel's, so it
holds across pid namespaces that share the tmpfs (containers with one /dev/shm, a hostPath), where a
pid means nothing; the time covers the moment between two attempts (a torchrun restart, a requeue)
when the job has no process at all. A folder of an earlier run at the same checkpoint location
(`<location>-<run>`: the run folder was deleted and the command started again) is removed as soon
as nothing holds it: no later run can use it.
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import time
import uuid
from pathlib import Path

ENV_DIR = "DDP_KIT_MEM_DIR"
ALIVE = ".alive"
KEEP_S = 900.0  # an unheld folder touched this recently may be a job between two attempts
RENEW_S = 60.0  # how often a live job touches its folder (a cleaner counts KEEP_S from the last touch)
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class NotPrivate(Exception):
    """The tier's root is not this user's alone; the message says why, in a few words."""


def root_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or f"/dev/shm/ddp_kit-{os.geteuid()}")


def make_private(root: Path) -> None:
    """Create `root` (0700), or check the one there: this user's folder, that no one else can write into."""
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    me = os.geteuid()
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid != me:
            raise NotPrivate(f"it is a link made by user {st.st_uid}")
        st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise NotPrivate("it is not a folder")
    if st.st_uid != me:
        raise NotPrivate(f"it belongs to user {st.st_uid}, not to you (user {me})")
    if st.st_mode & 0o022:
        raise NotPrivate(f"others can write into it (mode {stat.S_IMODE(st.st_mode):o})")


def read_private(path: Path, limit: int = 1 << 16) -> str:
    """A small file of the tier, never through a link."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    try:
        return os.read(fd, limit).decode(errors="replace")
    finally:
        os.close(fd)


def write_new(path: Path, data: bytes) -> None:
    """Create `path` with `data`: exclusively (never an existing file or a link), mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def node_id(root: Path) -> str:
    """This node's identity, made once: written whole under a temporary name, then linked into place
    (a reader never sees it half-written; the first of several writers wins)."""
    path = root / "node_id"
    try:
        got = read_private(path).strip()
    except FileNotFoundError:
        tmp = root / f".node_id.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        write_new(tmp, uuid.uuid4().hex.encode())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        got = read_private(path).strip()
    if len(got) != 32 or not all(c in "0123456789abcdef" for c in got):
        raise NotPrivate(f"{path} does not hold a node identity")
    return got


def hold(folder: Path) -> int:
    """Make `folder` (0700) and hold a shared lock on its .alive for this process's life; returns the fd.
    A cleaner removing the folder holds the lock exclusively: wait for it, then start anew."""
    while True:
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        fd = os.open(folder / ALIVE, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_ino == os.stat(folder / ALIVE, follow_symlinks=False).st_ino:
                os.utime(fd)
                return fd
        except FileNotFoundError:
            pass  # removed while we waited: make it again
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def renew(fd: int) -> None:
    """The job is alive: a cleaner leaves an unheld folder alone for KEEP_S after this."""
    try:
        os.utime(fd)
    except OSError:
        pass


def _take(folder: Path) -> int | None:
    """An exclusive lock on `folder`'s .alive, or None when a live process holds it (or it has none)."""
    try:
        fd = os.open(folder / ALIVE, os.O_RDWR | _NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise


def remove_abandoned(root: Path, keep: str, now: float | None = None) -> list[str]:
    """Remove the folders on this node no live job holds (see the module's docstring); their names."""
    now = time.time() if now is None else now
    location = keep.split("-")[0]
    removed = []
    for folder in root.iterdir():
        if folder.name == keep or folder.is_symlink() or not folder.is_dir():
            continue
        fd = _take(folder)
        if fd is None:
            try:  # a folder with no .alive (being made, or an older ddp_kit's): by its own age
                if (folder / ALIVE).exists() or now - folder.stat().st_mtime < KEEP_S:
                    continue
            except OSError:
                continue
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
            continue
        try:
            earlier_run = folder.name.split("-")[0] == location
            if earlier_run or now - os.fstat(fd).st_mtime >= KEEP_S:
                shutil.rmtree(folder, ignore_errors=True)  # under the lock: a process arriving waits, then starts anew
                removed.append(folder.name)
        finally:
            os.close(fd)
    return removed


def leave(folder: Path, fd: int, clean: bool) -> None:
    """Let go of `folder`; after a clean end the last process of the job on this node removes it."""
    os.close(fd)
    if not clean:
        return
    last = _take(folder)
    if last is not None:
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(last)

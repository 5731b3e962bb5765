"""The run folder: its layout, and the checks that make it safe to use before any work starts.

    run_dir/config.yaml, metrics.jsonl, summary.json   rank 0
    run_dir/trackers.json, tb/, wandb/                rank 0: the experiment trackers' run ids (boundary/tracking.py)
    run_dir/checkpoints/                              the folder checkpoint backend (names: checkpoint/layout.py),
                                                      unless ckpt_dir puts checkpoints elsewhere (a URL)
    run_dir/hang/                                     stacks and traces of a hang or crash
    run_dir/archive/<time>/                           what a fresh start (`--resume never`) moved aside
    run_dir/.lock                                     held (flock) by rank 0 of the job using the folder
    run_dir/.run_id                                   the run's identity, made at its first start: what the memory
                                                      tier's copies belong to (a new folder is a new run)

- Writable: rank 0 creates the folder and writes a probe, so a read-only mount or a path under a
  regular file is one line at startup, not a traceback at the first checkpoint.
- One job at a time: rank 0 holds an flock on `.lock` for the job's life. The kernel drops it when
  the process dies, SIGKILL included, so a stale lock cannot exist. The holder writes host, pid and
  job id into the file so that a second job is refused with a line naming it. The same job (a
  SLURM requeue, a torchrun restart: same job id) waits a little for its old self to let go.
- Shared: every rank must see the same folder (checkpoints are written by every rank and
  committed by rank 0). Rank 0 writes a random token; every rank reads it back. With ckpt_dir set,
  that folder is ckpt_dir (a URL: the store's own probe checks it), and run_dir may be each node's own.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint.layout import RUN_CHECKPOINTS
from .errors import UserError

LOCK_WAIT_SAME_JOB_S = 30.0


@dataclass(frozen=True)
class RunDir:
    path: Path
    ckpt_dir: str | None = None  # Policy.ckpt_dir: checkpoints elsewhere (a folder or a URL)

    @property
    def checkpoints(self) -> Path:
        return self.path / RUN_CHECKPOINTS

    @property
    def hang(self) -> Path:
        return self.path / "hang"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def trackers(self) -> Path:
        return self.path / "trackers.json"

    @property
    def archive(self) -> Path:
        return self.path / "archive"


class NotWritable(UserError):
    """A folder refused: `errno` says whether it looks like the node's (EROFS: a file system remounted read-only
    after errors, EIO) or the job's choice (EACCES, ENOTDIR, EEXIST)."""

    def __init__(self, message: str, hint: str, errno_: int | None):
        super().__init__(message, hint, local=True)
        self.errno = errno_


NODE_ERRNOS = frozenset({errno.EROFS, errno.EIO})


def check_writable(path: Path, what: str = "run_dir") -> None:
    """Create `path` and write a probe file in it, or refuse in one line naming the path (`what` it is)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe.{socket.gethostname()}.{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        why = {errno.EROFS: "is on a read-only file system", errno.EACCES: "is not writable (permission denied)",
               errno.ENOTDIR: "is under a regular file, not a folder", errno.ENOSPC: "is on a full disk",
               errno.EEXIST: "exists and is not a folder"}.get(exc.errno or 0, f"cannot be written ({exc.strerror})")
        raise NotWritable(f"{what} {str(path)!r} {why}", f"pass a writable folder as {what}", exc.errno) from None


class RunLock:
    """The flock on run_dir/.lock, held by rank 0 of the job using the folder."""

    def __init__(self, path: Path, job_id: str | None):
        # torchrun's default rendezvous id is the same for every job ("none"): no identity at all
        self.path, self.job_id = path, (job_id if job_id not in (None, "", "none") else None)
        self._fd: int | None = None

    def acquire(self, wait_same_job_s: float = LOCK_WAIT_SAME_JOB_S) -> RunLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(f"cannot open the run lock {str(self.path)!r}: {exc.strerror}",
                            "check the permissions of run_dir (is it another user's?)", local=True) from None
        deadline = time.monotonic() + wait_same_job_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
                    os.close(fd)  # e.g. Lustre mounted noflock: run unguarded rather than not at all
                    print(f"ddp_kit: warning: {str(self.path.parent)!r} does not support file locks "
                          f"({exc.strerror}); two jobs in this run_dir would not be stopped", file=sys.stderr, flush=True)
                    return self
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise UserError(f"cannot lock {str(self.path)!r}: {exc.strerror}",
                                    "put run_dir on a file system with working locks (flock)", local=True) from None
            holder = _read_holder(self.path)
            same_job = self.job_id and holder.get("job_id") == self.job_id
            if not same_job or time.monotonic() > deadline:
                os.close(fd)
                who = (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, job {holder.get('job_id') or 'none'}"
                       if holder else "a process that has not written its name yet")
                raise UserError(f"run_dir {str(self.path.parent)!r} is in use by another job ({who})",
                                "wait for it to finish, stop it, or use another run_dir")
            time.sleep(0.2)  # our own previous attempt (requeue, torchrun restart) is still exiting
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "job_id": self.job_id,
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (removing it would race a waiter)
            self._fd = None


def _read_holder(path: Path) -> dict[str, Any]:
    try:
        holder = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def run_identity(path: Path) -> str:
    """The run's identity, made at its first start in this folder and kept there (rank 0)."""
    file = path / ".run_id"
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        try:
            got = file.read_text().strip()
        except OSError:
            got = ""
        if len(got) == 32:
            return got
        file.unlink(missing_ok=True)  # cut short by a kill between create and write: make it again
        return run_identity(path)
    run = secrets.token_hex(16)
    try:
        os.write(fd, (run + "\n").encode())
    finally:
        os.close(fd)
    return run


def new_token() -> str:
    return secrets.token_hex(8)


def write_token(path: Path, token: str) -> None:
    (path / f".shared.{token}").write_text(token)


def sees_token(path: Path, token: str) -> bool:
    try:
        return (path / f".shared.{token}").read_text() == token
    except OSError:
        return False


def remove_token(path: Path, token: str) -> None:
    (path / f".shared.{token}").unlink(missing_ok=True)


def hang_folder(run_dir: str | Path | None) -> str:
    """run_dir/hang; without a run folder a per-user folder in the temp dir, so that a hang still
    leaves its stacks somewhere findable."""
    if run_dir:
        return str(RunDir(Path(run_dir)).hang)
    return os.path.join(tempfile.gettempdir(), f"ddp_kit-hang-{os.getuid()}")

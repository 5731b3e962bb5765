"""What a checkpoints folder holds, read without a process group: which step folders are valid
(manifest and checksums), which one `latest` names, which one a run resumes from, and moving an
abandoned run's steps aside. Used by the job, `python -m ddp_kit.checkpoint` and the report."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

from .durable import fsync_dir
from ..errors import UserError

MANIFEST = "manifest.json"


def step_numbers(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit():
            out.append(int(p.name[5:]))
    return out


def validate(path: Path) -> str | None:
    """None when `path` is a complete checkpoint; otherwise the reason it is not, in a few words."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        return "no manifest (save did not finish)"
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError):
        return "unreadable manifest"
    for name, want in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["size"]:
            return f"{name} is truncated ({f.stat().st_size} of {want['size']} bytes)"
        sha = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                sha.update(chunk)
        if sha.hexdigest() != want["sha256"]:
            return f"{name} is corrupt (checksum mismatch)"
    from .safe_load import check_folder  # torch only here: listing a folder of bad steps stays light

    return check_folder(path)  # a manifest proves nothing against whoever could also rewrite it


def list_checkpoints(root: Path) -> list[tuple[int, Path, str | None]]:
    """(step, path, reason-if-invalid) for every step folder, newest first."""
    return [(s, root / f"step_{s}", validate(root / f"step_{s}")) for s in sorted(step_numbers(root), reverse=True)]


def read_latest(root: Path) -> int | None:
    """The step `latest` names, or None when there is no (readable) `latest`."""
    try:
        name = (root / "latest").read_text().strip()
    except OSError:
        return None
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def choose(root: Path, resume: str, warn: Callable[[str], None]) -> tuple[str, int] | None:
    """resume=auto: the checkpoint `latest` names, once validated. Only when it is damaged, the newest
    valid one below it. Steps above `latest` belong to a run that was abandoned (`--resume never`, or
    a resume from an older checkpoint) and are never chosen."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.exists():
            raise UserError(f"checkpoint {str(path)!r} does not exist",
                            "pick one from `python -m ddp_kit.checkpoint list RUN_DIR`, or use resume auto")
        reason = validate(path)
        if reason:
            raise UserError(f"checkpoint {str(path)!r} cannot be resumed: {reason}",
                            "pick a valid one from `python -m ddp_kit.checkpoint list RUN_DIR`, or use resume auto")
        meta = json.loads((path / "meta.json").read_text())
        return str(path), int(meta["step"])
    latest = read_latest(root)
    for step, path, reason in list_checkpoints(root):
        if latest is not None and step > latest:
            continue
        if reason is None:
            return str(path), step
        warn(f"checkpoint {path.name} is not usable ({reason}); falling back to an older one")
    return None


def archive_abandoned(root: Path, keep_upto: int | None, archive_root: Path) -> list[int]:
    """Move every step above `keep_upto` (all of them when None: a fresh start, or a resume from
    another folder) out of `root`, into `archive_root/<time>/`, with `latest` naming `keep_upto`
    (or removed) before anything moves, so that a crash half-way never resumes the abandoned run.
    Nothing is deleted: a wrong `--resume never` is undone by moving the folders back."""
    moved = sorted(s for s in step_numbers(root) if keep_upto is None or s > keep_upto)
    if keep_upto is None:
        (root / "latest").unlink(missing_ok=True)
    elif read_latest(root) != keep_upto:
        point_latest(root, f"step_{keep_upto}")
    if moved:
        dest = archive_root / time.strftime("%Y%m%dT%H%M%S")
        dest.mkdir(parents=True, exist_ok=True)
        for s in moved:
            os.replace(root / f"step_{s}", dest / f"step_{s}")
        fsync_dir(root)
    return moved


def point_latest(root: Path, name: str) -> None:
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(name + "\n")
    os.replace(latest_tmp, root / "latest")
    fsync_dir(root)


def latest_name(root: Path) -> str:
    step = read_latest(root)
    return f"step_{step}" if step is not None else "none yet"

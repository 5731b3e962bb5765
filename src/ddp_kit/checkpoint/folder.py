"""A checkpoints folder on a local (or mounted) file system, read and rearranged without a process
group: which step folders are valid (manifest and checksums), which one `latest` names, which one a
run resumes from, and moving an abandoned run's steps aside. Used by the file backend
(checkpointer.py) and by `python -m ddp_kit.checkpoint`. Names come from layout."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from ..errors import UserError
from . import layout
from .durable import fsync_dir, sha256_of


def step_numbers(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return [s for p in root.iterdir() if p.is_dir() and (s := layout.step_of(p.name)) is not None]


def validate(path: Path) -> str | None:
    """None when `path` is a complete checkpoint; otherwise the reason it is not, in a few words."""
    mpath = path / layout.MANIFEST
    if not mpath.is_file():
        return "no manifest (save did not finish)"
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError:
        return "unreadable manifest"
    unsafe = layout.manifest_problem(manifest)  # a name outside the folder is never opened
    if unsafe:
        return unsafe
    files = manifest["files"]
    for name, want in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["size"]:
            return f"{name} is truncated ({f.stat().st_size} of {want['size']} bytes)"
        if sha256_of(f) != want["sha256"]:
            return f"{name} is corrupt (checksum mismatch)"
    from .safe_load import check_folder  # torch only here: listing a folder of bad steps stays light

    return check_folder(path)  # a manifest proves nothing against whoever could also rewrite it


def list_checkpoints(root: Path) -> list[tuple[int, Path, str | None]]:
    """(step, path, reason-if-invalid) for every step folder, newest first."""
    paths = [(s, root / layout.step_name(s)) for s in sorted(step_numbers(root), reverse=True)]
    return [(s, p, validate(p)) for s, p in paths]


def read_latest(root: Path) -> int | None:
    """The step `latest` names, or None when there is no (readable) `latest`."""
    try:
        return layout.step_of((root / layout.LATEST).read_text().strip())
    except OSError:
        return None


def read_meta(path: Path) -> dict:
    """meta.json of step folder `path`."""
    return json.loads((path / layout.META).read_text())


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
        return str(path), int(read_meta(path)["step"])
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
        (root / layout.LATEST).unlink(missing_ok=True)
    elif read_latest(root) != keep_upto:
        point_latest(root, layout.step_name(keep_upto))
    if moved:
        dest = archive_root / layout.archive_stamp()
        dest.mkdir(parents=True, exist_ok=True)
        for s in moved:
            os.replace(root / layout.step_name(s), dest / layout.step_name(s))
        fsync_dir(root)
    return moved


def point_latest(root: Path, name: str) -> None:
    latest_tmp = root / layout.LATEST_TMP
    latest_tmp.write_text(name + "\n")
    os.replace(latest_tmp, root / layout.LATEST)
    fsync_dir(root)


def latest_name(root: Path) -> str:
    step = read_latest(root)
    return layout.step_name(step) if step is not None else "none yet"

"""The one commit protocol, over any storage (storage.py: a folder, an fsspec URL, ...), with no
process group: which steps a location holds, which are committed and valid (manifest, sizes against
a listing, checksums), which one `latest` names, which one a run resumes from, the order of a
commit's writes, pruning, and moving an abandoned run's steps aside. Both backends (checkpointer,
object_store) and `python -m ddp_kit.checkpoint` go through it; names come from layout.

The commit of step N, once every file it holds is written and durable under its staging name
(`.tmp_step_N/` where the storage can rename, else `step_N/` itself):

    1. `latest` names step_N              (one atomic write)
    2. the manifest, under the staging name (on a storage without rename: the commit itself)
    3. with rename: a previous step_N moved aside, the staged folder renamed to step_N (the commit)
    4. prune: a killed save's leftovers, and committed steps beyond keep_last (but for those the newest
       step's meta names: the kept-best ones, and the newest at or before the last agreed step; spared.py)

A kill between any two writes leaves every previously committed step as it was and never a step
that resume takes while incomplete: before 1 nothing vouches for the new files; between 1 and the
commit `latest` names a step that is not (yet) complete, and resume falls back to the newest valid
one below it. `latest` goes first because the other order would leave a complete step above
`latest` for a while, which resume takes for an abandoned run's (never chosen, archived).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import UserError
from . import layout
from .durable import sha256_of
from .spared import KEEP_BEST as KEEP_BEST  # where keep_best and the CLI have always found them
from .spared import kept_best as kept_best
from .spared import spared
from .storage import Storage

DOWNLOADS = 8  # objects fetched at once
Attempt = Callable[[Callable[[], object], str], None]  # run one write (retried, said), raise when it fails


def _now(action: Callable[[], object], what: str) -> None:
    action()


# ---- what a location holds ---------------------------------------------------------------------------

def objects(storage: Storage) -> dict[str, int]:
    """{path: size} of every object of the location, its archive/ and the lease excluded."""
    return {rel: size for rel, size in storage.listing().items()
            if rel.split("/", 1)[0] != layout.ARCHIVE and not rel.startswith(layout.LEASE_PREFIX)}


def by_step(objects: dict[str, int]) -> dict[int, list[str]]:
    """The objects under each step_<N>/ prefix."""
    out: dict[int, list[str]] = {}
    for rel in objects:
        head, _, rest = rel.partition("/")
        step = layout.step_of(head)
        if step is not None and rest:
            out.setdefault(step, []).append(rel)
    return out


def committed(objects: dict[str, int]) -> list[int]:
    """The steps whose manifest is present, newest first (valid or not: see validate)."""
    return sorted((s for s in by_step(objects) if f"{layout.step_name(s)}/{layout.MANIFEST}" in objects), reverse=True)


# ---- the pointer -------------------------------------------------------------------------------------

def read_latest(storage: Storage) -> int | None:
    """The step `latest` names; None when there is no (readable) `latest`."""
    try:
        return layout.step_of(storage.read_bytes(layout.LATEST).decode(errors="replace").strip())
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def point_latest(storage: Storage, name: str) -> None:
    storage.write_bytes(layout.LATEST, (name + "\n").encode())


def latest_name(storage: Storage) -> str:
    step = read_latest(storage)
    return layout.step_name(step) if step is not None else "none yet"


# ---- is a step sound ---------------------------------------------------------------------------------

def read_json(storage: Storage, rel: str) -> Any:
    return json.loads(storage.read_bytes(rel))


def read_manifest(storage: Storage, name: str) -> dict[str, Any] | None:
    """Step `name`'s manifest when it is readable and names only files inside the step, else None."""
    try:
        manifest = read_json(storage, f"{name}/{layout.MANIFEST}")
    except (ValueError, FileNotFoundError):
        return None
    return manifest if layout.manifest_problem(manifest) is None else None


def check(storage: Storage, name: str, objects: dict[str, int]) -> tuple[str | None, dict[str, Any] | None]:
    """(None, manifest) when step `name` has a readable manifest whose every object is listed with its
    size; else (the reason it is not usable, None). Checksums need the bytes: see validate."""
    if f"{name}/{layout.MANIFEST}" not in objects:
        return "no manifest (save did not finish)", None
    try:
        manifest = read_json(storage, f"{name}/{layout.MANIFEST}")
    except (ValueError, FileNotFoundError):
        return "unreadable manifest", None
    unsafe = layout.manifest_problem(manifest)  # a name outside the step is never opened
    if unsafe:
        return unsafe, None
    for rel, want in sorted(manifest["files"].items()):
        have = objects.get(f"{name}/{rel}")
        if have is None:
            return f"{rel} is missing", None
        if have != want["size"]:
            return f"{rel} is truncated ({have} of {want['size']} bytes)", None
    return None, manifest


def validate(storage: Storage, name: str, objects: dict[str, int], cache: Path | None) -> tuple[str | None, dict[str, Any] | None]:
    """(None, manifest) when step `name` is committed and sound, else (why not, None). On a local
    storage the checksums and pickles are checked in place; elsewhere the step is downloaded into
    `cache` and checked there (it then lies verified in `cache`), or with no cache only its manifest
    and sizes are (a listing that downloads nothing)."""
    reason, manifest = check(storage, name, objects)
    if reason is not None or manifest is None:
        return reason, None
    if storage.local_root is not None:
        folder = storage.local_root / name
        for rel, want in sorted(manifest["files"].items()):
            if sha256_of(folder / rel) != want["sha256"]:
                return f"{rel} is corrupt (checksum mismatch)", None
        from .safe_load import check_folder  # torch only here: listing a folder of bad steps stays light

        reason = check_folder(folder)  # a manifest proves nothing against whoever could also rewrite it
    elif cache is not None:
        reason = fetch(storage, name, cache, manifest)
        if reason is not None:
            shutil.rmtree(cache, ignore_errors=True)
    return (reason, None) if reason else (None, manifest)


def fetch(storage: Storage, name: str, dest: Path, manifest: dict[str, Any], want: Callable[[str], bool] | None = None) -> str | None:
    """Make `dest` hold step `name`'s manifest and the files `want` admits (default all), each
    verified against the manifest's size and sha256; None when they are sound, else why not.

    `dest` is one folder per node (the ranks of a node share it): a file a rank of this node already
    downloaded and verified (dest/.verified) is not fetched again, and a flock on dest/.lock keeps two
    ranks from downloading the same file at once, so a node downloads each file once. Files are
    downloaded under a temporary name and renamed once verified. Nothing is written before every name
    in the manifest is known to stay inside `dest`. Pickles are then checked as in any local step
    folder (safe_load.check_folder: every *.pt here, and dcp/'s byte items when the step is whole)."""
    unsafe = layout.manifest_problem(manifest)
    if unsafe:
        return unsafe
    dest.mkdir(parents=True, exist_ok=True)
    files = manifest["files"]
    names = [n for n in sorted(files) if want is None or want(n)]
    with _node_lock(dest):
        verified = _read_verified(dest)
        todo = [n for n in names if verified.get(n) != files[n]["sha256"] or not (dest / n).is_file()]
        if todo:  # what is about to be replaced is vouched for by nothing until verified again
            for n in todo:
                verified.pop(n, None)
                (dest / n).unlink(missing_ok=True)
            _write_json(dest / VERIFIED, verified)
        tag = f".{os.getpid()}.part"  # a download of its own per process, even where flock does not work

        def get(n: str) -> str | None:
            return _download(storage, name, dest, n, files[n], tag)

        with ThreadPoolExecutor(DOWNLOADS, thread_name_prefix="ddp_kit-ckpt-get") as pool:
            results = dict(zip(todo, pool.map(get, todo)))
        errors: list[str] = [r for r in results.values() if r]
        verified.update({n: files[n]["sha256"] for n, r in results.items() if r is None})
        if _read_local_json(dest / layout.MANIFEST) != manifest:  # readers of this folder read it unlocked: whole
            _write_json(dest / layout.MANIFEST, manifest)
        _write_json(dest / VERIFIED, verified)
    if errors:
        return errors[0]
    from .safe_load import check_folder  # torch only here

    problem: str | None = check_folder(dest, dcp=want is None)
    return problem


VERIFIED = ".verified"  # in a node's download folder: {file: sha256} of the files verified there
_LOCK = ".lock"


def _download(storage: Storage, name: str, dest: Path, n: str, entry: dict[str, Any], tag: str) -> str | None:
    """fetch's download of file `n` of step `name` into `dest`, under a temporary name (`tag`) until
    it matches `entry` (the manifest's size and sha256); None once it is in place, else why not."""
    part = dest / f"{n}{tag}"
    try:
        part.parent.mkdir(parents=True, exist_ok=True)
        storage.get(f"{name}/{n}", part)
        size, sha = part.stat().st_size, sha256_of(part)
        if size != entry["size"]:
            return f"{n} is truncated ({size} of {entry['size']} bytes)"
        if sha != entry["sha256"]:
            return f"{n} is corrupt (checksum mismatch)"
        os.replace(part, dest / n)
    except FileNotFoundError:
        return f"{n} is missing"
    except OSError as exc:  # a name the local disk cannot hold, a full disk: this step is not usable here
        from .store_fs import unreachable
        if unreachable(exc):  # the store did not answer: nothing is wrong with this step (the caller's verdict)
            raise
        return f"{n} cannot be downloaded ({type(exc).__name__}: {exc.strerror or exc})"
    finally:
        part.unlink(missing_ok=True)
    return None


@contextmanager
def _node_lock(dest: Path) -> Iterator[None]:
    """The node's ranks one at a time in `dest`. Where the file system has no flock (TMPDIR on a
    network file system), downloads go on unlocked: each into a name of its own, renamed whole."""
    fd = os.open(dest / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
        yield
    finally:
        os.close(fd)  # closing drops the flock


def _read_verified(dest: Path) -> dict[str, str]:
    found = _read_local_json(dest / VERIFIED)
    return found if isinstance(found, dict) else {}


def _read_local_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def list_checkpoints(storage: Storage) -> list[tuple[int, str, str | None, int, Any]]:
    """(step, where, reason-if-invalid, bytes, world size) for every step, newest first. A local step
    is checked whole (checksums, pickles); elsewhere only the manifest and the listed sizes are:
    checksums need a download (validate with a cache; export does it)."""
    objs = objects(storage)
    rows = []
    for step, rels in sorted(by_step(objs).items(), reverse=True):
        name = layout.step_name(step)
        reason, manifest = validate(storage, name, objs, None)
        rows.append((step, storage.locate(name), reason, sum(objs[r] for r in rels),
                     manifest.get("world_size", "?") if manifest else "?"))
    return rows


# ---- resume ------------------------------------------------------------------------------------------

def _shown(storage: Storage, name: str) -> str:
    """How resume's warning names a step: by its name in a folder, by its URL on a store."""
    return name if storage.local_root is not None else storage.locate(name)


def choose(storage: Storage, resume: str, warn: Callable[[str], None], cache: Path | None) -> tuple[str, int] | None:
    """resume=auto: the step `latest` names, once validated; only when it is damaged the newest valid
    one below it. Steps above `latest` belong to a run that was abandoned (`--resume never`, or a
    resume from an older step) and are never chosen. Otherwise `resume` names a step: a URL
    (<location>/step_<N>, here or elsewhere on the same storage) or a local step folder. Returns
    (where the step is, its step number); a step not local lies verified in `cache`/step_<N>."""
    if resume == "never":
        return None
    if resume != "auto":
        return _named(storage, resume, cache)
    objs = objects(storage)
    latest = read_latest(storage)
    for step in sorted(by_step(objs), reverse=True):
        if latest is not None and step > latest:
            continue
        name = layout.step_name(step)
        reason, _ = validate(storage, name, objs, _under(cache, name))
        if reason is None:
            return storage.locate(name), step
        warn(f"checkpoint {_shown(storage, name)} is not usable ({reason}); falling back to an older one")
    return None


def _under(cache: Path | None, name: str) -> Path | None:
    return cache / name if cache is not None else None


def _named(storage: Storage, resume: str, cache: Path | None) -> tuple[str, int]:
    url = resume.rstrip("/")
    parent, _, name = url.rpartition("/")
    there = storage.sibling(parent) if "://" in resume else None
    if there is None:  # a step folder on this machine, wherever it is
        return _named_folder(Path(resume), cache)
    hint = f"pick one from `python -m ddp_kit.checkpoint list {storage.location}`, or use resume auto"
    step = layout.step_of(name)
    if step is None:
        raise UserError(f"resume {resume!r} does not name a step (<location>/step_<N>)", hint)
    reason, _ = validate(there, name, objects(there), _under(cache, name))
    if reason:
        raise UserError(f"checkpoint {url!r} cannot be resumed: {reason}", hint)
    return url, step


def _named_folder(path: Path, cache: Path | None) -> tuple[str, int]:
    from .storage_registry import open_storage

    if not path.exists():
        raise UserError(f"checkpoint {str(path)!r} does not exist",
                        "pick one from `python -m ddp_kit.checkpoint list RUN_DIR`, or use resume auto")
    there = open_storage(str(path.parent))
    reason, _ = validate(there, path.name, there.listing(path.name), _under(cache, path.name))
    if reason:
        raise UserError(f"checkpoint {str(path)!r} cannot be resumed: {reason}",
                        "pick a valid one from `python -m ddp_kit.checkpoint list RUN_DIR`, or use resume auto")
    return str(path), int(read_json(there, f"{path.name}/{layout.META}")["step"])


# ---- the commit, pruning, archiving ------------------------------------------------------------------

def staging_name(storage: Storage, step: int) -> str:
    """Where step `step`'s files are written before its commit: .tmp_step_<N> where the storage can
    rename a folder into place, else step_<N> itself (its manifest, written last, is the commit)."""
    return layout.tmp_name(step) if storage.can_rename else layout.step_name(step)


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def commit(storage: Storage, step: int, manifest: dict[str, Any], attempt: Attempt = _now) -> None:
    """Commit step `step`, every file the manifest names already written and durable under
    staging_name: the order of writes in this module's docstring (prune is the caller's next call).
    `attempt` runs each write (a store's retries); it raises when one fails, and the step is then
    not committed."""
    name, staged = layout.step_name(step), staging_name(storage, step)
    attempt(lambda: point_latest(storage, name), storage.locate(layout.LATEST))
    body = manifest_bytes(manifest)

    def write_manifest() -> None:
        with storage.open_write(f"{staged}/{layout.MANIFEST}") as fh:
            fh.write(body)

    attempt(write_manifest, storage.locate(f"{staged}/{layout.MANIFEST}"))
    if staged == name:
        return
    if any(n.startswith(layout.DCP + "/") for n in manifest["files"]):
        storage.sync(f"{staged}/{layout.DCP}")
    storage.sync(staged)
    trash = layout.trash_name(step)
    replaced = bool(storage.listing(name))  # the same step again (after a resume from it): moved aside
    if replaced:
        storage.remove([trash])
        storage.rename(name, trash)
    storage.rename(staged, name)
    storage.sync()
    if replaced:
        storage.remove([trash])


def prune(storage: Storage, newest: int, keep_last: int) -> list[int]:
    """Remove a killed or failed save's leftovers (.tmp_ and .trash_ folders, step prefixes without a
    manifest, objects a manifest does not name, startup probes), and the committed steps up to
    `newest` beyond the newest `keep_last` (0: keep all) that the newest one's meta does not spare
    (spared.py: the kept-best ones, the newest at or before the last agreed step; its meta unreadable:
    none this time). Nothing above `newest` is touched: a
    complete step there is an abandoned run's (archive's), and a prefix without a manifest there may
    be an upload in flight. Returns the committed steps removed."""
    objs = objects(storage)
    steps = by_step(objs)
    done = set(committed(objs))
    orphans = [s for s in steps if s not in done and s <= newest]
    kept = sorted((s for s in done if s <= newest), reverse=True)
    doomed = kept[keep_last:] if keep_last >= 1 else []
    if doomed:  # read only where a step would go: one small read of the newest meta.json, keep_best on or off
        spare = _spared(storage, kept[0], kept)
        doomed = [s for s in doomed if spare is not None and s not in spare]
    leftovers = sorted({rel.split("/", 1)[0] for rel in objs if "/" in rel and
                        rel.startswith((layout.TRASH_PREFIX, layout.TMP_PREFIX + layout.STEP_PREFIX))})
    storage.remove(leftovers + [layout.step_name(s) for s in orphans + doomed])
    extras = [r for r in objs if r.startswith(layout.PROBE_PREFIX)]
    for s in (kept[:keep_last] if keep_last >= 1 else kept[:1]):  # older ones were cleaned at their own commit
        manifest = read_manifest(storage, layout.step_name(s))
        if manifest is not None:
            named = {f"{layout.step_name(s)}/{n}" for n in manifest["files"]} | {f"{layout.step_name(s)}/{layout.MANIFEST}"}
            extras += [r for r in steps[s] if r not in named]
    if extras:
        storage.remove(extras)
    return doomed


def _spared(storage: Storage, newest: int, committed: list[int]) -> set[int] | None:
    """The steps step `newest`'s meta names to keep beyond keep_last (spared.py); None when it cannot be read."""
    try:
        return spared(read_json(storage, f"{layout.step_name(newest)}/{layout.META}"), committed)
    except (OSError, ValueError):
        return None


def archive_abandoned(storage: Storage, keep_upto: int | None, into: Storage) -> list[int]:
    """Move every committed step above `keep_upto` (all of them when None: a fresh start, or a resume
    from elsewhere) to `into`/<time>/, with `latest` naming `keep_upto` (or removed) before anything
    moves, so that a crash half-way never resumes the abandoned run. Nothing is deleted: a wrong
    `--resume never` is undone by moving the steps back (a crash half-way on a storage without
    rename leaves a step in both places)."""
    objs = objects(storage)
    moved = sorted(s for s in committed(objs) if keep_upto is None or s > keep_upto)
    if keep_upto is None:
        storage.remove([layout.LATEST])
    elif read_latest(storage) != keep_upto:
        point_latest(storage, layout.step_name(keep_upto))
    if moved:
        stamp = layout.archive_stamp()
        for s in moved:
            storage.move_to(layout.step_name(s), into, f"{stamp}/{layout.step_name(s)}")
        storage.sync()
    return moved

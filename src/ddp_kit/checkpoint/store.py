"""A checkpoint location on an object store (any fsspec file system), read and rearranged without a
process group: its objects and steps, which steps are committed and valid (manifest, sizes against
a listing, then checksums of a download into a local cache), which one `latest` names, which one a
run resumes from, pruning a killed save's objects and old steps, and moving an abandoned run's steps
aside. The object store twin of folder.py; used by object_store.py and `python -m ddp_kit.checkpoint`.

There is no rename on a store: a step is committed by writing `latest`, then its manifest, after every
object it names (the folder backend's order). A step prefix without a manifest is a killed or failed
save's, never read.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError
from . import folder, layout
from .durable import sha256_of
from .store_fs import Store

DOWNLOADS = 8  # objects fetched at once


def listing(store: Store) -> dict[str, int]:
    """{path relative to the location: size} of every object under it, archive/ and the lease excluded,
    listed now (not from the client's listing cache: other ranks and processes write here too)."""
    store.fs.invalidate_cache(store.root)
    try:
        found = store.fs.find(store.root, detail=True)
    except FileNotFoundError:
        return {}
    out = {}
    for path, info in found.items():
        rel = store.rel(path)
        if rel is None or rel.endswith("/") or info.get("type") == "directory":
            continue
        if rel.split("/", 1)[0] != layout.ARCHIVE and not rel.startswith(layout.LEASE_PREFIX):
            out[rel] = int(info.get("size") or 0)
    return out


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
    """The steps whose manifest is present, newest first (valid or not: see check and fetch)."""
    return sorted((s for s in by_step(objects) if f"{layout.step_name(s)}/{layout.MANIFEST}" in objects), reverse=True)


def read_latest(store: Store) -> int | None:
    """The step `latest` names; None when there is no (readable) `latest`."""
    try:
        return layout.step_of(store.fs.cat_file(store.path(layout.LATEST)).decode(errors="replace").strip())
    except FileNotFoundError:
        return None


def point_latest(store: Store, name: str) -> None:
    """One PUT: a reader sees the old pointer or the new one, never half of one."""
    store.fs.pipe_file(store.path(layout.LATEST), (name + "\n").encode())


def latest_name(store: Store) -> str:
    step = read_latest(store)
    return layout.step_name(step) if step is not None else "none yet"


def read_manifest(store: Store, step: int) -> dict | None:
    """Step `step`'s manifest when it is readable and names only files inside the step, else None."""
    try:
        manifest = json.loads(store.fs.cat_file(store.path(layout.step_name(step), layout.MANIFEST)))
    except (ValueError, FileNotFoundError):
        return None
    return manifest if layout.manifest_problem(manifest) is None else None


def check(store: Store, step: int, objects: dict[str, int]) -> tuple[str | None, dict | None]:
    """(None, manifest) when step `step` has a readable manifest whose every object is listed with its
    size; else (the reason it is not usable, None). Checksums need the bytes: see fetch."""
    name = layout.step_name(step)
    if f"{name}/{layout.MANIFEST}" not in objects:
        return "no manifest (save did not finish)", None
    try:
        manifest = json.loads(store.fs.cat_file(store.path(name, layout.MANIFEST)))
    except (ValueError, FileNotFoundError):
        return "unreadable manifest", None
    unsafe = layout.manifest_problem(manifest)
    if unsafe:
        return unsafe, None
    for rel, want in sorted(manifest["files"].items()):
        have = objects.get(f"{name}/{rel}")
        if have is None:
            return f"{rel} is missing", None
        if have != want["size"]:
            return f"{rel} is truncated ({have} of {want['size']} bytes)", None
    return None, manifest


def fetch(store: Store, step_url: str, dest: Path, manifest: dict, want: Callable[[str], bool] | None = None) -> str | None:
    """Make `dest` hold step `step_url`'s manifest and the files `want` admits (default all), each
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
    src = store.fs._strip_protocol(step_url)
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
            part = dest / f"{n}{tag}"
            try:
                part.parent.mkdir(parents=True, exist_ok=True)
                store.fs.get_file(f"{src}/{n}", str(part))
                size, sha = part.stat().st_size, sha256_of(part)
                if size != files[n]["size"]:
                    return f"{n} is truncated ({size} of {files[n]['size']} bytes)"
                if sha != files[n]["sha256"]:
                    return f"{n} is corrupt (checksum mismatch)"
                os.replace(part, dest / n)
            except FileNotFoundError:
                return f"{n} is missing"
            except OSError as exc:  # a name the local disk cannot hold, a full disk: this step is not usable here
                return f"{n} cannot be downloaded ({type(exc).__name__}: {exc.strerror or exc})"
            finally:
                part.unlink(missing_ok=True)
            return None

        with ThreadPoolExecutor(DOWNLOADS, thread_name_prefix="ddp_kit-ckpt-get") as pool:
            results = dict(zip(todo, pool.map(get, todo)))
        errors = [r for r in results.values() if r]
        verified.update({n: files[n]["sha256"] for n, r in results.items() if r is None})
        if _read_json(dest / layout.MANIFEST) != manifest:  # readers of this folder read it unlocked: whole
            _write_json(dest / layout.MANIFEST, manifest)
        _write_json(dest / VERIFIED, verified)
    if errors:
        return errors[0]
    from .safe_load import check_folder  # torch only here

    return check_folder(dest, dcp=want is None)


VERIFIED = ".verified"  # in a node's download folder: {file: sha256} of the files verified there
_LOCK = ".lock"


@contextmanager
def _node_lock(dest: Path):
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
    found = _read_json(dest / VERIFIED)
    return found if isinstance(found, dict) else {}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def validate(store: Store, step: int, objects: dict[str, int], cache: Path) -> str | None:
    """None when step `step` is committed and sound (then it lies verified in `cache`), else why not."""
    reason, manifest = check(store, step, objects)
    if reason is None:
        reason = fetch(store, store.url_of(layout.step_name(step)), cache, manifest)
    if reason is not None:
        shutil.rmtree(cache, ignore_errors=True)
    return reason


def list_checkpoints(store: Store) -> list[tuple[int, str, str | None, int, int | None]]:
    """(step, URL, reason-if-invalid, bytes, world size) for every step prefix, newest first. Only the
    manifest and the listed sizes are checked: checksums need a download (fetch; export does it)."""
    objects = listing(store)
    rows = []
    for step, rels in sorted(by_step(objects).items(), reverse=True):
        reason, manifest = check(store, step, objects)
        rows.append((step, store.url_of(layout.step_name(step)), reason, sum(objects[r] for r in rels),
                     manifest.get("world_size") if manifest else None))
    return rows


def choose(store: Store, resume: str, warn: Callable[[str], None], cache: Path) -> tuple[str, int] | None:
    """As folder.choose, on a store: resume=auto takes the step `latest` names once verified; only when
    it is damaged the newest valid one below it (steps above `latest` are an abandoned run's).
    An explicit step is a URL (<location>/step_<N>, here or elsewhere on the same store) or a local
    step folder. The chosen step lies verified in `cache`/step_<N>."""
    if resume == "never":
        return None
    if resume != "auto":
        return _named(store, resume, cache)
    objects = listing(store)
    latest = read_latest(store)
    for step in sorted(by_step(objects), reverse=True):
        if latest is not None and step > latest:
            continue
        name = layout.step_name(step)
        reason = validate(store, step, objects, cache / name)
        if reason is None:
            return store.url_of(name), step
        warn(f"checkpoint {store.url_of(name)} is not usable ({reason}); falling back to an older one")
    return None


def _named(store: Store, resume: str, cache: Path) -> tuple[str, int]:
    hint = f"pick one from `python -m ddp_kit.checkpoint list {store.url}`, or use resume auto"
    if "://" not in resume:
        return folder.choose(Path(resume), resume, lambda _: None)  # a local step folder, refused there if bad
    url = resume.rstrip("/")
    parent, _, name = url.rpartition("/")
    step = layout.step_of(name)
    if step is None:
        raise UserError(f"resume {resume!r} does not name a step (<location>/step_<N>)", hint)
    there = Store(store.fs, store.fs._strip_protocol(parent).rstrip("/"), parent)
    reason = validate(there, step, listing(there), cache / name)
    if reason:
        raise UserError(f"checkpoint {url!r} cannot be resumed: {reason}", hint)
    return url, step


def remove_steps(store: Store, steps: list[int]) -> None:
    if steps:
        store.fs.rm([store.path(layout.step_name(s)) for s in steps], recursive=True)


def prune(store: Store, newest: int, keep_last: int) -> list[int]:
    """Remove a killed or failed save's objects (step prefixes without a manifest, objects a manifest
    does not name, startup probes), and the committed steps up to `newest` beyond the newest
    `keep_last` (0: keep all). Nothing above `newest` is touched: a complete step there is an abandoned
    run's (archive's), and a prefix without a manifest there may be an upload in flight.
    Returns the committed steps removed."""
    objects = listing(store)
    steps = by_step(objects)
    done = set(committed(objects))
    orphans = [s for s in steps if s not in done and s <= newest]
    kept = sorted((s for s in done if s <= newest), reverse=True)
    doomed = kept[keep_last:] if keep_last >= 1 else []
    remove_steps(store, orphans + doomed)
    extras = [store.path(r) for r in objects if r.startswith(layout.PROBE_PREFIX)]
    for s in (kept[:keep_last] if keep_last >= 1 else kept[:1]):  # older ones were cleaned at their own commit
        manifest = read_manifest(store, s)
        if manifest is not None:
            named = {f"{layout.step_name(s)}/{n}" for n in manifest["files"]} | {f"{layout.step_name(s)}/{layout.MANIFEST}"}
            extras += [store.path(r) for r in steps[s] if r not in named]
    if extras:
        store.fs.rm(extras)
    return doomed


def archive_abandoned(store: Store, keep_upto: int | None, into: Store) -> list[int]:
    """As folder.archive_abandoned, on a store: every committed step above `keep_upto` (all when None)
    is copied to `into`/<time>/ and then deleted, with `latest` naming `keep_upto` (or removed) before
    anything moves. Nothing is lost: a crash half-way leaves a step in both places."""
    objects = listing(store)
    moved = sorted(s for s in committed(objects) if keep_upto is None or s > keep_upto)
    if keep_upto is None:
        try:
            store.fs.rm_file(store.path(layout.LATEST))
        except FileNotFoundError:
            pass
    elif read_latest(store) != keep_upto:
        point_latest(store, layout.step_name(keep_upto))
    if moved:
        dest = into.path(layout.archive_stamp())
        steps = by_step(objects)
        for s in moved:
            for rel in steps[s]:
                store.fs.copy(store.path(rel), f"{dest}/{rel}")
        remove_steps(store, moved)
    return moved

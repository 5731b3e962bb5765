"""Every name under a run's checkpoint area, and nothing else: no reads, no writes.

    <root>/step_<N>/             one committed step (STEP_PREFIX + N)
        manifest.json            written last: every file's size and sha256; the step counts only with it
        meta.json                step, world size, strategy, config and its hash, versions
        model.pt                 the unwrapped model's state_dict (exportable as is), when one is "model"
        train_state.pt           optimizer, scheduler, scaler, loop and data position
        rank<R>.pt               rank R's own small state (RNG)
        dcp/                     strategy fsdp: torch.distributed.checkpoint's shards (__<R>_<i>.distcp)
        dcp/.metadata            ... and DCP's index of them (rank 0)
    <root>/latest                the name of the newest committed step folder
    <root>/.latest.tmp           `latest` being replaced
    <root>/.tmp_step_<N>/        a save in progress (renamed to step_<N> at its commit)
    <root>/.trash_step_<N>/      a step being deleted (pruned or replaced)
    <archive>/<YYYYmmddTHHMMSS>/ the steps of an abandoned run, moved aside whole

On a storage without rename (an object store: store_fs.py) the same names are key prefixes under
the URL, with no .tmp_/.trash_ names (nothing is renamed): a step's objects without its manifest
are a killed or failed save's, removed by the next prune; and two more:
    <url>/archive/<time>/step_<N>/  ARCHIVE: an abandoned run's steps, copied there and deleted
    <url>/.probe.<token>         PROBE_PREFIX: written at startup by rank 0, read by every rank, deleted
    <url>/.lease.<generation>    LEASE_PREFIX: the one job writing here (checkpoint/lease.py)

Every module that reads or writes these (steps.py, the storages, the backends, the CLI, safe
loading) spells them through this one. The names on disk never change: checkpoints written by any
earlier ddp_kit still load.
A backend without folders (an object store) uses the same names as key prefixes.
"""
from __future__ import annotations

import time

RUN_CHECKPOINTS = "checkpoints"  # run_dir/checkpoints: where a run keeps its steps without a ckpt_dir
STEP_PREFIX = "step_"
MANIFEST = "manifest.json"
META = "meta.json"
MODEL = "model.pt"
TRAIN_STATE = "train_state.pt"
DCP = "dcp"
DCP_METADATA = ".metadata"
LATEST = "latest"
LATEST_TMP = ".latest.tmp"
TMP_PREFIX = ".tmp_"
TRASH_PREFIX = ".trash_"
TORCH_FILES = "*.pt"  # every file of a step folder that torch.load reads (safe_load checks each)
ARCHIVE_STAMP = "%Y%m%dT%H%M%S"
ARCHIVE = "archive"  # an object store's archive prefix, under its URL
PROBE_PREFIX = ".probe."
LEASE_PREFIX = ".lease."  # <url>/.lease.<generation>: which job writes here (lease.py)


def member_problem(name: object) -> str | None:
    """Why `name` cannot be a file of a step (a manifest's key), or None when it can: a file of the
    step or of its dcp/ folder (`model.pt`, `dcp/__0_0.distcp`). Whoever can write a bucket or a
    folder can write a manifest, and a name like `../../x` or `/x` would make resume and export write
    or read outside the step's folder; such a step is invalid like any other damaged one."""
    if not isinstance(name, str) or not name:
        return "names an empty file"
    parts = name.split("/")
    if (len(parts) > 2 or (len(parts) == 2 and parts[0] != DCP) or any(p in ("", ".", "..") for p in parts)
            or "\\" in name or not name.isprintable() or name in (DCP, MANIFEST) or len(name.encode()) > 200
            or parts[-1].startswith((".lock", ".verified")) or parts[-1].endswith((".part", ".tmp"))):
        # the last: a reader's own bookkeeping beside the files (steps.fetch's download folder)
        return f"names {name[:80]!r}, which is not a file inside the step"
    return None


def manifest_problem(manifest: object) -> str | None:
    """Why a manifest read from storage cannot be trusted to name files (see member_problem), or None."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return "unreadable manifest"
    for name, want in files.items():
        why = member_problem(name)
        if why:
            return f"unsafe manifest: it {why}"
        if not (isinstance(want, dict) and isinstance(want.get("size"), int) and isinstance(want.get("sha256"), str)):
            return f"unreadable manifest (the entry of {str(name)[:80]!r} has no size and sha256)"
    return None


def step_name(step: int) -> str:
    """The folder (or key prefix) of step `step`: step_<N>."""
    return f"{STEP_PREFIX}{step}"


def step_of(name: str) -> int | None:
    """The step a folder name stands for (step_<N> -> N); None for any other name."""
    digits = name[len(STEP_PREFIX):] if name.startswith(STEP_PREFIX) else ""
    return int(digits) if digits.isascii() and digits.isdigit() else None


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def rank_of(name: str) -> int | None:
    """The rank whose own file `name` is (rank<R>.pt -> R); None for any other name."""
    digits = name[4:-3] if name.startswith("rank") and name.endswith(".pt") else ""
    return int(digits) if digits.isascii() and digits.isdigit() else None


def tmp_name(step: int) -> str:
    """Where step `step` is written before its commit."""
    return TMP_PREFIX + step_name(step)


def trash_name(step: int) -> str:
    """Where a step folder goes to be deleted (renamed first: the deletion may take its time)."""
    return TRASH_PREFIX + step_name(step)


# Leftovers of a process that exited mid-save or mid-delete: removed by the next prune.
LEFTOVERS = (TRASH_PREFIX + "*", TMP_PREFIX + STEP_PREFIX + "*")


def dcp_file(name: str) -> str:
    """A DCP file's name in the manifest, relative to the step folder: dcp/<name>."""
    return f"{DCP}/{name}"


def dcp_shards(rank: int) -> str:
    """The glob of rank `rank`'s shard files in dcp/ (DCP's own naming: __<rank>_<i>.distcp)."""
    return f"__{rank}_*.distcp"


def archive_stamp(when: float | None = None) -> str:
    """The name of one archive folder: the local time it was made."""
    return time.strftime(ARCHIVE_STAMP, time.localtime(when))

"""`python -m ddp_kit.checkpoint`: list a run's checkpoints with their validity; export model weights.

    python -m ddp_kit.checkpoint list RUN_DIR|URL
    python -m ddp_kit.checkpoint export RUN_DIR|URL --out model.pt [--step N|latest] [--name model]
    python -m ddp_kit.checkpoint export RUN_DIR|URL --out model.safetensors [--format safetensors]

RUN_DIR is a run folder (its checkpoints/), a checkpoints folder, or a run's ckpt_dir URL
(s3://bucket/prefix, gs://, az://, file:///path). Either is opened through the storage registry
(storage_registry.open_storage) and read through the same code as the run (steps.py), with no process group.
Where the storage is not local (a URL), `list` checks each step's manifest and object sizes, and
`export` downloads the step and verifies every checksum first.
`--format safetensors` (the default for an --out ending in .safetensors) writes the whole model
without pickle, the checkpoint's step, strategy and config hash in its header (weights.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..exit_codes import EXIT_USER_ERROR
from . import layout, steps, weights
from .storage import Storage
from .storage_registry import open_storage, scheme_of

LIST_HINT = "see `python -m ddp_kit.checkpoint list RUN_DIR`"
FORMATS = ("pt", "safetensors")


def _run_dir(run_dir: str) -> Path:
    p = Path(str(run_dir))
    if not p.exists():  # said plainly: "no checkpoints" would suggest the run lost them
        raise UserError(f"RUN_DIR {str(p)!r} does not exist", "pass the run_dir of a run that saved checkpoints")
    if not p.is_dir():
        raise UserError(f"RUN_DIR {str(p)!r} is not a folder", "pass the run_dir of a run that saved checkpoints")
    return p


def _root(run_dir: str) -> Path:
    p = _run_dir(run_dir)
    ckpts = p / layout.RUN_CHECKPOINTS
    return ckpts if ckpts.is_dir() else p


def _out_path(out: object) -> Path:
    """Refuse an --out that cannot be written before anything is loaded."""
    if out is None or isinstance(out, bool):  # fire passes True for a bare `--out`
        raise UserError("--out needs a file path", "e.g. --out model.pt")
    p = Path(str(out))
    folder = p.parent
    if not folder.exists():
        raise UserError(f"the folder of --out, {str(folder)!r}, does not exist", f"create it first: mkdir -p {folder}")
    if not folder.is_dir():
        raise UserError(f"--out {str(p)!r}: {str(folder)!r} is a file, not a folder", "pass --out inside an existing folder")
    if p.is_dir():
        raise UserError(f"--out {str(p)!r} is a folder", f"name a file, e.g. --out {p / 'model.pt'}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"cannot write into {str(folder)!r} (permission denied)", "pass --out in a folder you can write to")
    return p


def _step(step: object) -> int | str | None:
    if step is None:
        return None
    if step == "latest":
        return "latest"
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    if isinstance(step, float) and step.is_integer():  # fire reads --step 1e3 as 1000.0
        return int(step)
    if isinstance(step, str) and layout.step_of(step) is not None:  # the folder's name, as `list` shows
        return layout.step_of(step)
    raise UserError(f"--step expects a step number, step_N or 'latest'; got {step!r}", f"e.g. --step latest; {LIST_HINT}")


def _location(run_dir: str) -> str:
    """The checkpoints location RUN_DIR names: a URL as it is; a folder's checkpoints/ when it has one."""
    return run_dir if scheme_of(run_dir) else str(_root(run_dir))


def _list_hint(run_dir: str, storage: Storage) -> str:
    return f"see `python -m ddp_kit.checkpoint list {storage.location}`" if scheme_of(run_dir) else LIST_HINT


def _refusal(storage: Storage, exc: Exception) -> Exception:
    """A store's error in one line (refusal: missing bucket, credentials...); a local folder's as it is."""
    if storage.local_root is not None or isinstance(exc, UserError):
        return exc
    from .store_fs import refusal

    return refusal(storage.location, exc, "read")


def list_(run_dir: str) -> None:
    """Print every checkpoint of RUN_DIR (or a ckpt_dir URL), newest first, with its validity."""
    arg = str(run_dir)
    storage = open_storage(_location(arg))
    try:
        rows, latest = steps.list_checkpoints(storage), steps.read_latest(storage)
    except Exception as exc:
        raise _refusal(storage, exc) from None
    if not rows:
        raise UserError(f"no checkpoints under {storage.location!r}",
                        f"pass the {'ckpt_dir' if scheme_of(arg) else 'run_dir'} of a run that saved some")
    best = _best_marks(storage, rows, latest)
    print(f"{'step':>8}  {'status':<7} {'world':>5}  {'size':>10}  {'url' if scheme_of(arg) else 'path'}")
    for step, at, reason, size, world in rows:
        mark = (" (latest)" if step == latest else "") + (f"  {best[step]}" if step in best else "")
        print(f"{step:>8}  {'valid' if reason is None else 'INVALID':<7} {world if reason is None else '?':>5}  "
              f"{size:>10}  {at}{mark}" + (f"  -- {reason}" if reason else ""))


def _best_marks(storage: Storage, rows: list[tuple[int, str, str | None, int, Any]], latest: int | None) -> dict[int, str]:
    """{step: "best #1 eval.loss=0.1234"} for the kept-best steps (services/keep_best.py) that the newest valid
    step up to `latest` names in its meta, as the next prune reads them; {} where it names none."""
    newest = next((r[0] for r in rows if r[2] is None and (latest is None or r[0] <= latest)), None)
    try:
        meta = steps.read_json(storage, f"{layout.step_name(newest)}/{layout.META}") if newest is not None else {}
    except (OSError, ValueError):
        return {}
    monitor, best = steps.kept_best(meta)
    return {s: f"best #{i} {monitor}={v:.4f}" for i, (s, v) in enumerate(best, 1)}


def _format(format: str | None, dest: Path) -> str:
    """pt or safetensors: as given, else by the suffix of --out (.safetensors; anything else pt). A
    suffix that names the other format is refused: whoever receives the file goes by its name."""
    said = {weights.SUFFIX: "safetensors", ".pt": "pt", ".pth": "pt"}.get(dest.suffix.lower())
    if format is not None and format not in FORMATS:
        raise UserError(f"--format expects {' or '.join(FORMATS)}; got {format!r}", "e.g. --format safetensors")
    fmt = format or said or "pt"
    if said not in (None, fmt):
        raise UserError(f"--format {fmt} does not match --out {str(dest)!r}",
                        f"name the file {dest.with_suffix(weights.SUFFIX if fmt == 'safetensors' else '.pt').name}, "
                        "or drop --format")
    if fmt == "safetensors":
        weights.require()  # a missing package is said before anything is downloaded or assembled
    return fmt


def export(run_dir: str, out: str, step: int | str | None = None, name: str = "model", format: str | None = None) -> None:
    """Write the model weights of checkpoint STEP (default: newest valid; latest: the one `latest`
    names) as a plain state_dict file: torch.save (--format pt) or safetensors (--format safetensors,
    the default for --out *.safetensors). A sharded (strategy fsdp) checkpoint is assembled in this
    process; `name` picks another registered model of it (e.g. model_1). RUN_DIR may be a ckpt_dir URL."""
    arg = str(run_dir)
    given = None if scheme_of(arg) else _run_dir(arg)
    dest = _out_path(out)
    fmt = _format(format, dest)
    step = _step(step)
    if given is not None and ((given / layout.MANIFEST).exists() or (given / layout.MODEL).exists()):
        storage, chosen = open_storage(str(given.parent)), given.name  # RUN_DIR is a step folder
    else:
        storage, chosen = open_storage(_location(arg)), None
    with tempfile.TemporaryDirectory(prefix="ddp_kit-export-") as cache:
        try:
            picked = _pick(storage, arg, step, chosen, Path(cache))
        except Exception as exc:
            raise _refusal(storage, exc) from None
        local = storage.local_root / picked if storage.local_root is not None else Path(cache) / picked
        _write_export(local, dest, str(name), storage.locate(picked), fmt)


def _pick(storage: Storage, arg: str, step: int | str | None, chosen: str | None, cache: Path) -> str:
    """The step folder to export, verified (downloaded into `cache` where the storage is not local):
    `chosen`, the one `latest` names, step `step`, or the newest valid one (the damaged ones above it
    said, as resume says them)."""
    hint = _list_hint(arg, storage)
    if chosen is None and step == "latest":
        chosen = _latest(storage, hint)
    if chosen is not None:
        reason, _ = steps.validate(storage, chosen, storage.listing(chosen), cache / chosen)
        if reason:
            raise UserError(f"checkpoint {storage.locate(chosen)!r} is not valid: {reason}", f"export another step; {hint}")
        return chosen
    objects = steps.objects(storage)
    skipped: list[tuple[str, str]] = []
    for s in sorted((s for s in steps.by_step(objects) if step is None or s == step), reverse=True):
        name = layout.step_name(s)
        reason, _ = steps.validate(storage, name, objects, cache / name)
        if reason is None:
            for what, why in skipped:
                print(f"ddp_kit: warning: checkpoint {what} is not usable ({why}); exporting {name} instead",
                      file=sys.stderr, flush=True)
            return name
        skipped.append((name, reason))
    why = f" ({skipped[0][0]}: {skipped[0][1]})" if skipped else ""
    which = "" if step is None else f" at step {step}"
    raise UserError(f"no valid checkpoint{which} under {storage.location if scheme_of(arg) else arg!r}{why}", hint)


def _latest(storage: Storage, hint: str) -> str:
    """The step folder `latest` names; the save protocol points it before the step's commit."""
    where = storage.locate(layout.LATEST)
    try:
        name = storage.read_bytes(layout.LATEST).decode(errors="replace").strip()
    except FileNotFoundError:
        raise UserError(f"--step latest: there is no 'latest' {storage.object_word} under {storage.location!r}",
                        f"pass a step number; {hint}") from None
    except OSError as exc:
        raise UserError(f"--step latest: cannot read {where!r} ({exc.strerror or exc})", f"pass a step number; {hint}") from None
    if layout.step_of(name) is None:
        raise UserError(f"--step latest: {where!r} does not name a checkpoint (it holds {name[:40]!r})",
                        f"pass a step number; {hint}")
    if not storage.listing(name):
        raise UserError(f"--step latest: {where!r} names {name}, which does not exist", f"pass a step number; {hint}")
    return name


def _write_export(path: Path, dest: Path, name: str, shown: str | None = None, fmt: str = "pt") -> None:
    """Write object `name` of the checkpoint in `path` to `dest` (`shown`: what the message calls the step)."""
    import torch

    state = _read_object(path, name)
    if fmt == "safetensors":
        meta = json.loads((path / layout.META).read_text()) if (path / layout.META).is_file() else {}
        head = weights.save_weights(state, dest, weights.header(meta, name), what=f"{name!r} of {path.name}")
        shared = json.loads(head.get("shared", "{}"))
        note = f"; {len(shared)} sharing memory, each written whole: {', '.join(sorted(shared))[:200]}" if shared else ""
        print(f"exported {len(state)} tensors of {name!r} from {shown or path} to {dest} "
              f"(safetensors, step {head.get('step', '?')}{note})")
        return
    # Written beside the target and renamed: an interrupted export never leaves a truncated model.pt
    # where an inference job would pick it up.
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write --out {str(dest)!r} ({exc.strerror or exc})",
                        "pass --out in a folder you can write to, on a disk with free space") from None
    tensors = sum(1 for v in state.values() if hasattr(v, "shape"))
    print(f"exported {len(state)} entries ({tensors} tensors) of {name!r} from {shown or path} to {dest}")


def _read_object(path: Path, name: str) -> dict[str, Any]:
    """The saved object `name` of a checkpoint, whole: the model from model.pt, a sharded object
    (strategy fsdp) assembled from dcp/, anything else (an optimizer under DDP, a scheduler, a
    second replicated model) from train_state.pt."""
    import torch

    if name == "model" and (path / layout.MODEL).exists():
        return _state_dict(torch.load(path / layout.MODEL, map_location="cpu", weights_only=True), layout.MODEL, path)
    sharded = _dcp_names(path)
    if name in sharded:
        return _consolidate(path, name)
    shared = _state_dict(torch.load(path / layout.TRAIN_STATE, map_location="cpu", weights_only=True),
                         layout.TRAIN_STATE, path)
    if name in shared:
        return _state_dict(shared[name], f"{name!r} of {layout.TRAIN_STATE}", path)
    held = sorted(set(sharded) | set(shared) | ({"model"} if (path / layout.MODEL).exists() else set()))
    raise UserError(f"checkpoint {str(path)!r} holds no {name!r} (it holds: {', '.join(held)})",
                    f"pass --name with one of those; {LIST_HINT}")


def _dcp_names(path: Path) -> list[str]:
    if not (path / layout.DCP).is_dir():
        return []
    from .safe_load import read_dcp_metadata

    return sorted({k.split(".", 1)[0] for k in read_dcp_metadata(path / layout.DCP).state_dict_metadata})


def _consolidate(path: Path, name: str = "model") -> dict[str, Any]:
    """The whole `name` state dict of a sharded (strategy fsdp) checkpoint, read from its dcp/ folder
    in this one process: no GPU, no process group, any world size that wrote it."""
    import warnings

    # DCP's own whole-checkpoint reader, restricted to one key: it rebuilds nested entries too
    # (a module's _extra_state), which a template of plain tensors cannot.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from .safe_load import reader as safe_reader

    reader = safe_reader(path / layout.DCP)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore")
        return _state_dict(_load_state_dict_from_keys(keys={name}, storage_reader=reader)[name], f"{name!r} of dcp/", path)


def _state_dict(obj: object, what: str, path: Path) -> dict[str, Any]:
    """`obj` (read from checkpoint `path`: whoever can write the folder chose it) as the dict export writes,
    refused in one line when it is something else."""
    if not isinstance(obj, dict):
        raise UserError(f"checkpoint {str(path)!r}: {what} holds an object of type {type(obj).__name__}, not a state dict",
                        f"pass --name with a model or another state dict; {LIST_HINT}")
    return obj


def main() -> None:
    import fire

    try:
        fire.Fire({"list": list_, "export": export})
    except UserError as err:
        print(err.line(), file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)

"""A model's weights as a safetensors file: written by `python -m ddp_kit.checkpoint export --format
safetensors`, read back without unpickling anything, loaded into a model under any strategy.

    from ddp_kit.checkpoint import load_weights, read_weights, save_weights
    meta = load_weights(model, "model.safetensors")      # plain, DDP or FSDP model; every rank calls it
    state, meta = read_weights("model.safetensors")      # {name: CPU tensor}, {str: str}
    save_weights(run.full_state_dict(model), "model.safetensors", {"step": "100"})   # rank 0

The file is the unwrapped model's whole state_dict (the keys of your own module, no `module.` prefix,
whole tensors even from a sharded run) and a header of strings: format=pt (as Hugging Face writes it),
step, world_size, strategy, config_hash, and the ddp_kit and torch versions of the run. The run's
config itself is not copied in (it may name paths and whatever a script passed to `init`); its hash is.

Tensors that share memory (tied weights: an embedding also used as the output layer) are each
written whole, so every key of the state_dict is in the file and a plain `safetensors.torch.load_file`
+ `model.load_state_dict` works anywhere; the header's `shared` names them ({"key": "the key it
shares memory with"}) and they cost their bytes twice on disk. Only overlapping memory is shared:
disjoint views of one storage (a fused QKV weight split in three) are separate tensors. An entry that is not a tensor (a
module's `_extra_state`, an optimizer's nested state) is refused in one line: safetensors holds
tensors only.

safetensors is an optional dependency (`pip install 'ddp_kit[safetensors]'`), imported only here.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import UserError

SUFFIX = ".safetensors"
INSTALL = "pip install 'ddp_kit[safetensors]'"


def _safetensors() -> ModuleType:
    """safetensors.torch, or one line naming the extra that installs it."""
    try:
        import safetensors.torch
    except ImportError:
        raise UserError("the safetensors package is not installed", f"{INSTALL} (or pip install safetensors)") from None
    return safetensors


def require() -> None:
    """Refuse now, before any work, when safetensors is missing."""
    _safetensors()


def header(meta: Mapping[str, Any], name: str = "model") -> dict[str, str]:
    """The header of an export from a checkpoint's meta.json: strings only, as safetensors stores them."""
    out = {"format": "pt", "name": name}
    for key in ("step", "world_size", "strategy", "config_hash", "ddp_kit", "torch"):
        if meta.get(key) is not None:
            out[key] = str(meta[key])
    return out


def _plain(state: Mapping[str, Any], what: str) -> tuple[dict[str, Any], dict[str, str]]:
    """`state` as safetensors can write it: every value a dense, contiguous CPU tensor, and a tensor
    that shares memory with one before it copied ({key: the key it shares with})."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    shared: dict[str, str] = {}
    # (device, storage address) -> the byte ranges of that storage written so far, with their keys
    owners: dict[tuple[torch.device, int], list[tuple[int, int, str]]] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise UserError(f"{what} has a key {key!r} that is not a string: a safetensors file names tensors by strings",
                            "export it with --format pt")
        if not isinstance(value, torch.Tensor):
            raise UserError(f"{what} entry {key!r} is a {type(value).__name__}, not a tensor: a safetensors file holds "
                            "tensors only", "export it with --format pt (torch.save), or leave that entry out")
        if value.layout != torch.strided or hasattr(value, "to_local"):
            raise UserError(f"{what} entry {key!r} is a {'sharded (DTensor)' if hasattr(value, 'to_local') else 'sparse'} "
                            "tensor", "pass whole tensors: run.full_state_dict(model) gathers them")
        t = value.detach().to("cpu").contiguous()
        if t.numel():
            where = (t.device, t.untyped_storage().data_ptr())
            start = int(t.storage_offset()) * t.element_size()
            end = start + int(t.numel()) * t.element_size()  # contiguous: its bytes are this one range
            ranges = owners.setdefault(where, [])
            # Tied only where the memory overlaps: the views of a fused QKV split are separate tensors.
            first = next((k for s, e, k in ranges if s < end and start < e), None)
            if first is not None:
                shared[key] = first
            ranges.append((start, end, key))
            if len(ranges) > 1:  # safetensors refuses two names in one storage; each gets its own copy
                t = t.clone()
        tensors[key] = t
    return tensors, shared


def save_weights(state: Mapping[str, Any], path: str | os.PathLike[str], metadata: Mapping[str, Any] | None = None,
                 what: str = "the state_dict") -> dict[str, str]:
    """Write `state` (a plain state_dict of whole tensors) to `path` as safetensors, with `metadata`
    (values turned into strings) in the header; returns the header written. Written beside `path` and
    renamed, so an interrupted save never leaves a truncated file under its name."""
    st = _safetensors()
    tensors, shared = _plain(state, what)
    head = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    if shared:
        head["shared"] = json.dumps(shared, sort_keys=True)
    dest = Path(path)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb"):  # the mode a new file gets here (the umask's), which safetensors' 0600 temp lacks
            pass
        mode = tmp.stat().st_mode & 0o777
        st.torch.save_file(tensors, str(tmp), metadata=head)
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except (OSError, st.SafetensorError) as exc:  # safetensors says an I/O error in its own type
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        why = getattr(exc, "strerror", None) or str(exc).splitlines()[0][:160]
        raise UserError(f"cannot write {str(dest)!r} ({why})",
                        "write it in a folder you can write to, on a disk with free space") from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    return head


def read_weights(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """({name: CPU tensor}, header) of safetensors file `path`. Nothing is unpickled: safetensors reads
    a JSON header and raw bytes. A missing or unreadable file, or one that is not safetensors (a
    torch.save pickle), is one line."""
    st = _safetensors()
    p = Path(path)
    if not p.is_file():
        raise UserError(f"weights file {str(p)!r} does not exist" if not p.exists() else f"{str(p)!r} is not a file",
                        "pass the file `python -m ddp_kit.checkpoint export RUN --format safetensors --out FILE` wrote",
                        local=True)
    try:
        with st.safe_open(str(p), framework="pt", device="cpu") as f:
            head = dict(f.metadata() or {})
            state = {k: f.get_tensor(k) for k in f.keys()}
    except OSError as exc:
        raise UserError(f"cannot read {str(p)!r} ({exc.strerror or exc})", "check the file's permissions",
                        local=True) from None
    except Exception as exc:  # safetensors' own error: a bad header, offsets out of the file
        raise UserError(f"{str(p)!r} is not a readable safetensors file ({str(exc).splitlines()[0][:120]})",
                        "a .pt file is read with torch.load(path, weights_only=True); re-export with --format "
                        "safetensors", local=True) from None
    return state, head


def _fit(module: Any, state: Mapping[str, Any], strict: bool, path: Path) -> None:
    """Refuse, in one line, a file whose keys (strict) or shapes do not fit `module`'s state_dict."""
    own = {k: tuple(v.shape) for k, v in module.state_dict().items() if hasattr(v, "shape")}
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if strict and (missing or unexpected):
        said = "; ".join(f"{what} {len(keys)} key(s): {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}"
                         for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys)
        raise UserError(f"{str(path)!r} does not fit this model ({said})",
                        "build the model class the run trained (the keys of its unwrapped module), or pass strict=False")
    wrong = [f"{k} {tuple(state[k].shape)} vs {own[k]}" for k in sorted(set(own) & set(state))
             if tuple(state[k].shape) != own[k]]
    if wrong:
        raise UserError(f"{str(path)!r} does not fit this model: shapes differ for {len(wrong)} tensor(s) "
                        f"(file vs model: {'; '.join(wrong[:3])}{'; ...' if len(wrong) > 3 else ''})",
                        "build the model with the sizes the run trained")


def load_weights(model: Any, path: str | os.PathLike[str], strict: bool = True) -> dict[str, str]:
    """Load safetensors file `path` into `model` (plain, under DDP or torch.compile, or sharded by
    FSDP: each rank keeps its own shards), for fine-tuning or evaluation at any world size; returns
    the file's header (step, strategy, ... as strings). Call it on every rank, before or after
    `run.prepare`: each rank reads the file, and under FSDP the whole tensors are split into shards
    collectively. `strict=False` tolerates missing and unexpected keys; shapes must always fit."""
    from ..parallel.ddp import unwrap
    from ..parallel.fsdp import is_sharded

    state, head = read_weights(path)
    module = unwrap(model)
    _fit(module, state, strict, Path(path))
    if is_sharded(module):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=strict))
    else:
        module.load_state_dict(state, strict=strict)
    return head

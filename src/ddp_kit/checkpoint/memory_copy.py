"""One memory-tier copy: a rank's whole state at one step, as two files in a node-local folder
(`/dev/shm` by default) that nothing ever unpickles.

    <copy>/data.bin        every tensor's bytes, back to back (64-byte aligned)
    <copy>/manifest.json   written once data.bin is complete and its sha256 known: the step, the world
                           size, each tensor's dtype, shape, offset and size, the state's structure as
                           JSON (dicts with their int or str keys, lists, tuples, numbers, strings), and
                           the sha256 of data.bin

A copy is read back only through `manifest_of` and `read_data`: the manifest is JSON, its dtypes come
from an allow-list, every tensor must lie inside data.bin, and the checksum must match. So a forged,
truncated or unsealed copy is one more copy that is not usable (named in one line), never code that
runs. Files are opened without following links.

Sealing takes a pass over the data (about 50 ms per 100 MB), which is why it is not on the loop's
path: the writer's thread computes it, then writes the manifest. A kill before that leaves a copy
without a manifest, which is not a copy at all: the one before it is used.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FORMAT = "ddp_kit.memory/1"
DATA, MANIFEST = "data.bin", "manifest.json"
ALIGN = 64
MAX_MANIFEST = 64 << 20  # a manifest is a few KB to a few MB (an optimizer's structure): more is not one
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class Unusable(Exception):
    """A copy that cannot be used; its message says why, in a few words."""


class NotStorable(Exception):
    """A value in the state that the memory tier does not hold (its path and type in the message)."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan(state: Any) -> tuple[Any, list[torch.Tensor], int]:
    """(the state's structure as JSON with tensors as {"t": i}, the tensors in order, the data size)."""
    tensors: list[torch.Tensor] = []

    def enc(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            local = v.to_local() if hasattr(v, "to_local") else v  # a DTensor: this rank's shard
            if str(local.dtype).removeprefix("torch.") not in DTYPES:
                raise NotStorable(f"{path} (a {local.dtype} tensor)")
            tensors.append(local.detach())
            return {"t": len(tensors) - 1}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, dict):
            for k in v:
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise NotStorable(f"{path} (a key of type {type(k).__name__})")
            return {"d": [[k, enc(x, f"{path}.{k}")] for k, x in v.items()]}
        if isinstance(v, (list, tuple)):
            return {"l" if isinstance(v, list) else "u": [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        raise NotStorable(f"{path} (a {type(v).__name__})")

    tree = enc(state, "state")
    return tree, tensors, sum(_aligned(t.numel() * t.element_size()) for t in tensors)


def table(tensors: list[torch.Tensor]) -> list[list[Any]]:
    """[dtype, shape, offset, nbytes] of each tensor, as laid out in data.bin."""
    out, offset = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        out.append([str(t.dtype).removeprefix("torch."), list(t.shape), offset, n])
        offset += _aligned(n)
    return out


def fill(buf: torch.Tensor, tensors: list[torch.Tensor], entries: list[list[Any]], non_blocking: bool = False) -> None:
    """Copy each tensor into its place in `buf` (a uint8 view of data.bin): the only work a save blocks on."""
    for t, (_, _, offset, n) in zip(tensors, entries):
        if n:
            buf[offset:offset + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=non_blocking)


def checksum(buf: torch.Tensor) -> str:
    """sha256 of a uint8 host tensor (hashlib lets other threads run while it reads)."""
    return hashlib.sha256(_bytes(buf)).hexdigest() if buf.numel() else hashlib.sha256().hexdigest()


def _bytes(buf: torch.Tensor) -> memoryview:
    """A writable byte view of a uint8 host tensor, with no copy."""
    view: memoryview = buf.numpy().data
    return view


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Atomically: a reader sees the old manifest, none, or this one. The temporary file is created
    exclusively and never through a link (a planted link cannot turn this write into another file's)."""
    tmp = folder / f".{MANIFEST}.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(manifest).encode())
    finally:
        os.close(fd)
    os.replace(tmp, folder / MANIFEST)


def _read_nofollow(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_MANIFEST + 1)
    finally:
        os.close(fd)


def manifest_of(folder: Path) -> dict[str, Any]:
    """The manifest of the copy in `folder`, checked for shape (not yet against its data)."""
    try:
        raw = _read_nofollow(folder / MANIFEST)
        if len(raw) > MAX_MANIFEST:
            raise ValueError("too large")
        m = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise Unusable(f"manifest unreadable ({type(exc).__name__})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise Unusable("not a ddp_kit memory-tier manifest")
    if not isinstance(m.get("sha256"), str):
        raise Unusable("not sealed: its writer stopped before its checksum was written")
    for key in ("step", "rank", "world_size", "nbytes"):
        if not isinstance(m.get(key), int) or isinstance(m.get(key), bool) or m[key] < 0:
            raise Unusable(f"manifest field {key} missing or not a count")
    entries = m.get("tensors")
    if not isinstance(entries, list):
        raise Unusable("manifest has no tensor table")
    for e in entries:
        ok = (isinstance(e, list) and len(e) == 4 and e[0] in DTYPES and isinstance(e[1], list)
              and all(isinstance(d, int) and d >= 0 for d in e[1]) and isinstance(e[2], int) and isinstance(e[3], int))
        if not ok:
            raise Unusable("a malformed tensor entry in the manifest")
        numel = 1
        for d in e[1]:
            numel *= d
        if numel * DTYPES[e[0]].itemsize != e[3] or e[2] < 0 or e[2] % ALIGN or e[2] + e[3] > m["nbytes"]:
            raise Unusable("a tensor entry outside the data file or of the wrong size")
    return m


def check_data(folder: Path, m: dict[str, Any]) -> None:
    """The data file is there at the size the manifest says (cheap: no read)."""
    try:
        size = os.stat(folder / DATA, follow_symlinks=False).st_size
    except OSError:
        raise Unusable("data file missing") from None
    if size != m["nbytes"]:
        raise Unusable(f"data file is {size} bytes, the manifest says {m['nbytes']} (truncated?)")


def read_data(folder: Path, m: dict[str, Any]) -> torch.Tensor:
    """data.bin into fresh memory (never a mapping: the slot is overwritten by a later save while
    the restored optimizer may still hold views), checked against a sealed manifest's sha256."""
    check_data(folder, m)
    buf = torch.empty(m["nbytes"], dtype=torch.uint8)
    fd = os.open(folder / DATA, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with open(fd, "rb", buffering=0) as f:
        view, got = _bytes(buf), 0
        while got < m["nbytes"]:
            n = f.readinto(view[got:])
            if not n:
                raise Unusable("data file ended early")
            got += n
    if checksum(buf) != m.get("sha256"):
        raise Unusable("data does not match the manifest's sha256")
    return buf


def decode(m: dict[str, Any], buf: torch.Tensor) -> Any:
    """The state of a checked manifest, each tensor its own copy out of `buf` (as torch.load gives them:
    an optimizer keeps what it loads, and one view of a shared buffer would save all of it). JSON in,
    plain values out."""
    views = [buf[off:off + n].view(DTYPES[dt]).view(shape).clone() if n else torch.empty(shape, dtype=DTYPES[dt])
             for dt, shape, off, n in m["tensors"]]

    def dec(v: Any) -> Any:
        if not isinstance(v, dict):
            if isinstance(v, list):
                raise Unusable("a bare list in the state's structure")
            return v
        if len(v) != 1:
            raise Unusable("a malformed node in the state's structure")
        (kind, x), = v.items()
        if kind == "t" and isinstance(x, int) and 0 <= x < len(views):
            return views[x]
        if kind in ("l", "u") and isinstance(x, list):
            items = [dec(i) for i in x]
            return items if kind == "l" else tuple(items)
        if kind == "d" and isinstance(x, list) and all(isinstance(p, list) and len(p) == 2
                                                       and isinstance(p[0], (str, int)) for p in x):
            return {k: dec(i) for k, i in x}
        raise Unusable("a malformed node in the state's structure")

    return dec(m.get("tree"))


def fill_template(template: Any, saved: Any, copy: Callable[[torch.Tensor, torch.Tensor], Any]) -> Any:
    """Load `saved` into `template` (a strategy's sharded state dicts, e.g. FSDP's DTensors) in place:
    tensors are copied into the template's own (its local shard), other values taken as saved."""
    if isinstance(template, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            raise Unusable("the saved state does not fit this run's sharded state")
        copy(template.to_local() if hasattr(template, "to_local") else template, saved)
        return template
    if isinstance(template, dict) and isinstance(saved, dict):
        for k in list(template):
            if k in saved:
                template[k] = fill_template(template[k], saved[k], copy)
        return template
    if isinstance(template, list) and isinstance(saved, (list, tuple)) and len(template) == len(saved):
        for i, (t, s) in enumerate(zip(template, saved)):
            template[i] = fill_template(t, s, copy)
        return template
    return saved


def flat_keys(state: Any, prefix: str = "") -> set[str]:
    """Dotted keys of every leaf, as DCP names them ("optimizer.state.fc.weight.exp_avg")."""
    if isinstance(state, dict):
        return {k for key, v in state.items() for k in flat_keys(v, f"{prefix}{key}.")}
    return {prefix.rstrip(".")}

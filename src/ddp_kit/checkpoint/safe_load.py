"""Reading a checkpoint folder without running code from it.

Whoever can write a run folder can also rewrite its manifest, so checksums prove only that the
files are the ones the manifest names, not that they are ours. Everything ddp_kit reads back is
therefore unpickled with an allow-list:

- `.pt` files through torch's own `weights_only=True` loader;
- DCP's `.metadata` (which torch reads with plain `pickle`) through `_MetadataUnpickler`, which
  admits only DCP's metadata dataclasses and the few torch values they hold (dtypes, layouts,
  `torch.Size`, paths);
- DCP's byte items (an optimizer's param_groups, a module's extra state), which torch's planners
  load with `weights_only=False`, are first checked with `weights_only=True`.

`check_folder` runs all of these over a step folder for `steps.validate`, so a forged
checkpoint is one more invalid checkpoint: named in one line, and resume falls back past it.
"""
from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from . import layout

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import LoadPlanner

_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name ("torch.strided") to the layout
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("pathlib", "Path"),
}


class ForgedCheckpoint(Exception):
    """A file in a checkpoint folder holds a pickle that names something outside the allow-list."""


class _MetadataUnpickler(pickle._Unpickler):  # the Python one: its opcodes can be watched (BUILD)
    # Parts of the pure-Python unpickler that typeshed's pickle._Unpickler stub leaves out.
    stack: list[Any]
    load_build: Callable[[], None]

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED or (module in _DCP_MODULES and not name.startswith("__")):
            obj = super().find_class(module, name)
            # Only the metadata's own classes: a function the module happens to import is not data.
            if (module, name) in _ALLOWED or (isinstance(obj, type) and obj.__module__ == module):
                return obj
        raise ForgedCheckpoint(f"DCP metadata names {module}.{name}, which is not checkpoint metadata")

    def _build(self) -> None:
        # BUILD sets attributes of the object below it: on an instance that is data, on a class it
        # would rewrite the class for the whole process (pathlib.Path.__truediv__ = ...).
        if isinstance(self.stack[-2], type):
            raise ForgedCheckpoint("DCP metadata sets attributes of a class, which metadata never does")
        self.load_build()

    dispatch = dict(pickle._Unpickler.dispatch)
    # typeshed types dispatch's handlers as taking the C pickle.Unpickler; they take the _Unpickler they run on
    dispatch[pickle.BUILD[0]] = _build  # type: ignore[assignment]


def read_dcp_metadata(folder: str | os.PathLike[str]) -> Any:
    """DCP's Metadata of `folder` (a dcp/ folder), unpickled with the allow-list; every storage item
    must name a file of the folder itself and lie inside it (a forged one could name /dev/zero). A shard
    not downloaded yet (object store: a rank fetches only the shards it reads) is measured by the size
    the step's manifest records, which its download is verified against."""
    folder = Path(folder)
    with open(folder / layout.DCP_METADATA, "rb") as fh:
        try:
            meta = _MetadataUnpickler(fh).load()
        except ForgedCheckpoint:
            raise
        except Exception as exc:  # truncated, not a pickle at all
            raise ForgedCheckpoint(f"DCP metadata is unreadable ({type(exc).__name__}: {exc})") from None
    sizes: dict[str, int] = {}
    recorded = _manifest_sizes(folder.parent)
    for info in (getattr(meta, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name.startswith("."):
            raise ForgedCheckpoint(f"DCP metadata names the file {name!r}, which is not one of the folder's shards")
        if name not in sizes:
            sizes[name] = ((folder / name).stat().st_size if (folder / name).is_file()
                           else recorded.get(layout.dcp_file(name), -1))
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0
                and info.length >= 0 and info.offset + info.length <= sizes[name]):
            raise ForgedCheckpoint(f"DCP metadata points outside {name} (offset {info.offset}, length {info.length})")
    return meta


def check_bytes(data: bytes, what: str) -> None:
    """Raise ForgedCheckpoint unless `data` (torch.save output) loads with weights_only=True."""
    import torch

    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ForgedCheckpoint(f"{what} is not plain checkpoint data ({_first_line(exc)})") from None


def _manifest_sizes(step_dir: Path) -> dict[str, int]:
    """{file: size} from step_dir's manifest (only for files its name check admits); {} without one."""
    import json

    try:
        manifest = json.loads((step_dir / layout.MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    if layout.manifest_problem(manifest):
        return {}
    return {n: f["size"] for n, f in manifest["files"].items()}


def reader(folder: str | Path, before_read: Callable[[set[str]], None] | None = None) -> Any:
    """A DCP FileSystemReader over `folder` that unpickles nothing outside the allow-list. `before_read`
    is told the files (relative to `folder`) this rank's load plan reads, before any is opened: a
    backend that downloads fetches only those."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:  # per-rank metadata files are a mode ddp_kit never writes
                raise ForgedCheckpoint("per-rank DCP metadata is not read by ddp_kit")
            meta = read_dcp_metadata(self.path)
            # What torch's own read_metadata adds after its (unrestricted) unpickling.
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            if hasattr(self, "load_id"):
                meta.storage_meta.load_id = self.load_id
            return meta

        def read_data(self, plan: Any, planner: Any) -> Any:
            if before_read is not None:
                before_read({self.storage_data[item.storage_index].relative_path for item in plan.items})
            # _CheckedBytes is not a LoadPlanner subclass but forwards every attribute to the one it wraps
            return super().read_data(plan, cast("LoadPlanner", _CheckedBytes(planner)))

    return SafeReader(folder)


class _CheckedBytes:
    """A load planner whose load_bytes first proves the bytes are plain data (see module docstring)."""

    def __init__(self, planner: Any):
        self._planner = planner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        check_bytes(value.getvalue(), f"DCP item {read_item.dest_index.fqn!r}")
        value.seek(0)
        self._planner.load_bytes(read_item, value)


def check_folder(path: Path, dcp: bool = True) -> str | None:
    """None when every pickle in step folder `path` is plain data; else why not, in a few words.
    dcp=False leaves dcp/'s byte items to the load (a folder holding only the shards a rank reads)."""
    import torch

    for f in sorted(path.glob(layout.TORCH_FILES)):
        try:
            # mmap: the storages are not read, only the pickle that names them is checked
            torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            return f"{f.name} is not plain checkpoint data ({_first_line(exc)})"
    folder = path / layout.DCP
    if not dcp or not (folder / layout.DCP_METADATA).is_file():
        return None
    try:
        meta = read_dcp_metadata(folder)
        for index in _byte_items(meta):
            info = meta.storage_data[index]
            if getattr(info, "transform_descriptors", None):
                continue  # compressed or otherwise transformed: checked when it is loaded (_CheckedBytes)
            with open(folder / info.relative_path, "rb") as fh:
                fh.seek(info.offset)
                check_bytes(fh.read(info.length), f"dcp item {index.fqn!r}")
    except ForgedCheckpoint as exc:
        return f"dcp/ is not plain checkpoint data ({exc})"
    except (OSError, AttributeError, KeyError, TypeError, MemoryError) as exc:
        return f"dcp/ is unreadable ({type(exc).__name__}: {exc})"
    return None


def _byte_items(meta: Any) -> list[Any]:
    """The storage indices of DCP's byte items (the values torch pickles rather than writes as tensors)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    return [index for index in meta.storage_data
            if isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata)]


def _first_line(exc: BaseException) -> str:
    """The informative line of a load error: for torch's weights_only refusal, the global it names."""
    import re

    text = str(exc)
    found = re.search(r"Unsupported (?:global|operand): \S+(?: [\w.]+)?", text)
    lines = [found.group(0)] if found else text.strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160]}" if lines else type(exc).__name__

"""Sharded state (strategy fsdp) in a step folder through torch.distributed.checkpoint (DCP): its
own gloo group, writing dcp/, the manifest entries of what each rank wrote, and reading it back."""
from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from . import layout, safe_load
from .durable import file_digest

# Posted by rank 0 beside its files, never written to the manifest: every file DCP's metadata names,
# so the commit can prove the ranks' lists together cover them.
EXPECTED = layout.dcp_file(".expected")


def gloo_group(timeout_s: float) -> Any:
    """A gloo group for DCP alone, also at world size 1: its async save needs a CPU backend, and the
    default group is NCCL-only on GPUs. None without a process group. Every rank creates it at the
    same point (first save or load)."""
    import torch.distributed as tdist

    return tdist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if tdist.is_initialized() else None


def write(step_dir: Path, sharded: dict[str, Any], group: Any, now: bool, stager: Any = None) -> Any:
    """Every rank writes its shards into step_dir/dcp/: now (returns DCP's metadata), or from DCP's
    thread (returns a Future), staged by `stager` when one is given."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import async_save, save

    writer = FileSystemWriter(step_dir / layout.DCP)
    if now:
        return save(sharded, storage_writer=writer, process_group=group, no_dist=group is None)
    # named only when there is one: dcp_stager makes none for a torch whose async_save lacks the parameter
    extra: dict[str, Any] = {"async_stager": stager} if stager else {}
    return async_save(sharded, storage_writer=writer, process_group=group, no_dist=group is None, **extra)


def written(step_dir: Path, rank: int, metadata: Any) -> dict[str, Any]:
    """{relative path: size and sha256} of the DCP files this rank wrote (rank 0: and .metadata, and
    under EXPECTED the list of every file the metadata names).

    DCP names a rank's files __<rank>_<i>.distcp; rank 0 checks against the metadata that the
    ranks' lists together cover every file it names (see Checkpointer._commit_files)."""
    folder = step_dir / layout.DCP
    mine = sorted(folder.glob(layout.dcp_shards(rank))) + ([folder / layout.DCP_METADATA] if rank == 0 else [])
    out: dict[str, Any] = {layout.dcp_file(f.name): file_digest(f) for f in mine}
    if rank == 0:
        # torch 2.11's writer fills storage_data on a copy: the Metadata dcp.save returns has None; the
        # file it wrote has the list (read through the allow-list, as any .metadata)
        storage = metadata.storage_data if metadata.storage_data is not None else \
            safe_load.read_dcp_metadata(folder).storage_data
        out[EXPECTED] = sorted({layout.dcp_file(info.relative_path) for info in storage.values()})
    return out


def present(step_dir: Path) -> bool:
    return (step_dir / layout.DCP).is_dir()


def keys(step_dir: Path) -> set[str]:
    """The flattened keys the step's sharded state holds (e.g. "optimizer.state.fc.weight.exp_avg")."""
    return set(safe_load.read_dcp_metadata(step_dir / layout.DCP).state_dict_metadata) if present(step_dir) else set()


def load(step_dir: Path, template: dict[str, Any], group: Any, before_read: Callable[[set[str]], None] | None = None) -> None:
    """Fill `template` from step_dir/dcp/ (collective over `group`), through the allow-listed reader
    (`before_read`: see safe_load.reader)."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    dcp_load(template, storage_reader=safe_load.reader(step_dir / layout.DCP, before_read), process_group=group,
             no_dist=group is None)

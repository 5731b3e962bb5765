"""The memory tier's traffic between nodes, on its own gloo group: after each save a rank's copy goes to
the same local rank of the next node (and the previous node's comes in), and at resume each chosen
copy a rank needs from another node comes from the rank holding it. Every copy received is checked
against its sha256 before it counts.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from . import memory_copy as mc
from .memory_slot import CopyLost, _mb, _room, _Slot


def _wait_all(works: list[Any]) -> None:
    for w in works:
        w.wait()


def exchange(group: Any, to: int, frm: int, slot: _Slot, job_dir: Path, buf: torch.Tensor | None,
             manifest: dict[str, Any] | None, lost: list[str]) -> bool:
    """Send this copy to the partner node's rank, receive the previous node's rank's copy. Each side
    says first whether it has a copy to send and whether it can take the one coming, so a side that
    cannot (a full tmpfs) costs that copy only, and neither waits for bytes that never come. The copy
    received goes into `slot` (room counted in `job_dir`'s tmpfs); a copy lost is said in `lost`.
    Returns whether a sealed copy arrived."""
    blob = torch.frombuffer(bytearray(json.dumps(manifest).encode()), dtype=torch.uint8) if manifest else None
    head = torch.tensor([buf.numel() if buf is not None and blob is not None else -1,
                         blob.numel() if blob is not None else 0], dtype=torch.int64)
    got = torch.empty(2, dtype=torch.int64)
    _wait_all([tdist.isend(head, to, group=group), tdist.irecv(got, frm, group=group)])
    nbytes, mlen = (int(x) for x in got.tolist())
    inbuf = None
    if nbytes >= 0:
        try:
            if nbytes - (slot.buf.numel() if slot.buf is not None else 0) > _room(job_dir):
                raise CopyLost(f"the tmpfs has less than {_mb(nbytes)} free")
            inbuf = slot.open(nbytes, pin=False)
        except CopyLost as exc:
            lost.append(f"the peer copy from rank {frm} ({exc})")
    can, will = torch.tensor([int(inbuf is not None)], dtype=torch.int64), torch.empty(1, dtype=torch.int64)
    _wait_all([tdist.isend(can, frm, group=group), tdist.irecv(will, to, group=group)])
    works = []
    if blob is not None and buf is not None and int(will.item()):
        works.append(tdist.isend(blob, to, group=group))
        if buf.numel():
            works.append(tdist.isend(buf, to, group=group))
    inblob = torch.empty(mlen, dtype=torch.uint8)
    if inbuf is not None:
        works.append(tdist.irecv(inblob, frm, group=group))
        if nbytes:
            works.append(tdist.irecv(inbuf, frm, group=group))
    _wait_all(works)
    if inbuf is None:
        return False
    try:
        received = json.loads(bytes(inblob.numpy()).decode())
    except ValueError:
        received = {}
    if not isinstance(received, dict) or received.get("rank") != frm or mc.checksum(inbuf) != received.get("sha256"):
        lost.append(f"the peer copy from rank {frm} (it arrived damaged)")
        return False
    try:
        mc.write_manifest(slot.folder, received)
    except OSError as exc:
        lost.append(f"the peer copy from rank {frm} ({exc.strerror or exc})")
        slot.release()
        return False
    return True


def transfer(group: Any, rank: int, sources: list[dict[str, Any]], nodes: list[str],
             held: dict[int, tuple[dict[str, Any], torch.Tensor]]) -> list[tuple[str, str]]:
    """Each copy a rank needs from another node, from its holder, one pair at a time; the copies that
    arrived damaged (their folder, why), on the rank that received them."""
    bad = []
    for r, s in enumerate(sources):
        if s["node"] == nodes[r]:
            continue
        holder = s["holder"]
        if rank == holder:
            m, buf = held.pop(r)
            blob = torch.frombuffer(bytearray(json.dumps(m).encode()), dtype=torch.uint8)
            tdist.send(torch.tensor([buf.numel(), blob.numel()], dtype=torch.int64), r, group=group)
            tdist.send(blob, r, group=group)
            if buf.numel():
                tdist.send(buf, r, group=group)
        elif rank == r:
            head = torch.empty(2, dtype=torch.int64)
            tdist.recv(head, holder, group=group)
            blob = torch.empty(int(head[1]), dtype=torch.uint8)
            tdist.recv(blob, holder, group=group)
            buf = torch.empty(int(head[0]), dtype=torch.uint8)
            if buf.numel():
                tdist.recv(buf, holder, group=group)
            try:
                m = json.loads(bytes(blob.numpy()).decode())
            except ValueError:
                m = {}
            if not isinstance(m, dict) or mc.checksum(buf) != m.get("sha256"):
                bad.append((s["folder"], f"it arrived damaged from rank {holder}"))
                continue
            held[r] = (m, buf)
    return bad

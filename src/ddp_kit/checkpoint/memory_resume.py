"""The memory tier's choice at resume: which copies of a node's tmpfs are usable (sealed, whole, this
run's, of a known lineage, newer than the durable tier's step), the newest step every rank's state
has a copy of in one lineage and where each rank takes its copy from, and the reading of the copies
a rank reads. memory_tier.MemoryTier.find runs it on every rank together.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..dist import DistContext
from . import memory_copy as mc


def scan(ctx: DistContext, job_dir: Path, node: str, run: str, after: int) -> list[dict[str, Any]]:
    """This rank's share of the node's copies newer than `after` (the node's local ranks split them)."""
    lw = max(ctx.env.local_world_size, 1)
    folders = sorted(p for p in job_dir.iterdir() if p.is_dir() and not p.is_symlink()
                     and p.name.startswith(("own-r", "peer-r")))
    out = []
    for i, folder in enumerate(folders):
        if i % lw != ctx.local_rank % lw:
            continue
        entry: dict[str, Any] = {"folder": str(folder), "holder": ctx.rank, "node": node,
                                 "node_rank": ctx.env.node_rank, "kind": folder.name.split("-")[0]}
        if not (folder / mc.MANIFEST).exists():
            continue  # being written when its process ended: never complete
        try:
            m = mc.manifest_of(folder)
            mc.check_data(folder, m)
            named = int(folder.name.split("-")[1][1:])
            if m["rank"] != named:
                raise mc.Unusable(f"its manifest is rank {m['rank']}'s")
            if m.get("run") != run:
                raise mc.Unusable("it belongs to another run")
            lineage = m.get("lineage")
            if not isinstance(lineage, dict) or not isinstance(lineage.get("attempt"), str):
                raise mc.Unusable("its manifest names no lineage")
        except (mc.Unusable, ValueError) as exc:
            out.append({**entry, "why": str(exc)})
            continue
        if m["step"] > after and m["world_size"] == ctx.world_size:
            out.append({**entry, "state_rank": m["rank"], "step": m["step"], "lineage": lineage["attempt"]})
    return out


def _choose(usable: list[dict[str, Any]], nodes: list[str], world: int) -> tuple[int, list[dict[str, Any]]] | None:
    """The newest step with a copy of every rank's state from one lineage (the attempt that wrote it: two
    attempts' copies of one step are two different states), and for each rank the copy to take: on its
    own node first (its own slot before a peer copy there), else the lowest holder's."""
    by_step: dict[tuple[int, str], dict[int, list[dict[str, Any]]]] = {}
    for e in usable:
        by_step.setdefault((e["step"], e.get("lineage", "")), {}).setdefault(e["state_rank"], []).append(e)
    for step, lineage in sorted(by_step, reverse=True):
        held = by_step[step, lineage]
        if all(r in held for r in range(world)):
            return step, [min(held[r], key=lambda e: (e["node"] != nodes[r], e["kind"] != "own", e["holder"]))
                          for r in range(world)]
    return None


def verify(rank: int, node: str, sources: list[dict[str, Any]],
           nodes: list[str]) -> tuple[dict[int, tuple[dict[str, Any], torch.Tensor]], list[tuple[str, str]]]:
    """Read and check the chosen copies this rank reads: its own (on its node), and the ones it holds
    for a rank on another node, read into memory for load and the transfer (returned), and the ones not
    usable (their folder, why)."""
    held: dict[int, tuple[dict[str, Any], torch.Tensor]] = {}
    bad = []
    for r, s in enumerate(sources):
        mine = r == rank and s["node"] == node
        holds = s["holder"] == rank and s["node"] != nodes[r]
        if not (mine or holds):
            continue
        folder = Path(s["folder"])
        try:
            m = mc.manifest_of(folder)
            if m["step"] != s["step"] or m["rank"] != r:
                raise mc.Unusable("replaced since it was listed")
            held[r] = (m, mc.read_data(folder, m))
        except mc.Unusable as exc:
            bad.append((str(folder), str(exc)))
    return held, bad

"""Replica groups of a fault-tolerant run (strategy "ft", parallel/ft.py): which group this
process's launcher belongs to, how many groups the job has, and where their lighthouse listens.

Each replica group is a launch of its own (one torchrun, one SLURM node, one pod set) whose ranks
form the process group; the groups meet only through torchft's lighthouse and manager. The
variables are what `python -m ddp_kit.launch ft` and the ft templates set; torchft's own names
(REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, as its examples use) are read too. An `around` step under
every launcher: torchrun inside a group knows nothing of the others.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ..errors import UserError
from .base import DistEnv

GROUP, GROUPS, LIGHTHOUSE = "DDP_KIT_REPLICA_GROUP", "DDP_KIT_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"
RESTARTS = "DDP_KIT_GROUP_RESTARTS"  # how often the launcher restarted this group (attempt counting, inject)
ALIASES = {GROUP: "REPLICA_GROUP_ID", GROUPS: "NUM_REPLICA_GROUPS"}


def _count(environ: Mapping[str, str], key: str) -> int | None:
    name = key if environ.get(key, "") != "" else ALIASES.get(key, key)
    raw = environ.get(name, "").strip()
    if raw == "":
        return None
    if not raw.isdigit():
        raise UserError(f"{name}={raw!r} is not a whole number", f"set {name} to the replica group's number, or unset it")
    return int(raw)


def around(env: DistEnv, environ: Mapping[str, str]) -> DistEnv:
    """`env` with its replica group facts (unchanged outside a fault-tolerant launch)."""
    group, groups, restarts = _count(environ, GROUP), _count(environ, GROUPS), _count(environ, RESTARTS)
    lighthouse = environ.get(LIGHTHOUSE, "").strip() or None
    if group is None and groups is None and lighthouse is None:
        return env
    groups = groups if groups is not None else 1
    group = group if group is not None else 0
    if groups < 1 or not 0 <= group < groups:
        raise UserError(f"replica group {group} is outside the {groups} groups that {GROUPS} states",
                        f"set {GROUP} to 0..{max(groups, 1) - 1}, or launch with python -m ddp_kit.launch ft")
    return replace(env, replica_group=group, replica_groups=groups, lighthouse=lighthouse,
                   restart_count=max(env.restart_count, restarts or 0))

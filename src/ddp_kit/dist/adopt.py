"""Taking over a process group that someone else created: Ray Train, a framework, or the user's own
`init_process_group` before `ddp_kit.init()`.

The group's own numbers are the truth (rank, world size, backend); the environment adds what a
group does not know (local rank, node, launcher facts). ddp_kit's store traffic (fail-fast,
watchdog heartbeats, the checkpoint commit) goes to the group's own TCPStore under a prefix of its
own, through connections of its own; the group itself is left to whoever made it, at exit too.
group.py runs one path for both kinds of group; what differs for an adopted one is here.
"""
from __future__ import annotations

import gc
import sys
from dataclasses import replace

import torch
import torch.distributed as tdist

from ..env import DistEnv
from ..errors import UserError

# Default groups ddp_kit created itself (ids): a second ddp_kit.init() is then a mistake, not an
# adoption. A set, since a group destroyed and created again is a new object.
_OURS: set[int] = set()


def mark_ours() -> None:
    """Remember that ddp_kit created the current default group."""
    _OURS.add(id(tdist.group.WORLD))


def forget_ours() -> None:
    _OURS.discard(id(tdist.group.WORLD))


def ours() -> bool:
    """True when the current default group was created by ddp_kit."""
    return tdist.is_initialized() and id(tdist.group.WORLD) in _OURS


def adopt(env: DistEnv) -> DistEnv:
    """`env` as the existing default group has it (group_env); ddp_kit's own group is refused: a
    second ddp_kit.init() or distributed() is a mistake, not an adoption."""
    if ours():
        raise UserError("ddp_kit's process group already exists (a second ddp_kit.init() or distributed())",
                        "call ddp_kit.init() once and pass the Run it returns around")
    return group_env(env)


def group_backend(asked: str, dev: torch.device) -> str:
    """The existing group's backend; a device it cannot serve is one line."""
    be = tdist.get_backend()
    if be == "nccl" and dev.type != "cuda":
        raise UserError("the existing process group is NCCL but this process has no CUDA device",
                        "create the group with backend gloo on CPU, or give the process a GPU", local=True)
    if asked != be and asked != "gloo":  # gloo is what auto picks on CPU: no word for that
        print(f"ddp_kit: warning: the existing process group uses {be}; backend {asked} does not apply",
              file=sys.stderr, flush=True)
    return be


def say_joined(env: DistEnv, be: str) -> None:
    if env.rank == 0:
        engine = getattr(env, "engine", None)
        print(f"ddp_kit: joined the existing process group ({be}, {env.world_size} rank(s)"
              f"{', ' + engine if engine else ''}); it stays its creator's to destroy", file=sys.stderr, flush=True)


def leave(control, failed: bool) -> None:
    """The teardown of an adopted group: ddp_kit's side group only (after a failure not even that:
    destroying waits for work a failed collective never finishes); the group stays its owner's."""
    gc.collect()  # DDP's reducer goes before the group does (see group.teardown)
    if control is not None and not failed and tdist.is_initialized():
        try:
            tdist.destroy_process_group(control)
        except Exception as exc:
            print(f"ddp_kit: warning: destroying ddp_kit's side group failed: {exc}", file=sys.stderr)


def group_env(env: DistEnv) -> DistEnv:
    """`env` as the existing default group has it: its rank and world size, and the address of its
    store (where ddp_kit's helper threads connect). Raises UserError for a group ddp_kit cannot
    share: one without a TCPStore behind it (a file:// rendezvous), or one that contradicts the
    launcher's numbers."""
    rank, world = tdist.get_rank(), tdist.get_world_size()
    if env.launched and (env.rank, env.world_size) != (rank, world):
        raise UserError(f"the existing process group says rank {rank} of {world} but {env.launcher} says rank "
                        f"{env.rank} of {env.world_size}",
                        "create the group from the launcher's RANK and WORLD_SIZE, or let ddp_kit.init() create it")
    if world == 1:
        return replace(env, rank=0, world_size=1)
    tcp = _tcp_store(tdist.distributed_c10d._get_default_store())
    if tcp is None:
        raise UserError(f"the existing process group (rank {rank} of {world}) has no TCP store behind it, which "
                        "ddp_kit's watchdog and checkpoint commit need",
                        "create the group with init_method env:// or tcp://host:port (or let ddp_kit.init() create it)",
                        rank=rank)
    local = env if env.launched else replace(env, local_rank=0, local_world_size=1, node_rank=rank, num_nodes=world)
    return replace(local, rank=rank, world_size=world, master_addr=tcp.host, master_port=tcp.port,
                   # the group's members met already: the store is up and reachable
                   rendezvous_by_launcher=True)


def _tcp_store(store) -> tdist.TCPStore | None:
    """The TCPStore under any PrefixStore wrappers, or None."""
    for _ in range(8):
        if isinstance(store, tdist.TCPStore):
            return store
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None

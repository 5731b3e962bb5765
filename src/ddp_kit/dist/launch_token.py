"""Which launch an attempt belongs to: an id made or read at a launch's first start, kept by every
restart of that launch (a torchrun restart, a SLURM requeue, a pod restarted by its engine) and new
for a new submission. The run ledger (boundary/attempts.py) refuses only a restart of the launch that
failed deterministically; the checkpoint lease (checkpoint/lease.py) hands the location at once to a
later attempt of its holder's launch, and to nobody else without watching it first.

Tried in this order, the widest scope a restart keeps first:

    DDP_KIT_LAUNCH_ID        set by the user or a template (e.g. a TrainJob's jobset-uid label through
                             the downward API): taken as given, unique
    the batch job            SLURM_JOB_ID (DistEnv.batch_job_id): requeue keeps it, every sbatch gets a
                             new one; unique
    the engine               Kubernetes, Ray (DistEnv.restarted_by_engine): its job id, else rank 0's
                             pod name, which a restart in place and an operator recreating pods under
                             their names keep; a new job under the same name looks the same: not unique
    torchrun, agent store    a uuid rank 0 puts into the agent's rendezvous store with compare_set at
                             the first start (KEY, no attempt prefix); every restart of that torchrun
                             finds it there, a second torchrun (its own store) makes its own; unique
    torchrun, no store kept  rank 0's agent (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a store per round):
                             its host, boot and log folder (made once per agent, random); unique
    anything else            this process: every start is a launch of its own

Rank 0 asks (the ledger's check and the lease both run there); the rendezvous store's compare_set
makes the answer the same for every rank that asks.
"""
from __future__ import annotations

import os
import re
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..env import DistEnv

KEY = "ddp_kit/launch_token"  # in the agent's store, outside every attempt's prefix
VAR = "DDP_KIT_LAUNCH_ID"
_STORE_TIMEOUT_S = 30.0
_AGENT_DIR = re.compile(r"^(.*)/attempt_\d+/")  # <log_dir>/<run_id>_<random>/attempt_<n>/<rank>/error.json


@dataclass(frozen=True)
class Launch:
    """`id`: the same for every attempt of one launch. `unique`: no other live job can have it (a made
    token, a scheduler's job id), so a lease held under it may be taken without watching its holder."""
    id: str
    unique: bool


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _process(pid: int) -> str:
    """host, boot and start time of `pid`: no other process anywhere has all three."""
    stat = _read(f"/proc/{pid}/stat") or ""
    start = stat.rsplit(")", 1)[-1].split()[19:20]
    return f"{socket.gethostname()} boot {_read('/proc/sys/kernel/random/boot_id')} pid {pid} start {''.join(start)}"


def store_token(addr: str, port: int, store: Any = None) -> str:
    """The launch's token in the rendezvous store at addr:port: the one put there by the first attempt
    to ask, or a new one now (compare_set: exactly one asker's value stands). `store`: a client to use
    (tests); else a connection of our own, closed again."""
    if store is None:
        from torch.distributed import TCPStore

        store = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=_STORE_TIMEOUT_S),
                         wait_for_workers=False)
    value = store.compare_set(KEY, "", uuid.uuid4().hex)
    return value.decode() if isinstance(value, bytes) else str(value)


def launch_of(env: DistEnv, environ: Mapping[str, str] | None = None, store: Any = None) -> Launch:
    """This attempt's launch (see the module's docstring). Asked by rank 0; never raises: a store that
    cannot be reached leaves the next way down."""
    environ = os.environ if environ is None else environ
    given = environ.get(VAR, "").strip()
    if given:
        return Launch(f"{VAR} {given}", True)
    if env.batch_job_id:
        return Launch(f"batch job {env.batch_job_id}", True)
    if env.restarted_by_engine:
        job = env.job_id if env.job_id not in (None, "", "none") else None
        return Launch(f"{env.engine or 'engine'} {'job ' + job if job else 'pod ' + socket.gethostname()}", False)
    if env.agent_store and env.master_addr and env.master_port:
        try:
            return Launch(f"torchrun {store_token(env.master_addr, env.master_port, store)}", True)
        except Exception:  # the agent's store is the job's own: reachable, or the rendezvous fails first
            pass
    if env.rendezvous_by_launcher:
        agent = _AGENT_DIR.match(environ.get("TORCHELASTIC_ERROR_FILE", ""))
        if agent:
            return Launch(f"torchrun agent {socket.gethostname()} boot {_read('/proc/sys/kernel/random/boot_id')} "
                          f"{agent.group(1)}", True)
        return Launch(f"torchrun agent {_process(os.getppid())}", True)
    return Launch(f"process {_process(os.getpid())}", True)

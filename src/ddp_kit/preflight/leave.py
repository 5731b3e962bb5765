"""A host the gate failed is left out, not retried forever: what each launcher allows.

    SLURM            rank 0 requeues the job and adds the hosts to its ExcNodeList (`scontrol update`), so the
                     next attempt is scheduled elsewhere; the attempt ends with verdict infrastructure, exit 1.
                     A job may only be updated while pending, and a requeue ends it: so the requeue comes first
                     and the update right after, with SIGTERM ignored meanwhile (SLURM sends it at the requeue
                     and waits KillWait before SIGKILL).
    elastic torchrun the failed hosts' agents leave (each host's first rank sends its torchrun agent SIGTERM:
    (--nnodes MIN:MAX) an agent stopped by a signal leaves the rendezvous open); the others exit 1, their
                     agents restart them and the job goes on with the hosts left, if MIN allows and a restart
                     is left; else every rank stops with exit 2, naming the hosts.
    anything else    exit 1 (retryable; the Kubernetes templates retry it) naming the hosts: docs/reliability.md
                     says how to keep the retry off that node (cordon it).

Also the run ledger's memory: a host that ended two attempts with an infrastructure verdict naming it (an ECC
error, a failed gate, storage failing under it; a rank of it outvoted at a sync check, a rollback line, counts as
one) is left out the same way at the next start, where the launcher allows it. A lost peer is not counted against a host: its verdict names the rank that saw the loss, not the
one lost. Torch-free."""
from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPEATS = 2  # infrastructure failures naming one host before it is left out


@dataclass(frozen=True)
class Elastic:
    min_nodes: int
    max_nodes: int
    restarts_left: int
    rdzv_host: str | None = None  # the host whose agent holds the rendezvous: it cannot leave


@dataclass(frozen=True)
class Launcher:
    """What this job's launcher allows, read once by rank 0 and sent to every rank (each rank's own view may
    differ: torchrun's restart count is per agent, a rank's parent may be a wrapper)."""
    slurm_job: str | None = None
    elastic: Elastic | None = None

    @property
    def can_leave(self) -> bool:
        return self.slurm_job is not None or self.elastic is not None


def launcher(requeue_command: Sequence[str] | None) -> Launcher:
    return Launcher(slurm_job(requeue_command), elastic())


# What a verdict's text says when the host it names is the cause (not the rank that saw a store or a peer fail)
NODE_WORDS = ("Unhealthy:", "ECC", "Xid", "NVLink", "fallen off the bus", "GPU is lost")


def twice_failed(records: Sequence[dict[str, Any]], hosts: Sequence[str]) -> dict[str, str]:
    """{host: why} for the hosts of this job that ended REPEATS attempts with an infrastructure verdict naming
    them as the cause (a failed gate, a GPU's hardware error; or whose ranks a sync check's vote outvoted, each
    rollback counting as one); not a store that refused the rank that saw it."""
    seen: dict[str, list[str]] = {}
    for r in records:
        if r.get("event") == "end" and r.get("verdict") == "infrastructure" and r.get("host") and \
                any(w in str(r.get("error", "")) for w in NODE_WORDS):
            for h in str(r["host"]).split(","):
                seen.setdefault(h, []).append(f"attempt {r.get('attempt')}: {str(r.get('cause', ''))[:120]}")
        elif r.get("event") in ("rollback", "replay") and isinstance(r.get("hosts"), list):
            # its rank was outvoted, or computed a step differently when it computed it again (docs/sdc.md)
            for h in dict.fromkeys(str(x) for x in r["hosts"]):
                seen.setdefault(h, []).append(f"attempt {r.get('attempt')}: silent data corruption suspected at "
                                              f"step {r.get('step')}" + (" (replay check)" if r["event"] == "replay" else ""))
    return {h: "; ".join(why[-REPEATS:]) for h, why in seen.items() if len(why) >= REPEATS and h in hosts}


def left_out(records: Sequence[dict[str, Any]]) -> dict[str, str]:
    """{host: why} of every host an attempt of this run left out (the ledger's "excluded" lines)."""
    out: dict[str, str] = {}
    for r in records:
        if r.get("event") == "excluded" and isinstance(r.get("left_out"), dict):
            out.update({str(h): str(why) for h, why in r["left_out"].items()})
    return out


def slurm_job(requeue_command: Sequence[str] | None) -> str | None:
    """The job (or array task) a SLURM requeue command names; None elsewhere."""
    if requeue_command and list(requeue_command[:2]) == ["scontrol", "requeue"] and len(requeue_command) == 3:
        return str(requeue_command[2])
    return None


@dataclass(frozen=True)
class Requeue:
    """How rank 0's requeue with the hosts left out went: `said` is its own line (scontrol's words)."""
    requeued: bool  # scontrol requeue succeeded: SLURM ends this attempt and schedules the job again
    excluded: bool  # ... and the hosts are in its ExcNodeList: the next attempt runs elsewhere
    said: str

    def done(self, hosts: Sequence[str]) -> str:
        """What happened, for every rank's error line."""
        names = ", ".join(hosts)
        if self.excluded:
            return f"requeued the job without {names}"
        if self.requeued:
            return f"requeued the job without the exclusion (the ExcNodeList update failed): {names} may be chosen again"
        return f"the job was not requeued (scontrol requeue failed): {names} not left out"


def slurm_exclude(job: str, hosts: Sequence[str]) -> Requeue:
    """Requeue `job` with `hosts` added to its ExcNodeList. SIGTERM is ignored throughout (SLURM sends it at
    the requeue, then waits KillWait): the caller's own handler would not survive into scontrol, whose exec
    keeps only an ignored disposition. A job submitted with --no-requeue, or an salloc session, refuses the
    requeue: that is said, and nothing is left out."""
    def run(*cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)

    queued = False
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        before = run("scontrol", "show", "job", "-o", job).stdout
        had = next((kv.split("=", 1)[1] for kv in before.split() if kv.startswith("ExcNodeList=")), "")
        # appended, not split: a bracketed list (n[1,3]) is SLURM's to read
        wanted = ",".join([*([had] if had and had != "(null)" else []), *hosts])
        requeue = run("scontrol", "requeue", job)
        if requeue.returncode != 0:
            return Requeue(False, False, f"scontrol requeue {job} failed: {(requeue.stderr or requeue.stdout).strip()} "
                                         f"(is the job requeueable: sbatch --requeue, not salloc?)")
        queued = True
        updated = run("scontrol", "update", f"JobId={job}", f"ExcNodeList={wanted}")
    except (OSError, subprocess.SubprocessError) as err:  # no scontrol here (a container), or it hung
        why = f"{type(err).__name__}: {err}"
        if queued:
            return Requeue(True, False, f"requeued, but leaving out {', '.join(hosts)} failed: {why}")
        return Requeue(False, False, f"could not requeue job {job} without {', '.join(hosts)}: {why}")
    finally:
        signal.signal(signal.SIGTERM, old)
    if updated.returncode != 0:
        return Requeue(True, False, f"requeued, but leaving out {wanted} failed: {(updated.stderr or updated.stdout).strip()} "
                                    f"(scontrol update JobId={job} ExcNodeList={wanted} by hand)")
    return Requeue(True, True, f"requeued without {', '.join(hosts)} (scontrol update JobId={job} ExcNodeList={wanted})")


def _agent_argv(pid: int) -> list[str] | None:
    """The argv of process `pid` when it is torchrun's agent (torchrun, or python -m torch.distributed.run)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return _agent_argv_words([a.decode(errors="replace") for a in argv if a])


def _agent_argv_words(words: list[str]) -> list[str] | None:
    return words if any(w.endswith("torchrun") or w == "torch.distributed.run" for w in words[:3]) else None


def elastic(environ: Mapping[str, str] | None = None, agent_argv: list[str] | None = None) -> Elastic | None:
    """This process's torchrun job when it is elastic (--nnodes MIN:MAX, MIN < MAX), read from the agent's
    own command line (torchrun tells its workers neither bound; `agent_argv`: that command line, read from
    /proc when not given); None otherwise."""
    env = os.environ if environ is None else environ
    argv = _agent_argv(os.getppid()) if agent_argv is None else agent_argv
    if argv is None or "TORCHELASTIC_RUN_ID" not in env:
        return None
    nnodes = _flag(argv, "--nnodes")
    nnodes = nnodes or env.get("PET_NNODES", "")  # torchrun takes its flags from PET_* too (Kubeflow's elastic jobs)
    lo, _, hi = nnodes.partition(":")
    if not hi or not lo.isdigit() or not hi.isdigit() or int(lo) >= int(hi):
        return None
    left = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) - int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    endpoint = _flag(argv, "--rdzv_endpoint") or _flag(argv, "--rdzv-endpoint") or env.get("PET_RDZV_ENDPOINT", "")
    host = endpoint.rsplit(":", 1)[0] if ":" in endpoint else endpoint
    return Elastic(int(lo), int(hi), max(0, left), host or None)


def _flag(argv: list[str], name: str) -> str:
    for i, w in enumerate(argv):
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
        if w == name and i + 1 < len(argv):
            return argv[i + 1]
    return ""


def leave_agent() -> bool:
    """Stop this host's torchrun agent (our parent), so that it leaves the job; True when it was one."""
    parent = os.getppid()
    if _agent_argv(parent) is None:
        return False
    os.kill(parent, signal.SIGTERM)
    return True

"""The pre-flight health gate as a service: at every attempt's start, on every node, before the first step
(preflight/gate.py: storage, the memory tier's tmpfs, GPUs, clocks, the links between hosts, each compared
with its peers). A failure is one line per finding, naming the host, the check, what was measured and what
was expected; the attempt ends with verdict infrastructure naming the hosts, and the hosts are left out
where the launcher allows it (preflight/leave.py). The run ledger keeps the gate's results per host and
what it cost (a "health" line; the time is start-up's); `python -m ddp_kit.status` shows them. The gate runs
in `ddp_kit.init`, before the model exists: at a first start the memory tier's room is asked again at
`run.resume`, against the state then registered (a second "health" line only when it fails there).

Every decision here is the same on every rank: it is made from the gathered report and from what rank 0
read (the ledger, the last checkpoint's size, what the launcher allows) and sent to all."""
from __future__ import annotations

import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..exit_codes import EXIT_FAILED, EXIT_USER_ERROR
from ..hooks import Boundary, StepHooks
from ..options import Option
from ..preflight.leave import REPEATS
from ..service_registry import Service

OPTIONS = (
    Option("health_check", "quick", key="health_check", resumable=True, choices=("off", "quick", "thorough"),
           help="The pre-flight health gate at every attempt's start, before step 1: storage writable with room, the memory tier's tmpfs, GPU health (NVML), memory a previous attempt holds, a checked matmul, clocks, links between hosts; a failing host is named and left out where the launcher allows (quick: about 0.1 s here; thorough: every pair of hosts, larger transfers and matmul; off). See docs/health.md."),
)


class HealthGate(StepHooks):
    def __init__(self, mode: str):
        self.mode = mode
        self.pending: tuple[Any, Any] | None = None  # (the report, the launcher) while the tier's room waits for the state

    def started(self, b: Boundary) -> None:
        from ..preflight.gate import run

        bb: Any = b
        plan, history, launcher = _plan(bb, self.mode)
        report = run(b.ctx, plan)
        if plan.shm_need == 0:  # the memory tier is on and no checkpoint gave its size: asked once the state exists
            self.pending = (report, launcher)
        _act(bb, report, history, launcher)

    def resumed(self, b: Boundary, meta: dict[str, Any]) -> None:
        """At a first start the gate (run at init, before the model exists) asked the memory tier's tmpfs for its
        probe's megabyte only: here, before step 1, the model and optimizers are registered, and each node's room
        is checked against their state (a lower bound: preflight/tier_room.py). Once (a rollback resumes too)."""
        if self.pending is None:
            return
        (report, launcher), self.pending = self.pending, None
        bb: Any = b
        shm = _tier_room(bb, report.hosts)
        if not all(r.ok for r in shm):
            _act(bb, replace(report, results=tuple(r for r in report.results if r.check != "shm") + tuple(shm)),
                 {}, launcher)


def _act(b: Any, report: Any, history: dict[str, str], launcher: Any) -> None:
    """Say the findings, leave the named hosts out where the launcher allows it, record the gate in the ledger,
    and end the attempt when a host failed (or history named one that was left out)."""
    history = {h: why for h, why in history.items() if h in report.hosts}
    if history and not launcher.can_leave:  # said, not acted on: a restart here lands on the same host again
        _stays(b, history, "this launcher cannot leave a host out")
        history = {}
    bad = list(dict.fromkeys([*report.bad_hosts, *history]))
    outcome = None
    if bad:
        closing, b.flag.closing = b.flag.closing, True  # a SIGTERM from here (a requeue, torchrun stopping an agent) is not a preemption
        if b.ctx.is_main:
            for r in report.failed:
                print(f"ddp_kit: {r.line()}", file=sys.stderr, flush=True)
        outcome = _leave(b, report, bad, history, launcher)
        if not report.failed and not outcome.ends:
            # History alone, and the host cannot be left out this time (elastic below MIN or without a restart,
            # the rendezvous host, a requeue SLURM refused): the gate passed it, so it may have healed, and an
            # attempt that raised here would fail every time. Said once, and the attempt goes on.
            _stays(b, history, outcome.why)
            b.flag.closing, history, outcome = closing, {}, None
    if b.ctx.is_main:
        b.tell({"event": "health", "mode": report.mode, "seconds": round(report.seconds, 3),
                "per_host": report.per_host(), **({"history": history} if history else {})})
    if outcome is not None:
        _unfit(b, report, bad, history, outcome)


def _tier_room(b: Any, hosts: tuple[str, ...]) -> list[Any]:
    """Each node's tmpfs against its ranks' state (collective: every rank's size, then each node's result)."""
    from ..dist.collectives import all_gather_object
    from ..preflight import local, tier_room
    from ..preflight.peers import Layout

    sizes = all_gather_object(b.ctx, tier_room.state_bytes(b.modules, b.optimizers))
    lay = Layout(hosts, b.ctx.rank)
    need = tier_room.from_state(sizes, hosts, lay.host, b.ctx.env.num_nodes)
    mine = [local.tmpfs_room(lay.host, need)] if lay.is_leader else []
    return [r for part in all_gather_object(b.ctx, mine) for r in part]


@dataclass(frozen=True)
class Outcome:
    """What was done about the hosts the gate named, the same on every rank."""
    left: bool = False  # left out of the next attempt (an "excluded" line)
    ends: bool = False  # this attempt ends whatever the findings: SLURM requeued it, or a host's agent left
    done: str = ""  # for the error line
    why: str = ""  # why the hosts stay, where they do
    code: int = EXIT_FAILED
    everywhere: bool = False  # not a host's fault: every host was named, or storage they share failed


def _stays(b: Any, history: dict[str, str], why: str) -> None:
    if b.ctx.is_main:
        for h, what in history.items():
            print(f"ddp_kit: warning: {h} ended {REPEATS} attempts of this launch with an infrastructure failure "
                  f"({what}); it cannot be left out ({why}) and passed the gate: the attempt goes on; to keep "
                  f"the job off it, drain it (SLURM: --exclude {h}; Kubernetes: kubectl cordon {h})",
                  file=sys.stderr, flush=True)


def _plan(b: Any, mode: str) -> tuple[Any, dict[str, str], Any]:
    """(the gate's plan, {host: why} of hosts the ledger shows failing twice, what the launcher allows), the
    same on every rank: rank 0 reads them and sends them."""
    from ..checkpoint.storage_registry import scheme_of
    from ..dist.collectives import broadcast_object
    from ..preflight import tier_room
    from ..preflight.gate import Plan

    # A URL location is probed when its backend opens, before step 1 (store_checks: a missing bucket is the
    # job's mistake, a store that does not answer is retryable): the gate reads and writes local folders only.
    location = None if b.rd is None else str(b.policy.ckpt_dir or b.rd.checkpoints)
    local = location if location is not None and not scheme_of(location) else None
    need, history, launcher = broadcast_object(b.ctx, _rank0_facts(b, local) if b.ctx.is_main else None)
    folders: list[tuple[str, str, int]] = []
    if b.rd is not None:
        # The checkpoint folder is probed itself (run_dir/checkpoints when no ckpt_dir names one): it may be
        # another mount than run_dir (read-only on one node), and it is where the room is needed. Before it
        # exists the probe goes to the folder it would be made in (local.folder): the gate makes nothing.
        same = local is not None and Path(local) == b.rd.path
        folders.append(("run_dir", str(b.rd.path), need if same else 0))
        if local is not None and not same:
            folders.append(("checkpoints", local, need))
    shm = None
    if b.policy.settings.get("mem_ckpt_every") and b.rd is not None:  # a lower bound: preflight/tier_room.py
        env = b.ctx.env
        shm = tier_room.from_checkpoint(need, b.ctx.world_size, env.local_world_size, env.num_nodes)
    return Plan(mode, tuple(folders), None, shm), history, launcher


def _rank0_facts(b: Any, location: str | None) -> tuple[int, dict[str, str], Any]:
    """(the last checkpoint's bytes, {host: why} of hosts the ledger shows failing twice, the launcher)."""
    import os

    from ..boundary import attempts
    from ..checkpoint import steps
    from ..checkpoint.layout import step_name
    from ..checkpoint.storage_registry import open_storage
    from ..dist.launch_token import launch_of
    from ..preflight.leave import launcher, twice_failed

    need = 0
    try:
        if location is not None and os.path.isdir(location):  # opening a storage may make its folder: not before the job does
            store = open_storage(location)
            latest = steps.read_latest(store)
            need = sum(store.listing(step_name(latest)).values()) if latest is not None else 0
    except Exception:  # the gate's storage check names what is wrong with the location
        need = 0
    records = attempts.read(b.rd.path / attempts.FILE) if b.rd is not None else []
    # This launch's attempts only (a SLURM requeue, a torchrun restart): a new submission is the fix being tried,
    # as for the crash-loop rule. This attempt's start line (just written) names its hosts.
    mine = attempts.this_launch(records, launch_of(b.ctx.env).id)
    return need, twice_failed(mine, _all_hosts(records)), launcher(b.ctx.env.requeue_command)


def _all_hosts(records: list[dict[str, Any]]) -> list[str]:
    starts = [r for r in records if r.get("event") == "start"]
    return [str(h) for h in starts[-1].get("hosts", [])] if starts else []


def _same_host(a: str, b: str | None) -> bool:
    """Whether host names `a` and `b` (a rendezvous endpoint's: a name or an address) are one host."""
    if b is None:
        return False
    if a == b or (not _is_address(a) and not _is_address(b) and a.split(".")[0] == b.split(".")[0]):
        return True  # node1 and node1.cluster.local
    try:
        return socket.gethostbyname(a) == socket.gethostbyname(b)
    except OSError:
        return False


def _is_address(name: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _leave(b: Any, report: Any, bad: list[str], history: dict[str, str], launcher: Any) -> Outcome:
    """Leave the hosts out where the launcher allows it this time (collective: the outcome is rank 0's)."""
    from ..env.facts import host_name
    from ..preflight import leave

    of_nodes = [r for r in report.failed if not r.shared]
    hosts = set(report.hosts)
    if (len(hosts) > 1 and hosts <= set(bad)) or (not of_nodes and not history):
        return Outcome(everywhere=True, why="every host of the job is named: none would be left")
    if launcher.slurm_job is not None:
        return _requeue(b, launcher.slurm_job, bad)
    elastic = launcher.elastic
    if elastic is None:
        return Outcome(why="this launcher cannot leave a host out")
    rendezvous = [h for h in bad if _same_host(h, elastic.rdzv_host)]
    if rendezvous:
        return Outcome(done=f"{rendezvous[0]} holds torchrun's rendezvous and cannot leave",
                       why="it holds torchrun's rendezvous")
    nodes_left = len(hosts) - len(set(bad) & hosts)
    if nodes_left >= elastic.min_nodes and elastic.restarts_left > 0:
        if host_name() in bad and b.ctx.local_rank == 0:
            leave.leave_agent()
        return Outcome(True, True, f"{', '.join(bad)} left the job; it goes on with {nodes_left} node(s) after "
                                   f"torchrun's restart")
    if elastic.restarts_left == 0:
        return Outcome(done="torchrun has no restart left: stopping", why="torchrun has no restart left",
                       code=EXIT_USER_ERROR)
    needs = f"the job needs {elastic.min_nodes} node(s) (--nnodes {elastic.min_nodes}:{elastic.max_nodes}) and would have {nodes_left}"
    return Outcome(done=f"{needs}: the host stays, and torchrun's restarts run the gate again", why=needs)


def _requeue(b: Any, job: str, bad: list[str]) -> Outcome:
    from ..dist.collectives import broadcast_object
    from ..preflight import leave

    went = None
    if b.ctx.is_main:
        went = leave.slurm_exclude(job, bad)
        print(f"ddp_kit: {went.said}", file=sys.stderr, flush=True)
    # No rank exits before the requeue is done: under `srun --kill-on-bad-exit` the first rank to exit
    # non-zero gets every other task, and rank 0's scontrol, killed (as boundary/stopping.py). How it went
    # comes with it: every rank's error line must be the same (whichever rank posts first is printed).
    sent = (went.excluded, went.requeued, went.done(bad)) if went is not None else None
    left, requeued, done = broadcast_object(b.ctx, sent)
    return Outcome(left, requeued, done, why=done)


def _unfit(b: Any, report: Any, bad: list[str], history: dict[str, str], outcome: Outcome) -> None:
    """Say what history named once, record what was left out, and end the attempt."""
    from ..errors import Unhealthy

    if b.ctx.is_main:
        for h, why in history.items():
            print(f"ddp_kit: {h} ended {REPEATS} attempts with an infrastructure failure ({why})"
                  + (": leaving it out" if outcome.left else ""), file=sys.stderr, flush=True)
    what = ", ".join(sorted({r.check for r in report.failed} | ({"history"} if history else set())))
    done = outcome.done
    if b.ctx.is_main and outcome.left:
        b.tell({"event": "excluded", "left_out": {h: (history.get(h) or f"health gate: {what}") for h in bad}, "done": done})
    hint = ("fix or drain the host, then rerun" if outcome.left else
            "the hosts share what failed: check that storage or the settings; a restart retries" if outcome.everywhere else
            f"a restart retries; to keep it off the host, drain it (SLURM: --exclude {','.join(bad)}; Kubernetes: "
            f"kubectl cordon {bad[0] if bad else 'NODE'})")
    raise Unhealthy(f"the health gate failed on {', '.join(bad)} ({what}){': ' + done if done else ''}", hint,
                    [] if outcome.everywhere else bad, outcome.code)


def make(b: Any, settings: Mapping[str, Any]) -> HealthGate | None:
    mode = settings["health_check"]
    return None if mode == "off" else HealthGate(mode)


SERVICE = Service("health", OPTIONS, make)

"""`python -m ddp_kit.launch ft --groups N --nproc_per_node P -- <train args>`: a fault-tolerant run
(strategy ft) on one machine: torchft's lighthouse, then N replica groups, each a torchrun of P ranks,
and a restart for a group that fails while the others train on.

    python -m ddp_kit.launch ft --groups 2 --nproc_per_node 2 -- --strategy ft --run_dir runs/ft
    python -m ddp_kit.launch ft --groups 2 --script my_train.py -- --epochs 3
    python -m ddp_kit.launch ft --srun --nproc_per_node 4 -- --run_dir runs/ft   # in a SLURM job: slurm/ft.sbatch

Each group gets its own rendezvous port and DDP_KIT_REPLICA_GROUP, and every group the lighthouse's
address (TORCHFT_LIGHTHOUSE): nothing to export by hand. A group that exits with an error is
restarted (a fresh torchrun, DDP_KIT_GROUP_RESTARTS counting) up to --max_restarts times and then
left out; the others go on. The lighthouse is watched too: a lighthouse that dies is started again on
the same port (up to --max_restarts times), else the groups are stopped. Once a group has finished the
job, no group is restarted, and the last line names the groups that hold the result (each group that
finishes records it in the results folder, DDP_KIT_FT_RESULTS). A stop signal (SIGTERM, SIGINT,
SIGUSR2) goes to every group, which agree on one step, checkpoint it and exit 75 (130 for Ctrl-C): the
launcher then exits the same, and the same command resumes. The groups' workers run under the same rank shim as the Kubernetes
templates (templates/k8s/rank.sh): torchrun reports any failed worker as exit 1, the shim's mark
says a worker stopped on a signal.

With --srun (inside a SLURM allocation, slurm/ft.sbatch) the same launcher spreads the groups over the nodes:
the lighthouse stays where the launcher runs (the batch host, the job's first node), group g is one
`srun --relative=g` step, a torchrun --standalone with its store on its own node, so a lost node takes one
group with it and the rest train on; the restart is a fresh step on the same node.

The lighthouse (its command, timeouts and restarts) is ft_lighthouse.py; how the launcher starts and ends
its processes, ft_procs.py.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..exit_codes import EXIT_USER_ERROR
from .ft_lighthouse import Lighthouse, join_timeout, lighthouse_command, revive
from .ft_procs import _die_with_parent, _end_session, _exit_name, _marked, free_port, say

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
RESULTS = "DDP_KIT_FT_RESULTS"  # the results folder, read by each group (parallel/ft.py, FtHooks.may_report)
JOIN = "DDP_KIT_FT_JOIN_TIMEOUT_S"  # the lighthouse's join timeout, named to a group that was left out of a quorum
# Marks the processes of one start of one group: torchrun puts its workers in sessions of their own, so
# a killed torchrun's workers are found by this mark, not by process group.
TOKEN = "DDP_KIT_FT_GROUP_TOKEN"
# Each rank runs under this shim (as templates/k8s/rank.sh does for the pods): torchrun reports any failed
# worker as its own exit 1, so a rank that stopped on a signal (75 preempted, 130 Ctrl-C) or on a failure a
# restart cannot heal (2: a user error, a deterministic one) writes its code into the group's mark; the traps
# keep the shell alive until the rank has saved and exited.
SHIM = """trap : TERM INT HUP USR2
"$@"
rc=$?
case "$rc" in 75|130|2) echo "$rc" >"${DDP_KIT_PREEMPT_MARK:-/tmp/ddp_kit.preempted}" ;; esac
exit "$rc"
"""


@dataclass
class Group:
    """One replica group: its torchrun, its restarts, how it ended."""

    index: int
    restarts: int = 0
    proc: subprocess.Popen | None = None
    code: int | None = None  # how it ended for good (None: running, or to be restarted)
    mark: Path = field(default=Path())
    token: str = ""  # in the environment of every process of this group's current start (see _end_group)
    rc: int | None = None  # how its last start exited
    restart_at: float | None = None  # failed: when its restart is due


def group_command(target: list[str], nproc: int, port: int, node: int | None = None) -> list[str]:
    """One group's torchrun: on loopback at `port`, or (node given) as an srun step on that node of the
    allocation, its rendezvous store local to it (--standalone): no group waits on another's node."""
    # USR2 (SLURM's warning, or forwarded by ft()): torchrun must pass it on, not die of it, and the
    # shim, which torchrun signals with its rank, must outlive it as it does SIGTERM.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
                "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"]
    if node is None:
        torchrun += ["--master_addr=127.0.0.1", f"--master_port={port}"]
    else:
        torchrun = ["srun", "--nodes=1", "--ntasks=1", f"--relative={node}", "--kill-on-bad-exit=1", "--export=ALL",
                    *torchrun, "--standalone"]
    return [*torchrun, "--max_restarts=0", "--no-python", "sh", "-c", SHIM, "ddp_kit-rank", *target]


def resolve_groups(groups: int | None, srun: bool, environ: Mapping[str, str] = os.environ) -> int:
    """--groups, else one per node of the SLURM allocation (--srun), else 2."""
    if not srun:
        return 2 if groups is None else groups
    nodes = environ.get("SLURM_JOB_NUM_NODES", "")
    if not nodes.isdigit():
        raise UserError("--srun needs a SLURM allocation, and SLURM_JOB_NUM_NODES is not set",
                        "run it inside a batch job (python -m ddp_kit.launch slurm --layout ft) or drop --srun")
    if groups is not None and groups > int(nodes):
        raise UserError(f"--groups {groups} with --srun: the allocation has {nodes} node(s), one group per node",
                        f"ask sbatch for --nodes={groups}, or pass --groups {nodes}")
    return int(nodes) if groups is None else groups


def train_command(train_args: tuple[str, ...], script: str | None) -> list[str]:
    """What each rank runs: `script`, else the reference job under strategy ft (its own default is ddp)."""
    args = [str(a) for a in train_args]
    if script is None and "--strategy" not in args:
        args = ["--strategy", "ft", *args]  # the reference job: its default strategy is ddp
    return [sys.executable, script, *args] if script else [sys.executable, "-m", "ddp_kit.train", *args]


def ft(*train_args: str, groups: int | None = None, nproc_per_node: int = 1, max_restarts: int = 3,
       script: str | None = None, lighthouse_port: int = 0, heartbeat_timeout_ms: int = 500,
       restart_delay_s: float = 1.0, srun: bool = False, join_timeout_ms: int | None = None) -> None:
    """Start the lighthouse and `groups` replica groups of `nproc_per_node` ranks; restart a failed group.
    srun: one group per node of this SLURM allocation, each an srun step (the module docstring says why)."""
    groups = resolve_groups(groups, srun)
    if groups < 1 or nproc_per_node < 1:
        raise UserError(f"--groups {groups} --nproc_per_node {nproc_per_node}: both must be at least 1",
                        "e.g. --groups 2 --nproc_per_node 1")
    join_ms = join_timeout(join_timeout_ms)
    target = train_command(train_args, script)
    port = lighthouse_port or free_port()
    # Groups on other nodes reach the lighthouse by this host's name; on one machine, loopback.
    lighthouse = f"http://{socket.gethostname() if srun else '127.0.0.1'}:{port}"
    base = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    stopping: list[int] = []
    # A group's rank shim writes its mark on the group's node: under srun, in the job's (shared) folder.
    marks = Path(tempfile.mkdtemp(prefix="ddp_kit_ft_", dir=_shared_tmp() if srun else None))
    house = Lighthouse(lighthouse_command(port, heartbeat_timeout_ms, join_ms),
                       {**base, TOKEN: f"{os.getpid()}-lighthouse"}, port, lighthouse, marks / "lighthouse.log")
    members = [Group(g, mark=marks / f"group{g}.stopped") for g in range(groups)]
    # Where a group that finishes the job records it, and a group that comes back reads it.
    results = marks / "results"
    results.mkdir()

    def start(group: Group) -> None:
        group.token = f"{os.getpid()}-{group.index}-{group.restarts}"
        env = {**base, TOKEN: group.token, "DDP_KIT_REPLICA_GROUP": str(group.index), "DDP_KIT_REPLICA_GROUPS": str(groups),
               "TORCHFT_LIGHTHOUSE": lighthouse, "DDP_KIT_GROUP_RESTARTS": str(group.restarts),
               "DDP_KIT_PREEMPT_MARK": str(group.mark), RESULTS: str(results), JOIN: f"{join_ms / 1000:g}"}
        command = group_command(target, nproc_per_node, free_port(), node=group.index if srun else None)
        group.proc = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        if stopping:  # a stop signal came while this group was (re)starting: it stops too
            os.kill(group.proc.pid, stopping[0])

    def forward(signum: int, _frame) -> None:
        stopping.append(signum)
        for group in members:
            if group.proc is not None and group.proc.poll() is None:
                os.kill(group.proc.pid, signum)

    previous = {s: signal.signal(s, forward) for s in STOPS}
    try:
        house.start()
        say(f"lighthouse at {lighthouse} (heartbeat timeout {heartbeat_timeout_ms} ms, join timeout {join_ms} ms); {groups} replica "
            f"group(s) of {nproc_per_node} rank(s){', one per node (srun)' if srun else ''}")
        for group in members:
            start(group)
        code = supervise(members, start, stopping, max_restarts, restart_delay_s, house=house,
                         stop=lambda: forward(signal.SIGTERM, None), results=results)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for group in members:
            _end_group(group)
        house.end()
        shutil.rmtree(marks, ignore_errors=True)
    raise SystemExit(code)


def supervise(members: list[Group], start, stopping: list[int], max_restarts: int, delay_s: float,
              finish_grace_s: float = 60.0, house: Lighthouse | None = None, stop=None,
              results: Path | None = None) -> int:
    """Wait for every group to end; restart one that fails while no stop was asked for, and the lighthouse
    when it dies (`stop()` the groups when it cannot be brought back). The exit code: 0 when every group
    finished, 75/130 when they stopped on a signal, else the first failure's.

    Once a group has finished the job (exit 0), no group is restarted: it would have no peer to take
    the final weights from. A group that fails then, or is due for a restart, is left out without
    failing the job (it holds no result, and says so). A group still running `finish_grace_s` after the
    finish is one that came back too late and did not see it (each group checks the results folder,
    parallel/ft_steps.py): it is stopped (SIGTERM: it saves and exits 75), no failure either.
    At the end one line names the groups that hold the job's result (those that recorded it in
    `results`)."""
    watch = _Watch(start, stopping, max_restarts, delay_s)
    while any(g.code is None for g in members):
        time.sleep(0.1)
        now = time.monotonic()
        if house is not None and house.proc is not None and (rc := house.exited()) is not None:
            _lighthouse_exited(house, rc, max_restarts, stop, stopping)
        if watch.finished_at is not None and now > watch.finished_at + finish_grace_s:
            _stop_late(members, watch.late, finish_grace_s)
        for group in members:
            if group.code is not None:
                continue
            if group.restart_at is not None:  # failed, its restart due after the delay
                _restart_when_due(group, watch, now)
            elif group.proc is not None and group.proc.poll() is not None:
                _exited(group, watch, now)
    if watch.finished_at is not None and results is not None:
        say(result_line(results, [g.index for g in members]))
    return _launch_code([g.code for g in members])


@dataclass
class _Watch:
    """What supervise carries from one round to the next."""

    start: Callable[[Group], None]
    stopping: list[int]
    max_restarts: int
    delay_s: float
    finished_at: float | None = None  # when a group first finished the job
    late: set[int] = field(default_factory=set)  # groups stopped for running on after it


def _lighthouse_exited(house: Lighthouse, rc: int, max_restarts: int, stop, stopping: list[int]) -> None:
    """Start it again; when it cannot be, watch it no more and stop the groups (they checkpoint and exit 75)."""
    if not revive(house, rc, max_restarts):
        house.end()
        house.proc = None  # watched no more
        if stop is not None and not stopping:
            stop()


def _stop_late(members: list[Group], late: set[int], finish_grace_s: float) -> None:
    """SIGTERM the groups still running `finish_grace_s` after another finished the job (they came back late)."""
    for group in members:
        if group.code is None and group.index not in late and group.proc is not None and group.proc.poll() is None:
            late.add(group.index)
            say(f"replica group {group.index} is still running {finish_grace_s:.0f}s after another group "
                f"finished the job: stopping it")
            os.kill(group.proc.pid, signal.SIGTERM)


def _restart_when_due(group: Group, watch: _Watch, now: float) -> None:
    """A failed group waits out the delay, then starts again: unless a stop came, or the job was finished."""
    due = group.restart_at
    if watch.stopping:  # stopped while it waited: nothing left to save
        group.code, group.restart_at = group.rc, None
    elif watch.finished_at is not None:
        say(f"replica group {group.index} is not restarted: the job was finished meanwhile, and it "
            f"would have no peer to take the final weights from; it holds no result")
        group.code, group.restart_at = 0, None
    elif due is not None and now >= due:
        group.restart_at = None
        watch.start(group)


def _exited(group: Group, watch: _Watch, now: float) -> None:
    """The group's torchrun has exited: done, stopped, or failed (_failed)."""
    rc = group.rc = group.proc.returncode
    _end_group(group)  # its workers, should torchrun itself have died first
    marked = _mark_code(group.mark)
    stopped = marked if marked in (75, 130) else 0
    if group.index in watch.late:
        group.code = 0  # the job was done without it
        return
    if rc == 0 or stopped or watch.stopping:
        group.code = stopped or rc
        if rc == 0 and watch.finished_at is None:
            watch.finished_at = now
        return
    _failed(group, watch, rc, marked, now)


def _failed(group: Group, watch: _Watch, rc: int, marked: int, now: float) -> None:
    """A group failed with no stop asked for: left out, or restarted after the delay."""
    if marked == EXIT_USER_ERROR and watch.finished_at is None:
        group.code = EXIT_USER_ERROR
        say(f"replica group {group.index} failed with exit {EXIT_USER_ERROR} (not retryable: a user error, or the "
            f"same failure at the same step twice): not restarted")
        return
    if watch.finished_at is not None:
        say(f"replica group {group.index} failed (exit {_exit_name(rc)}) after the job was finished: not "
            f"restarted; it holds no result")
        group.code = 0
        return
    if group.restarts >= watch.max_restarts:
        group.code = rc
        say(f"replica group {group.index} failed (exit {_exit_name(rc)}) after {group.restarts} restart(s) "
            f"(--max_restarts {watch.max_restarts}): left out; the other groups go on")
        return
    group.restarts += 1
    say(f"replica group {group.index} failed (exit {_exit_name(rc)}); restarting it "
        f"({group.restarts} of {watch.max_restarts}); it recovers live from a running group")
    group.restart_at = now + watch.delay_s


def _launch_code(codes: list[int | None]) -> int:
    """0 when every group finished, 75/130 when they stopped on a signal, else the first failure's."""
    if all(c == 0 for c in codes):
        return 0
    stops = [c for c in codes if c in (75, 130)]
    if stops and all(c in (0, 75, 130) for c in codes):
        return stops[0]
    failed = next(c for c in codes if c not in (0, 75, 130))
    return 128 - failed if failed < 0 else failed  # killed by a signal: the shell's 128 + N


def result_line(results: Path, groups: list[int]) -> str:
    """Which groups hold the job's result: those that recorded it when they finished (FtHooks.may_report)."""
    held: dict[int, int] = {}
    for path in results.glob("group*.json"):
        try:
            record = json.loads(path.read_text())
            held[int(record["group"])] = int(record["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not held:
        return "the job was finished (no group recorded a result)"
    names = ", ".join(str(g) for g in sorted(held))
    line = (f"the job was finished by replica group {names} at step {max(held.values())}: the result is in "
            f"run_dir/replica_<g> of {'that group' if len(held) == 1 else 'each of them'}")
    without = [g for g in groups if g not in held]
    if without:
        line += f"; replica group {', '.join(map(str, without))} holds no result"
    return line


def _shared_tmp() -> Path:
    """.ddp_kit/ in the working folder, which sbatch's nodes share (/tmp is each node's own)."""
    path = Path(".ddp_kit").resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _mark_code(mark: Path) -> int:
    """The code a group's rank stopped with on a signal (75, 130) or on a failure that is not retryable
    (2), from the shim's mark; 0: none."""
    try:
        text = mark.read_text().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 75  # an empty mark (templates/k8s/rank.sh's): preempted


def _end_group(group: Group, timeout_s: float = 10.0) -> None:
    """SIGKILL every process left of the group's current start (its torchrun's session and the workers
    carrying its token), and wait until they are gone: a restart must not find the old workers' run
    folder lock held."""
    _end_session(group.proc)
    if not group.token:
        return
    end = time.monotonic() + timeout_s
    while True:
        left = _marked(f"{TOKEN}={group.token}".encode())
        if not left or time.monotonic() > end:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)

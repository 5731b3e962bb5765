"""`python -m ddp_kit.launch ft --groups N --nproc_per_node P -- <train args>`: a fault-tolerant run
(strategy ft) on one machine: torchft's lighthouse, then N replica groups, each a torchrun of P ranks,
and a restart for a group that fails while the others train on.

    python -m ddp_kit.launch ft --groups 2 --nproc_per_node 2 -- --strategy ft --run_dir runs/ft
    python -m ddp_kit.launch ft --groups 2 --script my_train.py -- --epochs 3
    python -m ddp_kit.launch ft --srun --nproc_per_node 4 -- --run_dir runs/ft   # in a SLURM job: slurm/ft.sbatch

Each group gets its own rendezvous port and DDP_KIT_REPLICA_GROUP, and every group the lighthouse's
address (TORCHFT_LIGHTHOUSE): nothing to export by hand. A group that exits with an error is
restarted (a fresh torchrun, DDP_KIT_GROUP_RESTARTS counting) up to --max_restarts times and then
left out; the others go on. A stop signal (SIGTERM, SIGINT, SIGUSR2) goes to every group, which
agree on one step, checkpoint it and exit 75 (130 for Ctrl-C): the launcher then exits the same, and
the same command resumes. The groups' workers run under the same rank shim as the Kubernetes
templates (templates/k8s/rank.sh): torchrun reports any failed worker as exit 1, the shim's mark
says a worker stopped on a signal.

With --srun (inside a SLURM allocation, slurm/ft.sbatch) the same launcher spreads the groups over the nodes:
the lighthouse stays where the launcher runs (the batch host, the job's first node), group g is one
`srun --relative=g` step, a torchrun --standalone with its store on its own node, so a lost node takes one
group with it and the rest train on; the restart is a fresh step on the same node.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
# Marks the processes of one start of one group: torchrun puts its workers in sessions of their own, so
# a killed torchrun's workers are found by this mark, not by process group.
TOKEN = "DDP_KIT_FT_GROUP_TOKEN"
# Each rank runs under this shim (as templates/k8s/rank.sh does for the pods): torchrun reports any failed
# worker as its own exit 1, so a rank that stopped on a signal (75 preempted, 130 Ctrl-C) writes its code
# into the group's mark; the traps keep the shell alive until the rank has saved and exited.
SHIM = """trap : TERM INT HUP USR2
"$@"
rc=$?
case "$rc" in 75|130) echo "$rc" >"${DDP_KIT_PREEMPT_MARK:-/tmp/ddp_kit.preempted}" ;; esac
exit "$rc"
"""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def lighthouse_binary() -> str:
    found = shutil.which("torchft_lighthouse") or shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    if not found:
        raise UserError("torchft_lighthouse is not installed (it comes with torchft)", "pip install 'ddp_kit[ft]'")
    return found


def lighthouse_command(port: int, heartbeat_timeout_ms: int, join_timeout_ms: int = 1000) -> list[str]:
    """torchft's lighthouse for one job. min_replicas 1: a quorum forms with whatever groups are alive
    (a fresh start waits for all of them in ddp_kit itself, reliability/replica_steps.join). The
    heartbeat timeout is how long the survivors pause when a group dies without a word; join_timeout
    how long a quorum waits for a group that heartbeats but has not asked yet."""
    return [lighthouse_binary(), "--min_replicas", "1", "--bind", f"[::]:{port}",
            "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--join_timeout_ms", str(join_timeout_ms),
            "--quorum_tick_ms", "20"]


def wait_listening(port: int, proc: subprocess.Popen, log: Path | None = None, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            said = log.read_text(errors="replace").strip().splitlines()[-1:] if log is not None and log.exists() else []
            raise UserError(f"torchft's lighthouse exited with {proc.returncode} at startup (port {port})"
                            + (f": {said[0][:200]}" if said else ""),
                            "pass another --lighthouse_port, or check that torchft is installed whole")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise UserError(f"torchft's lighthouse did not listen on port {port} within {timeout_s:.0f}s",
                    "check that nothing else holds the port, or pass another --lighthouse_port")


@dataclass
class Group:
    """One replica group: its torchrun, its restarts, how it ended."""

    index: int
    restarts: int = 0
    proc: subprocess.Popen | None = None
    code: int | None = None  # how it ended for good (None: running, or to be restarted)
    mark: Path = field(default=Path())
    token: str = ""  # in the environment of every process of this group's current start (see _end_group)


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


def ft(*train_args: str, groups: int | None = None, nproc_per_node: int = 1, max_restarts: int = 3,
       script: str | None = None, lighthouse_port: int = 0, heartbeat_timeout_ms: int = 500,
       restart_delay_s: float = 1.0, srun: bool = False, join_timeout_ms: int = 1000) -> None:
    """Start the lighthouse and `groups` replica groups of `nproc_per_node` ranks; restart a failed group.
    srun: one group per node of this SLURM allocation, each an srun step (the module docstring says why)."""
    groups = resolve_groups(groups, srun)
    if groups < 1 or nproc_per_node < 1:
        raise UserError(f"--groups {groups} --nproc_per_node {nproc_per_node}: both must be at least 1",
                        "e.g. --groups 2 --nproc_per_node 1")
    args = [str(a) for a in train_args]
    if script is None and "--strategy" not in args:
        args = ["--strategy", "ft", *args]  # the reference job: its default strategy is ddp
    target = [sys.executable, script, *args] if script else [sys.executable, "-m", "ddp_kit.train", *args]
    port = lighthouse_port or free_port()
    # Groups on other nodes reach the lighthouse by this host's name; on one machine, loopback.
    lighthouse = f"http://{socket.gethostname() if srun else '127.0.0.1'}:{port}"
    base = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    stopping: list[int] = []
    # A group's rank shim writes its mark on the group's node: under srun, in the job's (shared) folder.
    marks = Path(tempfile.mkdtemp(prefix="ddp_kit_ft_", dir=_shared_tmp() if srun else None))
    # The lighthouse's log goes to a file (a pipe nobody reads would fill and stall it): its tail is
    # shown when it fails to start.
    house_log = open(marks / "lighthouse.log", "wb")
    house = subprocess.Popen(lighthouse_command(port, heartbeat_timeout_ms, join_timeout_ms),
                             env={**base, TOKEN: f"{os.getpid()}-lighthouse"}, start_new_session=True,
                             preexec_fn=_die_with_parent, stdout=subprocess.DEVNULL, stderr=house_log)
    members = [Group(g, mark=marks / f"group{g}.stopped") for g in range(groups)]

    def start(group: Group) -> None:
        group.token = f"{os.getpid()}-{group.index}-{group.restarts}"
        env = {**base, TOKEN: group.token, "DDP_KIT_REPLICA_GROUP": str(group.index), "DDP_KIT_REPLICA_GROUPS": str(groups),
               "TORCHFT_LIGHTHOUSE": lighthouse, "DDP_KIT_GROUP_RESTARTS": str(group.restarts),
               "DDP_KIT_PREEMPT_MARK": str(group.mark)}
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
        wait_listening(port, house, marks / "lighthouse.log")
        say(f"lighthouse at {lighthouse} (heartbeat timeout {heartbeat_timeout_ms} ms); {groups} replica "
            f"group(s) of {nproc_per_node} rank(s){', one per node (srun)' if srun else ''}")
        for group in members:
            start(group)
        code = supervise(members, start, stopping, max_restarts, restart_delay_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for group in members:
            _end_group(group)
        _end_session(house)
        house_log.close()
        shutil.rmtree(marks, ignore_errors=True)
    raise SystemExit(code)


def supervise(members: list[Group], start, stopping: list[int], max_restarts: int, delay_s: float,
              finish_grace_s: float = 60.0) -> int:
    """Wait for every group to end; restart one that fails while no stop was asked for. The exit code:
    0 when every group finished, 75/130 when they stopped on a signal, else the first failure's.

    Once a group has finished the job, the others have `finish_grace_s` to finish too (one in step
    with it ends within a step); a group still running then is one that came back too late to have a
    peer to recover from, and would only train alone from its own checkpoint: it is stopped (SIGTERM:
    it saves and exits 75), and that is not a failure of the job."""
    finished_at: float | None = None
    late: set[int] = set()
    while any(g.code is None for g in members):
        time.sleep(0.1)
        if finished_at is not None and time.monotonic() > finished_at + finish_grace_s:
            for group in members:
                if group.code is None and group.index not in late and group.proc is not None and group.proc.poll() is None:
                    late.add(group.index)
                    say(f"replica group {group.index} is still running {finish_grace_s:.0f}s after another group "
                        f"finished the job: stopping it")
                    os.kill(group.proc.pid, signal.SIGTERM)
        for group in members:
            if group.code is not None or group.proc is None or group.proc.poll() is None:
                continue
            rc = group.proc.returncode
            _end_group(group)  # its workers, should torchrun itself have died first
            stopped = _mark_code(group.mark)
            # After a group has finished the job, one that fails has no peer left to recover from.
            if group.index in late:
                group.code = 0  # the job was done without it
                continue
            if rc == 0 or stopped or stopping or finished_at is not None:
                group.code = stopped or rc
                if rc == 0 and finished_at is None:
                    finished_at = time.monotonic()
                continue
            if group.restarts >= max_restarts:
                group.code = rc
                say(f"replica group {group.index} failed (exit {_exit_name(rc)}) after {group.restarts} restart(s) "
                    f"(--max_restarts {max_restarts}): left out; the other groups go on")
                continue
            group.restarts += 1
            say(f"replica group {group.index} failed (exit {_exit_name(rc)}); restarting it "
                f"({group.restarts} of {max_restarts}); it recovers live from a running group")
            time.sleep(delay_s)
            if stopping:  # stopped while it waited to restart: nothing left to save
                group.code = rc
                continue
            start(group)
    codes = [g.code for g in members]
    if all(c == 0 for c in codes):
        return 0
    stops = [c for c in codes if c in (75, 130)]
    if stops and all(c in (0, 75, 130) for c in codes):
        return stops[0]
    failed = next(c for c in codes if c not in (0, 75, 130))
    return 128 - failed if failed < 0 else failed  # killed by a signal: the shell's 128 + N


def _shared_tmp() -> Path:
    """.ddp_kit/ in the working folder, which sbatch's nodes share (/tmp is each node's own)."""
    path = Path(".ddp_kit").resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _mark_code(mark: Path) -> int:
    """The code a group's rank stopped with on a signal (75, 130), from the shim's mark; 0: none."""
    try:
        text = mark.read_text().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 75  # an empty mark (templates/k8s/rank.sh's): preempted


def _exit_name(rc: int) -> str:
    return f"{rc} ({signal.Signals(-rc).name})" if rc < 0 and -rc in signal.valid_signals() else str(rc)


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


def _marked(needle: bytes) -> list[int]:
    """PIDs whose environment holds `needle` (only this user's processes can be read: ours)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                out.append(int(entry.name))
        except OSError:
            continue
    return out


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG), so that no lighthouse or torchrun outlives it; elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _end_session(proc: subprocess.Popen | None) -> None:
    """SIGKILL what is left of a session this launcher started (a killed torchrun's orphaned workers)."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(timeout=10)


def say(msg: str) -> None:
    print(f"ddp_kit: launch ft: {msg}", file=sys.stderr, flush=True)

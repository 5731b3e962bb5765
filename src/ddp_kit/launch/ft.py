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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..exit_codes import EXIT_USER_ERROR

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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def lighthouse_binary() -> str:
    found = shutil.which("torchft_lighthouse") or shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    if not found:
        raise UserError("torchft_lighthouse is not installed (it comes with torchft)", "pip install 'ddp_kit[ft]'")
    return found


def quorum_timeout_s(environ: Mapping[str, str] = os.environ) -> float:
    """The groups' quorum timeout (DDP_KIT_FT_QUORUM_TIMEOUT_S, 60 s: parallel/ft.py's Timeouts.quorum_s)."""
    raw = environ.get("DDP_KIT_FT_QUORUM_TIMEOUT_S", "").strip()
    try:
        return float(raw) if raw else 60.0
    except ValueError:
        raise UserError(f"DDP_KIT_FT_QUORUM_TIMEOUT_S={raw!r} is not a number of seconds",
                        "set it to e.g. 120, or unset it (60)") from None


def join_timeout(join_timeout_ms: int | None, environ: Mapping[str, str] = os.environ) -> int:
    """The lighthouse's join timeout: how long a quorum that a majority of the groups asked for waits for
    a group that is alive (heartbeats) but has not asked yet. It matters with 3 or more groups (with 2,
    no quorum forms without both while both live), when one group is late, by a checkpoint write slower
    than the others', an evaluation, a long step: a group left out then takes the whole state live at the
    next quorum, or, near the end, misses the job's end. So by default it is as long as it can be: half
    the groups' quorum timeout (30 of 60 s), so that the groups waiting for a late one do not time out
    first. (ddp_kit's own checkpoints are followed by a stop check across the groups, which waits for
    the slowest writer up to DDP_KIT_FT_TIMEOUT_S.) Groups later than that: raise
    DDP_KIT_FT_QUORUM_TIMEOUT_S (the join timeout follows)."""
    quorum_ms = quorum_timeout_s(environ) * 1000
    if join_timeout_ms is None:
        return int(quorum_ms / 2)
    if join_timeout_ms >= quorum_ms:
        raise UserError(f"--join_timeout_ms {join_timeout_ms} is not below the groups' quorum timeout ({quorum_ms:.0f} ms, "
                        f"DDP_KIT_FT_QUORUM_TIMEOUT_S): groups waiting for a late one would time out first",
                        f"pass --join_timeout_ms below {quorum_ms:.0f}, or raise DDP_KIT_FT_QUORUM_TIMEOUT_S")
    return join_timeout_ms


def lighthouse_command(port: int, heartbeat_timeout_ms: int, join_timeout_ms: int) -> list[str]:
    """torchft's lighthouse for one job. min_replicas 1: a quorum forms with whatever groups are alive
    (a fresh start waits for all of them in ddp_kit itself, parallel/ft_steps.py, FtHooks.restore). The
    heartbeat timeout is how long the survivors pause when a group dies without a word; the join
    timeout how long a quorum waits for a group that heartbeats but has not asked yet (join_timeout)."""
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
class Lighthouse:
    """torchft's lighthouse for this job, watched by the launcher (supervise): when it dies, it is started
    again on the same port, and the groups' manager servers reconnect to it (their quorum requests retry,
    parallel/ft.py) and go on; at most `max_restarts` times, then the groups are stopped."""

    command: list[str]
    env: dict[str, str]
    port: int
    address: str
    log: Path  # its stderr (a pipe nobody reads would fill and stall it): its tail is shown when it fails to start
    restarts: int = 0
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command, env=self.env, start_new_session=True, preexec_fn=_die_with_parent,
                                         stdout=subprocess.DEVNULL, stderr=log)
        wait_listening(self.port, self.proc, self.log)

    def exited(self) -> int | None:
        """Its exit code once it has exited; None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def end(self) -> None:
        _end_session(self.proc)


def revive(house: Lighthouse, rc: int, max_restarts: int) -> bool:
    """The lighthouse exited: start it again (True), or say why not (False: the groups are to stop)."""
    lost = f"torchft's lighthouse at {house.address} exited ({_exit_name(rc)})"
    stop = ("stopping the replica groups (each checkpoints at its next agreed step and exits 75); rerun the same "
            "command to resume")
    if house.restarts >= max_restarts:
        say(f"{lost} after {house.restarts} restart(s) (--max_restarts {max_restarts}): {stop}")
        return False
    house.restarts += 1
    try:
        house.start()
    except UserError as err:
        say(f"{lost} and could not be started again: {err.message}; {stop}")
        return False
    say(f"{lost}: restarted it on the same port ({house.restarts} of {max_restarts}); the replica groups reconnect "
        f"and go on")
    return True


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
    finished_at: float | None = None
    late: set[int] = set()
    while any(g.code is None for g in members):
        time.sleep(0.1)
        now = time.monotonic()
        if house is not None and house.proc is not None and (rc := house.exited()) is not None:
            if not revive(house, rc, max_restarts):
                house.end()
                house.proc = None  # watched no more
                if stop is not None and not stopping:
                    stop()
        if finished_at is not None and now > finished_at + finish_grace_s:
            for group in members:
                if group.code is None and group.index not in late and group.proc is not None and group.proc.poll() is None:
                    late.add(group.index)
                    say(f"replica group {group.index} is still running {finish_grace_s:.0f}s after another group "
                        f"finished the job: stopping it")
                    os.kill(group.proc.pid, signal.SIGTERM)
        for group in members:
            if group.code is not None:
                continue
            if group.restart_at is not None:  # failed, its restart due after the delay
                if stopping:  # stopped while it waited: nothing left to save
                    group.code, group.restart_at = group.rc, None
                elif finished_at is not None:
                    say(f"replica group {group.index} is not restarted: the job was finished meanwhile, and it "
                        f"would have no peer to take the final weights from; it holds no result")
                    group.code, group.restart_at = 0, None
                elif now >= group.restart_at:
                    group.restart_at = None
                    start(group)
                continue
            if group.proc is None or group.proc.poll() is None:
                continue
            rc = group.rc = group.proc.returncode
            _end_group(group)  # its workers, should torchrun itself have died first
            marked = _mark_code(group.mark)
            stopped = marked if marked in (75, 130) else 0
            if group.index in late:
                group.code = 0  # the job was done without it
                continue
            if rc == 0 or stopped or stopping:
                group.code = stopped or rc
                if rc == 0 and finished_at is None:
                    finished_at = now
                continue
            if marked == EXIT_USER_ERROR and finished_at is None:
                group.code = EXIT_USER_ERROR
                say(f"replica group {group.index} failed with exit {EXIT_USER_ERROR} (not retryable: a user error, or the "
                    f"same failure at the same step twice): not restarted")
                continue
            if finished_at is not None:
                say(f"replica group {group.index} failed (exit {_exit_name(rc)}) after the job was finished: not "
                    f"restarted; it holds no result")
                group.code = 0
                continue
            if group.restarts >= max_restarts:
                group.code = rc
                say(f"replica group {group.index} failed (exit {_exit_name(rc)}) after {group.restarts} restart(s) "
                    f"(--max_restarts {max_restarts}): left out; the other groups go on")
                continue
            group.restarts += 1
            say(f"replica group {group.index} failed (exit {_exit_name(rc)}); restarting it "
                f"({group.restarts} of {max_restarts}); it recovers live from a running group")
            group.restart_at = now + delay_s
    if finished_at is not None and results is not None:
        say(result_line(results, [g.index for g in members]))
    codes = [g.code for g in members]
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

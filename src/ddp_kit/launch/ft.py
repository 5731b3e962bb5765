"""`python -m ddp_kit.launch ft --groups N --nproc_per_node P -- <train args>`: a fault-tolerant run
(strategy ft) on one machine: torchft's lighthouse, then N replica groups, each a torchrun of P ranks,
and a restart for a group that fails while the others train on.

    python -m ddp_kit.launch ft --groups 2 --nproc_per_node 2 -- --strategy ft --run_dir runs/ft
    python -m ddp_kit.launch ft --groups 2 --script my_train.py -- --epochs 3

Each group gets its own rendezvous port and DDP_KIT_REPLICA_GROUP, and every group the lighthouse's
address (TORCHFT_LIGHTHOUSE): nothing to export by hand. A group that exits with an error is
restarted (a fresh torchrun, DDP_KIT_GROUP_RESTARTS counting) up to --max_restarts times and then
left out; the others go on. A stop signal (SIGTERM, SIGINT, SIGUSR2) goes to every group, which
agree on one step, checkpoint it and exit 75 (130 for Ctrl-C): the launcher then exits the same, and
the same command resumes. The groups' workers run under the same rank shim as the Kubernetes
templates (templates/k8s/rank.sh): torchrun reports any failed worker as exit 1, the shim's mark
says a worker stopped on a signal.
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
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
# Marks the processes of one start of one group: torchrun puts its workers in sessions of their own, so
# a killed torchrun's workers are found by this mark, not by process group.
TOKEN = "DDP_KIT_FT_GROUP_TOKEN"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def lighthouse_binary() -> str:
    found = shutil.which("torchft_lighthouse") or shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    if not found:
        raise UserError("torchft_lighthouse is not installed (it comes with torchft)", "pip install 'ddp_kit[ft]'")
    return found


def lighthouse_command(port: int, heartbeat_timeout_ms: int, join_timeout_ms: int = 100) -> list[str]:
    """torchft's lighthouse for one job. min_replicas 1: a quorum forms with whatever groups are alive
    (a fresh start waits for all of them in ddp_kit itself, reliability/replica_steps.join). The
    heartbeat timeout is how long the survivors pause when a group dies without a word; join_timeout
    how long a quorum waits for a group that heartbeats but has not asked yet."""
    return [lighthouse_binary(), "--min_replicas", "1", "--bind", f"[::]:{port}",
            "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--join_timeout_ms", str(join_timeout_ms),
            "--quorum_tick_ms", "20"]


def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise UserError(f"torchft's lighthouse exited with {proc.returncode} at startup (port {port})",
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


def group_command(target: list[str], nproc: int, port: int) -> list[str]:
    shim = (Path(__file__).resolve().parent / "templates" / "k8s" / "rank.sh").read_text()
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1", f"--master_port={port}", "--max_restarts=0", "--no-python",
            "sh", "-c", shim, "ddp_kit-rank", *target]


def ft(*train_args: str, groups: int = 2, nproc_per_node: int = 1, max_restarts: int = 3, script: str | None = None,
       lighthouse_port: int = 0, heartbeat_timeout_ms: int = 500, restart_delay_s: float = 1.0) -> None:
    """Start the lighthouse and `groups` replica groups of `nproc_per_node` ranks; restart a failed group."""
    if groups < 1 or nproc_per_node < 1:
        raise UserError(f"--groups {groups} --nproc_per_node {nproc_per_node}: both must be at least 1",
                        "e.g. --groups 2 --nproc_per_node 1")
    args = [str(a) for a in train_args]
    if script is None and "--strategy" not in args:
        args = ["--strategy", "ft", *args]  # the reference job: its default strategy is ddp
    target = [sys.executable, script, *args] if script else [sys.executable, "-m", "ddp_kit.train", *args]
    port = lighthouse_port or free_port()
    base = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    house = subprocess.Popen(lighthouse_command(port, heartbeat_timeout_ms), env=base, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stopping: list[int] = []
    marks = Path(tempfile.mkdtemp(prefix="ddp_kit_ft_"))
    members = [Group(g, mark=marks / f"group{g}.stopped") for g in range(groups)]

    def start(group: Group) -> None:
        group.token = f"{os.getpid()}-{group.index}-{group.restarts}"
        env = {**base, TOKEN: group.token, "DDP_KIT_REPLICA_GROUP": str(group.index), "DDP_KIT_REPLICA_GROUPS": str(groups),
               "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "DDP_KIT_GROUP_RESTARTS": str(group.restarts),
               "DDP_KIT_PREEMPT_MARK": str(group.mark)}
        group.proc = subprocess.Popen(group_command(target, nproc_per_node, free_port()), env=env, start_new_session=True)

    def forward(signum: int, _frame) -> None:
        stopping.append(signum)
        for group in members:
            if group.proc is not None and group.proc.poll() is None:
                os.kill(group.proc.pid, signum)

    previous = {s: signal.signal(s, forward) for s in STOPS}
    try:
        wait_listening(port, house)
        say(f"lighthouse at http://127.0.0.1:{port} (heartbeat timeout {heartbeat_timeout_ms} ms); {groups} replica "
            f"group(s) of {nproc_per_node} rank(s)")
        for group in members:
            start(group)
        code = supervise(members, start, stopping, max_restarts, restart_delay_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for group in members:
            _end_group(group)
        _end_session(house)
        shutil.rmtree(marks, ignore_errors=True)
    raise SystemExit(code)


def supervise(members: list[Group], start, stopping: list[int], max_restarts: int, delay_s: float) -> int:
    """Wait for every group to end; restart one that fails while no stop was asked for. The exit code:
    0 when every group finished, 75/130 when they stopped on a signal, else the first failure's."""
    while any(g.code is None for g in members):
        time.sleep(0.1)
        for group in members:
            if group.code is not None or group.proc is None or group.proc.poll() is None:
                continue
            rc = group.proc.returncode
            _end_group(group)  # its workers, should torchrun itself have died first
            stopped = group.mark.exists()
            if rc == 0 or stopped or stopping:
                group.code = (130 if stopping and stopping[0] == signal.SIGINT else 75) if stopped else rc
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
            start(group)
    codes = [g.code for g in members]
    if all(c == 0 for c in codes):
        return 0
    stops = [c for c in codes if c in (75, 130)]
    if stops and all(c in (0, 75, 130) for c in codes):
        return stops[0]
    return next(c for c in codes if c not in (0, 75, 130)) or 1


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

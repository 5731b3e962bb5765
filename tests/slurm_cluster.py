"""A real, throw-away SLURM cluster on this one machine, for the tests (root, Debian's slurm + munge).

munged + slurmctld + N slurmd daemons; each slurmd runs in its own UTS + mount namespace with
hostname node<i> and a private /etc/hosts (node<i> -> 127.0.1.<i>), so jobs see distinct,
resolvable hosts, all on loopback. Every daemon's PID is recorded; `stop()` signals only those
PIDs and the processes left in the nodes' namespaces. Starts in about a second.

Install once: apt-get install --no-install-recommends slurmctld slurmd slurm-client munge
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BINARIES = ("munged", "munge", "unmunge", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "unshare")

CONF = """\
ClusterName=ddpkit
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool/%n
SlurmctldPidFile={base}/run/slurmctld.pid
SlurmdPidFile={base}/run/slurmd.%n.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd.%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={base}/log/jobcomp.txt
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1,bf_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
EnforcePartLimits=ALL
JobRequeue=1
SlurmdTimeout=60
SlurmctldTimeout=60
InactiveLimit=0
MinJobAge=600
KillWait=5
Waittime=0
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


def available() -> str | None:
    """None when a cluster can be started here; otherwise why not."""
    if os.geteuid() != 0:
        return "needs root"
    missing = [b for b in BINARIES if not shutil.which(b)]
    if missing:
        return f"missing {' '.join(missing)} (apt-get install --no-install-recommends slurmctld slurmd slurm-client munge)"
    return None


def _free_port_block(n: int) -> int:
    for base in range(17800, 30000, 37):
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port block for slurm")


@dataclass
class Cluster:
    base: Path
    nodes: int = 2
    cpus: int = 4
    pids: dict[str, int] = field(default_factory=dict)
    uts: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def start(self, timeout: float = 60) -> Cluster:
        for d in ("etc", "state", "spool", "log", "run"):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        # munged wants every directory above its socket world-executable, and the path short.
        self.rt = Path(tempfile.mkdtemp(prefix="ddpkit-munge-", dir="/tmp"))
        os.chmod(self.rt, 0o755)
        key = self.base / "munge.key"
        key.write_bytes(os.urandom(128))
        os.chmod(key, 0o400)
        sock = self.rt / "munge.socket"
        self._spawn("munged", ["munged", "-F", f"--key-file={key}", f"--socket={sock}", f"--pid-file={self.rt}/munged.pid",
                               f"--seed-file={self.rt}/munged.seed", f"--log-file={self.base}/log/munged.log"])
        self._wait(lambda: subprocess.run(f"munge -n -S {sock} | unmunge -S {sock}", shell=True,
                                          capture_output=True).returncode == 0, 10, "munged")
        port = _free_port_block(self.nodes + 1)
        hosts = ["127.0.0.1 localhost"] + [f"127.0.1.{i} node{i}" for i in range(1, self.nodes + 1)]
        (self.base / "etc" / "hosts").write_text("\n".join(hosts) + "\n")
        nodes = "\n".join(f"NodeName=node{i} NodeHostname=node{i} NodeAddr=127.0.1.{i} Port={port + i} CPUs={self.cpus} "
                          f"RealMemory=1000 State=UNKNOWN" for i in range(1, self.nodes + 1))
        conf = self.base / "etc" / "slurm.conf"
        conf.write_text(CONF.format(ctld_port=port, slurmd_port=port + 1, munge_socket=sock, base=self.base, nodes=nodes))
        self.env = {"SLURM_CONF": str(conf)}
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(conf)])
        self.node_local.mkdir(parents=True, exist_ok=True)
        for i in range(1, self.nodes + 1):
            (self.base / "spool" / f"node{i}").mkdir(parents=True, exist_ok=True)
            # unshare execs sh, which execs slurmd: the recorded PID is slurmd's own.
            # NODE_LOCAL is a private tmpfs in each node's mount namespace: what a job writes there on
            # node1 does not exist on node2, like a node's local disk.
            self._spawn(f"slurmd.node{i}", ["unshare", "--uts", "--mount", "--propagation", "slave", "--", "/bin/sh", "-c",
                                            'hostname "$1" && mount --bind "$2" /etc/hosts && mount -t tmpfs -o size=64m '
                                            'tmpfs "$4" && exec slurmd -D -N "$1" -f "$3"',
                                            "sh", f"node{i}", str(self.base / "etc" / "hosts"), str(conf), str(self.node_local)])
        self._wait(self._all_idle, timeout, "slurm nodes idle")
        for i in range(1, self.nodes + 1):
            self.uts[f"node{i}"] = os.readlink(f"/proc/{self.pids[f'slurmd.node{i}']}/ns/uts")
        return self

    @property
    def node_local(self) -> Path:
        """A folder that is a separate, empty tmpfs on each node (for jobs; empty from outside)."""
        return self.base / "node_local"

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.base / "log" / f"{name}.stdout", "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                             start_new_session=True)
        self.pids[name] = p.pid

    def _wait(self, cond, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if cond():
                return
            for name, pid in self.pids.items():
                if not _alive(pid):
                    raise RuntimeError(f"{name} died; see {self.base}/log/")
            time.sleep(0.1)
        raise RuntimeError(f"timed out waiting for {what}; see {self.base}/log/")

    def _all_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], check=False).stdout
        return len(out.split()) == self.nodes

    def run(self, cmd: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **self.env}, timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr}")
        return res

    def sbatch(self, args: list[str], env: dict | None = None, unset: tuple[str, ...] = ()) -> str:
        full = {k: v for k, v in {**os.environ, **self.env, **(env or {})}.items() if k not in unset}
        res = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=30, env=full)
        if res.returncode != 0:
            raise RuntimeError(f"sbatch failed: {res.stderr}")
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run(["scontrol", "show", "job", "-o", job_id], check=False).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_job(self, job_id: str, timeout: float = 300, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                                       "NODE_FAIL", "OUT_OF_MEMORY")) -> dict[str, str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} did not end within {timeout}s:\n{self.describe(job_id)}")

    def describe(self, job_id: str, tail: int = 3000) -> str:
        """What a job is doing, for a failure message: its scheduler fields, the whole queue (a job
        PENDING for Resources waits for whatever holds the nodes) and the tail of its output file."""
        info = self.job(job_id)
        fields = " ".join(f"{k}={info.get(k)}" for k in ("JobId", "JobState", "Reason", "ExitCode", "Restarts",
                                                           "RunTime", "NodeList"))
        queue = self.run(["squeue", "-h", "-o", "%i %T %R %M"], check=False).stdout.strip()
        out = Path(info.get("StdOut", "/nonexistent"))
        text = out.read_text(errors="replace")[-tail:] if out.is_file() else f"(no output file {out})"
        return f"{fields}\nqueue:\n{queue}\noutput ({out}):\n{text}"

    def cancel_all(self, timeout: float = 20) -> list[str]:
        """Cancel every job still queued or running and wait until the nodes are idle, so that a test
        that failed mid-job does not leave the next tests PENDING behind it. Returns what it cancelled."""
        jobs = self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
        if jobs:
            self.run(["scancel", *jobs], check=False)
        end = time.monotonic() + timeout
        while time.monotonic() < end and (self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip()
                                          or not self._all_idle()):
            time.sleep(0.1)
        return jobs

    def stop(self) -> None:
        self.cancel_all(timeout=10)
        for pid in self.pids.values():
            _kill(pid, signal.SIGTERM)
        _wait_gone(list(self.pids.values()), 10)
        for pid in self.pids.values():
            _kill(pid, signal.SIGKILL)
        # Job processes left in the nodes' private UTS namespaces: found and killed by PID.
        for ns in self.uts.values():
            for sig in (signal.SIGTERM, signal.SIGKILL):
                left = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _uts(d) == ns]
                for pid in left:
                    _kill(pid, sig)
                if not left or _wait_gone(left, 5):
                    break
        shutil.rmtree(getattr(self, "rt", "/nonexistent"), ignore_errors=True)


def _uts(d: Path) -> str | None:
    try:
        return os.readlink(d / "ns" / "uts")
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(pids: list[int], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False

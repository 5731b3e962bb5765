"""Hosts as network namespaces for the tests: each one its own loopback, one veth into a shared
/24 (addresses that exist only inside the namespaces), its own hosts file (bound over /etc/hosts by
`ip netns exec`) and, through `unshare --uts`, its own hostname. Removed afterwards, with every
process inside them (only those: they are ours)."""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

AVAILABLE = os.geteuid() == 0 and bool(shutil.which("ip")) and bool(shutil.which("unshare"))


def finish(procs: list[subprocess.Popen], timeout: float = 180) -> list[str]:
    """Each process's combined output once it ends; one that outlives `timeout` is killed with its
    process group (ours: started with start_new_session) and says so in its output."""
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            outs.append(p.communicate()[0] + "\n[killed by the test: timed out]")
    return outs


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@dataclass(frozen=True)
class Host:
    name: str  # its hostname
    ns: str  # its network namespace
    addr: str

    @property
    def hosts_file(self) -> Path:
        return Path(f"/etc/netns/{self.ns}/hosts")

    def command(self, *argv: str, setup: str = "") -> list[str]:
        """`argv` run inside this host, under its hostname. `setup`: shell commands run first, as root in the
        host's own mount namespace (`ip netns exec` makes one, a slave of the machine's): a mount there, such
        as a tiny tmpfs over /dev/shm, is this host's alone."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--", "sh", "-c",
                f'hostname {self.name} && {setup + " && " if setup else ""}exec "$@"', "sh", *argv]


_calls = itertools.count()


@contextmanager
def hosts(names: list[str], subnet: str = "10.231.0", hosts_entries: dict[str, str] | None = None) -> Iterator[list[Host]]:
    """Namespaces joined by a bridge, host i at <subnet>.<i+1>. Each hosts file names every host,
    plus `hosts_entries` (name -> address); a test may append to it later (the bind mount follows the
    file, so a name can appear while the processes run)."""
    # Unique per call, not only per process: the kernel destroys a deleted namespace's veth asynchronously,
    # so the next test in this worker reusing the names could find them still there ("File exists").
    tag = f"dk{os.getpid() % 10000}{next(_calls) % 100:02d}"
    made = [Host(name, f"{tag}{i}", f"{subnet}.{i + 1}") for i, name in enumerate(names)]
    bridge = f"{tag}br"
    try:
        sh("ip", "link", "add", bridge, "type", "bridge")
        sh("ip", "link", "set", bridge, "up")
        lines = ["127.0.0.1 localhost", *(f"{h.addr} {h.name}" for h in made),
                 *(f"{addr} {name}" for name, addr in (hosts_entries or {}).items())]
        for h in made:
            sh("ip", "netns", "add", h.ns)
            sh("ip", "link", "add", f"v{h.ns}", "type", "veth", "peer", "name", f"b{h.ns}")
            sh("ip", "link", "set", f"v{h.ns}", "netns", h.ns)
            sh("ip", "link", "set", f"b{h.ns}", "master", bridge)
            sh("ip", "link", "set", f"b{h.ns}", "up")
            sh("ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", f"v{h.ns}")
            sh("ip", "-n", h.ns, "link", "set", "lo", "up")
            sh("ip", "-n", h.ns, "link", "set", f"v{h.ns}", "up")
            h.hosts_file.parent.mkdir(parents=True, exist_ok=True)
            h.hosts_file.write_text("\n".join(lines) + "\n")
        yield made
    finally:
        for h in made:
            for pid in subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True, text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True)
            shutil.rmtree(h.hosts_file.parent, ignore_errors=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)

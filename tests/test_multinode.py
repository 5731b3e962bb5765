"""Multi-node torchrun outside SLURM: two "hosts" as two network namespaces joined by a veth pair
(10.231.0.1 nodea / 10.231.0.2 nodeb, addresses that exist only inside them), each with its own
hostname; launch/torchrun.sh runs on both with c10d rendezvous on nodea. Namespaces are removed after."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import REFERENCE_3_EPOCHS, ROOT, proc_env, read_json

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"),
                                 reason="needs root, iproute2 and unshare")]
ARGS = [*REFERENCE_3_EPOCHS, "--hang_timeout_s", "60"]  # epochs 3, as test_slurm's: one reference run for both


def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def hosts():
    tag = f"dk{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", f"v{a}", "type", "veth", "peer", "name", f"v{b}")
        for ns, addr in ((a, "10.231.0.1"), (b, "10.231.0.2")):
            sh("ip", "link", "set", f"v{ns}", "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", f"v{ns}")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", f"v{ns}", "up")
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:  # `ip netns exec` binds this over /etc/hosts
                f.write("127.0.0.1 localhost\n10.231.0.1 nodea\n10.231.0.2 nodeb\n")
        yield {"nodea": a, "nodeb": b}
    finally:
        for ns in (a, b):
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)  # only processes inside our own namespaces
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def launch_node(ns: str, host: str, run_dir) -> subprocess.Popen:
    # Own UTS namespace too, so each "host" has its own hostname, resolvable through its hosts file.
    cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "--", "sh", "-c", f'hostname {host} && exec "$@"', "sh",
           str(ROOT / "launch" / "torchrun.sh"), *ARGS, "--run_dir", str(run_dir)]
    env = proc_env({"NNODES": "2", "NPROC_PER_NODE": "2", "RDZV_HOST": "nodea", "RDZV_PORT": "29511",
                    "PYTHON": sys.executable, "RDZV_CONF": "join_timeout=60"})
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_two_hosts_c10d_rendezvous(hosts, tmp_path, reference_summary):
    ref = reference_summary(4, REFERENCE_3_EPOCHS)  # the same job as 4 ranks of torchrun on one host
    for attempt in range(2):  # measured: ~1 in 30 such runs fails to rendezvous; one retry
        run_dir = tmp_path / f"run{attempt}"
        procs = [launch_node(hosts[h], h, run_dir) for h in ("nodea", "nodeb")]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=150)[0])
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                outs.append(p.communicate()[0])
        if all(p.returncode == 0 for p in procs):
            break
    assert all(p.returncode == 0 for p in procs), "\n=====\n".join(o[-3000:] for o in outs)
    summary = read_json(run_dir / "summary.json")
    assert summary["world_size"] == 4 and summary["eval_samples"] == 360
    assert summary["param_sha256"] == ref["param_sha256"]

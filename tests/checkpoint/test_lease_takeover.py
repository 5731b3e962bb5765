"""The one-writer lease is taken only from a holder that was seen not to renew, or from an earlier attempt
of the taker's own launch (issue 44, items 8 and 9), with real processes:
- a second torchrun job with the same --rdzv_id is refused at every attempt, its restart included;
- a starter whose wall clock runs two hours ahead (faketime), on this host or on "another" (its own UTS
  and pid namespace), takes no live lease;
- a plain-path ckpt_dir shared by two jobs with their own run folders: the second is refused in one line
  naming the holder, as on a URL, and takes the folder over once the first is dead."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, proc_env, read_json, run_cmd
from procs import errors, wait_for, workers
from s3_server import free_port

pytestmark = pytest.mark.integration

TRAIN = ["-m", "ddp_kit.train", "--epochs", "2", "--ckpt_every", "5", "--progress", "false", "--log_every", "5"]
# 44 steps of 1.5 s (66 s): the first job outlives the second's start-up and refusal, and is killed anyway.
# (At 0.4 s a step, B's start on a loaded 2-core machine took as long as A's whole run: A finished and
# released its lease first, as test_s3.py's twin test met in CI.)
SLOW = ["--inject", "slow:rank=0:step=1:ms=1500"]


def _start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=proc_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _latest(folder) -> str | None:
    try:
        return (folder / "latest").read_text().strip() or None
    except OSError:
        return None


def _torchrun(port: int, restarts: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "1",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "tutorial",
            "--max-restarts", str(restarts), "--monitor-interval", "0.5", *args]


def test_a_second_torchrun_job_with_the_same_rdzv_id_is_refused_at_its_restart_too(tmp_path):
    """Job A and job B both pass --rdzv_id tutorial (as tutorials do) and one ckpt_dir URL. B is refused;
    torchrun restarts it; its restart (restart count 1, A's job id) must be refused again, not take A's
    live lease (before: it did, silently, and A stopped at its next commit)."""
    url = f"file://{tmp_path}/ck"
    # 44 steps of 2.5 s (110 s, ~97 s left after A's first commit): A outlives both of B's attempts, each a
    # torchrun start with a torch import on a loaded 2-core machine (at 1 s a step only ~39 s were left).
    slower = ["--inject", "slow:rank=0:step=1:ms=2500"]
    a = _start(_torchrun(free_port(), 0, *TRAIN, *slower, "--run_dir", str(tmp_path / "a"), "--ckpt_dir", url))
    try:
        wait_for(lambda: _latest(tmp_path / "ck"), a, timeout=120, what="job A's first commit")
        b = run_cmd(_torchrun(free_port(), 1, *TRAIN, "--run_dir", str(tmp_path / "b"), "--ckpt_dir", url), timeout=180)
        refused = [ln for ln in errors(workers(b.stderr)) if "is in use by another job" in ln]
        assert b.returncode != 0 and len(refused) == 2, b.stderr[-4000:]  # the first attempt and its restart
        assert "taking over" not in b.stderr, b.stderr[-4000:]
        out, err = a.communicate(timeout=240)  # what is left of A's 110 s of steps, with room for a loaded machine
    finally:
        _stop(a)
    assert a.returncode == 0, err[-4000:]
    assert "another job took over" not in err and _latest(tmp_path / "ck") == "step_44", err[-3000:]


HOLD = textwrap.dedent("""
    import sys, time
    from ddp_kit.checkpoint import lease
    from ddp_kit.checkpoint.store_fs import open_store
    keeper = lease.LeaseKeeper(open_store(sys.argv[1]), lease.identity("job-a", None), ttl_s=3.0)
    print("held", flush=True)
    time.sleep(120)
""")
TAKE = textwrap.dedent("""
    import sys, time
    from ddp_kit.checkpoint import lease
    from ddp_kit.checkpoint.store_fs import open_store
    from ddp_kit.errors import UserError
    began = time.monotonic()
    try:
        gen, _ = lease.acquire(open_store(sys.argv[1]), lease.identity("job-b", None), ttl_s=3.0)
        print(f"took generation {gen} after {time.monotonic() - began:.1f}s", flush=True)
    except UserError as err:
        print(f"refused after {time.monotonic() - began:.1f}s: {err.line()}", flush=True)
""")


@pytest.mark.parametrize("where", ["this host", "another host"])
def test_a_starter_whose_clock_is_hours_ahead_takes_no_live_lease(tmp_path, where):
    """The holder renews every 0.5 s (ttl 3 s). The starter's wall clock runs 2 h ahead (faketime): by the
    holder's `renewed` the lease is 2 h stale, which it is not. Before: taken over in 0 s. Now: refused,
    on this host at once (a live process), on another host (own UTS and pid namespace) once it was
    seen to renew."""
    if not shutil.which("faketime") or not shutil.which("unshare"):
        pytest.skip("needs faketime and unshare (apt-get install faketime util-linux)")
    url = f"file://{tmp_path}/ck"
    holder = _start([sys.executable, "-c", HOLD, url])
    try:
        wait_for(lambda: list((tmp_path / "ck").glob(".lease.*")), holder, timeout=60, what="the holder's lease")
        skewed = ["faketime", "-f", "+2h", sys.executable, "-c", TAKE, url]
        if where == "another host":
            if os.geteuid() != 0:
                pytest.skip("needs root for unshare --uts --pid")
            skewed = ["unshare", "--uts", "--pid", "--fork", "sh", "-c", 'hostname node-b && exec "$@"', "sh", *skewed]
        res = run_cmd(skewed, timeout=60)  # monotonic shifted too, by a constant: only wall clocks compare
        assert holder.poll() is None, "the holder died"
    finally:
        _stop(holder)
    assert res.stdout.startswith("refused after") and "is in use by another job" in res.stdout, res.stdout + res.stderr
    if where == "another host":
        assert "waiting up to" in res.stderr, res.stderr


def test_a_second_job_on_one_ckpt_folder_is_refused_then_takes_over_once_the_first_is_dead(tmp_path):
    """Two jobs with their own run folders and one plain-path ckpt_dir (a shared NFS path): the second is
    refused in one line naming the holder, exit 2, before it writes anything; the first trains on. After
    the first is SIGKILLed, the second's rerun takes the folder over and resumes from its `latest`."""
    ck = tmp_path / "ck"
    args = [sys.executable, *TRAIN, "--ckpt_dir", str(ck)]
    a = _start([*args, *SLOW, "--run_dir", str(tmp_path / "a")])
    try:
        wait_for(lambda: _latest(ck), a, timeout=120, what="job A's first commit")
        b = run_cmd([*args, "--run_dir", str(tmp_path / "b")], timeout=120)
        assert b.returncode == 2, b.stderr[-3000:]
        errs = errors(b.stderr)
        assert len(errs) == 1 and f"checkpoint location '{ck}' is in use by another job" in errs[0], b.stderr[-3000:]
        assert f"pid {a.pid}" in errs[0] and "give this job its own ckpt_dir" in errs[0], errs
        assert not (tmp_path / "b" / "metrics.jsonl").exists() or "step" not in (tmp_path / "b" / "metrics.jsonl").read_text()
        assert a.poll() is None, "job A stopped while B was refused"
    finally:
        _stop(a)
    resumed_from = int(_latest(ck).split("_")[1])
    again = run_cmd([*args, "--run_dir", str(tmp_path / "b")], timeout=180)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"taking over checkpoint location {ck} from process {a.pid} on this host" in again.stderr, again.stderr[-3000:]
    assert read_json(tmp_path / "b" / "summary.json")["resumed_from_step"] == resumed_from

"""Outside SLURM: SIGTERM (sent by PID to a process we started) finishes the step, checkpoints and exits 75;
running the same command again resumes and ends bit-identical to an uninterrupted run."""
import os
import signal
import subprocess
import sys

import pytest

from conftest import REFERENCE_2_EPOCHS, ROOT, ok, proc_env, read_json, run_cmd
from procs import ARGS, wait_step

pytestmark = pytest.mark.integration  # every test here starts real processes



@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_sigterm_checkpoints_and_exits_75(tmp_path, launcher, reference_summary):
    # the uninterrupted job on as many ranks (its timed checkpoints do not change its weights)
    ref = reference_summary(1 if launcher == "python" else 2, REFERENCE_2_EPOCHS)
    run_dir = tmp_path / "run"
    slow = ["--inject", "slow:rank=0:step=1:ms=100"]
    cmd = ([sys.executable] if launcher == "python" else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]) + [*ARGS, "--run_dir", str(run_dir), *slow]
    p = subprocess.Popen(cmd, cwd=ROOT, env=proc_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        wait_step(run_dir, 10, p)
        os.kill(p.pid, signal.SIGTERM)  # the process we started: python itself, or the torchrun agent
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert "preempted by SIGTERM" in err and "exiting with 75" in err, err[-2000:]
    if launcher == "python":
        assert p.returncode == 75
    else:
        assert p.returncode != 0
    saved = sorted(int(d.name[5:]) for d in (run_dir / "checkpoints").glob("step_*"))
    assert saved and saved[-1] >= 10
    rerun = ok(run_cmd([*cmd[:-2]]))  # the same command, without the slow-down hook
    assert "resumed from" in rerun.stdout
    assert read_json(run_dir / "summary.json")["param_sha256"] == ref["param_sha256"]

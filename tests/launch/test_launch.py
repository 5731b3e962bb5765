"""Launch scripts and the launcher command: shell syntax, and golden files of what the launcher renders."""
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_cmd

pytestmark = pytest.mark.integration  # every test here starts real processes

GOLDEN = Path(__file__).parents[1] / "golden"
CASES = {
    "launch_srun.sbatch": ["--layout", "srun", "--nodes", "2", "--gpus_per_node", "4", "--partition", "gpu", "--time",
                           "02:00:00", "--dry_run", "--", "configs/default.yaml", "--epochs", "3", "--run_dir", "runs/x y"],
    "launch_torchrun.sbatch": ["--layout", "torchrun", "--nodes", "3", "--nproc_per_node", "2", "--account", "proj",
                               "--job_name", "sweep", "--dry_run", "--", "--run_dir", "runs/sweep_{array_task}"],
    "launch_ft.sbatch": ["--layout", "ft", "--nodes", "2", "--nproc_per_node", "2", "--partition", "gpu", "--dry_run",
                         "--", "--run_dir", "runs/ft", "--max_steps", "300"],
}


K8S_SCRIPTS = ["src/ddp_kit/launch/templates/k8s/pod.sh", "src/ddp_kit/launch/templates/k8s/rank.sh"]


@pytest.mark.parametrize("script", ["launch/torchrun.sh", "slurm/srun.sbatch", "slurm/torchrun.sbatch", "slurm/ft.sbatch",
                                    ".ci/run", *K8S_SCRIPTS])
def test_shell_syntax(script):
    assert subprocess.run(["bash", "-n", str(ROOT / script)]).returncode == 0


@pytest.mark.parametrize("script", K8S_SCRIPTS)
def test_pod_scripts_are_posix_sh(script):
    """The pod entrypoints run as `sh -c` in images we do not choose: dash (Debian's sh) must read them too."""
    assert subprocess.run(["sh", "-n", str(ROOT / script)]).returncode == 0


@pytest.mark.parametrize("golden", sorted(CASES))
def test_launcher_renders_golden_file(golden):
    res = run_cmd([sys.executable, "-m", "ddp_kit.launch", "slurm", *CASES[golden]])
    assert res.returncode == 0, res.stderr
    assert res.stdout == (GOLDEN / golden).read_text()
    rendered = GOLDEN / golden
    assert subprocess.run(["bash", "-n", str(rendered)]).returncode == 0


def test_launcher_bad_layout_one_line():
    res = run_cmd([sys.executable, "-m", "ddp_kit.launch", "slurm", "--layout", "mpi", "--dry_run"])
    assert res.returncode == 2 and res.stderr.strip().startswith("ddp_kit: error: unknown layout 'mpi'")


def test_launch_script_refuses_bad_config_before_torchrun():
    res = run_cmd(["bash", str(ROOT / "launch" / "torchrun.sh"), "--batch_size", "63"],
                  env={"NPROC_PER_NODE": "2", "PYTHON": sys.executable})
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "ddp_kit: error: batch_size 63 (global) does not divide into world_size 2 x grad_accum 1 "
        "(hint: use a multiple of 2, e.g. batch_size 62)"]


def test_launch_script_checks_every_world_size_of_an_elastic_job():
    res = run_cmd(["bash", str(ROOT / "launch" / "torchrun.sh"), "--batch_size", "64"],
                  env={"NPROC_PER_NODE": "1", "NNODES": "1:3", "PYTHON": sys.executable})
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "ddp_kit: error: batch_size 64 (global) does not divide into world_size 3 x grad_accum 1, one of the world "
        "sizes this elastic job may run at (1, 2, 3) (hint: use a multiple of 6, e.g. batch_size 60)"]


@pytest.mark.parametrize("nnodes", ["x", "2:1", "1:", "0", "0:2", "1:2:3", "-1"])
def test_launch_script_refuses_a_bad_node_count(nnodes):
    res = run_cmd(["bash", str(ROOT / "launch" / "torchrun.sh")], env={"NNODES": nnodes, "PYTHON": sys.executable})
    assert res.returncode == 2 and res.stderr.startswith(f"ddp_kit: error: NNODES '{nnodes}'"), res.stderr

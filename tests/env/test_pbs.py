"""PBS (PBS Pro, OpenPBS, Torque): the job around whatever started the ranks, from plain dicts and a fake
$PBS_NODEFILE, and pbs/ddp_kit.qsub run against a stand-in for mpirun (its command line, and the SIGUSR2
it sends ahead of the walltime)."""
from __future__ import annotations

import signal
import subprocess

import pytest

from conftest import ROOT, run_cmd
from ddp_kit.env import Facts, allocation, detect

NODEFILE = "n1.cluster\n" * 4 + "n2.cluster\n" * 4  # Torque's: one line per core (nodes=2:ppn=4)


def in_job(environ: dict, nodefile: str = NODEFILE) -> Facts:
    return Facts({"PBS_JOBID": "4242.pbs01", "PBS_NODEFILE": "/var/spool/pbs/aux/4242.pbs01", **environ},
                 hostname=lambda: "n1", read_file={"/var/spool/pbs/aux/4242.pbs01": nodefile}.__getitem__)


def test_a_plain_process_in_a_pbs_job_trains_alone_with_the_jobs_facts():
    env = detect(in_job({"NCPUS": "16"}))
    assert (env.launcher, env.world_size, env.scheduler, env.job_id) == ("single", 1, "PBS", "4242.pbs01")
    assert env.hosts == ("n1.cluster", "n2.cluster") and env.cpus_on_node == 16
    assert (env.requeue_command, env.preempt_signal) == (("qrerun", "4242.pbs01"), signal.SIGUSR2)
    assert allocation(in_job({"PBS_NUM_PPN": "4"})).cpus_on_node == 4  # Torque's count, as the doctor shows it


def test_pbsdsh_task_variables_alone_are_no_launcher():
    # the batch script itself is task 1 on node 0: a pbsdsh task there looks the same (pbs.py says why)
    env = detect(in_job({"PBS_TASKNUM": "1", "PBS_NODENUM": "0", "PBS_VNODENUM": "0"}))
    assert not env.launched and env.world_size == 1


def test_mpirun_and_torchrun_ranks_inside_a_pbs_job():
    ranks = detect(in_job({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "n1.cluster", "MASTER_PORT": "29742"}))
    assert (ranks.launcher, ranks.rank, ranks.node_rank, ranks.scheduler) == ("mpi", 5, 1, "PBS")
    assert ranks.hosts == ("n1.cluster", "n2.cluster") and ranks.requeue_command == ("qrerun", "4242.pbs01")
    worker = detect(in_job({"TORCHELASTIC_RUN_ID": "4242.pbs01", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                            "GROUP_RANK": "1", "MASTER_ADDR": "n1.cluster", "MASTER_PORT": "29742"}))
    assert (worker.launcher, worker.batch_job_id, worker.scheduler) == ("torchrun", "4242.pbs01", "PBS")


def test_node_file_unreadable_on_another_host_is_no_error():
    def missing(path):
        raise FileNotFoundError(2, "No such file or directory", path)

    env = detect(Facts({"PBS_JOBID": "9.srv", "PBS_NODEFILE": "/aux/9.srv"}, hostname=lambda: "n2", read_file=missing))
    assert (env.scheduler, env.hosts) == ("PBS", ())


def test_an_array_subjob_is_requeued_alone():
    env = detect({"PBS_JOBID": "123[4].pbs01", "PBS_ARRAY_INDEX": "4"})
    assert env.requeue_command == ("qrerun", "123[4].pbs01")


# ---- the template ------------------------------------------------------------------------------------------

# A stand-in for mpirun: logs its command line and the master it was given; with STAND_IN_WAIT it runs
# that long, and a SIGUSR2 ends it with 75 as ddp_kit's ranks end after a checkpoint.
STAND_IN = """#!/bin/bash
echo "$(basename "$0") $* | MASTER_ADDR=${MASTER_ADDR:-} MASTER_PORT=${MASTER_PORT:-}" >> "$STAND_IN_LOG"
if [ -n "${STAND_IN_WAIT:-}" ]; then
    trap 'echo "got SIGUSR2" >> "$STAND_IN_LOG"; kill "$nap"; exit 75' USR2
    sleep "$STAND_IN_WAIT" & nap=$!; wait "$nap"
fi
"""


def _run_template(tmp_path, **env):
    script = ROOT / "pbs" / "ddp_kit.qsub"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("mpirun", "qstat"):
        (bin_dir / name).write_text(STAND_IN if name == "mpirun" else "#!/bin/sh\necho '    Resource_List.walltime = 00:00:03'\n")
        (bin_dir / name).chmod(0o755)
    (tmp_path / "nodefile").write_text(NODEFILE)
    log = tmp_path / "log"
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STAND_IN_LOG": str(log), "PBS_JOBID": "4242.pbs01",
            "PBS_NODEFILE": str(tmp_path / "nodefile"), "PBS_O_WORKDIR": str(tmp_path), "NPROC_PER_NODE": "2"}
    res = run_cmd(["bash", str(script)], env={**base, **env}, timeout=30)
    return res, log.read_text().splitlines()


@pytest.mark.integration
def test_qsub_template_starts_the_reference_job_in_both_layouts(tmp_path):
    res, log = _run_template(tmp_path / "a", PBS_WALLTIME="3600", DDP_KIT_ARGS="--epochs 3 --seed {array_task}",
                             PBS_ARRAY_INDEX="7")
    assert res.returncode == 0, res.stderr
    assert log == ["mpirun --hostfile " + str(tmp_path / "a" / "nodefile") + " --bind-to none -x MASTER_ADDR -x MASTER_PORT "
                   "--map-by ppr:2:node python -m ddp_kit.train --epochs 3 --seed 7 | MASTER_ADDR=n1.cluster MASTER_PORT=29742"]
    res, log = _run_template(tmp_path / "b", PBS_WALLTIME="3600", LAYOUT="torchrun", DDP_KIT_ARGS="--epochs 3")
    assert res.returncode == 0, res.stderr
    assert "--map-by ppr:1:node python -m torch.distributed.run --nnodes=2 --nproc_per_node=2 " in log[0]
    assert "--rdzv_endpoint=n1.cluster:29742 --rdzv_id=4242.pbs01" in log[0] and "SIGUSR2" in log[0]
    assert log[0].split(" | ")[0].endswith("-m ddp_kit.train --epochs 3")


@pytest.mark.integration
def test_qsub_template_warns_the_ranks_ahead_of_the_walltime(tmp_path):
    # a walltime of 3 s as qstat says it (PBS Pro), the warning 2 s ahead: SIGUSR2 reaches mpirun after 1 s
    res, log = _run_template(tmp_path, STAND_IN_WAIT="20", WARN_S="2")
    assert res.returncode == 75 and log[-1] == "got SIGUSR2"
    assert "2s before the walltime: SIGUSR2 to the ranks" in res.stderr
    assert "submit this script again to resume" in res.stderr

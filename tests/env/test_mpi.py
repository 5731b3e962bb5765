"""MPI launchers: ranks detected from the variables mpirun/mpiexec set (plain dicts: the cases Lightning's
MPIEnvironment tests expect, tests/tests_fabric/plugins/environments/test_mpi.py, read without mpi4py),
and one real Open MPI `mpirun` training the reference job as torchrun does."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ROOT, proc_env
from ddp_kit.env import DistEnv, Facts, detect
from ddp_kit.env.mpi import mpi_port
from ddp_kit.errors import UserError
from procs import outcome


def open_mpi(rank: int, size: int, local_rank: int, local_size: int, **extra: str) -> dict[str, str]:
    """What Open MPI 4's mpirun puts in a rank's environment (the part we read; see the real one below)."""
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
            "OMPI_COMM_WORLD_NODE_RANK": str(local_rank), "PMIX_NAMESPACE": "1834156033",
            "OMPI_MCA_ess_base_jobid": "1834156033", **extra}


# ---- Lightning's expectations ------------------------------------------------------------------------

def test_a_world_of_one_or_none_is_a_plain_process_and_of_two_is_mpi():
    # Lightning's test_detect: COMM_WORLD size 0 and 1 are not MPI, 2 is
    for size in (0, 1):
        assert detect({"OMPI_COMM_WORLD_SIZE": str(size), "OMPI_COMM_WORLD_RANK": "0"}) == DistEnv()
    env = detect(open_mpi(1, 2, 1, 2))
    assert (env.launcher, env.rank, env.world_size, env.master_addr) == ("mpi", 1, 2, "127.0.0.1")
    assert env.launched and not env.rendezvous_by_launcher and not env.agent_store and not env.scheduler_binds_gpus


def test_world_rank_and_size():
    # Lightning's test_world_comm: size 8, rank 3 (all on this node)
    env = detect(open_mpi(3, 8, 3, 8))
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == (3, 8, 3, 8, 0, 1)


@pytest.mark.parametrize("rank,local_rank,node", [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)])
def test_node_rank_on_two_hosts(rank, local_rank, node):
    # Lightning's test_init_local_comm: 4 ranks on host1 and host2, node rank 0 and 1 by host; here from the
    # launcher's node-local numbers, with the master exported as the template does
    env = detect(open_mpi(rank, 4, local_rank, 2, MASTER_ADDR="host1", MASTER_PORT="29500"))
    assert (env.node_rank, env.num_nodes, env.local_rank, env.master_addr) == (node, 2, local_rank, "host1")


# ---- the launcher families, and what only the variables can say ------------------------------------------

@pytest.mark.parametrize("environ", [
    {"MV2_COMM_WORLD_RANK": "5", "MV2_COMM_WORLD_SIZE": "8", "MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_LOCAL_SIZE": "4"},
    {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"},  # MPICH / Intel MPI's Hydra
    {"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "4"},  # HPE Cray PALS
    open_mpi(5, 8, 1, 4),
])
def test_every_launcher_family_gives_the_same_place(environ):
    env = detect({**environ, "MASTER_ADDR": "n1", "MASTER_PORT": "29400"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == (5, 8, 1, 4, 1, 2)
    assert (env.launcher, env.master_addr, env.master_port) == ("mpi", "n1", 29400)


def test_ranks_on_several_nodes_without_master_addr_are_refused_in_one_line():
    with pytest.raises(UserError) as e:
        detect(open_mpi(5, 8, 1, 4))
    line = e.value.line()
    assert "\n" not in line and "MASTER_ADDR" in e.value.message and "2 nodes" in e.value.message
    assert "mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500" in e.value.hint


def test_node_rank_is_not_open_mpis_node_rank_and_round_robin_is_read():
    # OMPI_COMM_WORLD_NODE_RANK counts this node's processes over every job there: not the node's index
    assert detect(open_mpi(6, 8, 2, 4, OMPI_COMM_WORLD_NODE_RANK="5", MASTER_ADDR="n1")).node_rank == 1
    # --map-by node on 2 nodes: rank 1 is node 1's first (Open MPI 4 states the node count)
    env = detect(open_mpi(1, 4, 0, 2, MASTER_ADDR="n1", OMPI_MCA_orte_num_nodes="2"))
    assert (env.node_rank, env.num_nodes) == (1, 2)


def test_port_is_shared_by_the_launch_and_differs_between_launches():
    a, b = open_mpi(0, 2, 0, 2), open_mpi(1, 2, 1, 2)
    assert detect(a).master_port == detect(b).master_port == mpi_port(a)
    assert 25000 <= mpi_port(a) < 30000
    assert mpi_port({"PMIX_NAMESPACE": "prterun-n1-4242@1"}) != mpi_port({"PMIX_NAMESPACE": "prterun-n1-4243@1"})
    assert mpi_port({}) == 29500  # nothing shared: torch's default
    assert detect({**a, "MASTER_PORT": "40000"}).master_port == 40000


def test_no_local_size_stated_is_one_node_and_a_missing_rank_is_refused():
    env = detect({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"})
    assert (env.local_rank, env.local_world_size, env.master_addr) == (2, 4, "127.0.0.1")
    with pytest.raises(UserError) as e:
        detect({"OMPI_COMM_WORLD_SIZE": "4"})
    assert "OMPI_COMM_WORLD_RANK" in e.value.message and "\n" not in e.value.line()


def in_job(environ: dict[str, str], files: dict[str, str], host: str = "n1") -> Facts:
    """`environ` with the scheduler's files as a fake file system (a missing one unreadable) and this host's name."""
    def read(path: str) -> str:
        if path not in files:
            raise FileNotFoundError(2, "No such file or directory", path)
        return files[path]
    return Facts(environ, hostname=lambda: host, read_file=read)


PBS_2 = {"PBS_JOBID": "42.pbs", "PBS_NODEFILE": "/var/spool/pbs/aux/42.pbs"}
NODEFILE = {"/var/spool/pbs/aux/42.pbs": "n1\nn1\nn1\nn1\nn2\nn2\nn2\nn2\n"}


def test_pmi_alone_is_read_and_without_local_numbers_is_one_node_only_where_provable():
    # PMI-1 launchers set PMI_RANK/PMI_SIZE alone: they were read as a plain process, so each rank trained alone
    env = detect({"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_FD": "5"})  # no scheduler: one node
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size, env.master_addr) == (
        "mpi", 3, 4, 3, 4, "127.0.0.1")
    one_host = {"/var/spool/pbs/aux/42.pbs": "n1\nn1\n"}
    assert detect(in_job({"PMI_RANK": "1", "PMI_SIZE": "2", **PBS_2}, one_host)).local_world_size == 2
    # two hosts named: spread by slot, as the launcher's default mapping does
    env = detect(in_job({"PMI_RANK": "5", "PMI_SIZE": "8", **PBS_2, "MASTER_ADDR": "n1"}, NODEFILE, host="n2"))
    assert (env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == (1, 4, 1, 2)
    # a job around whose host list this host cannot read: the node is unknown, refused in one line
    with pytest.raises(UserError) as e:
        detect(in_job({"PMI_RANK": "5", "PMI_SIZE": "8", **PBS_2, "MASTER_ADDR": "n1"}, {}, host="n2"))
    assert "PMI_LOCAL_SIZE" in e.value.message and "\n" not in e.value.line()


@pytest.mark.parametrize("environ,named", [
    ({"PMI_SIZE": "4"}, "PMI_RANK"),  # a size without its rank
    ({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0", "PMI_SIZE": "4", "PMI_RANK": "2"}, "PMI_SIZE=4"),
])
def test_a_size_above_one_is_never_run_as_a_world_of_one(environ, named):
    with pytest.raises(UserError) as e:
        detect(environ)
    assert named in e.value.message and "\n" not in e.value.line()


def test_rank_alone_left_in_the_environment_does_not_hide_the_launchers_numbers():
    # env_vars.py reads RANK only with WORLD_SIZE or LOCAL_RANK: alone it was read by nobody, so a world of one
    env = detect({**open_mpi(1, 2, 1, 2), "RANK": "0"})
    assert (env.launcher, env.rank, env.world_size) == ("mpi", 1, 2)


@pytest.mark.parametrize("environ,files,master", [
    (PBS_2, NODEFILE, "n1"),
    ({"LSB_JOBID": "7", "LSB_DJOB_RANKFILE": "/lsf/rank"}, {"/lsf/rank": "n1\nn1\nn1\nn1\nn2\nn2\nn2\nn2\n"}, "n1"),
    ({"LSB_JOBID": "7", "LSB_DJOB_RANKFILE": "/lsf/rank"}, {"/lsf/rank": "login1\nn1\nn1\nn2\nn2\n"}, "n1"),
    ({"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-2]"}, {}, "n1"),
])
def test_several_nodes_without_master_addr_meet_at_the_schedulers_first_host(environ, files, master):
    for rank, local_rank, host in ((0, 0, "n1"), (5, 1, "n2")):
        env = detect(in_job({**open_mpi(rank, 8, local_rank, 4), **environ}, files, host=host))
        assert (env.master_addr, env.notes) == (master, ())


def test_rank_0_elsewhere_than_the_first_host_says_so():
    env = detect(in_job({**open_mpi(0, 8, 0, 4), **PBS_2}, NODEFILE, host="n7"))
    assert env.master_addr == "n1" and len(env.notes) == 1
    assert "rank 0 runs on n7" in env.notes[0] and "MASTER_ADDR" in env.notes[0]


# An srun step's task, and a torchrun worker (as tests/env/test_env.py has them)
SLURM_SRUN = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
              "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[01-03,07]",
              "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_NUM_NODES": "4"}
TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "abc"}


def test_others_started_inside_or_around_mpirun_keep_their_reading():
    # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE without Hydra's MPI_LOCAL*: the tasks stay srun's
    assert detect({**SLURM_SRUN, "PMI_RANK": "5", "PMI_SIZE": "8"}).launcher == "slurm"
    # torchrun started by mpirun (one per node): its workers inherit mpirun's variables
    assert detect({**open_mpi(1, 2, 1, 2), **TORCHRUN}).launcher == "torchrun"
    # a script that set torch's variables itself inside the rank
    assert detect({**open_mpi(1, 2, 1, 2), "RANK": "1", "WORLD_SIZE": "2"}).launcher == "env"
    # mpirun inside a SLURM allocation: srun started its daemons, one per node (step 0, task = node)
    orted_step = {**SLURM_SRUN, "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4",
                  "SLURM_TASKS_PER_NODE": "1(x4)"}
    env = detect({**orted_step, **open_mpi(6, 8, 0, 2, MASTER_ADDR="gpu01")})
    assert (env.launcher, env.rank, env.world_size, env.scheduler) == ("mpi", 6, 8, "SLURM")
    assert env.requeue_command == ("scontrol", "requeue", "123456")


# ---- a real mpirun ---------------------------------------------------------------------------------------

# The same job as tests/reliability/test_sdc.py's reference, so that under the whole suite its 3-rank
# torchrun run is one run for both files (conftest's reference_summary keys on these arguments).
ARGS = ("--progress", "false", "--log_every", "5", "--sync_check_every", "10", "--max_steps", "20", "--batch_size", "48",
        "--ckpt_every", "10")


@pytest.mark.integration
def test_mpirun_trains_the_reference_job_as_torchrun_does(tmp_path, reference_summary):
    """mpirun -np 2 and -np 3 (Open MPI, CPU, gloo): detected as world size 2 and 3 with no variable
    exported (every rank on this node), and the final weights bit-identical to torchrun's."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not installed (Debian: apt-get install openmpi-bin)")
    t0 = time.monotonic()
    launches = {}
    for n in (2, 3):  # all four launches at once: the suite is short of time
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(n), sys.executable,
               "-m", "ddp_kit.train", *ARGS, "--run_dir", str(tmp_path / f"mpi{n}"), "--init_timeout_s", "120"]
        launches[n] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=proc_env(), cwd=ROOT, start_new_session=True)
    with ThreadPoolExecutor(2) as pool:  # the torchrun runs at the same time (or shared: conftest)
        references = {n: pool.submit(reference_summary, n, ARGS) for n in (2, 3)}
        for n, proc in launches.items():
            code, text = outcome(proc, timeout=150)
            assert code == 0, text[-4000:]
            assert f"{n} rank(s) (gloo, cpu, mpi)" in text  # the startup line names the launcher
            summary = json.loads((tmp_path / f"mpi{n}" / "summary.json").read_text())
            assert (summary["world_size"], summary["steps"]) == (n, 20)
            assert summary["param_sha256"] == references[n].result()["param_sha256"]
    print(f"mpirun 2 and 3 ranks with their torchrun references: {time.monotonic() - t0:.1f}s")

"""IBM LSF: jsrun's tasks detected from plain dicts and a fake rank file (the cases Lightning's own
LSFEnvironment tests expect, tests/tests_fabric/plugins/environments/test_lsf.py, and what they leave
out), the LSF job around any launcher, and lsf/ddp_kit.bsub run against stand-ins for jsrun and mpirun."""
from __future__ import annotations

import signal
import subprocess

import pytest

from conftest import ROOT, run_cmd
from ddp_kit.env import DistEnv, Facts, detect
from ddp_kit.errors import UserError

# Lightning's rank file: the launch node ("batch") first, then one line per compute host.
RANKFILE = "batch\n10.10.10.0\n10.10.10.1\n10.10.10.2\n10.10.10.3"
JSRUN = {"LSB_DJOB_RANKFILE": "/lsf/rankfile", "LSB_JOBID": "1234", "JSM_NAMESPACE_SIZE": "4",
         "JSM_NAMESPACE_RANK": "3", "JSM_NAMESPACE_LOCAL_RANK": "1"}


def _never(*_args):
    raise AssertionError("read although no launcher asked")


def on(host: str, environ: dict, rankfile: str = RANKFILE) -> Facts:
    """`environ` as a task on `host` sees it, with the job's rank file at /lsf/rankfile."""
    return Facts(environ, hostname=lambda: host, read_file={"/lsf/rankfile": rankfile}.__getitem__)


def one_line(exc: pytest.ExceptionInfo) -> str:
    line = exc.value.line()
    assert "\n" not in line
    return line


# ---- Lightning's expectations (test_attributes_from_environment_variables, test_node_rank) ---------------

def test_lightnings_jsrun_task():
    env = detect(on("10.10.10.2", JSRUN))
    assert (env.rank, env.local_rank, env.world_size, env.node_rank) == (3, 1, 4, 2)
    assert (env.master_addr, env.master_port) == ("10.10.10.0", 10234)  # the first compute host; 10000 + 1234 % 1000
    assert env.launcher == "lsf" and env.launched and env.job_id == "1234"
    assert env.hosts == ("10.10.10.0", "10.10.10.1", "10.10.10.2", "10.10.10.3") and env.num_nodes == 4
    assert env.local_rank < env.local_world_size  # taken as given, as Lightning does, not refused
    assert env.scheduler_binds_gpus and not env.rendezvous_by_launcher


@pytest.mark.parametrize("host,node", [("10.10.10.0", 0), ("10.10.10.1", 1), ("10.10.10.2", 2), ("10.10.10.3", 3)])
def test_node_rank_is_the_hosts_place_after_the_launch_node(host, node):
    assert detect(on(host, JSRUN)).node_rank == node


def test_user_set_master_port_and_address_win():
    # Lightning's test_manual_main_port_and_address
    env = detect(on("10.10.10.2", {**JSRUN, "MASTER_PORT": "4321", "MASTER_ADDR": "ib-10-10-10-0"}))
    assert (env.master_addr, env.master_port) == ("ib-10-10-10-0", 4321)


def test_detected_by_jsruns_variables_present_even_empty_then_refused_in_one_line():
    # Lightning's test_detect: the four names present (empty) count as jsrun; its constructor then refuses
    assert detect({}) == DistEnv()
    empty = {"LSB_DJOB_RANKFILE": "", "LSB_JOBID": "", "JSM_NAMESPACE_SIZE": "", "JSM_NAMESPACE_LOCAL_RANK": ""}
    with pytest.raises(UserError) as e:
        detect(on("n1", empty))
    line = one_line(e)
    assert "JSM_NAMESPACE_RANK" in line and "JSM_NAMESPACE_SIZE" in line and "jsrun" in e.value.hint


def test_rank_file_missing_or_empty_is_refused_naming_it():
    # Lightning's test_missing_lsb_djob_rankfile and test_empty_lsb_djob_rankfile
    unset = {k: v for k, v in JSRUN.items() if k != "LSB_DJOB_RANKFILE"}
    for environ, word in ((unset, "not set"), ({**JSRUN, "LSB_DJOB_RANKFILE": ""}, "empty")):
        with pytest.raises(UserError) as e:
            detect(on("10.10.10.2", environ))
        assert "LSB_DJOB_RANKFILE" in one_line(e) and word in e.value.message and "MASTER_ADDR" in e.value.hint
    # with the master exported, the task still has its place (one node assumed without the host list)
    env = detect(on("n1", {**unset, "MASTER_ADDR": "n1", "JSM_NAMESPACE_LOCAL_SIZE": "2"}))
    assert (env.rank, env.world_size, env.local_world_size, env.node_rank, env.num_nodes) == (3, 4, 2, 1, 2)


def test_job_id_missing_is_refused_unless_a_port_is_given():
    # Lightning's test_missing_lsb_job_id
    no_id = {k: v for k, v in JSRUN.items() if k != "LSB_JOBID"}
    with pytest.raises(UserError) as e:
        detect(on("10.10.10.2", no_id))
    assert "LSB_JOBID" in one_line(e) and "MASTER_PORT" in e.value.hint
    assert detect(on("10.10.10.2", {**no_id, "MASTER_PORT": "29500"})).master_port == 29500


# ---- what Lightning's tests leave out --------------------------------------------------------------------

def test_slots_repeat_hosts_and_short_names_match_full_ones():
    rankfile = "login2\n" + "n1.cluster\n" * 6 + "n2.cluster\n" * 6
    task = {**JSRUN, "JSM_NAMESPACE_SIZE": "8", "JSM_NAMESPACE_RANK": "5", "JSM_NAMESPACE_LOCAL_RANK": "1",
            "JSM_NAMESPACE_LOCAL_SIZE": "4"}
    env = detect(on("n2", task, rankfile))
    assert (env.node_rank, env.num_nodes, env.local_world_size, env.master_addr) == (1, 2, 4, "n1.cluster")
    # addresses are compared whole: 10.10.10.2 is not 10.10.10.20's "short name"
    with pytest.raises(UserError) as e:
        detect(on("10.10.10.20", JSRUN))
    assert "10.10.10.20" in one_line(e) and "launch node" in e.value.message


def test_unreadable_rank_file_is_one_line():
    def missing(path):
        raise FileNotFoundError(2, "No such file or directory", path)

    with pytest.raises(UserError) as e:
        detect(Facts(JSRUN, hostname=lambda: "10.10.10.2", read_file=missing))
    assert "/lsf/rankfile" in one_line(e) and "No such file" in e.value.message


def test_torch_rank_set_inside_the_task_is_read_as_env_vars():
    env = detect(on("10.10.10.2", {**JSRUN, "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "n1", "MASTER_PORT": "1"}))
    assert env.launcher == "env" and env.scheduler == "LSF"


def test_the_lsf_job_around_any_launcher():
    plain = detect(Facts({"LSB_JOBID": "77", "LSB_JOBINDEX": "0"}, hostname=_never, read_file=_never))
    assert (plain.launcher, plain.world_size, plain.scheduler, plain.job_id) == ("single", 1, "LSF", "77")
    assert (plain.requeue_command, plain.preempt_signal) == (("brequeue", "77"), signal.SIGUSR2)
    element = detect({"LSB_JOBID": "77", "LSB_JOBINDEX": "3"})  # `brequeue 77` would requeue every element
    assert element.requeue_command == ("brequeue", "77[3]") and element.requeue_id == "77[3]"
    # mpirun's ranks inside an LSF job (Open MPI reads the allocation itself)
    ranks = detect({"LSB_JOBID": "77", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (ranks.launcher, ranks.scheduler, ranks.requeue_command) == ("mpi", "LSF", ("brequeue", "77"))
    torchrun = detect({**JSRUN, "TORCHELASTIC_RUN_ID": "r", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                       "MASTER_ADDR": "n1", "MASTER_PORT": "2"})
    assert (torchrun.launcher, torchrun.batch_job_id, torchrun.requeue_command) == ("torchrun", "1234", ("brequeue", "1234"))


# ---- the template, against stand-ins for jsrun and mpirun ------------------------------------------------

STAND_IN = """#!/bin/bash
echo "$(basename "$0") $* | MASTER_ADDR=${MASTER_ADDR:-} MASTER_PORT=${MASTER_PORT:-}" >> "$STAND_IN_LOG"
case "$*" in *nvidia-smi*) printf 'GPU 0: A\\nGPU 1: B\\nGPU 2: C\\n';; esac
"""


def _stand_ins(tmp_path, *names):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in names:
        (bin_dir / name).write_text(STAND_IN if name != "hostname" else "#!/bin/sh\necho lsfhost1\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.integration
@pytest.mark.parametrize("launcher", ["jsrun", "mpirun"])
def test_bsub_template_starts_the_reference_job(tmp_path, launcher):
    script = ROOT / "lsf" / "ddp_kit.bsub"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    bin_dir = _stand_ins(tmp_path, "jsrun", "mpirun", "hostname")
    (tmp_path / "rankfile").write_text("batch1\n" + "h1\n" * 3 + "h2\n" * 3)
    log = tmp_path / "log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STAND_IN_LOG": str(log), "LSB_JOBID": "4321", "LSB_JOBINDEX": "2",
           "LSB_DJOB_RANKFILE": str(tmp_path / "rankfile"), "LAUNCHER": launcher,
           "DDP_KIT_ARGS": "--epochs 3 --run_dir runs/sweep_{array_task}"}
    res = run_cmd(["bash", str(script)], env=env, timeout=30)
    assert res.returncode == 0, res.stderr
    last = log.read_text().splitlines()[-1]
    tail = "python -m ddp_kit.train --epochs 3 --run_dir runs/sweep_2"
    if launcher == "jsrun":  # 2 compute hosts (the launch node left out) x the 3 GPUs jsrun's probe listed
        assert last.startswith("jsrun --nrs 6 --rs_per_host 3 --tasks_per_rs 1 --gpu_per_rs 1 ") and tail in last
    else:  # this host, the first execution host, runs rank 0; the port as lsf.py derives it
        assert last.startswith("mpirun -x MASTER_ADDR -x MASTER_PORT --bind-to none python") and tail in last
        assert last.endswith("MASTER_ADDR=lsfhost1 MASTER_PORT=10321")
    assert "LSF job 4321[2]" in res.stderr

"""Launcher detection from plain dicts: every layout we support, and the inconsistent ones we refuse."""
import pytest

from ddp_kit.env import DistEnv, detect, expand_nodelist, slurm_port
from ddp_kit.errors import UserError

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29400",
            "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "1"}
SLURM_SRUN = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
              "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[01-03,07]",
              "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_NUM_NODES": "4"}


def test_nothing_is_single_process():
    assert detect({}) == DistEnv()
    assert detect({}).world_size == 1 and detect({}).master_port is None


def test_torchrun():
    env = detect(TORCHRUN)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.node_rank, env.num_nodes, env.master_addr, env.master_port) == (1, 2, "node1", 29400)
    assert env.launcher == "torchrun" and env.restart_count == 1


def test_slurm_one_task_per_gpu():
    env = detect(SLURM_SRUN)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (5, 1, 8, 2, 1)
    assert env.hosts == ("gpu01", "gpu02", "gpu03", "gpu07")
    assert env.master_addr == "gpu01" and env.master_port == slurm_port("123456")
    assert env.launcher == "slurm" and env.num_nodes == 4


def test_slurm_port_is_stable_and_differs_between_jobs():
    assert slurm_port("123456") == slurm_port("123456")
    assert slurm_port("123456") != slurm_port("123457")
    assert 1024 < slurm_port("99999999") < 65536


def test_slurm_with_torchrun_inside_torchrun_wins():
    env = detect({**SLURM_SRUN, **TORCHRUN})
    assert env.launcher == "torchrun" and env.rank == 3 and env.world_size == 4


def test_slurm_user_master_addr_wins():
    env = detect({**SLURM_SRUN, "MASTER_ADDR": "ib-gpu01", "MASTER_PORT": "40000"})
    assert env.master_addr == "ib-gpu01" and env.master_port == 40000


def test_slurm_uneven_tasks_per_node():
    env = detect({**SLURM_SRUN, "SLURM_TASKS_PER_NODE": "3,2(x2)", "SLURM_NODEID": "2", "SLURM_NTASKS": "7", "SLURM_PROCID": "6"})
    assert env.local_world_size == 2


def test_slurm_batch_script_with_one_task_is_single():
    env = detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"})
    assert env.world_size == 1 and env.launcher == "single" and env.job_id == "7"


def test_slurm_many_tasks_without_srun_is_refused_with_hint():
    with pytest.raises(UserError) as e:
        detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert "srun" in e.value.hint


def test_partial_torchrun_vars_refused():
    with pytest.raises(UserError):
        detect({"WORLD_SIZE": "2"})
    with pytest.raises(UserError):
        detect({"RANK": "0", "LOCAL_RANK": "0"})  # no WORLD_SIZE


def test_rank_outside_world_refused():
    with pytest.raises(UserError) as e:
        detect({**TORCHRUN, "RANK": "4"})
    assert "outside world size" in e.value.message


def test_env_vars_by_hand():
    env = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"})
    assert env.launcher == "env" and env.rank == 1 and env.master_port == 1234


@pytest.mark.parametrize("text,hosts", [
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("node1", ["node1"]),
    ("a[1-2],b5,c[09-11]", ["a1", "a2", "b5", "c09", "c10", "c11"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("x[7]", ["x7"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


def test_detect_does_not_write_environment():
    environ = dict(SLURM_SRUN)
    detect(environ)
    assert environ == SLURM_SRUN


def test_slurm_array_tasks_get_distinct_ports():
    a = detect({**SLURM_SRUN, "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "0", "SLURM_JOB_ID": "101"})
    b = detect({**SLURM_SRUN, "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_ID": "102"})
    assert a.master_port != b.master_port


def test_requeue_target_is_the_array_task_not_the_array():
    from ddp_kit.env import requeue_target

    assert requeue_target({"SLURM_JOB_ID": "7"}) == "7"
    assert requeue_target({"SLURM_JOB_ID": "100", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "0"}) == "100_0"
    assert requeue_target({}) is None


# ---- the neutral facts the rest of ddp_kit asks instead of a launcher's name ----------------------------

FACTS = ("scheduler_binds_gpus", "agent_store", "sets_omp_threads", "rendezvous_by_launcher", "launched")


def facts(env):
    return {name: getattr(env, name) for name in FACTS}


def test_facts_of_torchrun():
    env = detect({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert facts(env) == {"scheduler_binds_gpus": False, "agent_store": True, "sets_omp_threads": True,
                          "rendezvous_by_launcher": True, "launched": True}
    assert env.requeue_command is None and env.batch_job_id is None and env.job_id == "abc"
    assert detect({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "False"}).agent_store is False  # rank 0 hosts it


def test_facts_of_srun_one_task_per_gpu():
    env = detect({**SLURM_SRUN, "SLURM_CPUS_ON_NODE": "32", "SLURM_GPUS_ON_NODE": "2"})
    assert facts(env) == {"scheduler_binds_gpus": True, "agent_store": False, "sets_omp_threads": False,
                          "rendezvous_by_launcher": False, "launched": True}
    assert env.requeue_command == ("scontrol", "requeue", "123456")
    assert (env.batch_job_id, env.cpus_on_node, env.gpus_on_node) == ("123456", 32, 2)


def test_facts_of_torchrun_inside_a_slurm_job():
    # one srun task per node runs torchrun: torchrun's variables describe the workers, SLURM's the allocation
    env = detect({**SLURM_SRUN, **TORCHRUN, "SLURM_CPUS_ON_NODE": "32", "SLURM_ARRAY_JOB_ID": "9",
                  "SLURM_ARRAY_TASK_ID": "4"})
    assert facts(env) == {"scheduler_binds_gpus": False, "agent_store": False, "sets_omp_threads": True,
                          "rendezvous_by_launcher": True, "launched": True}
    assert env.requeue_command == ("scontrol", "requeue", "9_4") and env.batch_job_id == "123456"
    assert env.cpus_on_node == 32 and env.job_id == "abc"
    no_run_id = {k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}
    assert detect({**SLURM_SRUN, **no_run_id}).job_id == "123456"  # the scheduler's job id fills in


def test_facts_of_env_vars_by_hand():
    env = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"})
    assert facts(env) == {"scheduler_binds_gpus": False, "agent_store": False, "sets_omp_threads": False,
                          "rendezvous_by_launcher": False, "launched": True}
    assert env.requeue_command is None


def test_facts_of_a_plain_process():
    for environ in ({}, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}):
        env = detect(environ)
        assert facts(env) == {"scheduler_binds_gpus": False, "agent_store": False, "sets_omp_threads": False,
                              "rendezvous_by_launcher": False, "launched": False}
    assert detect({}).requeue_command is None
    assert detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}).requeue_command == ("scontrol", "requeue", "7")


def test_launchers_are_tried_in_order_and_each_says_none_when_not_its_process():
    from ddp_kit.env import LAUNCHERS

    # the engines' own files joined the order (issue 27): Ray before torchrun, the operators before env://;
    # jsrun and mpirun (issue 49) right after torchrun
    assert [m.NAME for m in LAUNCHERS] == ["ray", "torchrun", "lsf", "mpi", "trainer", "volcano", "pytorchjob", "env",
                                           "slurm", "single"]
    for launcher in LAUNCHERS[:-1]:
        assert launcher.detect({}) is None  # only the last always answers
    assert LAUNCHERS[-1].detect({}) == DistEnv()


def test_srun_gpu_layout_rules():
    from ddp_kit.env import check_gpus

    env = detect({**SLURM_SRUN, "SLURM_GPUS_ON_NODE": "4", "SLURM_LOCALID": "0", "SLURM_PROCID": "4"})
    assert check_gpus(env, 1, {}) == ["[node 1] SLURM allocated 4 GPU(s) but 1 are visible (CUDA_VISIBLE_DEVICES=unset)"]
    with pytest.raises(UserError) as e:
        check_gpus(env, 4, {})  # 2 tasks on the node, 4 GPUs each sees
    assert "--ntasks-per-node=4" in e.value.hint
    assert check_gpus(detect({**SLURM_SRUN, "SLURM_GPUS_ON_NODE": "2"}), 2, {}) == []
    assert check_gpus(detect(TORCHRUN), 8, {}) == []  # torchrun has no rules of its own here


# ---- misses found against peer projects' expectations (issue 27) ------------------------------------------

# Task 0 of `srun --pty -n 8 bash` (srun made the job, named after its command, and step 0 of it):
# srun --pty exports SLURM_PTY_PORT/WIN_COL/WIN_ROW (SchedMD/slurm src/srun/srun.c, setup_env).
PTY_SHELL = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "bash", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
             "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
             "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_PTY_PORT": "34889", "SLURM_PTY_WIN_COL": "236", "SLURM_PTY_WIN_ROW": "64"}


def test_command_typed_into_an_srun_pty_shell_trains_alone_and_says_so():
    env = detect(PTY_SHELL)
    assert (env.world_size, env.launched) == (1, False)
    assert len(env.notes) == 1 and "srun --pty" in env.notes[0] and "8 tasks" in env.notes[0]
    assert env.job_id == "4242"  # the allocation's facts still apply
    salloc_shell = {**PTY_SHELL, "SLURM_JOB_NAME": "interactive"}  # `srun --pty bash` inside salloc
    assert detect(salloc_shell).world_size == 1


def test_real_steps_next_to_a_pty_shell_stay_steps():
    no_pty = {k: v for k, v in PTY_SHELL.items() if not k.startswith("SLURM_PTY_")}
    assert detect(no_pty).world_size == 8  # `srun -n 8 python train.py` as the job's step 0
    overlap = {**PTY_SHELL, "SLURM_STEP_ID": "1", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1"}
    env = detect(overlap)  # `srun --overlap -n 8 python ...` typed in the shell: step 1, PTY vars inherited
    assert (env.rank, env.world_size, env.node_rank, env.notes) == (5, 8, 1, ())
    named = {**PTY_SHELL, "SLURM_JOB_NAME": "train"}  # `srun --pty -n 8 python` in job "train"
    assert detect(named).world_size == 8


@pytest.mark.parametrize("extra,layout", [
    ({"GROUP_RANK": "1"}, (4, 1, 2)),  # from RANK - LOCAL_RANK over GROUP_RANK
    ({"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}, (4, 1, 2)),
    ({"GROUP_RANK": "0", "RANK": "2"}, (8, 0, 1)),  # node 0, nothing says more nodes: one node
])
def test_torchrun_style_variables_without_local_world_size(extra, layout):
    base = {"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    for marks in ({"TORCHELASTIC_RUN_ID": "r"}, {}):  # torchrun's, or another tool's
        env = detect({**base, **extra, **marks})
        assert (env.local_world_size, env.node_rank, env.num_nodes) == layout
        assert env.local_rank == 2


def test_inconsistent_torchrun_variables_are_taken_as_given_not_refused():
    # Lightning's torchelastic test environment: rank 1 as local rank 2 of node 3, world 20
    env = detect({"MASTER_ADDR": "1.2.3.4", "MASTER_PORT": "500", "LOCAL_RANK": "2", "GROUP_RANK": "3",
                  "RANK": "1", "WORLD_SIZE": "20", "TORCHELASTIC_RUN_ID": "1"})
    assert (env.rank, env.local_rank, env.world_size, env.node_rank) == (1, 2, 20, 3)
    assert env.local_rank < env.local_world_size


def test_submitit_exported_variables_in_an_srun_task_take_the_node_from_slurm():
    # submitit's TorchDistributedEnvironment.export(): MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK
    submitit = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "gpu01", "MASTER_PORT": "23456"}
    env = detect({**SLURM_SRUN, **submitit})
    assert (env.rank, env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == (5, 1, 2, 1, 4)
    assert env.launcher == "env" and env.scheduler_binds_gpus and not env.rendezvous_by_launcher
    assert env.requeue_command == ("scontrol", "requeue", "123456")
    assert detect({**SLURM_SRUN, **submitit, "LOCAL_WORLD_SIZE": "2"}).node_rank == 1  # newer submitit


@pytest.mark.parametrize("text", ["compute-b2[1-,4]", "n[1-x]", "n[3-1]", "n[1-2", "n[]", "n[1,,2]", "a,,b"])
def test_malformed_nodelist_is_one_line_naming_it(text):
    with pytest.raises(UserError) as e:
        expand_nodelist(text)
    assert repr(text) in e.value.message and "\n" not in e.value.line()
    with pytest.raises(UserError):
        detect({**SLURM_SRUN, "SLURM_JOB_NODELIST": text})


# ---- detection against peers' own tests (issue 34) --------------------------------------------------------

# Lightning's SLURM tests: test_main_address_from_slurm_node_list (tests/tests_fabric/plugins/environments/
# test_slurm.py) and the SLURM_NODELIST "1.1.1.1, 1.1.1.2" of its test_attributes_from_environment_variables.
# Blanks separate hosts as commas do; inside brackets they only follow a comma.
@pytest.mark.parametrize("text,hosts", [
    ("alpha beta gamma", ["alpha", "beta", "gamma"]),
    ("alpha, host[5-9], gamma", ["alpha", "host5", "host6", "host7", "host8", "host9", "gamma"]),
    ("1.2.3.[089, 100-110]", ["1.2.3.089"] + [f"1.2.3.{n}" for n in range(100, 111)]),  # 089's padding kept
    ("alpha[3,1], beta", ["alpha3", "alpha1", "beta"]),
    ("1.1.1.1, 1.1.1.2", ["1.1.1.1", "1.1.1.2"]),
])
def test_nodelist_with_blanks_as_lightning_parses_it(text, hosts):
    assert expand_nodelist(text) == hosts
    env = detect({**SLURM_SRUN, "SLURM_JOB_NODELIST": text})
    assert env.hosts == tuple(hosts) and env.master_addr == hosts[0]  # Lightning's expected main address


def test_slurm_ntasks_per_node_and_nnodes_alone():
    # `sbatch --nodes=2 --ntasks-per-node=4` exports SLURM_NTASKS_PER_NODE and SLURM_NNODES (the older name of
    # SLURM_JOB_NUM_NODES), the two that Lightning's SLURMEnvironment.validate_settings and fairseq's
    # distributed/utils.py (infer_init_method) read.
    task = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "2"}
    env = detect(task)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank, env.num_nodes) == (
        5, 1, 8, 4, 1, 2)
    # submitit's exported variables in the same task (env_vars.py) read the same count
    submitit = detect({**task, "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "n1",
                       "MASTER_PORT": "23456"})
    assert (submitit.local_world_size, submitit.node_rank, submitit.num_nodes) == (4, 1, 2)


def test_torchrun_mark_alone_names_the_missing_variables():
    # torch.distributed.is_torchelastic_launched() is TORCHELASTIC_RUN_ID alone; Lightning's
    # TorchElasticEnvironment then raises on WORLD_SIZE (tests_fabric/plugins/environments/test_torchelastic.py,
    # test_default_attributes).
    with pytest.raises(UserError) as e:
        detect({"TORCHELASTIC_RUN_ID": "none"})
    assert "WORLD_SIZE" in e.value.message and "TORCHELASTIC_RUN_ID" in e.value.message
    assert "torchrun" in e.value.hint and "\n" not in e.value.line()
    with pytest.raises(UserError) as e:
        detect({k: v for k, v in TORCHRUN.items() if k != "WORLD_SIZE"})
    assert "WORLD_SIZE" in e.value.message and "RANK," not in e.value.message

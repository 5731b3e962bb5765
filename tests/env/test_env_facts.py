"""Detection reads one frozen Facts value: the environment, this host's name and the files a scheduler
names, the last two only when a launcher asks. A launcher that takes its ranks from a rank file is one
module plus one entry in LAUNCHERS; the environment names its own preemption signal and requeue."""
from __future__ import annotations

import signal
import types
from dataclasses import FrozenInstanceError

import pytest

import ddp_kit.env as env_pkg
from ddp_kit.env import DistEnv, Facts, detect, facts_of
from ddp_kit.env.base import int_var


def _never(*_args):
    raise AssertionError("read although no launcher asked")


def test_facts_are_the_environment_and_read_the_host_and_files_only_when_asked():
    facts = Facts({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "1",
                   "MASTER_ADDR": "n1"},
                  hostname=_never, read_file=_never)
    assert facts["RANK"] == "1" and "WORLD_SIZE" in facts and dict(facts)["LOCAL_RANK"] == "1"
    assert detect(facts).rank == 1  # every launcher and scheduler ran; none asked for the host or a file
    with pytest.raises(FrozenInstanceError):
        facts.environ = {}  # type: ignore[misc]
    assert facts_of(facts) is facts and facts_of({"A": "1"})["A"] == "1"


def test_a_plain_mapping_still_works_everywhere():
    assert detect({}) == DistEnv()
    for launcher in env_pkg.LAUNCHERS[:-1]:
        assert launcher.detect({}) is None and launcher.detect(Facts({})) is None


# An LSF-like launcher, written as its own file would be: the job's rank file lists one host name per
# slot, in rank order; this host's slots are its ranks. (The local-rank variable is this test's own.)
def _detect_rank_file(environ):
    if "LSB_JOBID" not in environ or "LSB_DJOB_RANKFILE" not in environ:
        return None
    facts = facts_of(environ)
    slots = facts.read_file(environ["LSB_DJOB_RANKFILE"]).split()
    me = facts.hostname().split(".")[0]
    hosts = list(dict.fromkeys(slots))
    local_rank = int_var(environ, "FAKE_LOCAL_RANK", 0)
    mine = [rank for rank, host in enumerate(slots) if host == me]
    return DistEnv(rank=mine[local_rank], local_rank=local_rank, world_size=len(slots), local_world_size=len(mine),
                   node_rank=hosts.index(me), num_nodes=len(hosts), master_addr=slots[0], master_port=29500,
                   launcher="rank_file", job_id=environ["LSB_JOBID"])


RANK_FILE = types.SimpleNamespace(NAME="rank_file", detect=_detect_rank_file)


def test_a_launcher_with_a_rank_file_is_one_module_and_one_entry(monkeypatch):
    *others, single = env_pkg.LAUNCHERS
    monkeypatch.setattr(env_pkg, "LAUNCHERS", (*others, RANK_FILE, single))  # the one line
    files = {"/lsf/rankfile": "node1\nnode1\nnode2\nnode2\n"}
    environ = {"LSB_JOBID": "314", "LSB_DJOB_RANKFILE": "/lsf/rankfile", "FAKE_LOCAL_RANK": "1"}
    env = detect(Facts(environ, hostname=lambda: "node2.cluster", read_file=files.__getitem__))
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank, env.num_nodes) == (3, 1, 4, 2, 1, 2)
    assert (env.master_addr, env.launcher, env.job_id) == ("node1", "rank_file", "314")
    # outside such a job the launcher asks for nothing
    assert detect(Facts({}, hostname=_never, read_file=_never)) == DistEnv()


def test_the_environment_names_its_preemption_signal_and_requeue():
    from ddp_kit.reliability.preemption import requeues

    slurm = detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"})
    assert (slurm.preempt_signal, slurm.requeue_command) == (signal.SIGUSR2, ("scontrol", "requeue", "7"))
    assert requeues(signal.SIGUSR2, slurm) and not requeues(signal.SIGTERM, slurm) and not requeues(signal.SIGINT, slurm)
    plain = detect({})
    assert (plain.preempt_signal, plain.requeue_command) == (signal.SIGTERM, None)
    assert not requeues(signal.SIGTERM, plain) and not requeues(signal.SIGUSR2, plain)


def test_the_scheduler_says_its_allocation():
    from ddp_kit.env import allocation

    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS_PER_NODE": "4", "SLURM_STEP_GPUS": "0,1,2,3"}
    env = allocation(step)
    assert (env.scheduler, env.gpus_on_node, env.gpu_ids, env.tasks_per_node) == ("SLURM", None, ("0", "1", "2", "3"), 4)
    assert allocation({}).scheduler is None and allocation({"SLURM_JOB_ID": "7"}).tasks_per_node is None

"""Detection under the engines of issue 27, from plain dicts: each dict is what the engine's source
puts into a worker's environment (cited per test), plus what torchrun adds where it runs in the pod.

No engine runs here: these are the environments the operators' code writes, read by the pure
`detect()`. KUBERNETES_SERVICE_HOST is the kubelet's, in every pod's containers.
"""
import pytest

from ddp_kit.env import detect
from ddp_kit.errors import UserError

POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "HOSTNAME": "pod"}


def torchrun_worker(rank, local_rank, world, local_world, node, nodes, master, port):
    """What torchrun's agent sets in each worker it starts (torch/distributed/elastic/agent/server/
    local_elastic_agent.py, _start_workers), over whatever the pod had."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nodes),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": master, "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True"}


def layout(env):
    return env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank, env.num_nodes


# ---- Kubeflow Trainer v2 ---------------------------------------------------------------------------------

def trainer_pod(node, nodes=2, nproc="2"):
    """kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go, EnforceMLPolicy: PET_NNODES,
    PET_NPROC_PER_NODE, PET_NODE_RANK (the completion index), PET_MASTER_ADDR
    `<trainjob>-node-0-0.<trainjob>`, PET_MASTER_PORT 29500; the Indexed Job adds JOB_COMPLETION_INDEX."""
    return {**POD, "PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(node),
            "PET_MASTER_ADDR": "mnist-node-0-0.mnist", "PET_MASTER_PORT": "29500", "JOB_COMPLETION_INDEX": str(node)}


def test_trainer_v2_under_torchrun_names_the_engine():
    env = detect({**trainer_pod(1), **torchrun_worker(3, 1, 4, 2, 1, 2, "mnist-node-0-0.mnist", 29500)})
    assert env.launcher == "torchrun" and layout(env) == (3, 1, 4, 2, 1, 2)
    assert env.engine == "Kubeflow Trainer v2" and env.restarted_by_engine and env.requeue_command is None
    assert env.agent_store and env.rendezvous_by_launcher  # torchrun's facts are kept


def test_trainer_v2_one_process_per_pod_without_torchrun():
    env = detect(trainer_pod(1, nproc="1"))
    assert env.launcher == "trainer" and layout(env) == (1, 0, 2, 1, 1, 2)
    assert (env.master_addr, env.master_port, env.engine) == ("mnist-node-0-0.mnist", 29500, "Kubeflow Trainer v2")
    assert env.restarted_by_engine and not env.rendezvous_by_launcher and env.requeue_command is None


@pytest.mark.parametrize("nproc", ["2", "auto", "gpu"])
def test_trainer_v2_many_per_pod_without_torchrun_is_refused(nproc):
    with pytest.raises(UserError) as e:
        detect(trainer_pod(0, nproc=nproc))
    assert "torchrun" in e.value.hint and "\n" not in e.value.line()


# ---- PyTorchJob (training-operator v1) -------------------------------------------------------------------

def pytorchjob_pod(rank, replicas=2, nproc="1"):
    """kubeflow/training-operator pkg/controller.v1/pytorch/envvar.go setPodEnv and master.go:
    MASTER_ADDR `<job>-master-0`, MASTER_PORT (the pytorchjob-port, 23456), WORLD_SIZE = replicas x
    nprocPerNode (1 for auto), RANK = pod index (Worker i is i + 1), PET_NPROC_PER_NODE, PET_NODE_RANK
    = RANK, PET_NNODES = replicas, PYTHONUNBUFFERED; since v1.7 PET_MASTER_ADDR/PORT = MASTER_*."""
    per = int(nproc) if nproc.isdigit() else 1
    return {**POD, "PYTHONUNBUFFERED": "0", "MASTER_PORT": "23456", "MASTER_ADDR": "mnist-master-0",
            "PET_MASTER_PORT": "23456", "PET_MASTER_ADDR": "mnist-master-0",
            "WORLD_SIZE": str(replicas * per), "RANK": str(rank), "PET_NPROC_PER_NODE": nproc,
            "PET_NODE_RANK": str(rank), "PET_NNODES": str(replicas)}


def without_pet_master(pod):
    """PET_NPROC_PER_NODE, PET_NODE_RANK, PET_NNODES but no PET_MASTER_*: no released operator sets this
    (v1.7.0 added PET_MASTER_* together with nprocPerNode, training-operator #1840, master.go), but the
    layout must not hang on PET_MASTER_*."""
    return {k: v for k, v in pod.items() if not k.startswith("PET_MASTER_")}


@pytest.mark.parametrize("nproc", ["1", "auto"])
def test_pytorchjob_one_process_per_pod(nproc):
    assert layout(detect(without_pet_master(pytorchjob_pod(1, nproc=nproc)))) == (1, 0, 2, 1, 1, 2)
    env = detect(pytorchjob_pod(1, nproc=nproc))  # the first Worker
    assert env.launcher == "pytorchjob" and layout(env) == (1, 0, 2, 1, 1, 2)
    assert (env.master_addr, env.master_port, env.engine) == ("mnist-master-0", 23456, "PyTorchJob")
    assert env.restarted_by_engine and env.requeue_command is None
    assert layout(detect(pytorchjob_pod(0, nproc=nproc)))[:2] == (0, 0)


def test_pytorchjob_before_nproc_per_node_one_process_per_pod():
    """Operators before nprocPerNode (training-operator v1.5 envvar.go): MASTER_ADDR, MASTER_PORT,
    WORLD_SIZE = replicas, RANK, PYTHONUNBUFFERED only."""
    old = {k: v for k, v in pytorchjob_pod(1).items() if not k.startswith("PET_")}
    env = detect(old)
    assert layout(env) == (1, 0, 2, 1, 1, 2) and env.engine == "PyTorchJob"
    # the same variables outside a pod are a user's own env:// launch, all ranks on this one node, as before
    by_hand = {k: v for k, v in old.items() if not k.startswith("KUBERNETES_")}
    assert detect(by_hand).launcher == "env" and detect(by_hand).local_rank == 1


@pytest.mark.parametrize("marks", [{"KUBERNETES_PORT": "tcp://127.0.0.1:443"}, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"},
                                   {"KUBERNETES_PORT": "tcp://10.96.0.1:443", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}])
def test_a_pod_lightning_takes_for_kubeflow_is_one_process_per_pod(marks):
    """Lightning's KubeflowEnvironment.detect() asks KUBERNETES_PORT, MASTER_ADDR, MASTER_PORT, WORLD_SIZE
    and RANK (src/lightning/fabric/plugins/environments/kubeflow.py); its test_attributes_from_environment_
    variables (tests_fabric/plugins/environments/test_kubeflow.py): world 20, rank 1 -> local rank 0, node
    rank 1. The kubelet sets both KUBERNETES_PORT and KUBERNETES_SERVICE_HOST (pkg/kubelet/envvars); either
    marks a pod."""
    env = detect({**marks, "MASTER_ADDR": "1.2.3.4", "MASTER_PORT": "500", "WORLD_SIZE": "20", "RANK": "1"})
    assert layout(env) == (1, 0, 20, 1, 1, 20) and (env.master_addr, env.master_port) == ("1.2.3.4", 500)
    assert env.engine == "Kubernetes" and env.restarted_by_engine and env.requeue_command is None


def test_pytorchjob_torchrun_in_each_pod():
    latest = pytorchjob_pod(1, nproc="2")
    for pod in (latest, without_pet_master(latest)):
        env = detect({**pod, **torchrun_worker(3, 1, 4, 2, 1, 2, "mnist-master-0", 23456)})
        assert env.launcher == "torchrun" and layout(env) == (3, 1, 4, 2, 1, 2) and env.engine == "PyTorchJob"


def test_pytorchjob_many_per_pod_without_torchrun_is_refused():
    with pytest.raises(UserError) as e:
        detect(pytorchjob_pod(1, nproc="4"))  # WORLD_SIZE 8 processes, RANK 1 the pod
    assert "torchrun --nproc_per_node=$PET_NPROC_PER_NODE" in e.value.hint and "\n" not in e.value.line()


def test_elastic_pytorchjob_without_torchrun_is_refused():
    """elastic.go: with an elasticPolicy PET_NNODES is a range and PET_RDZV_* name the rendezvous."""
    pod = {**POD, "PET_NNODES": "1:3", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "mnist-worker-0:23456",
           "PET_NPROC_PER_NODE": "1"}
    with pytest.raises(UserError) as e:
        detect(pod)
    assert "elastic" in e.value.message


# ---- Volcano ---------------------------------------------------------------------------------------------

def volcano_hosts(master=1, workers=2):
    """svc plugin (volcano-sh/volcano pkg/controllers/job/plugins/svc/svc.go GenerateHosts, const.go):
    VC_<TASK>_HOSTS `<job>-<task>-<i>.<job>` comma-joined, VC_<TASK>_NUM; env plugin (env/env.go):
    VC_TASK_INDEX and VK_TASK_INDEX, the pod's index in its task."""
    hosts = {}
    for task, n in (("master", master), ("worker", workers)):
        if n:
            hosts[f"VC_{task.upper()}_HOSTS"] = ",".join(f"vj-{task}-{i}.vj" for i in range(n))
            hosts[f"VC_{task.upper()}_NUM"] = str(n)
    return hosts


def test_volcano_with_the_pytorch_plugin():
    """distributed-framework/pytorch/pytorch.go OnPodCreate: MASTER_ADDR `<job>-master-0.<job>`,
    MASTER_PORT 23456, WORLD_SIZE = master + worker replicas, RANK = worker index + 1 (master 0)."""
    pod = {**POD, **volcano_hosts(), "HOSTNAME": "vj-worker-1", "VC_TASK_INDEX": "1", "VK_TASK_INDEX": "1",
           "MASTER_ADDR": "vj-master-0.vj", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"}
    env = detect(pod)
    assert env.launcher == "volcano" and layout(env) == (2, 0, 3, 1, 2, 3)
    assert (env.master_addr, env.master_port, env.engine) == ("vj-master-0.vj", 23456, "Volcano")
    assert env.restarted_by_engine and env.requeue_command is None


def test_volcano_without_the_plugin_one_task():
    pod = {**POD, **volcano_hosts(master=0, workers=3), "HOSTNAME": "vj-worker-2", "VC_TASK_INDEX": "2",
           "VK_TASK_INDEX": "2"}
    env = detect(pod)
    assert layout(env) == (2, 0, 3, 1, 2, 3) and (env.master_addr, env.master_port) == ("vj-worker-0.vj", 23456)


def test_volcano_without_the_plugin_master_and_workers_by_hostname():
    pod = {**POD, **volcano_hosts(), "HOSTNAME": "vj-worker-1", "VC_TASK_INDEX": "1", "VK_TASK_INDEX": "1"}
    env = detect(pod)
    assert layout(env) == (2, 0, 3, 1, 2, 3) and env.master_addr == "vj-master-0.vj"
    assert detect({**pod, "HOSTNAME": "vj-master-0", "VC_TASK_INDEX": "0"}).rank == 0
    dashed = {**POD, "VC_TRAINER_A_HOSTS": "vj-trainer-a-0.vj,vj-trainer-a-1.vj", "VC_TRAINER_A_NUM": "2",
              "VC_TASK_INDEX": "1", "HOSTNAME": "vj-trainer-a-1"}  # task "trainer-a": - becomes _
    assert layout(detect(dashed))[:3] == (1, 0, 2)


@pytest.mark.parametrize("pod", [
    {**POD, **volcano_hosts(), "VC_TASK_INDEX": "1"} | {"HOSTNAME": ""},  # several tasks, no pod name
    {**POD, **volcano_hosts(), "VC_TASK_INDEX": "1", "HOSTNAME": "elsewhere"},
    {**POD, "VC_TASK_INDEX": "1", "VK_TASK_INDEX": "1"},  # env plugin only: nothing names the others
    # a template hostname: GenerateHosts lists it once (NUM 1) for 3 replicas; pod 2 is outside it
    {**POD, "VC_WORKER_HOSTS": "trainer.vj", "VC_WORKER_NUM": "1", "VC_TASK_INDEX": "2"},
])
def test_volcano_what_cannot_be_derived_is_refused(pod):
    with pytest.raises(UserError) as e:
        detect(pod)
    assert "pytorch plugin" in e.value.hint and "\n" not in e.value.line()


def test_volcano_one_task_without_the_env_plugin_takes_its_place_from_the_hostname():
    """svc.go OnPodCreate sets the pod's hostname to its name, `<job>-<task>-<i>` (helpers.MakePodName),
    and VC_<TASK>_HOSTS; without the env plugin (env/env.go) there is no VC_TASK_INDEX."""
    for i in range(3):
        env = detect({**POD, **volcano_hosts(master=0, workers=3), "HOSTNAME": f"vj-worker-{i}"})
        assert layout(env) == (i, 0, 3, 1, i, 3) and env.master_addr == "vj-worker-0.vj"


@pytest.mark.parametrize("hostname", ["", "pod", "vj-worker-7"])
def test_volcano_one_task_without_index_or_listed_hostname_is_refused_naming_the_env_plugin(hostname):
    with pytest.raises(UserError) as e:
        detect({**POD, **volcano_hosts(master=0, workers=3), "HOSTNAME": hostname})
    assert "`env` plugin" in e.value.hint and "\n" not in e.value.line()


@pytest.mark.parametrize("index", [None, "0", "1", "2"])
def test_volcano_task_template_hostname_is_refused_on_every_pod(index):
    """svc.go GenerateHosts lists a template's `hostname` once (VC_<TASK>_NUM=1) whatever the replicas, and
    every pod of the task carries that hostname: no pod can tell its place, pod 0 included."""
    pod = {**POD, "VC_WORKER_HOSTS": "trainer.vj", "VC_WORKER_NUM": "1", "HOSTNAME": "trainer"}
    if index is not None:
        pod |= {"VC_TASK_INDEX": index, "VK_TASK_INDEX": index}
    with pytest.raises(UserError) as e:
        detect(pod)
    assert "hostname" in e.value.message and "pytorch plugin" in e.value.hint and "\n" not in e.value.line()
    with pytest.raises(UserError):  # a master task with a template hostname beside default workers
        detect({**POD, **volcano_hosts(master=0), "VC_MASTER_HOSTS": "master.vj", "VC_MASTER_NUM": "1",
                "HOSTNAME": "master"})
    # under the pytorch plugin or torchrun the ranks come from them: nothing to refuse
    assert detect({**pod, "MASTER_ADDR": "trainer.vj", "WORLD_SIZE": "3", "RANK": "0"}).world_size == 3


def test_volcano_single_pod_and_torchrun_in_each_pod():
    single = detect({**POD, "VC_TASK_INDEX": "0", "VK_TASK_INDEX": "0"})
    assert (single.world_size, single.launched, single.engine) == (1, False, "Volcano")
    pod = {**POD, **volcano_hosts(master=0, workers=2), "VC_TASK_INDEX": "1"}
    env = detect({**pod, **torchrun_worker(3, 1, 4, 2, 1, 2, "vj-worker-0.vj", 23456)})
    assert env.launcher == "torchrun" and env.engine == "Volcano" and layout(env) == (3, 1, 4, 2, 1, 2)


# ---- Ray Train -------------------------------------------------------------------------------------------

def ray_worker(rank=3, local_rank=1, world=4, local_world=2, node=1):
    """ray-project/ray python/ray/train/torch/config.py: _TorchBackend.on_start sets MASTER_ADDR and
    MASTER_PORT (init_method "env"), _set_torch_distributed_env_vars sets LOCAL_RANK, RANK,
    LOCAL_WORLD_SIZE, WORLD_SIZE, NODE_RANK, ACCELERATE_TORCH_DEVICE; the raylet starts every worker
    with RAY_RAYLET_PID and RAY_JOB_ID (src/ray/raylet/worker_pool.cc); Ray sets CUDA_VISIBLE_DEVICES."""
    return {"RAY_RAYLET_PID": "4711", "RAY_JOB_ID": "01000000", "CUDA_VISIBLE_DEVICES": "0,1",
            "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "41234", "RANK": str(rank), "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local_world), "NODE_RANK": str(node),
            "ACCELERATE_TORCH_DEVICE": f"cuda:{local_rank}"}


def test_ray_train_worker():
    env = detect(ray_worker())
    assert env.launcher == "ray" and layout(env) == (3, 1, 4, 2, 1, 2)
    assert (env.master_addr, env.master_port, env.job_id) == ("10.0.0.5", 41234, "01000000")
    assert env.engine == "Ray Train" and env.restarted_by_engine and env.scheduler_binds_gpus
    assert env.rendezvous_by_launcher and not env.agent_store and env.requeue_command is None


def test_ray_train_on_kuberay_stays_ray_and_torchrun_in_a_ray_task_stays_torchrun():
    assert detect({**POD, **ray_worker()}).engine == "Ray Train"
    inside = detect({**ray_worker(), **torchrun_worker(1, 1, 2, 2, 0, 1, "127.0.0.1", 29500)})
    assert inside.launcher == "torchrun" and inside.rank == 1


def test_ray_train_with_tcp_init_is_refused():
    worker = {k: v for k, v in ray_worker().items() if not k.startswith("MASTER_")}
    with pytest.raises(UserError) as e:
        detect(worker)
    assert "init_method" in e.value.hint


# ---- the grace period, under every launcher ---------------------------------------------------------------

@pytest.mark.parametrize("environ", [{}, trainer_pod(1, nproc="1"), ray_worker(),
                                     {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}])
def test_grace_period_from_the_template_under_every_launcher(environ):
    assert detect(environ).grace_period_s is None
    assert detect({**environ, "DDP_KIT_GRACE_PERIOD_S": "30"}).grace_period_s == 30.0
    assert detect({**environ, "DDP_KIT_GRACE_PERIOD_S": ""}).grace_period_s is None


@pytest.mark.parametrize("raw", ["thirty", "-1", "inf", "nan"])
def test_grace_period_that_is_not_seconds_is_one_line(raw):
    with pytest.raises(UserError) as e:
        detect({"DDP_KIT_GRACE_PERIOD_S": raw})
    assert "DDP_KIT_GRACE_PERIOD_S" in e.value.message and "\n" not in e.value.line()


def test_a_plain_pod_is_restarted_by_kubernetes_and_a_host_by_nobody():
    env = detect({**POD, **torchrun_worker(0, 0, 2, 2, 0, 1, "127.0.0.1", 29500)})
    assert (env.engine, env.restarted_by_engine, env.requeue_command) == ("Kubernetes", True, None)
    host = detect({})
    assert (host.engine, host.restarted_by_engine, host.grace_period_s) == (None, False, None)


def test_ray_train_names_the_device_it_assigned_and_choose_device_takes_it(monkeypatch):
    """Ray shares a node's workers' GPUs with each of them and says which one a worker holds in
    ACCELERATE_TORCH_DEVICE (ray/train/torch/config.py): that GPU, not cuda:<local rank>. The GPU
    itself cannot exist here: torch.cuda's answers are patched (a test of the choice only)."""
    import torch

    from ddp_kit.dist import choose_device

    env = detect({"RAY_RAYLET_PID": "7", "NODE_RANK": "0", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                  "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                  "ACCELERATE_TORCH_DEVICE": "cuda:3"})
    assert env.device_hint == "cuda:3"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert choose_device(env) == torch.device("cuda", 3)
    assert choose_device(env, "cpu") == torch.device("cpu")

"""The detected environment as one frozen value, and the variable parsing every launcher shares.

`DistEnv` carries the rank layout plus neutral facts about the launcher and the scheduler around
it (does the scheduler bind GPUs to tasks, who hosts the rendezvous store, how to requeue the job),
so that the rest of ddp_kit asks those facts and never a launcher's name. `launcher` is a display
name only (the startup line, the doctor).
"""
from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import UserError

# The launcher name of a process nobody launched: the default of `DistEnv.launcher`.
NO_LAUNCHER = "single"


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. World size 1 when nothing launched us."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = NO_LAUNCHER  # a display name; compare the facts below instead
    job_id: str | None = None
    restart_count: int = 0
    hosts: tuple[str, ...] = ()
    batch_job_id: str | None = None  # the scheduler's job (SLURM_JOB_ID) around us, whatever started the ranks
    requeue_id: str | None = None  # what `scontrol requeue` takes for this job: ARRAYID_TASKID for an array task
    cpus_on_node: int | None = None  # CPUs the scheduler allocated on this node (None: not said)
    gpus_on_node: int | None = None  # GPUs the scheduler allocated on this node (None: not said)
    # ---- the batch scheduler around whatever started the ranks, set by its `around` step ----
    # A display name ("SLURM"; the doctor says it), None outside any batch scheduler.
    scheduler: str | None = None
    # The ids of the GPUs the scheduler allocated to this job or step on this node, where it lists
    # them instead of (or as well as) counting them in gpus_on_node.
    gpu_ids: tuple[str, ...] = ()
    # The tasks per node the job asked its scheduler for, inside one of its steps (srun
    # --ntasks-per-node): one task per GPU means as many as the node's GPUs. None: not said.
    tasks_per_node: int | None = None
    # The signal the scheduler sends ahead of a preemption or the time limit, asking for a checkpoint
    # and a requeue (requeue_command); SLURM's templates ask for USR2 (NCCL may swallow USR1). Any other
    # stop signal checkpoints and exits without a requeue.
    preempt_signal: signal.Signals = signal.SIGTERM
    # ---- neutral facts, set by the launcher's detect() (the defaults: a plain process) ----
    # Each rank is a task the scheduler may bind to a GPU of its own (srun --gpu-bind): a task that
    # sees exactly one GPU then owns it, rather than sharing it with the node's other ranks.
    scheduler_binds_gpus: bool = False
    # The launcher's agent hosts the rendezvous store and the workers, rank 0 included, only connect
    # to it: rank 0's exit does not take the store down.
    agent_store: bool = False
    # The launcher puts OMP_NUM_THREADS=1 into its workers' environment when the user did not, so a 1
    # found there may be the launcher's default rather than the user's choice.
    sets_omp_threads: bool = False
    # The launcher met its peers at master_addr:master_port before it started this process: the
    # endpoint is known to resolve and its port is in use by design (nothing there for us to probe).
    rendezvous_by_launcher: bool = False
    # The command that puts this job back in its scheduler's queue (None: no scheduler requeues it).
    requeue_command: tuple[str, ...] | None = None
    # The device the engine assigned this process ("cuda:2"), when it says so (Ray Train's
    # ACCELERATE_TORCH_DEVICE): with GPUs shared among a node's workers, local rank i need not hold
    # the i-th visible GPU. None: the local rank decides.
    device_hint: str | None = None
    # ---- the engine around the launcher, set by the `around` steps (env/__init__.SCHEDULERS) ----
    # A display name of the engine that created the pods or workers ("Kubeflow Trainer v2",
    # "PyTorchJob", "Volcano", "Ray Train", "Kubernetes" for a pod no operator of ours names): the
    # startup line says it. None outside any engine.
    engine: str | None = None
    # Seconds between the engine's SIGTERM and its SIGKILL (Kubernetes: terminationGracePeriodSeconds,
    # passed by the templates in DDP_KIT_GRACE_PERIOD_S): a checkpoint must fit in it. None: not said.
    grace_period_s: float | None = None
    # The engine restarts failed or preempted workers itself (a Kubernetes operator's restart policy,
    # Ray's FailureConfig): an exit 75 is mapped by its policy, not by a requeue command.
    restarted_by_engine: bool = False
    # ---- replica groups of a fault-tolerant run (env/replicas.py; strategy "ft") ----
    # This launch is replica group `replica_group` of `replica_groups`; its ranks are the process
    # group, and the groups meet through torchft's lighthouse at `lighthouse` (http://host:port).
    replica_group: int = 0
    replica_groups: int = 1
    lighthouse: str | None = None
    # One-line warnings detection found (e.g. a command typed into the shell of `srun --pty bash`),
    # for the caller to print once, by rank 0.
    notes: tuple[str, ...] = ()

    @property
    def launched(self) -> bool:
        """Started by a launcher (torchrun, srun, ...), not as a plain `python` process."""
        return self.launcher != NO_LAUNCHER

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- what a launch of several replica groups means to the rest of ddp_kit, asked here ----
    @property
    def part(self) -> str | None:
        """The sub-folder of the run folder (and of its checkpoint location) that this launch's share
        of the run keeps, a job of its own to the lock, the metrics and the commits; None: the whole."""
        return f"replica_{self.replica_group}" if self.replica_groups > 1 else None

    @property
    def leads_job(self) -> bool:
        """This launch speaks for the whole job where one must (the experiment trackers)."""
        return self.replica_group == 0

    def data_place(self, rank: int, world_size: int) -> tuple[int, int]:
        """(shard, shards) of the training data `rank` of this launch's `world_size` reads: its place among
        the ranks of every launch of the job."""
        return self.replica_group * world_size + rank, self.replica_groups * world_size

    def job_facts(self) -> dict[str, int]:
        """What the job is beyond this launch, for a tracker's run parameters."""
        return {"replica_groups": self.replica_groups} if self.replica_groups > 1 else {}


def int_var(environ: Mapping[str, str], key: str, default: int | None = None) -> int:
    """`environ[key]` as an int; `default` when unset or empty (no default: refused as missing)."""
    raw = environ.get(key)
    if raw is None or raw == "":
        if default is None:
            raise UserError(f"{key} is not set", "launch with torchrun or srun, or unset the partial launcher variables")
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"{key}={raw!r} is not an integer", f"unset or fix {key}") from None


def count_var(environ: Mapping[str, str], key: str) -> int | None:
    """A count the scheduler may state, e.g. CPUs on this node; None when absent or not a plain number."""
    raw = environ.get(key, "")
    return int(raw) if raw.isdigit() else None


def check_place(env: DistEnv) -> None:
    """Refuse a layout whose numbers disagree, whichever launcher gave them."""
    if env.world_size < 1:
        raise UserError(f"world size {env.world_size} from {env.launcher} is not positive", "check the launcher's task count")
    if not 0 <= env.rank < env.world_size:
        raise UserError(f"rank {env.rank} is outside world size {env.world_size} ({env.launcher})",
                        "the launcher variables disagree; relaunch with torchrun or srun instead of setting them by hand")
    if not 0 <= env.local_rank < max(env.local_world_size, 1):
        raise UserError(f"local rank {env.local_rank} is outside local world size {env.local_world_size} ({env.launcher})",
                        "check --ntasks-per-node / --nproc_per_node")
    if env.world_size > 1 and not env.master_addr:
        raise UserError(f"{env.launcher} gave world size {env.world_size} but no master address",
                        "set MASTER_ADDR to the first node's host name")


def node_layout(environ: Mapping[str, str], rank: int, local_rank: int, world: int, node_hint: int | None = None,
                local_world_hint: int | None = None) -> tuple[int, int, int]:
    """(local_world_size, node_rank, num_nodes) of a worker whose launcher said its rank and local
    rank, from LOCAL_WORLD_SIZE, GROUP_RANK and GROUP_WORLD_SIZE where set and derived where not.

    torchrun sets them all; older launchers and hand-written ones leave some out. The hints are what
    the scheduler around says (an srun task's node and its node's task count)."""
    node = int_var(environ, "GROUP_RANK") if environ.get("GROUP_RANK") else node_hint
    groups = int_var(environ, "GROUP_WORLD_SIZE") if environ.get("GROUP_WORLD_SIZE") else None
    below = rank - local_rank  # the ranks of the nodes before this one, when every node has as many
    if environ.get("LOCAL_WORLD_SIZE"):
        local_world = int_var(environ, "LOCAL_WORLD_SIZE")
    elif local_world_hint:
        local_world = local_world_hint
    elif groups and world % groups == 0:
        local_world = world // groups
    elif node and below > 0 and below % node == 0 and below // node > local_rank:
        local_world = below // node
    else:  # at least node + 1 nodes share the world (one node when nothing says more)
        local_world = max(local_rank + 1, world // ((node or 0) + 1))
    if node is None:
        node = rank // max(1, local_world)
    return local_world, node, groups or max(node + 1, -(-world // max(1, local_world)))

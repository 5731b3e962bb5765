"""Ranks started by an MPI launcher (`mpirun`, `mpiexec`), read from the variables the launcher puts in
each rank's environment: no mpi4py, no MPI_Init, nothing collective. (Lightning's MPIEnvironment asks
mpi4py's COMM_WORLD and broadcasts rank 0's host name; every launcher below states rank, size and the
node-local numbers before the process starts, so reading them is enough and the ranks need no MPI library.)

| launcher | rank, size | local rank, local size | mark |
|---|---|---|---|
| Open MPI `mpirun` (orterun 4.x, prterun 5.x; IBM jsrun too, lsf.py first) | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE` | `OMPI_COMM_WORLD_SIZE` |
| MVAPICH `mpirun_rsh` | `MV2_COMM_WORLD_RANK`, `MV2_COMM_WORLD_SIZE` | `MV2_COMM_WORLD_LOCAL_RANK`, `MV2_COMM_WORLD_LOCAL_SIZE` | `MV2_COMM_WORLD_SIZE` |
| Hydra `mpiexec` (MPICH, Intel MPI, MVAPICH's mpiexec) | `PMI_RANK`, `PMI_SIZE` | `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` | `PMI_SIZE` with `MPI_LOCALNRANKS` |
| PMI alone (PMI-1 launchers, HPE Cray PALS `mpiexec`/`aprun`) | `PMI_RANK`, `PMI_SIZE` | `PMI_LOCAL_RANK`, `PMI_LOCAL_SIZE` (where set) | `PMI_SIZE` outside an srun step (srun's PMI plugins set PMI_* too: those tasks stay SLURM's, slurm.py) |

`OMPI_COMM_WORLD_NODE_RANK` is not the node's index: Open MPI counts it per node, over every job there.
The node index is taken from the ranks below this one (mpirun's default mapping fills a node's slots
before the next; round-robin `--map-by node` is recognised too), the node count from Open MPI's
`OMPI_MCA_orte_num_nodes` where it says it. A one-rank launch is a plain process (single.py), as
Lightning's detect() says of a size of 1; a size above 1 is never read as one (a second launcher's size
that disagrees, or a size without its rank, is refused). A launcher that states no local size: one node
where that is provable (the scheduler around names one host, or there is no scheduler job, as env_vars.py
takes hand-set variables), else the ranks spread by slot over the scheduler's hosts; refused where a
scheduler job is around but its host list cannot be read on this host.

The master must be agreed by every rank without a collective, so it is taken only from what every rank
sees alike: a MASTER_ADDR the user exported (`mpirun -x MASTER_ADDR=$(hostname)`), else 127.0.0.1 when
the launcher says every rank is on this node (local size = size), else the first host of the scheduler
around (PBS's `$PBS_NODEFILE`, LSF's compute hosts, SLURM's `SLURM_JOB_NODELIST`; rank 0 says so where it
runs elsewhere). Ranks over several nodes with none of these are refused in one line. Not used: Open MPI 4's `OMPI_MCA_orte_hnp_uri` names the host of
mpirun itself, which need not run rank 0 (`mpirun -host b,c` from a), in every address it has, bridges
and loopback-routed ones included; Open MPI 5 has no such variable, and its `PMIX_SERVER_URI*` name each
node's local daemon, which differs between nodes. The port: MASTER_PORT, else one derived from the job's
id that every rank shares (`PMIX_NAMESPACE`, Open MPI 4's `OMPI_MCA_ess_base_jobid`, MVAPICH's
`MPIRUN_ID`), else torch's 29500.

mpirun forwards SIGUSR1/SIGUSR2 to every rank and turns SIGTERM into a kill of the job; the scheduler
around it (slurm.py, lsf.py, pbs.py) names the preemption signal and the requeue.
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import UserError
from . import lsf, pbs
from .base import DistEnv, int_var
from .facts import facts_of
from .lsf import _same_host as same_host
from .slurm import _in_step as in_srun_step
from .slurm import expand_nodelist

NAME = "mpi"
SHOWN = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
         "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE",
         "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE")


@dataclass(frozen=True)
class Flavour:
    """One launcher family's names for the four numbers; `marks`: all must be present."""

    name: str
    rank: str
    size: str
    local_rank: str
    local_size: str
    marks: tuple[str, ...]
    srun_owns: bool = False  # srun's own PMI plugins set these names in its tasks: not ours inside an srun step


FLAVOURS = (
    Flavour("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE", ("OMPI_COMM_WORLD_SIZE",)),
    Flavour("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
            "MV2_COMM_WORLD_LOCAL_SIZE", ("MV2_COMM_WORLD_SIZE",)),
    Flavour("Hydra", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", ("PMI_SIZE", "MPI_LOCALNRANKS")),
    Flavour("PMI", "PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE", ("PMI_SIZE",), srun_owns=True),
)
# A scheduler job around the launch: where one is, its host list decides how many nodes the ranks are on.
_JOB_KEYS_AROUND = ("PBS_JOBID", "LSB_JOBID", "SLURM_JOB_ID")
# What every rank of one launch shares, to derive a port from (first found wins).
_JOB_KEYS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "MPIRUN_ID")
DEFAULT_PORT = 29500


def flavour_of(environ: Mapping[str, str]) -> Flavour | None:
    in_step = in_srun_step(environ)
    return next((f for f in FLAVOURS if all(mark in environ for mark in f.marks) and not (f.srun_owns and in_step)),
                None)


def detect(environ: Mapping[str, str]) -> DistEnv | None:
    """This rank's place, or None when no MPI launcher started more than one rank, or when torch's RANK
    was set inside the rank with WORLD_SIZE or LOCAL_RANK (a script that starts its own workers there:
    env_vars.py reads it; RANK alone it does not read, so the launcher's numbers stand)."""
    flavour = flavour_of(environ)
    if flavour is None or ("RANK" in environ and ("WORLD_SIZE" in environ or "LOCAL_RANK" in environ)):
        return None
    world = int_var(environ, flavour.size, 0)
    if world <= 1:
        _refuse_a_larger_size(environ, flavour, world)
        return None
    if not environ.get(flavour.rank):
        raise UserError(f"{flavour.size}={world} ({flavour.name}'s mark) is set but {flavour.rank} is not",
                        f"start the ranks with the MPI launcher, which sets both, or unset {flavour.size}")
    rank = int_var(environ, flavour.rank)
    stated = int_var(environ, flavour.local_size, 0)
    local_world = stated or _unstated_local_size(environ, flavour, world)
    local_rank = int_var(environ, flavour.local_rank, rank % local_world)
    nodes = int_var(environ, "OMPI_MCA_orte_num_nodes", 0) or -(-world // local_world)
    master, notes = _master_addr(environ, flavour, rank, world, local_world, nodes)
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=max(local_world, local_rank + 1),  # taken as given when the numbers disagree
        node_rank=node_of(rank, local_rank, local_world, nodes),
        num_nodes=nodes,
        master_addr=master,
        master_port=int_var(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else mpi_port(environ),
        launcher=NAME,
        notes=notes,
    )


def _refuse_a_larger_size(environ: Mapping[str, str], flavour: Flavour, world: int) -> None:
    """A size above 1 in another launcher's names is never run as a world of one."""
    in_step = in_srun_step(environ)
    for other in FLAVOURS:
        if other.size in environ and not (other.srun_owns and in_step) and int_var(environ, other.size, 0) > 1:
            raise UserError(f"{flavour.size}={world} but {other.size}={environ[other.size]}: two launchers' variables "
                            "disagree on the number of ranks", "start the ranks with one launcher, or unset the stale "
                            "variables of the other")


def _unstated_local_size(environ: Mapping[str, str], flavour: Flavour, world: int) -> int:
    """The ranks on this node where the launcher does not say: all of them where one node is provable (the
    scheduler around names one host, or there is no scheduler job), else the world over its hosts by slot."""
    hosts = scheduler_hosts(environ)[1]
    if len(hosts) > 1:
        return -(-world // len(hosts))
    if hosts or not any(environ.get(key) for key in _JOB_KEYS_AROUND):
        return world
    raise UserError(f"{flavour.name} started {world} ranks without {flavour.local_size}, and the job's host list is not "
                    "readable on this host, so the ranks on this node are unknown",
                    f"export {flavour.local_rank} and {flavour.local_size} to the ranks, or start them with a launcher "
                    "that states them (Open MPI's mpirun, MPICH's or Intel MPI's mpiexec)")


def _master_addr(environ: Mapping[str, str], flavour: Flavour, rank: int, world: int, local_world: int,
                 nodes: int) -> tuple[str, tuple[str, ...]]:
    """The master's host, and a note for rank 0 to say where it is not on that host."""
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"], ()
    if local_world >= world:
        return "127.0.0.1", ()  # every rank on this node, as the launcher says to each of them
    source, hosts = scheduler_hosts(environ)
    if hosts:
        # mpirun's (and mpiexec's) default mapping is by slot: it fills the first host of the scheduler's
        # allocation before the next, so rank 0 runs there; every rank reads the same list, so all agree.
        # A launch given its own host list (mpirun -host b,c) can differ: rank 0 then says so.
        me = facts_of(environ).hostname() if rank == 0 else ""
        if not me or same_host(hosts[0], me):
            return hosts[0], ()
        return hosts[0], (f"MASTER_ADDR is not set, so the master is the first host of {source} ({hosts[0]}), where "
                          f"the launcher's default mapping puts rank 0, but rank 0 runs on {me}: if the ranks do not "
                          "meet, export MASTER_ADDR (mpirun -x MASTER_ADDR=$(hostname))",)
    raise UserError(
        f"{flavour.name} started {world} ranks on {nodes} nodes ({flavour.local_size}={local_world}) but MASTER_ADDR "
        "is not set, and nothing every rank sees names the host of rank 0",
        "export it to the ranks from the job script: `mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ...` "
        "(MPICH/Intel MPI: `mpiexec -genv MASTER_ADDR $(hostname) -genv MASTER_PORT 29500 ...`)")


def scheduler_hosts(environ: Mapping[str, str]) -> tuple[str, tuple[str, ...]]:
    """(where from, the hosts) of the scheduler job around the launch, in the scheduler's order: PBS's node file,
    LSF's compute hosts (its rank file after the launch node), SLURM's job node list; ("", ()) where none is
    named or readable on this host."""
    hosts = pbs.job_hosts(environ)
    if hosts:
        return "$PBS_NODEFILE", hosts
    try:
        hosts = lsf.compute_hosts(environ)
    except UserError:  # unreadable here: as if not named (the caller's own refusal says what to export)
        hosts = ()
    if hosts:
        return f"${lsf.RANKFILE}", hosts
    nodelist = environ.get("SLURM_JOB_NODELIST", "")
    return ("SLURM_JOB_NODELIST", tuple(expand_nodelist(nodelist))) if nodelist else ("", ())


def node_of(rank: int, local_rank: int, local_world: int, nodes: int) -> int:
    """The node's index from the ranks' numbering: filled node by node (mpirun's default), or dealt
    round-robin (--map-by node); the first reading otherwise (the node rank is then approximate)."""
    below = rank - local_rank
    if below % local_world != 0 and nodes > 1 and rank // nodes == local_rank:
        return rank % nodes
    return min(max(0, below) // local_world, nodes - 1)


def mpi_port(environ: Mapping[str, str]) -> int:
    """A port every rank of one launch derives alike from the id it shares, in 25000..29999 (below
    Linux's ephemeral ports); 29500 when the launcher shares none."""
    key = next((environ[k] for k in _JOB_KEYS if environ.get(k)), None)
    return DEFAULT_PORT if key is None else 25000 + zlib.crc32(key.encode()) % 5000

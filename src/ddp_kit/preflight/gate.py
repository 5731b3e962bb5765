"""The pre-flight health gate: every check of one attempt's start, on every node, compared across nodes.

    node-local (a host's first rank)  run_dir and the checkpoint folder writable, with room for a checkpoint
                                      of the last one's size; the memory tier's tmpfs with room for its copies
    per GPU (each rank its own)       NVML health, memory a previous attempt still holds (waited for), a
                                      matmul with a known exact result, timed (preflight/gpu.py)
    between hosts                     each host's clock against rank 0's; the links between hosts, timed
                                      point to point (preflight/peers.py)
    across the job                    a GPU (or, on CPU, a host) whose matmul is well below the median; a
                                      URL checkpoint location written once (rank 0)

Collective: every rank calls `run` with the same plan and gets the same Report. Quick (the default at every
attempt) times one message size in two rounds of the ring; thorough every pair of hosts, a larger message,
and a larger matmul. The library function: the service (services/health_gate.py) and `python -m
ddp_kit.doctor --preflight` both call it."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..dist import DistContext
from ..dist.collectives import all_gather_object
from . import gpu, local, peers
from .results import Report, Result

MODES = ("off", "quick", "thorough")
HELD_LIMIT_MB = 2048  # memory on this rank's GPU that is not its own, above which a previous attempt still holds it


@dataclass(frozen=True)
class Plan:
    mode: str = "quick"
    folders: tuple[tuple[str, str, int], ...] = ()  # (check name, a local folder, the bytes it must have room for)
    url: str | None = None  # a checkpoint location at a URL: written once, by rank 0
    shm_need: int | None = None  # the memory tier's room on each node (None: the tier is off)
    clock_bound_s: float = peers.CLOCK_BOUND_S
    memory_wait_s: float = 50.0  # a GPU still held by the previous attempt is waited for this long


def run(ctx: DistContext, plan: Plan) -> Report:
    t0 = time.perf_counter()
    lay = peers.layout(ctx)
    mine: list[Result] = []
    if lay.is_leader:
        mine += [local.folder(name, path, lay.host, need) for name, path, need in plan.folders]
        if plan.shm_need is not None:
            mine.append(local.tmpfs_room(lay.host, plan.shm_need))
    if plan.url is not None and ctx.rank == 0:
        mine.append(_url_writable(plan.url, lay.host))
    mine += _device(ctx, lay, plan)
    thorough = plan.mode == "thorough"
    results = [r for part in all_gather_object(ctx, mine) for r in part]  # before the links: a GPU that failed
    results += peers.clock(ctx, lay, plan.clock_bound_s)                # cannot move their tensors
    cuda = ctx.backend == "nccl"
    broken = cuda and any(r.check == "gpu_matmul" and not r.ok for r in results)
    if broken:  # the same decision on every rank: it is made from what every rank gathered
        results.append(Result("network", lay.host, True, "not timed: a GPU failed its matmul (above)", skipped=True))
    else:
        nbytes = (64 if thorough else 8) * 2**20 if cuda else (8 if thorough else 2) * 2**20
        results += peers.links(ctx, lay, nbytes, rounds=len(lay.leaders) if thorough else 2)
    if cuda:  # on CPU the hosts' matmuls are too short, and here share cores, to compare: correctness only
        results += gpu.slow_ones([r for r in results if r.check == "gpu_matmul" and r.ok and r.value])
    return Report(plan.mode, tuple(results), time.perf_counter() - t0, lay.hosts)


def _device(ctx: DistContext, lay: peers.Layout, plan: Plan) -> list[Result]:
    """GPU checks on each rank's own GPU; on CPU, the host's first rank times the matmul alone (the ranks of
    a host share its cores: timed together they would measure each other)."""
    if ctx.device.type != "cuda":
        if not lay.is_leader:
            return []
        return [Result("gpu_health", lay.host, True, "no GPU: nothing to check", skipped=True),
                gpu.matmul(torch.device("cpu"), lay.host, 384 if plan.mode == "thorough" else None)]
    index = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()
    out = gpu.health([index], lay.host)
    # This process's CUDA context and NCCL's buffers exist by now, and NVML may not know this pid (a container's
    # own pid namespace): the limit allows for them, and still catches a previous attempt's model left behind.
    out += gpu.wait_memory_released([index], lay.host, limit_mb=HELD_LIMIT_MB, wait_s=plan.memory_wait_s)
    out.append(gpu.matmul(ctx.device, lay.host, 8192 if plan.mode == "thorough" else None))
    return out


def _url_writable(url: str, host: str) -> Result:
    from ..checkpoint.storage_registry import open_storage

    t0 = time.perf_counter()
    rel = f".ddp_kit-health-{host}"
    try:
        store = open_storage(url)
        store.write_bytes(rel, b"ok")
        store.remove([rel])
    except Exception as err:  # any refusal of the store is the finding: it is named, not raised
        return Result("checkpoints", host, False, f"not writable: {type(err).__name__}: {str(err)[:200]}",
                      "a location this job can write", url, seconds=time.perf_counter() - t0)
    return Result("checkpoints", host, True, "writable", detail=url, seconds=time.perf_counter() - t0)

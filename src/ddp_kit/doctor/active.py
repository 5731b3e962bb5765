"""Active checks: all-reduce latency and bus bandwidth (--comm, under torchrun), allocatable GPU memory (--memory)."""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as tdist

from ..dist import DistContext
from ..dist.collectives import all_gather_object


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for an all-reduce, with nccl-tests' factor 2(n-1)/n."""
    alg = nbytes / seconds / 1e9
    return alg, alg * (2 * (world - 1) / world if world > 1 else 1.0)


def comm_sweep(ctx: DistContext, max_mb: float | None = None, iters: int = 10, min_s: float = 0.2) -> dict[str, Any]:
    """Time all_reduce over sizes 4 KiB..max_mb (16 MiB on CPU, 256 MiB under NCCL, where small sizes
    say nothing about bandwidth), and a fixed local matmul per rank to spot a slow rank.

    Each size is warmed up (NCCL sets up its channels and buffers on first use), then timed as a
    batch of back-to-back calls with one synchronize at the end (a sync per call would measure the
    host's round trip), the batch growing until it lasts `min_s`; the median of 3 batches counts."""
    dev = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    max_mb = max_mb if max_mb is not None else (256 if dev.type == "cuda" else 16)
    rows = []
    size = 4096
    while size <= max_mb * 2**20:
        t = torch.ones(size // 4, dtype=torch.float32, device=dev)
        for _ in range(5):
            tdist.all_reduce(t)
        _sync(dev)
        n = iters
        while True:
            times = []
            for _ in range(3):
                tdist.barrier()  # every rank starts the batch together
                t0 = time.perf_counter()
                for _ in range(n):
                    tdist.all_reduce(t)
                _sync(dev)
                times.append((time.perf_counter() - t0) / n)
            # every rank takes the same decision: the slowest rank's figure decides
            longest = torch.tensor([min(times) * n], dtype=torch.float64, device=dev)
            tdist.all_reduce(longest, op=tdist.ReduceOp.MAX)
            if float(longest) >= min_s or n >= 10_000:
                break
            n *= 4
        med = statistics.median(times)
        alg, bus = bus_bandwidth(size, med, ctx.world_size)
        rows.append({"bytes": size, "latency_us": med * 1e6, "algbw_gbps": alg, "busbw_gbps": bus})
        size *= 4
    # Each rank times the same local work: in a collective the fast ranks wait for the slow one,
    # so collective timings hide who is slow; local work does not.
    side = 4096 if dev.type == "cuda" else 512  # long enough to time on either
    a = torch.randn(side, side, device=dev) / side ** 0.5
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(50 if dev.type == "cuda" else 20):
        a = torch.tanh(a @ a)
    _sync(dev)
    local = time.perf_counter() - t0
    per_rank = all_gather_object(ctx, {"rank": ctx.rank, "local_s": local, "host": _host()})
    med_local = statistics.median(r["local_s"] for r in per_rank)
    slow = [r for r in per_rank if r["local_s"] > 1.5 * med_local]
    return {"backend": ctx.backend, "world_size": ctx.world_size, "sizes": rows, "per_rank": per_rank, "slow_ranks": slow}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _host() -> str:
    import os

    return os.uname().nodename


def allocatable_memory(device: torch.device, chunk_mb: int = 256) -> dict[str, Any]:
    """Allocate chunks until out of memory; report how much of the GPU could really be had."""
    free, total = torch.cuda.mem_get_info(device)
    chunks, got = [], 0
    try:
        while True:
            chunks.append(torch.empty(chunk_mb * 2**20, dtype=torch.uint8, device=device))
            got += chunk_mb
    except torch.cuda.OutOfMemoryError:
        pass
    finally:
        del chunks
        torch.cuda.empty_cache()
    return {"device": str(device), "total_mb": total / 2**20, "free_mb_before": free / 2**20, "allocatable_mb": got}

"""The gate's checks of a GPU: what NVML says of its health, memory that a previous attempt still holds on
it (waited for), and a matmul whose exact result is known, timed so that the job can compare its GPUs
(`slow_ones`). Each returns Results, one per GPU; without a GPU, or without the NVIDIA driver, one skipped
Result says so.

GPUs are named by CUDA index, as this process sees them (after CUDA_VISIBLE_DEVICES), and found in NVML
by UUID: NVML counts in PCI bus order and ignores CUDA_VISIBLE_DEVICES, so index n there is not always
cuda:n here."""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from ctypes import c_void_p
from typing import Any

import torch

from . import nvml
from .results import Result

NO_GPU = "no GPU (torch.cuda.is_available() is False): nothing to check"
NO_NVML = "NVML not available (no NVIDIA driver)"
HEALTHY = ("no pending page retirement or row remap, no uncorrected ECC error, no recovery action, no hardware "
           "or thermal slowdown")
# 137 GFLOP a matmul on a GPU: a few ms at an H100's fp32 rate (estimated); ~0.2 ms on two CPU cores (measured)
MATMUL_SIZE = {"cuda": 4096, "cpu": 256}
WARMUPS, REPS = 2, 10  # the first call picks cuBLAS's kernel and makes its workspace; the clocks rise
# Timed in batches of REPS until this long has passed (at most MAX_BATCHES): a small CPU matmul takes a
# fraction of a millisecond, and one batch of those would compare hosts by their scheduler's jitter.
MIN_TIMED_S, MAX_BATCHES = 0.05, 20
# The matmul's operands repeat with period 7 along each axis, so the product does too and its 7x7 distinct
# values are computed on the CPU in int64. 7 is prime to every power of two: a kernel that reads a tile
# from the wrong place (tiles are 2**k wide) reads different values and is caught.
PERIOD = 7
SLOW_FACTOR = 1.5
# A median of fewer than three says nothing about which one is slow: of two, the median is their mean,
# and either could be the odd one (a single-GPU job on two nodes is left unjudged).
MIN_PEERS = 3

Gpu = tuple[int, c_void_p, str]  # (CUDA index, NVML handle, how a Result names it)


def _key(uuid: str) -> str:
    return uuid.strip().lower().removeprefix("gpu-")


def _cuda_uuids(indices: Sequence[int]) -> dict[int, str] | None:
    """{CUDA index: its UUID} for this process's devices `indices`; None without CUDA."""
    if not indices or not torch.cuda.is_available():
        return None
    out: dict[int, str] = {}
    for i in indices:
        try:
            out[i] = _key(str(torch.cuda.get_device_properties(i).uuid))
        except (AssertionError, AttributeError, RuntimeError):  # no such device, or a torch without uuids
            out[i] = ""
    return out


def _skipped(check: str, host: str, why: str, t0: float, detail: str = "") -> Result:
    return Result(check, host, True, why, detail=detail, seconds=time.perf_counter() - t0, skipped=True)


def _per_gpu(check: str, indices: Sequence[int], host: str,
             each: Callable[[Any, list[Gpu]], list[Result]]) -> list[Result]:
    """NVML opened, the CUDA devices found in it by UUID and handed to `each`; the guards on the way."""
    t0 = time.perf_counter()
    uuids = _cuda_uuids(indices)
    if uuids is None:
        return [_skipped(check, host, NO_GPU, t0)]
    lib = nvml.open_nvml()
    if lib is None:
        return [_skipped(check, host, NO_NVML, t0)]
    try:
        found: dict[str, tuple[c_void_p, str]] = {}
        for n in range(nvml.device_count(lib) or 0):
            h = nvml.handle(lib, n)
            uuid = nvml.uuid(lib, h) if h is not None else None
            if h is not None and uuid:
                pci = nvml.pci_bus_id(lib, h)
                found[_key(uuid)] = (h, f"({uuid}, PCI {pci})" if pci else f"({uuid})")
        mine = [(i, found[k][0], f"GPU {i} {found[k][1]}") for i, k in uuids.items() if k in found]
        done = dict(zip([g[0] for g in mine], each(lib, mine)))  # `each` answers one Result per GPU, in order
        return [done[i] if i in done else _skipped(
            check, host, "not found among NVML's GPUs by its UUID (a MIG instance?): not checked", t0, f"GPU {i}")
            for i in uuids]
    finally:
        nvml.close(lib)


def health(indices: Sequence[int], host: str) -> list[Result]:
    """"gpu_health" for each of this process's CUDA devices `indices`: what the driver knows is wrong with it
    (pages or rows waiting for a reset, a failed row remap, uncorrected ECC errors, a recovery action asked
    for, clocks held down by the hardware)."""
    return _per_gpu("gpu_health", indices, host, lambda lib, gpus: [_health_one(lib, g, host) for g in gpus])


def _health_one(lib: Any, gpu: Gpu, host: str) -> Result:
    t0 = time.perf_counter()
    h = gpu[1]
    pending, rows = nvml.retired_pages_pending(lib, h), nvml.remapped_rows(lib, h)
    ecc, action, clocks = nvml.uncorrected_ecc_volatile(lib, h), nvml.recovery_action(lib, h), nvml.clock_reasons(lib, h)
    wrong = []
    if pending:
        wrong.append("retired pages pending (they take effect at a GPU reset)")
    if rows and rows[3]:
        wrong.append("a row remap failed (the GPU needs service)")
    elif rows and rows[2]:
        wrong.append("a row remap pending (it takes effect at a GPU reset)")
    if ecc:
        wrong.append(f"{ecc} uncorrected ECC error{'s' if ecc > 1 else ''} since the driver loaded")
    if action:
        wrong.append(f"the driver asks for recovery action {nvml.RECOVERY_ACTIONS.get(action, str(action))}")
    if clocks and nvml.bad_clock_reasons(clocks):
        wrong.append("clocks held down: " + ", ".join(nvml.bad_clock_reasons(clocks)))
    unknown = [what for what, v in (("page retirement", pending), ("row remapping", rows), ("ECC", ecc),
                                    ("recovery action", action), ("clock reasons", clocks)) if v is None]
    measured = "; ".join(wrong) or "nothing wrong" + (f" (not reported here: {', '.join(unknown)})" if unknown else "")
    return Result("gpu_health", host, not wrong, measured, HEALTHY, gpu[2], seconds=time.perf_counter() - t0)


def wait_memory_released(indices: Sequence[int], host: str, limit_mb: int = 512, wait_s: float = 50.0,
                         poll_s: float = 2.0, sleep: Callable[[float], None] = time.sleep,
                         clock: Callable[[], float] = time.monotonic) -> list[Result]:
    """"gpu_memory_held" for each of this process's CUDA devices `indices`: the memory other processes hold
    on it (a previous attempt's workers, still exiting), polled every `poll_s` until under `limit_mb` or
    `wait_s` has passed. A GPU still over names the MiB held and the pids that NVML names.

    Held = NVML's used memory (without the driver's reservation) less this process's own: NVML's figure for
    this pid where NVML names it, else what torch's caching allocator holds. Where neither sees all of it
    (NVML reports host pids to a process in a container with its own pid namespace, and this process's CUDA
    context and NCCL's buffers are not torch's), the few hundred MiB of this process's context count as
    held: call this before the process makes its context, or leave room for it in `limit_mb`."""
    return _per_gpu("gpu_memory_held", indices, host,
                    lambda lib, gpus: _wait(lib, gpus, host, limit_mb, wait_s, poll_s, sleep, clock))


def _own_reserved(index: int) -> int:
    """What torch's caching allocator holds on `index` (0 before CUDA is initialised: this does not do it)."""
    try:
        return int(torch.cuda.memory_reserved(index))
    except (AssertionError, RuntimeError, ValueError):
        return 0


def _held(lib: Any, gpu: Gpu) -> tuple[int, list[tuple[int, int | None]]] | None:
    """(bytes held by other processes, [(their pid, bytes or None)]); None where NVML reports no memory."""
    mem = nvml.memory(lib, gpu[1])
    if mem is None:
        return None
    procs, me = nvml.compute_processes(lib, gpu[1]) or [], os.getpid()
    mine = [b for p, b in procs if p == me and b is not None]
    own = mine[0] if mine else _own_reserved(gpu[0])
    return max(0, mem[0] - own), [(p, b) for p, b in procs if p != me]


def _wait(lib: Any, gpus: list[Gpu], host: str, limit_mb: int, wait_s: float, poll_s: float,
          sleep: Callable[[float], None], clock: Callable[[], float]) -> list[Result]:
    start, limit = clock(), limit_mb * 2**20
    last: dict[int, tuple[int, list[tuple[int, int | None]]] | None] = {}
    under_at: dict[int, float] = {}  # when each GPU was first seen under the limit (seconds from the start)
    todo = list(range(len(gpus)))
    while True:
        for k in todo:
            last[k] = _held(lib, gpus[k])
        waited = clock() - start
        todo = [k for k in todo if (got := last[k]) is not None and got[0] > limit]
        under_at.update({k: waited for k in range(len(gpus)) if k not in todo and k not in under_at})
        if not todo or waited >= wait_s:
            break
        sleep(max(0.0, min(poll_s, wait_s - waited)))
    expected = f"under {limit_mb} MiB held by other processes within {wait_s:g} s"
    out = []
    for k, (_, _, label) in enumerate(gpus):
        got = last[k]
        if got is None:
            out.append(Result("gpu_memory_held", host, True, "NVML reports no memory use for it: not checked",
                              detail=label, seconds=waited, skipped=True))
            continue
        mib, procs = got[0] / 2**20, got[1]
        if k in todo:
            named = ", ".join(f"{p} ({b / 2**20:.0f} MiB)" if b is not None else str(p) for p, b in procs)
            measured = (f"{mib:.0f} MiB still held after {waited:.0f} s, "
                        + (f"by pids {named}" if named else "by no process NVML names"))
            out.append(Result("gpu_memory_held", host, False, measured, expected, label, mib, waited))
        else:
            after = f" (released after {under_at[k]:.0f} s)" if under_at[k] > 0 else ""
            out.append(Result("gpu_memory_held", host, True, f"{mib:.0f} MiB held by other processes{after}",
                              expected, label, mib, under_at[k]))
    return out


def _product_table(n: int) -> torch.Tensor:
    """The 7x7 distinct values of a @ b (see `_operands`), in int64 on the CPU: c[i, j] is a sum over k in
    which each residue r = k % 7 occurs `count[r]` times."""
    count = [n // PERIOD + (1 if r < n % PERIOD else 0) for r in range(PERIOD)]
    rows = [[sum(count[r] * ((i + 2 * r) % PERIOD - 3) * ((3 * r + j) % PERIOD - 3) for r in range(PERIOD))
             for j in range(PERIOD)] for i in range(PERIOD)]
    return torch.tensor(rows, dtype=torch.int64)


def _operands(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a[i, k] = (i + 2k) % 7 - 3 and b[k, j] = (3k + j) % 7 - 3 in fp32, and their exact product. Every
    product and partial sum is an integer of at most 9n in size, well below 2**24: fp32 (and TF32 or bf16
    inputs, which hold -3..3 exactly) computes it without rounding, in any order of summation."""
    if 9 * n >= 2**24:
        raise ValueError(f"matmul size {n} is too large for an exact fp32 result: use a size under {2**24 // 9}")
    r = torch.arange(n, device=device, dtype=torch.float32).remainder(PERIOD)
    a = (r[:, None] + 2 * r[None, :]).remainder(PERIOD) - 3
    b = (3 * r[:, None] + r[None, :]).remainder(PERIOD) - 3
    idx = torch.arange(n, device=device).remainder(PERIOD)
    want = _product_table(n).to(device=device, dtype=torch.float32)[idx][:, idx]
    return a, b, want


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _label(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"GPU {index} ({torch.cuda.get_device_name(index)})"


def _secs(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def matmul(device: torch.device | str, host: str, size: int | None = None) -> Result:
    """"gpu_matmul": a size x size fp32 matmul on `device` (4096 on a GPU, 256 on the CPU), checked against
    its exact result and timed after a warm-up (Result.value: seconds per matmul, for `slow_ones`)."""
    t0 = time.perf_counter()
    dev = torch.device(device)
    n = size or MATMUL_SIZE.get(dev.type, MATMUL_SIZE["cpu"])
    detail = _label(dev)
    expected = f"the exact product of two {n}x{n} matrices of small integers"
    wrong = 0
    try:
        # autocast would compute in fp16 or bf16, whose results above 256 or 2048 are rounded
        with torch.no_grad(), torch.autocast(dev.type, enabled=False):
            a, b, want = _operands(n, dev)
            for _ in range(WARMUPS):
                wrong = max(wrong, int((torch.matmul(a, b) != want).sum()))
            _sync(dev)
            start, done = time.perf_counter(), 0
            while done < REPS * MAX_BATCHES and (done == 0 or time.perf_counter() - start < MIN_TIMED_S):
                for _ in range(REPS):
                    c = torch.matmul(a, b)
                _sync(dev)
                done += REPS
            per = (time.perf_counter() - start) / done
            wrong = max(wrong, int((c != want).sum()))
    except RuntimeError as err:  # a CUDA error (an Xid, an ECC error raised to the context) is the finding
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return Result("gpu_matmul", host, False, f"the matmul failed: {first}", expected, detail,
                      seconds=time.perf_counter() - t0)
    if wrong:
        return Result("gpu_matmul", host, False,
                      f"wrong result: {wrong} of {n * n} elements differ (silent data corruption?)", expected,
                      detail, seconds=time.perf_counter() - t0)
    return Result("gpu_matmul", host, True, f"{_secs(per)} per {n}x{n} fp32 matmul, result exact", expected,
                  detail, value=per, seconds=time.perf_counter() - t0)


def _kind(detail: str) -> str:
    """What a matmul ran on, from its detail: "NVIDIA H100 80GB HBM3" of "GPU 3 (NVIDIA H100 80GB HBM3)", or "cpu"."""
    return detail.split("(", 1)[1].rstrip(")") if "(" in detail else detail


def slow_ones(results: Sequence[Result], factor: float = SLOW_FACTOR) -> list[Result]:
    """"gpu_slow" for each timed matmul (of every GPU of every node) that took over `factor` times the median
    of its kind (GPUs of one model, or CPUs: a job's different machines are not compared), where a kind has
    at least MIN_PEERS timings."""
    kinds: dict[str, list[tuple[Result, float]]] = {}
    for r in results:
        if r.check == "gpu_matmul" and r.ok and not r.skipped and r.value:
            kinds.setdefault(_kind(r.detail), []).append((r, r.value))
    out = []
    for kind, timed in kinds.items():
        if len(timed) < MIN_PEERS:
            continue
        median = statistics.median(v for _, v in timed)
        peers = f"{len(timed)} {'hosts' if kind == 'cpu' else 'GPUs'}"
        out += [Result("gpu_slow", r.host, False, f"{_secs(v)} per matmul", f"about {_secs(median)} (the median of {peers})",
                       r.detail, value=v) for r, v in timed if v > factor * median]
    return out

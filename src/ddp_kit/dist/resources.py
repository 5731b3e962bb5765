"""CPU resources of a rank: intra-op threads chosen by one rule under every launcher, and glibc's allocator.

Threads: torchrun sets OMP_NUM_THREADS=1 when it starts several workers per node; srun sets
nothing, so every rank would use every core (N ranks x all cores, and other numerics than the
torchrun layout). One rule for all: the CPUs of this node's allocation (SLURM_CPUS_ON_NODE under
SLURM, else the CPUs this process may run on) divided by the ranks on this node. A user's own
OMP_NUM_THREADS wins; torchrun's automatic 1 is not a user's choice and is replaced.

Allocator: glibc's dynamic thresholds make it return each step's freed heap to the kernel and fault
it back in the next step (~1,500 page faults and 10-20% of a small CPU step at 2 ranks); fixed
thresholds keep it. Set at init with mallopt unless the user set MALLOC_* variables (or DDP_KIT_MALLOC=0). See BENCHMARKS.md.
"""
from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

import torch

from ..env import DistEnv

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20


def _set_by_launcher_only(environ: Mapping[str, str], env: DistEnv) -> bool:
    """True when OMP_NUM_THREADS=1 came from the launcher's default rather than from the user: torchrun
    sets it in its own process after start, so its initial environment (/proc/PPID/environ) lacks it."""
    if not env.sets_omp_threads or environ.get("OMP_NUM_THREADS") != "1":
        return False
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            parent = f.read().split(b"\0")
    except OSError:
        return False
    return not any(item.startswith(b"OMP_NUM_THREADS=") for item in parent)


def threads_per_rank(env: DistEnv, environ: Mapping[str, str], cpus_visible: int) -> tuple[int, str]:
    """(threads, why) for this rank by the one rule; pure apart from the launcher check."""
    user = environ.get("OMP_NUM_THREADS", "")
    if user.isdigit() and int(user) > 0 and not _set_by_launcher_only(environ, env):
        return int(user), "OMP_NUM_THREADS"
    cpus, source = ((env.cpus_on_node, "CPUs allocated on this node") if env.cpus_on_node
                    else (cpus_visible, "CPUs available"))
    local = max(1, env.local_world_size)
    return max(1, cpus // local), f"{cpus} {source} / {local} rank(s) on this node"


class AutoWorkers(int):
    """A worker count ddp_kit chose, not the user: its loaders lower it to what the dataset needs
    (data.fit_workers). A plain int on a DataLoader is the user's and is kept as it is."""


def loader_workers(env: DistEnv, device: torch.device, cpus_visible: int | None = None) -> AutoWorkers:
    """DataLoader workers per rank when none are asked for: 0 on CPU (the rank's own threads do the
    work, and workers would compete with them), on CUDA the rank's share of the node's CPUs, less one
    for the rank itself, at most 8; ddp_kit's loaders take fewer where the data needs fewer."""
    if device.type != "cuda":
        return AutoWorkers(0)
    cpus = env.cpus_on_node or (cpus_visible if cpus_visible is not None else _cpus_visible())
    return AutoWorkers(max(0, min(8, cpus // max(1, env.local_world_size) - 1)))


def _cpus_visible() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def tune_allocator(environ: Mapping[str, str]) -> bool:
    """Fixed glibc mmap/trim thresholds; True when applied.

    Skipped when the user tuned malloc already (any MALLOC_* variable, or glibc.malloc.* in
    GLIBC_TUNABLES) or set DDP_KIT_MALLOC=0 to keep glibc's defaults (bench/malloc_bench.py does).
    """
    user_tuned = any(k.startswith("MALLOC_") for k in environ) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
    if user_tuned or environ.get("DDP_KIT_MALLOC") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        # The symbols already loaded into this process (libc among them): ctypes.util.find_library
        # would run `ldconfig -p` in a subprocess at every rank's start to find the same library.
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False


def apply_cpu_settings(env: DistEnv, device: torch.device, environ: Mapping[str, str] | None = None) -> str:
    """Set this rank's intra-op threads (and, on CPU, the allocator); returns a line saying what was chosen."""
    environ = os.environ if environ is None else environ
    threads, why = threads_per_rank(env, environ, _cpus_visible())
    torch.set_num_threads(threads)
    tuned = device.type == "cpu" and tune_allocator(environ)
    line = f"ddp_kit: {threads} intra-op thread(s) per rank ({why})" + ("; glibc malloc thresholds fixed" if tuned else "")
    if env.rank == 0:
        print(line, flush=True)
    return line

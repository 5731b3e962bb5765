"""python -m ddp_kit.doctor [--json] [--comm] [--memory] [--amp bf16] [--run_dir DIR]
python -m ddp_kit.doctor --preflight [--mode quick|thorough] [--run_dir DIR] [--ckpt_dir DIR|URL] [--shm_mb MB] [--json]
                                     [--exit_unhealthy 2]

Exit code: 0 all ok, 1 warnings, 2 failures (--preflight: 0 healthy, --exit_unhealthy (2) a host failed a check).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator

import fire

from .checks import FAIL, OK, SKIP, WARN, diagnose, exit_code
from .facts import gather

MARK = {OK: "ok  ", WARN: "WARN", FAIL: "FAIL", SKIP: "--  "}


def _summary(facts: dict) -> list[str]:
    t, nv = facts["torch"], facts["nvidia"]
    build = f"CUDA {t['cuda']}" if t.get("cuda") else ("ROCm " + t["hip"] if t.get("hip") else "CPU-only")
    cudnn = t.get("cudnn")
    if isinstance(cudnn, int):  # torch reports 9.24.0 as 92400
        cudnn = f"{cudnn // 10000}.{cudnn % 10000 // 100}.{cudnn % 100}"
    gpus = t.get("gpus") or nv["gpus"]
    lines = [f"  OS {facts['os']}, Python {facts['python']}",
             f"  torch {t.get('version')} ({build} build), torchvision {t.get('torchvision') or '-'}, cuDNN {cudnn or '-'}, NCCL {t.get('nccl') or '-'}",
             f"  driver {nv.get('driver') or '-'} (supports CUDA {nv.get('driver_cuda') or '-'}), GPUs: "
             + (", ".join(f"{g['name']} {g.get('memory_total_mb', 0) / 1024:.0f} GiB sm_{str(g.get('capability', '?')).replace('.', '')}" for g in gpus) or "none"),
             f"  torch arch list: {' '.join(t.get('arch_list') or []) or '-'}",
             f"  launcher: {facts['layout'].get('launcher', '?')}; env: " + (", ".join(f"{k}={v}" for k, v in sorted(facts['env'].items())) or "no CUDA/NCCL/MASTER variables"),
             f"  /dev/shm {facts['shm_bytes'] / 2**30 if facts['shm_bytes'] else 0:.1f} GiB, open files {facts['nofile_limit']}, "
             f"disk free in {facts['run_dir']}: {facts['disk_free_bytes'] / 2**30 if facts['disk_free_bytes'] else 0:.0f} GiB"]
    return lines


def main(json_out: bool = False, comm: bool = False, memory: bool = False, amp: str | None = None,
         run_dir: str | None = None, comm_max_mb: float | None = None, preflight: bool = False, mode: str = "quick",
         ckpt_dir: str | None = None, shm_mb: float | None = None, exit_unhealthy: int = 2, **kwargs) -> None:
    if "json" in kwargs:  # `--json` is the spelling users type
        json_out = bool(kwargs.pop("json"))
    if kwargs.pop("help", False) or kwargs.pop("h", False):
        print("python -m ddp_kit.doctor [--json] [--comm] [--memory] [--amp bf16|fp16] [--run_dir DIR] [--comm_max_mb MB]\n"
              "Diagnoses PyTorch + CUDA + NCCL on this machine; under torchrun, --comm times all_reduce between the "
              "ranks and --memory what each GPU can allocate.\n"
              "python -m ddp_kit.doctor --preflight [--mode quick|thorough] [--run_dir DIR] [--ckpt_dir DIR|URL] [--shm_mb MB] "
              "[--json] [--exit_unhealthy 2]\n"
              "The pre-flight health gate alone (one node, or every node under torchrun/srun): storage, /dev/shm, GPUs, "
              "clocks, links between hosts; exit 0 healthy, 2 a host failed a check.")
        return
    if kwargs:
        print(f"ddp_kit: error: unknown doctor option(s) {', '.join('--' + k for k in kwargs)} "
              f"(hint: use --json, --comm, --memory, --amp bf16, --run_dir DIR)", file=sys.stderr)
        sys.exit(2)
    if preflight:
        from .preflight import preflight as gate
        from .preflight import show

        with _stdout_to_stderr() if json_out else contextlib.nullcontext():
            report, main_rank, code = gate(mode, run_dir, ckpt_dir, shm_mb)
        if report is not None and main_rank:
            show(report, json_out)
        # 2 is "do not retry" to the Kubernetes templates' policies: an init container asks for 1 (retryable)
        sys.exit(int(exit_unhealthy) if report is not None and report.failed else code)
    with _stdout_to_stderr() if json_out else contextlib.nullcontext():
        facts = gather(run_dir or ".")
        findings = diagnose(facts, amp)
        active: dict = {}
        if comm or memory:
            active = _active(comm, memory, comm_max_mb)
    rank = facts["layout"].get("rank", 0) or 0
    if rank == 0:
        if json_out:
            extra = {**active, "findings": [f.__dict__ for f in findings + active.get("findings", [])]}
            print(json.dumps({"facts": facts, **extra}, indent=1, default=str))
        else:
            print("ddp_kit doctor")
            print("\n".join(_summary(facts)))
            print()
            for f in findings:
                print(f"  [{MARK[f.status]}] {f.name:<22} {f.message}")
                if f.status in (WARN, FAIL) and f.fix:
                    print(f"  {'':<6} {'':<22} fix: {f.fix}")
            _print_active(active)
    sys.exit(exit_code(findings + active.get("findings", [])))


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """With --json, stdout carries the JSON alone: what the checks print meanwhile (the process
    group's startup line, NCCL_DEBUG's output from C) goes to stderr, at the level of the fd."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        _flush_c_stdio()  # what C buffered meanwhile belongs to stderr too
        os.dup2(saved, 1)
        os.close(saved)


def _flush_c_stdio() -> None:
    try:
        import ctypes
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C runtime to ask (not POSIX): nothing buffered there either
        pass


def _active(comm: bool, memory: bool, comm_max_mb: float | None) -> dict:
    from ..dist import distributed
    from ..dist.collectives import all_gather_object
    from ..errors import UserError
    from .active import allocatable_memory, comm_sweep
    from .checks import Finding

    out: dict = {"findings": []}
    try:
        # fail_fast: a rank that cannot join says why in the store and the others stop at once with
        # that line, instead of each waiting out the timeout and reporting only "did not complete".
        with distributed(timeout_s=120, fail_fast=True) as ctx:
            if comm:
                res = comm_sweep(ctx, comm_max_mb)
                out["comm"] = res
                if ctx.world_size == 1:
                    out["findings"].append(Finding("comm", WARN, "one process: nothing to communicate with",
                                                   "run under torchrun --nproc_per_node=N -m ddp_kit.doctor --comm"))
                med = sorted(r["local_s"] for r in res["per_rank"])[len(res["per_rank"]) // 2]
                for r in res["slow_ranks"]:
                    out["findings"].append(Finding("slow rank", WARN, f"rank {r['rank']} on {r['host']} needs {r['local_s']:.3f}s "
                                                   f"for the local benchmark, the median rank {med:.3f}s",
                                                   "check that node's load, clocks and thermals"))
            if memory:
                if ctx.device.type != "cuda":
                    out["memory"] = None
                    out["findings"].append(Finding("memory", SKIP, "no GPU: nothing to measure"))
                else:
                    mems = all_gather_object(ctx, {"rank": ctx.rank, **allocatable_memory(ctx.device)})
                    out["memory"] = mems
                    for m in mems:
                        if m["allocatable_mb"] < 0.8 * m["total_mb"]:
                            out["findings"].append(Finding("memory", WARN, f"rank {m['rank']} ({m['device']}) could allocate only "
                                                           f"{m['allocatable_mb'] / 1024:.1f} of {m['total_mb'] / 1024:.1f} GiB",
                                                           "another process holds GPU memory: see nvidia-smi"))
    except UserError as err:
        out["findings"].append(Finding("active checks", FAIL, err.message, err.hint))
    return out


def _print_active(active: dict) -> None:
    comm = active.get("comm")
    if comm:
        print(f"\n  all_reduce ({comm['backend']}, {comm['world_size']} ranks; busbw = algbw * 2(n-1)/n as nccl-tests)")
        print(f"  {'bytes':>10} {'latency (us)':>14} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
        for r in comm["sizes"]:
            print(f"  {r['bytes']:>10} {r['latency_us']:>14.1f} {r['algbw_gbps']:>13.3f} {r['busbw_gbps']:>13.3f}")
        print("  local benchmark per rank: " + ", ".join(f"rank {r['rank']} {r['local_s']:.3f}s" for r in comm["per_rank"]))
    mem = active.get("memory")
    if mem:
        print("\n  allocatable GPU memory: " + ", ".join(
            f"rank {m['rank']} {m['allocatable_mb'] / 1024:.1f}/{m['total_mb'] / 1024:.1f} GiB" for m in mem))
    for f in active.get("findings", []):
        print(f"  [{MARK[f.status]}] {f.name:<22} {f.message}" + (f"\n  {'':<6} {'':<22} fix: {f.fix}" if f.fix and f.status in (WARN, FAIL) else ""))


if __name__ == "__main__":
    fire.Fire(main)

"""The defaults against the PyTorch DDP tutorial's loop, in CPU time (issue 48): a comparison that can
resolve 1 % on shared cores, where wall-clock ratios cannot.

    python bench/tutorial_cost.py [--rounds 3] [--short 100] [--long 1000]   # CPU: 2 ranks, gloo

Three variants, each `torchrun --standalone --nproc_per_node=2` with OMP_NUM_THREADS=1 and ddp_kit's glibc
malloc thresholds, on the same work (the reference MLP, synthetic 3x32x32 data, 64 samples per rank,
AdamW, cosine schedule):
- defaults: `python -m ddp_kit.train` as shipped (checkpoints and sync checks every 100 steps, per-rank
  metrics in a record every 50, the preemption agreement, the hang watchdog and peer heartbeat; the final
  checkpoint and eval are in both spans, so they cancel);
- off: the same job with all of those off (bench/run.py's OFF);
- tutorial: bench/tutorial_ddp.py.
Each variant runs --short and --long steps; its cost per step is the difference of the two runs divided
by the difference of steps, so that start-up (imports, process group, first eval) cancels. CPU time is
user + sys of the whole process tree (torchrun and its ranks: RUSAGE_CHILDREN); wall time is the same
difference of the launches' wall clocks. Round r runs the variants in the order rotated by r, each one's
short then long run back to back. Reported: the median over rounds of the per-round ratios, with their
range, and the load average and the other processes' load (from /proc/stat) during the rounds.
Writes bench/tutorial_cost_results.json (or --out).
"""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fire
from malloc_bench import busy_cpu_s
from run import OFF

HERE = Path(__file__).resolve().parent
JOB = ["-m", "ddp_kit.train", "--model", "mlp", "--dataset", "synthetic", "--synthetic_size", "4096", "--batch_size", "128",
       "--lr", "3e-3", "--seed", "0", "--epochs", "10000", "--progress", "false", "--eval_every_epoch", "false",
       "--resume", "never"]
VARIANTS = {"defaults": JOB, "off": [*JOB, *OFF], "tutorial": [str(HERE / "tutorial_ddp.py")]}
RATIOS = (("defaults", "tutorial"), ("defaults", "off"), ("off", "tutorial"))


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def launch(variant: str, steps: int, tmp: Path) -> tuple[float, float, float]:
    """(CPU seconds of the process tree, wall seconds, other processes' load in cores) of one run."""
    args = [*VARIANTS[variant], "--steps" if variant == "tutorial" else "--max_steps", str(steps)]
    if variant != "tutorial":
        args += ["--run_dir", str(tmp / f"{variant}_{time.monotonic_ns()}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    cpu0, busy0, t0 = children_cpu_s(), busy_cpu_s(), time.monotonic()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp)
    wall, cpu = time.monotonic() - t0, children_cpu_s() - cpu0
    if res.returncode != 0:
        raise SystemExit(f"{variant} ({steps} steps) failed:\n{res.stderr[-3000:]}")
    return cpu, wall, max(0.0, busy_cpu_s() - busy0 - cpu) / wall


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "rounds": xs}


def main(rounds: int = 3, short: int = 100, long: int = 1000, out: str | None = None):
    names = list(VARIANTS)
    per_step: dict[str, dict[str, list[float]]] = {v: {"cpu": [], "wall": []} for v in names}
    other: list[float] = []
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for r in range(rounds):
            for v in names[r % len(names):] + names[:r % len(names)]:  # ABC, BCA, CAB, ...
                (c0, w0, o0), (c1, w1, o1) = launch(v, short, tmp), launch(v, long, tmp)
                per_step[v]["cpu"].append((c1 - c0) / (long - short))
                per_step[v]["wall"].append((w1 - w0) / (long - short))
                other += [o0, o1]
            load.append(os.getloadavg())
            print(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{v} {per_step[v]['cpu'][-1] * 1e3:.2f} ms CPU {per_step[v]['wall'][-1] * 1e3:.2f} ms wall" for v in names)
                + f" (load average {load[-1][0]:.2f})", flush=True)

    def ratio(kind: str, a: str, b: str) -> dict:
        return spread([x / y for x, y in zip(per_step[a][kind], per_step[b][kind])])

    import torch

    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}",
        "nproc": 2, "rounds": rounds, "short": short, "long": long,
        "cpu_ms_per_step": {v: spread([x * 1e3 for x in per_step[v]["cpu"]]) for v in names},
        "wall_ms_per_step": {v: spread([x * 1e3 for x in per_step[v]["wall"]]) for v in names},
        "cpu_ratio": {f"{a}/{b}": ratio("cpu", a, b) for a, b in RATIOS},
        "wall_ratio": {f"{a}/{b}": ratio("wall", a, b) for a, b in RATIOS},
        "targets_cpu": {"defaults/tutorial": 1.02, "defaults/off": 1.01},
        "load_average_1_5_15": load,
        "other_load_cores": spread(other),
    }
    result["verdicts"] = {k: result["cpu_ratio"][k]["median"] <= t for k, t in result["targets_cpu"].items()}
    path = Path(out) if out else HERE / "tutorial_cost_results.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"cpu, 2 ranks, {rounds} rounds, per step = ({long}-step run - {short}-step run) / {long - short}:")
    for v in names:
        c, w = result["cpu_ms_per_step"][v], result["wall_ms_per_step"][v]
        print(f"  {v:9s} CPU {c['median']:.2f} ms ({c['min']:.2f}..{c['max']:.2f})  wall {w['median']:.2f} ms "
              f"({w['min']:.2f}..{w['max']:.2f})")
    for name in result["cpu_ratio"]:
        c, w = result["cpu_ratio"][name], result["wall_ratio"][name]
        verdict = {True: " PASS", False: " FAIL"}.get(result["verdicts"].get(name), "")
        print(f"  {name:18s} CPU {c['median']:.3f} ({c['min']:.3f}..{c['max']:.3f})  wall {w['median']:.3f} "
              f"({w['min']:.3f}..{w['max']:.3f}){verdict}")
    print(f"  other processes' load: median {result['other_load_cores']['median']:.2f} cores; "
          f"load average before {load[0][0]:.2f}, after {load[-1][0]:.2f}")
    print(f"  -> {path}")


if __name__ == "__main__":
    fire.Fire(main)

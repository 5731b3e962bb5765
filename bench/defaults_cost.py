"""What the defaults cost: ddp_kit's reference job with its defaults, against the same job with everything
off and against a tutorial-style raw DDP loop, in one run, alternated so that machine drift hits all three.

    python bench/defaults_cost.py [--rounds 9] [--steps 600] [--skip 100] [--parts]   # CPU: 2 ranks, gloo
    python bench/defaults_cost.py --device cuda [--nproc 1]                                 # a GPU per rank, NCCL

The three, each `torchrun --standalone --nproc_per_node=N` with OMP_NUM_THREADS=1 and ddp_kit's glibc
malloc thresholds (raw_ddp.py calls ddp_kit's apply_cpu_settings and nothing else of it), on the same
work (the reference MLP, synthetic 3x32x32 data, global batch 128, AdamW, cosine schedule):
- defaults: `python -m ddp_kit.train` as shipped (kit_ddp.py): a checkpoint and a sync check every 100
  steps, per-rank metrics in a record every 50, the preemption agreement every 10, the hang watchdog and
  peer heartbeat;
- off: the same job with all of those off (run.py's OFF);
- raw: raw_ddp.py.
Round r runs them in the order rotated by r (ABC, BCA, CAB, ...). A variant's step time in a round is
the median gap between step ends after the first --skip steps (data loading and all bookkeeping
included; the steps with a log event, sync check or checkpoint are a few percent of them and move a
median little). Reported: the median over rounds of the per-round ratios defaults/off and defaults/raw
with their range; the same ratios of the whole loop's mean step (checkpoints, logs and checks
included) and of rank 0's CPU time per step (less moved by other load on shared cores); the other
processes' load during each launch. `--parts` also runs bench/defaults_parts.py
once (each feature's cost per call and per step, timed where it runs). Writes
bench/defaults_cost_results.json (or --out).

On a GPU machine: `--device cuda` runs each variant with one rank per GPU (--nproc defaults to the GPUs
there) on NCCL; raw_ddp.py then does what the job does on a GPU (TF32, a fused AdamW, no loss read per
step). On a machine without `fire` (the lent H200), install the wheels as bench/gpu_device.sh does
(`bash bench/fetch_wheels.sh` here, carry .whl) and put src/ and that folder on PYTHONPATH.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fire
from malloc_bench import busy_cpu_s, children_cpu_s
from run import OFF

HERE = Path(__file__).resolve().parent
VARIANTS = {"defaults": ["kit_ddp.py"], "off": ["kit_ddp.py", *OFF], "raw": ["raw_ddp.py"]}


def launch(variant: str, nproc: int, steps: int, device: str, tmp: Path) -> dict:
    out = tmp / f"{variant}_{time.monotonic_ns()}.json"
    script, *extra = VARIANTS[variant]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_LAUNCH_T": repr(time.time())}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / script), "--out", str(out), "--steps", str(steps), "--device", device, *extra]
    t0, busy0, ours0 = time.monotonic(), busy_cpu_s(), children_cpu_s()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{res.stderr[-3000:]}")
    data = json.loads(out.read_text())
    data["other_load"] = max(0.0, (busy_cpu_s() - busy0) - (children_cpu_s() - ours0)) / (time.monotonic() - t0)
    return data


def write_results(result: dict, out: str | None, default: str) -> Path:
    """The results as JSON at `out`, else bench/`default`."""
    path = Path(out) if out else HERE / default
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def shown(s: dict, unit: str = "") -> str:
    """A spread (see spread) as "median unit (min..max)"."""
    return f"{s['median']:.3f}{unit} ({s['min']:.3f}..{s['max']:.3f})"


def step_s(data: dict, skip: int) -> float:
    ends = data["ends"]
    return statistics.median(b - a for a, b in list(zip(ends, ends[1:]))[skip:])


def loop_step_s(data: dict, skip: int) -> float:
    """The whole loop's time per step after `skip`: the mean, rare events (checkpoints, logs) included."""
    ends = data["ends"]
    return (ends[-1] - ends[skip]) / (len(ends) - 1 - skip)


def cpu_step_s(data: dict, skip: int) -> float:
    """Rank 0's CPU time (user + system, all its threads) per step over the same steps."""
    n = len(data["ends"]) - 1 - skip
    return (data["utime"][-1] + data["stime"][-1] - data["utime"][skip] - data["stime"][skip]) / max(n, 1)


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "rounds": xs}


def feature_parts(nproc: int, device: str, tmp: Path) -> dict:
    """bench/defaults_parts.py once, with the defaults: each feature's cost where it runs."""
    out = tmp / "parts.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / "defaults_parts.py"), "--out", str(out), "--device", device]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"defaults_parts.py failed:\n{res.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(rounds: int = 9, steps: int = 600, skip: int = 100, device: str = "cpu", nproc: int | None = None,
         parts: bool = False, out: str | None = None):
    """`parts`: also the per-feature breakdown (defaults_parts.py, one launch after the rounds)."""
    if nproc is None:
        import torch

        nproc = 2 if device == "cpu" else torch.cuda.device_count()
    names = list(VARIANTS)
    runs: dict[str, list[dict]] = {v: [] for v in names}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for r in range(rounds):
            for v in names[r % len(names):] + names[:r % len(names)]:  # ABC, BCA, CAB, ...
                runs[v].append(launch(v, nproc, steps, device, tmp))
            row = {v: step_s(runs[v][-1], skip) * 1e3 for v in names}
            print(f"round {r + 1}/{rounds}: " + ", ".join(f"{v} {ms:.3f} ms" for v, ms in row.items())
                  + f" (other load {max(runs[v][-1]['other_load'] for v in names):.2f} cores)", flush=True)
        breakdown = feature_parts(nproc, device, tmp) if parts else None
    wall = {v: [step_s(x, skip) for x in runs[v]] for v in names}
    cpu = {v: [cpu_step_s(x, skip) for x in runs[v]] for v in names}
    loop = {v: [loop_step_s(x, skip) for x in runs[v]] for v in names}

    def ratio(times: dict[str, list[float]], a: str, b: str) -> dict:
        return spread([x / y for x, y in zip(times[a], times[b])])

    import torch

    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}",
        "device": device, "nproc": nproc, "rounds": rounds, "steps": steps, "skip": skip,
        "step_ms": {v: spread([x * 1e3 for x in wall[v]]) for v in names},
        "ratio": {"defaults/off": ratio(wall, "defaults", "off"), "defaults/raw": ratio(wall, "defaults", "raw"),
                  "off/raw": ratio(wall, "off", "raw")},
        "cpu_ratio": {"defaults/off": ratio(cpu, "defaults", "off"), "defaults/raw": ratio(cpu, "defaults", "raw"),
                      "off/raw": ratio(cpu, "off", "raw")},
        "loop_step_ms": {v: spread([x * 1e3 for x in loop[v]]) for v in names},
        "loop_ratio": {"defaults/off": ratio(loop, "defaults", "off"), "defaults/raw": ratio(loop, "defaults", "raw"),
                       "off/raw": ratio(loop, "off", "raw")},
        "other_load_cores": spread([x["other_load"] for v in names for x in runs[v]]),
        "weights_bitwise_equal": len({x["param_sha256"] for v in names for x in runs[v]}) == 1,
        "parts": breakdown,
    }
    path = write_results(result, out, "defaults_cost_results.json")
    print(f"{device}, {nproc} rank(s), {rounds} rounds of {steps} steps (median step after {skip}):")
    for v in names:
        print(f"  {v:8s} {shown(result['step_ms'][v], ' ms')}")
    for kind, what in (("ratio", "median step"), ("loop_ratio", "whole loop "), ("cpu_ratio", "rank 0 CPU ")):
        for name, s in result[kind].items():
            print(f"  {what} {name:13s} {shown(s)}")
    print(f"  other processes' load: median {result['other_load_cores']['median']:.2f} cores "
          f"(max {result['other_load_cores']['max']:.2f}); weights bitwise equal: {result['weights_bitwise_equal']}")
    print(f"  -> {path}")


if __name__ == "__main__":
    fire.Fire(main)

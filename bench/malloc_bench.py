"""glibc's malloc thresholds on a small CPU step: the raw loop and ddp_kit, each with and without fixed thresholds.

    python bench/malloc_bench.py [--rounds 5] [--steps 300] [--world 2]

Variants, alternated in each round (order reversed every other round), all under `torchrun
--standalone` with gloo and OMP_NUM_THREADS=1, the work of bench/run.py (MLP 3072-256-10, global
batch 128):
  raw            bench/raw_ddp.py, glibc defaults (dynamic thresholds)
  raw_env        the same with MALLOC_MMAP_THRESHOLD_=32 MiB and MALLOC_TRIM_THRESHOLD_=64 MiB
  kit*           bench/kit_ddp.py as shipped (mallopt at init), sync check every 100 / 10 / 0 steps
  kit*_off       the same with DDP_KIT_MALLOC=0 (glibc defaults)
Every launch inherits no MALLOC_* variable except raw_env's. Per step on rank 0 (after `--skip`):
wall time (median gap between step ends), minor page faults, and user + system CPU time (getrusage,
all threads of the process; less moved than wall time by other load on the machine). Before the
rounds: ddp_kit's switches are checked (its init line) and each variable is probed alone, once.
Writes bench/malloc_results.json and re-renders BENCHMARKS.md through bench/run.py.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fire
import run as main_bench

HERE = Path(__file__).resolve().parent
THRESHOLDS = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}
OFF = {"DDP_KIT_MALLOC": "0"}
TUNED_LINE = "glibc malloc thresholds fixed"
# name: (script and flags, extra environment, what it is)
VARIANTS = {
    "raw": (["raw_ddp.py"], {}, "raw DDP loop, glibc defaults"),
    "raw_env": (["raw_ddp.py"], THRESHOLDS, "raw DDP loop, MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ set"),
    "kit": (["kit_ddp.py"], {}, "ddp_kit as shipped (mallopt; sync check every 100 steps)"),
    "kit_off": (["kit_ddp.py"], OFF, "ddp_kit, DDP_KIT_MALLOC=0 (glibc defaults; sync check every 100)"),
    "kit_chk0": (["kit_ddp.py", "--sync_check_every", "0"], {}, "ddp_kit, mallopt, no sync checks"),
    "kit_chk0_off": (["kit_ddp.py", "--sync_check_every", "0"], OFF, "ddp_kit, glibc defaults, no sync checks"),
    "kit_chk10": (["kit_ddp.py", "--sync_check_every", "10"], {}, "ddp_kit, mallopt, sync check every 10 steps"),
    "kit_chk10_off": (["kit_ddp.py", "--sync_check_every", "10"], OFF, "ddp_kit, glibc defaults, sync check every 10"),
}


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy since boot (/proc/stat), to see other load."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def launch(script: list[str], extra_env: dict, world: int, steps: int, tmp: Path) -> tuple[dict, str]:
    out = tmp / f"m_{time.monotonic_ns()}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "DDP_KIT_MALLOC"}
    env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "BENCH_LAUNCH_T": repr(time.time()), **extra_env})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(HERE / script[0]), "--out", str(out), "--steps", str(steps), *script[1:]]
    t0, busy0, ours0 = time.monotonic(), busy_cpu_s(), children_cpu_s()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"{script} with {extra_env} failed:\n{res.stderr[-3000:]}")
    data = json.loads(out.read_text())
    # cores kept busy by other processes during this launch (ours: torchrun and its workers)
    data["other_load"] = max(0.0, (busy_cpu_s() - busy0) - (children_cpu_s() - ours0)) / (time.monotonic() - t0)
    return data, res.stdout


def check_switches(world: int, tmp: Path) -> dict:
    """ddp_kit's own line says whether it tuned: on by default, off for DDP_KIT_MALLOC=0 and for a user's MALLOC_*."""
    cases = {"default": ({}, True), "DDP_KIT_MALLOC=0": (OFF, False), "MALLOC_ARENA_MAX=8": ({"MALLOC_ARENA_MAX": "8"}, False)}
    seen = {}
    for name, (extra, want) in cases.items():
        _, stdout = launch(["kit_ddp.py"], extra, world, 3, tmp)
        seen[name] = TUNED_LINE in stdout
        if seen[name] != want:
            raise SystemExit(f"ddp_kit tuned={seen[name]} with {name}, expected {want}:\n{stdout[-2000:]}")
    return seen


def probe_one_variable(world: int, tmp: Path, skip: int) -> dict:
    """Page faults per step with only one of the two variables set (either one turns glibc's adjustment off)."""
    out = {}
    for name in THRESHOLDS:
        data, _ = launch(["raw_ddp.py"], {name: THRESHOLDS[name]}, world, 120, tmp)
        out[name] = {"faults_per_step": per_step(data["minflt"], skip), "sys_ms_per_step": per_step(data["stime"], skip) * 1e3}
    return out


def per_step(values: list[float], skip: int) -> float:
    return (values[-1] - values[skip]) / (len(values) - 1 - skip)


def spread(xs) -> dict:
    xs = list(xs)
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(runs: dict[str, list[dict]], skip: int) -> dict:
    wall = {v: [main_bench.step_median(x["ends"], skip) for x in xs] for v, xs in runs.items()}
    cpu = {v: [per_step([u + s for u, s in zip(x["utime"], x["stime"])], skip) for x in xs] for v, xs in runs.items()}
    rows = {}
    for v, (_, _, what) in VARIANTS.items():
        rows[v] = {"what": what, "step_ms": spread(s * 1e3 for s in wall[v]),
                   "ratio_to_raw": spread(s / b for s, b in zip(wall[v], wall["raw"])),
                   "cpu_ms_per_step": spread(c * 1e3 for c in cpu[v]),
                   "cpu_ratio_to_raw": spread(c / b for c, b in zip(cpu[v], cpu["raw"])),
                   "sys_ms_per_step": statistics.median(per_step(x["stime"], skip) * 1e3 for x in runs[v]),
                   "faults_per_step": statistics.median(per_step(x["minflt"], skip) for x in runs[v]),
                   "peak_rss_mb": statistics.median(x["peak_rss_mb"] for x in runs[v])}
    pairs = {"sync check every 10 / none, glibc defaults": ("kit_chk10_off", "kit_chk0_off"),
             "sync check every 10 / none, mallopt": ("kit_chk10", "kit_chk0"),
             "ddp_kit no checks, mallopt / glibc defaults": ("kit_chk0", "kit_chk0_off"),
             "ddp_kit as shipped / raw with the two variables": ("kit", "raw_env")}
    ratios = {name: {"wall": spread(a / b for a, b in zip(wall[x], wall[y])),
                     "cpu": spread(a / b for a, b in zip(cpu[x], cpu[y]))} for name, (x, y) in pairs.items()}
    return {"rows": rows, "ratios": ratios, "per_round_step_s": wall, "per_round_cpu_s": cpu}


def main(rounds: int = 5, steps: int = 300, skip: int = 20, world: int = 2, out_md: str = "BENCHMARKS.md"):
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        switches = check_switches(world, tmp)
        one_variable = probe_one_variable(world, tmp, skip)
        runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            for v in (list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))):
                script, extra, _ = VARIANTS[v]
                data, stdout = launch(script, extra, world, steps, tmp)
                if v.startswith("kit") and (TUNED_LINE in stdout) == v.endswith("_off"):
                    raise SystemExit(f"{v}: ddp_kit's allocator line does not match the variant:\n{stdout[-2000:]}")
                runs[v].append(data)
            print(f"round {r + 1}/{rounds} done", flush=True)
    res = {"world": world, "rounds": rounds, "steps": steps, "skip": skip, "switches": switches,
           "one_variable": one_variable, **summarize(runs, skip),
           "other_load": spread(x["other_load"] for xs in runs.values() for x in xs),
           "bitwise_equal": len({x["param_sha256"] for xs in runs.values() for x in xs}) == 1}
    print(json.dumps({k: res[k] for k in ("rows", "ratios", "other_load")}, indent=1), flush=True)
    (HERE / "malloc_results.json").write_text(json.dumps(res, indent=1) + "\n")
    main_bench.main(markdown_only=True, out_md=out_md)


def markdown(res: dict) -> list[str]:
    """The allocator section of BENCHMARKS.md, from bench/malloc_results.json (bench/run.py calls this)."""
    def cell(s: dict, fmt: str) -> str:
        return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"

    rows, load = res["rows"], res["other_load"]
    lines = ["", f"## glibc's malloc thresholds ({res['world']} ranks, CPU)", "",
             f"Same work as above, {res['steps']} steps, {res['rounds']} rounds alternated, skip {res['skip']}. Median over rounds",
             "(min-max over rounds); ratios are per round, against the raw loop of the same round. Wall = median gap",
             "between step ends. CPU, system time, page faults and peak RSS are rank 0's per step (getrusage, all threads).",
             f"Other processes kept a median {load['median']:.2f} (max {load['max']:.2f}) of the 2 cores busy during these launches;",
             "wall times move with that, CPU time per step much less.", "",
             "Reproduce: `python bench/malloc_bench.py` (about 7 minutes on an idle 2-core machine)", "",
             "| variant | wall step (ms) | wall ratio to raw | CPU / step (ms) | CPU ratio to raw | system (ms) | minor faults / step | peak RSS (MB) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows.values():
        lines.append(f"| {r['what']} | {cell(r['step_ms'], '.2f')} | {cell(r['ratio_to_raw'], '.3f')} | "
                     f"{cell(r['cpu_ms_per_step'], '.2f')} | {cell(r['cpu_ratio_to_raw'], '.3f')} | {r['sys_ms_per_step']:.2f} | "
                     f"{r['faults_per_step']:.0f} | {r['peak_rss_mb']:.0f} |")
    lines += ["", "| same-round ratio | wall | CPU |", "|---|---|---|"]
    lines += [f"| {name} | {cell(s['wall'], '.3f')} | {cell(s['cpu'], '.3f')} |" for name, s in res["ratios"].items()]
    one = res["one_variable"]
    f = {k: f"{rows[k]['faults_per_step']:,.0f}" for k in rows}
    wall = {k: rows[k]["step_ms"]["median"] for k in rows}
    shipped = res["ratios"]["ddp_kit as shipped / raw with the two variables"]
    chk = {k: res["ratios"][f"sync check every 10 / none, {k}"] for k in ("glibc defaults", "mallopt")}
    lines += ["", f"Weights bitwise equal across all variants and rounds: {'yes' if res['bitwise_equal'] else 'NO'}.", "",
              f"**In short.** Fixed thresholds take the raw loop from {wall['raw']:.1f} to {wall['raw_env']:.1f} ms per step "
              f"({rows['raw_env']['ratio_to_raw']['median']:.2f}x) and ddp_kit",
              f"without sync checks from {wall['kit_chk0_off']:.1f} to {wall['kit_chk0']:.1f} ms; ddp_kit as shipped runs at "
              f"{shipped['wall']['median']:.2f}x the raw loop with the",
              "same thresholds. On these 2 shared cores wall times follow whatever else runs: when this section was",
              "written, two runs of this bench during a test run (1.3 cores busy elsewhere) gave 12-50 ms steps in scrambled order, while CPU time",
              "per step stayed within ~10% of the ones above and every mallopt / glibc-defaults pair kept its order.",
              "Trust the CPU and fault columns first when the load line above is not near 0.", "",
              "**What happens.** glibc starts with 128 KiB mmap and trim thresholds and adjusts both while the program",
              "runs: freeing an mmapped block raises the mmap threshold to that block's size and the trim threshold to",
              "twice that (`man mallopt`). Here the step's largest temporaries are 3 MiB (the 3072x256 weight's",
              "gradient and AdamW's temporaries), so after the first steps the thresholds sit near 3 and 6 MiB. The",
              "tensors then come from the heap, but each step frees about 6 MiB at the top of the heap, glibc returns it",
              f"to the kernel (brk), and the next step faults it in again: {f['raw']} minor faults per step on rank 0",
              f"({rows['raw']['faults_per_step'] * 4 / 1024:.1f} MiB of 4-KiB pages) with the defaults, {f['raw_env']} with both "
              "thresholds fixed, and",
              f"system time per step {rows['raw']['sys_ms_per_step']:.1f} vs {rows['raw_env']['sys_ms_per_step']:.1f} ms. "
              "Under the defaults the count also depends on the heap's layout: an",
              "occasional launch alternates between 0 and 2,300 faults per step. A one-off `strace -f -c -e",
              "trace=mmap,munmap,brk` of the raw loop at 50 and 250 steps found equal mmap/munmap counts and ~4.5 more brk",
              "calls per step (2 ranks) with the defaults, none with the variables set: the per-step churn is heap",
              "trimming, not mmap. Both variables are needed, since setting either one stops the adjustment and leaves",
              f"the other at 128 KiB: with only MALLOC_MMAP_THRESHOLD_, {one['MALLOC_MMAP_THRESHOLD_']['faults_per_step']:,.0f} "
              "faults per step (trimming every step);",
              f"with only MALLOC_TRIM_THRESHOLD_, {one['MALLOC_TRIM_THRESHOLD_']['faults_per_step']:,.0f} "
              "(each 3 MiB tensor mmapped and unmapped); one launch of 120 steps each.", "",
              "**The earlier anomaly.** The sync check converts every parameter to float64 (`ddp_kit.reliability.sync_checks.checksums`), a",
              "6 MiB temporary for the big weight. Freeing it raises glibc's thresholds to about 6 and 12 MiB, after",
              f"which fewer steps trim: {f['kit_chk10_off']} faults per step with a check every 10 steps, {f['kit_off']} with one every 100",
              f"(the first check is at step 100), {f['kit_chk0_off']} with none. That is why, with glibc's defaults, runs with periodic",
              "sync checks measured faster than runs without (the first table's negative check cost at 2 ranks). Same",
              f"round, a check every 10 steps over none: {chk['glibc defaults']['wall']['median']:.2f}x wall with glibc's defaults, "
              f"{chk['mallopt']['wall']['median']:.2f}x with the thresholds",
              "fixed, where the check no longer changes the allocator and costs what it costs.", "",
              "**What ddp_kit does.** For CPU runs, process-group setup (`ddp_kit.init()`, and the reference job) calls",
              "`ddp_kit.dist.resources.tune_allocator`: `mallopt` sets the mmap threshold to 32 MiB and the trim threshold to 64 MiB, the values of the",
              "two variables above, and the init line says `glibc malloc thresholds fixed`. A user's choice wins: with",
              "any MALLOC_* variable or glibc.malloc.* in GLIBC_TUNABLES ddp_kit leaves malloc alone, and",
              "DDP_KIT_MALLOC=0 keeps glibc's defaults (this bench checks both switches). The price: each process",
              "keeps up to 64 MiB of freed heap instead of returning it, and blocks up to 32 MiB come from the heap.",
              "Off glibc (musl, macOS) nothing is done. A loop that does not use ddp_kit can set the two variables."]
    return lines


if __name__ == "__main__":
    fire.Fire(main)

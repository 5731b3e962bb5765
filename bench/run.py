"""ddp_kit against a hand-written DDP loop, side by side, alternated in one run so machine drift hits both.

    python bench/run.py [--rounds 5] [--steps 300] [--worlds 1,2]

Each round launches, in turn, raw_ddp.py (with ddp_kit's threads and malloc thresholds), kit_ddp.py
with the job's defaults, kit_ddp.py with everything the step boundary schedules off, and (at
--features_at ranks) kit_ddp.py with each feature alone back on, each under `torchrun --standalone`
(order reversed every other round). Step time = wall time between consecutive step ends (data
loading and all loop bookkeeping included), median over steps after the first `--skip`. Writes
bench/results.json and this bench's section of BENCHMARKS.md.
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

HERE = Path(__file__).resolve().parent
# Everything the step boundary schedules, off; each feature variant turns one back on.
OFF = ["--ckpt_every", "0", "--sync_check_every", "0", "--rank_metrics", "false", "--hang_timeout_s", "0",
       "--peer_timeout_s", "0", "--preempt_check_every", "1000000"]
VARIANTS = {
    "raw": ["raw_ddp.py"],  # the same threads and malloc thresholds as ddp_kit (raw_ddp.py --same_settings)
    "kit": ["kit_ddp.py", "--ckpt_every", "100"],  # the job's defaults, checkpoints every 100 steps included
    "kit_off": ["kit_ddp.py", *OFF],
    "sync_checks": ["kit_ddp.py", *OFF, "--sync_check_every", "100"],
    "watchdog": ["kit_ddp.py", *OFF, "--hang_timeout_s", "180", "--peer_timeout_s", "30"],
    "rank_metrics": ["kit_ddp.py", *OFF, "--rank_metrics", "true"],
    "ckpt_sync": ["kit_ddp.py", *OFF, "--ckpt_every", "100"],
    "ckpt_async": ["kit_ddp.py", *OFF, "--ckpt_every", "100", "--async_ckpt", "true"],
    "preempt_agreement": ["kit_ddp.py", *OFF, "--preempt_check_every", "10"],
}
FEATURES = ("sync_checks", "watchdog", "rank_metrics", "ckpt_sync", "ckpt_async", "preempt_agreement")
BEGIN, END = "<!-- bench/run.py: begin -->", "<!-- bench/run.py: end -->"


def launch(variant: str, world: int, steps: int, tmp: Path) -> dict:
    out = tmp / f"{variant}_{world}_{time.monotonic_ns()}.json"
    script, *extra = VARIANTS[variant]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "BENCH_LAUNCH_T": repr(time.time())}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(HERE / script), "--out", str(out), "--steps", str(steps), *extra]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"{variant} at world {world} failed:\n{res.stderr[-3000:]}")
    data = json.loads(out.read_text())
    data["malloc_tuned"] = "glibc malloc thresholds fixed" in res.stdout  # ddp_kit's init line
    return data


def step_median(ends: list[float], skip: int) -> float:
    gaps = [b - a for a, b in zip(ends, ends[1:])][skip:]
    return statistics.median(gaps)


def main(rounds: int = 5, steps: int = 400, skip: int = 100, worlds: str = "1,2", out_md: str = "BENCHMARKS.md",
         markdown_only: bool = False, features_at: int = 2):
    """`features_at`: the world size at which each feature's own cost is measured (the others run
    raw, kit and kit_off only)."""
    if markdown_only:  # re-render BENCHMARKS.md from bench/results.json without measuring again
        res = json.loads((HERE / "results.json").read_text())
        ckpt = json.loads((HERE / "ckpt_results.json").read_text()) if (HERE / "ckpt_results.json").exists() else None
        write_markdown(Path(out_md), res["rows"], ckpt, res.get("rounds", rounds), res.get("steps", steps), skip, worlds)
        return
    worlds_list = [int(w) for w in (worlds if isinstance(worlds, (tuple, list)) else str(worlds).split(","))]
    rows, raw_json = [], {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for world in worlds_list:
            names = list(VARIANTS) if world == features_at else ["raw", "kit", "kit_off"]
            runs: dict[str, list[dict]] = {v: [] for v in names}
            for r in range(rounds):
                order = names if r % 2 == 0 else list(reversed(names))  # ABC CBA ...
                for v in order:
                    runs[v].append(launch(v, world, steps, tmp))
            med = {v: [step_median(x["ends"], skip) for x in runs[v]] for v in names}

            def ratios(a: str, b: str, med=med) -> list[float]:
                return [x / y for x, y in zip(med[a], med[b])]

            same = {x["param_sha256"] for v in names for x in runs[v]}
            row = {
                "world": world,
                "raw_step_ms": statistics.median(med["raw"]) * 1e3,
                "raw_step_ms_range": [min(med["raw"]) * 1e3, max(med["raw"]) * 1e3],
                "kit_step_ms": statistics.median(med["kit"]) * 1e3,
                "kit_off_step_ms": statistics.median(med["kit_off"]) * 1e3,
                "ratio_kit_raw": statistics.median(ratios("kit", "raw")),
                "ratio_kit_raw_rounds": ratios("kit", "raw"),
                "ratio_off_raw": statistics.median(ratios("kit_off", "raw")),
                "ratio_off_raw_rounds": ratios("kit_off", "raw"),
                "feature_cost": {f: statistics.median(ratios(f, "kit_off")) - 1 for f in FEATURES if f in med},
                "feature_cost_rounds": {f: [x - 1 for x in ratios(f, "kit_off")] for f in FEATURES if f in med},
                "bitwise_equal": len(same) == 1,
                "raw_first_step_s": statistics.median(x["first_step_after_launch_s"] for x in runs["raw"]),
                "kit_first_step_s": statistics.median(x["first_step_after_launch_s"] for x in runs["kit"]),
                "raw_peak_rss_mb": statistics.median(x["peak_rss_mb"] for x in runs["raw"]),
                "kit_peak_rss_mb": statistics.median(x["peak_rss_mb"] for x in runs["kit"]),
                "same_malloc": all(x["malloc_tuned"] for v in names for x in runs[v]),
            }
            rows.append(row)
            raw_json[str(world)] = {"per_round_step_median_s": med, "row": row}
            print(json.dumps(row), flush=True)
    ckpt = None
    if (HERE / "ckpt_results.json").exists():
        ckpt = json.loads((HERE / "ckpt_results.json").read_text())
    (HERE / "results.json").write_text(json.dumps({"rows": rows, "raw": raw_json, "ckpt": ckpt, "rounds": rounds,
                                                   "steps": steps}, indent=1) + "\n")
    write_markdown(Path(out_md), rows, ckpt, rounds, steps, skip, worlds)


def write_markdown(path: Path, rows: list[dict], ckpt: dict | None, rounds: int, steps: int, skip: int, worlds: str) -> None:
    """Replace this bench's section of BENCHMARKS.md (between its markers; the first time, the old
    first table before the API bench's section), leaving every other section as it is."""
    import torch

    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, CPU (gloo)"
    lines = [
        BEGIN,
        "## The reference job against a raw DDP loop with the same allocator settings (`python bench/run.py`)", "",
        "`bench/raw_ddp.py` is a DDP loop in the PyTorch tutorial's style (DistributedSampler, DDP, AdamW, a cosine",
        "schedule) with the same threads per rank and glibc malloc thresholds that ddp_kit sets (it calls ddp_kit's",
        "`apply_cpu_settings` and nothing else of it); `bench/kit_ddp.py` is `python -m ddp_kit.train` on the same work.",
        f"Machine: {machine}. Work: MLP (3072-256-10) on synthetic 3x32x32 data, global batch 128, {steps} steps.",
        f"Step time: median gap between step ends after the first {skip} steps. {rounds} rounds, the variants alternating",
        "(ABC, CBA, ...); figures are medians over rounds, with min..max of the per-round ratio in brackets.",
        "`kit` is the job's defaults (sync checks every 100 steps, hang watchdog, per-rank metrics every 50 steps,",
        "preemption agreement every 10, a checkpoint every 100); `kit_off` has all of them off; each feature's cost is",
        "`kit_off` with that one feature back on, against `kit_off` in the same round.", "",
        "Reproduce: `python bench/run.py` (about 10 minutes on 2 cores).", "",
        "| ranks | raw step (ms) | ddp_kit defaults (ms) | ratio defaults/raw | everything off (ms) | ratio off/raw | weights bitwise equal | same malloc thresholds | launch to first step, raw / ddp_kit (s) | peak RSS rank 0, raw / ddp_kit (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def span(xs: list[float]) -> str:
        return f"({min(xs):.3f}..{max(xs):.3f})"

    for r in rows:
        lines.append(f"| {r['world']} | {r['raw_step_ms']:.3f} | {r['kit_step_ms']:.3f} | {r['ratio_kit_raw']:.3f} "
                     f"{span(r['ratio_kit_raw_rounds'])} | {r['kit_off_step_ms']:.3f} | {r['ratio_off_raw']:.3f} "
                     f"{span(r['ratio_off_raw_rounds'])} | {'yes' if r['bitwise_equal'] else 'NO'} | "
                     f"{'yes' if r['same_malloc'] else 'NO'} | {r['raw_first_step_s']:.2f} / {r['kit_first_step_s']:.2f} | "
                     f"{r['raw_peak_rss_mb']:.0f} / {r['kit_peak_rss_mb']:.0f} |")
    names = {"sync_checks": "sync checks every 100 steps", "watchdog": "hang watchdog + peer heartbeat",
             "rank_metrics": "per-rank metrics (a record every 50 steps)", "ckpt_sync": "checkpoint every 100 steps, sync",
             "ckpt_async": "checkpoint every 100 steps, async", "preempt_agreement": "preemption agreement every 10 steps"}
    for r in rows:
        if r["feature_cost"]:
            lines += ["", f"Each feature's own cost at {r['world']} ranks (median of per-round ratios to everything off, minus 1):", "",
                      "| feature | cost | per round |", "|---|---|---|"]
            for f, cost in r["feature_cost"].items():
                per = r["feature_cost_rounds"][f]
                lines.append(f"| {names[f]} | {cost * 100:+.1f}% | {min(per) * 100:+.1f}%..{max(per) * 100:+.1f}% |")
    lines += ["", "Per-round figures: `bench/results.json`. The boundary's own work in microseconds per step, part",
              "by part: `bench/step_overhead.py` (below).", END]
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + "\n".join(lines) + rest.split(END, 1)[1]
    else:  # the old first table: from the title to the next section
        first, _, rest = text.partition("\n## ")
        text = first.split("\n", 1)[0] + "\n\n" + "\n".join(lines) + "\n\n## " + rest
    path.write_text(text)


if __name__ == "__main__":
    fire.Fire(main)

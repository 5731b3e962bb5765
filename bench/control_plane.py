"""The control plane at 2..32 ranks: bytes per rank and time per call for each of ddp_kit's own
operations, the growth fitted and extrapolated to 1,000 and 10,000 ranks; and launch-to-first-step
time of ddp_kit against a raw torchrun script at 1..16 ranks.

    python bench/control_plane.py [--worlds 2,4,8,16,32] [--startup_worlds 1,2,4,8,16] [--rounds 3]

Each world size is one real `torchrun --standalone` job of bench/control_plane_worker.py (gloo, CPU,
a tiny model, every check on), which counts what the real code sends. Bytes are payload bytes at
the torch.distributed / store API (what a rank hands in and gets back), not wire bytes: a ring
all-reduce puts about 2x its payload on the wire whatever the world size, so the growth is the same.
Times on this 2-core machine run N processes on 2 cores: they grow with N for that reason alone,
and are shown for completeness, not as a prediction.

Writes bench/control_plane_results.json, bench/control_plane.png and prints the BENCHMARKS.md tables.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fire

HERE = Path(__file__).resolve().parent
EXTRAPOLATE = (1_000, 10_000)
DEFAULT_BUDGET = 2000.0  # ddp_kit.env.STORE_OPS_PER_S


def run_world(world: int, tmp: Path, steps: int, budget: float | None) -> list[dict]:
    out = tmp / f"cp_{world}_{time.monotonic_ns()}"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if budget:
        env["DDP_KIT_STORE_OPS_PER_S"] = str(budget)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(HERE / "control_plane_worker.py"), "--out_dir", str(out), "--steps", str(steps)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        ours = "\n".join(line for line in res.stderr.splitlines() if line.startswith("ddp_kit:"))
        raise SystemExit(f"control-plane job at world {world} failed:\n{ours}\n{res.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


POLLERS = ("watchdog poll", "fail-fast poll")


def summarize(ranks: list[dict]) -> dict[str, dict]:
    """Per operation: the largest per-call payload of any rank but 0, rank 0's, time per call; store
    operations per call (per second for the pollers, which run on a clock) per rank, rank 0, whole job."""
    ops: dict[str, dict] = {}
    empty = {"calls": 0, "sent": 0, "received": 0, "store_ops": 0, "store_bytes": 0, "seconds": [], "store_ops_per_s": 0.0}
    for name in sorted({k for r in ranks for k in r["ops"]}):
        per = [r["ops"].get(name) or empty for r in ranks]

        def per_call(p, field):
            return p[field] / p["calls"] if p["calls"] else 0.0

        if name in POLLERS:
            store = [p["store_ops_per_s"] for p in per]
        else:
            store = [per_call(p, "store_ops") for p in per]
        secs = [x for p in per for x in p["seconds"]]
        ops[name] = {
            "calls": max(p["calls"] for p in per),
            "bytes_per_call": max([per_call(p, "sent") + per_call(p, "received") for p in per[1:]] or [0.0]),
            "rank0_bytes_per_call": per_call(per[0], "sent") + per_call(per[0], "received"),
            "ms_per_call": statistics.median(secs) * 1e3 if secs else None,
            "store_per_rank": max(store[1:] or [0.0]),
            "store_rank0": store[0],
            "store_total": sum(store),
        }
    return ops


def fit(xs: list[int], ys: list[float]) -> dict:
    """The simplest of O(1), O(log N), O(N) that explains ys: O(1) when ys vary by under 10%, else the
    better (least squares) of a + b*log2(N) and a + b*N."""
    if not ys or max(ys) <= 0:
        return {"order": "O(1)", "a": 0.0, "b": 0.0, "formula": "0"}
    if (max(ys) - min(ys)) <= 0.10 * max(ys):
        a = statistics.mean(ys)
        return {"order": "O(1)", "a": a, "b": 0.0, "formula": f"{a:.4g}"}
    best = None
    for order, f in (("O(log N)", lambda n: math.log2(n)), ("O(N)", lambda n: float(n))):
        fx = [f(x) for x in xs]
        mx, my = statistics.mean(fx), statistics.mean(ys)
        b = sum((u - mx) * (v - my) for u, v in zip(fx, ys)) / sum((u - mx) ** 2 for u in fx)
        a = my - b * mx
        sse = sum((a + b * u - v) ** 2 for u, v in zip(fx, ys))
        if best is None or sse < best["sse"]:
            var = "log2(N)" if order == "O(log N)" else "N"
            best = {"order": order, "a": a, "b": b, "sse": sse, "formula": f"{a:.4g} + {b:.4g}*{var}"}
    best.pop("sse")
    return best


def predict(f: dict, n: int) -> float:
    return f["a"] + f["b"] * (math.log2(n) if f["order"] == "O(log N)" else n if f["order"] == "O(N)" else 0.0)


def startup(worlds: list[int], rounds: int, tmp: Path) -> list[dict]:
    """Launch to the end of step 1 (rank 0's clock, which waits for every rank in step 1's all-reduce),
    raw_ddp.py against api_ddp.py (the same loop with ddp_kit's lines), alternated round by round."""
    sys.path.insert(0, str(HERE))
    from run import VARIANTS, launch
    VARIANTS.update({"api": ["api_ddp.py"]})
    rows = []
    for world in worlds:
        t = {"raw": [], "api": []}
        for r in range(rounds):
            for v in (("raw", "api") if r % 2 == 0 else ("api", "raw")):
                t[v].append(launch(v, world, 3, tmp)["first_step_after_launch_s"])
        ratios = [a / b for a, b in zip(t["api"], t["raw"])]
        rows.append({"world": world, "raw_s": statistics.median(t["raw"]), "api_s": statistics.median(t["api"]),
                     "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)})
        print(f"startup world {world}: raw {rows[-1]['raw_s']:.2f}s ddp_kit {rows[-1]['api_s']:.2f}s "
              f"ratio {rows[-1]['ratio']:.2f}", flush=True)
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = results["worlds"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, series in results["series"].items():
        ys = [s["bytes_per_call"] for s in series]
        if max(ys) > 0:
            a.plot(worlds, ys, marker="o", label=name)
        y0 = [s["rank0_bytes_per_call"] for s in series]
        if max(y0) > 0 and y0 != ys:
            a.plot(worlds, y0, marker="x", linestyle="--", label=f"{name} (rank 0)")
    a.set(xscale="log", yscale="log", xlabel="ranks", ylabel="payload bytes per call",
          title="collectives: bytes per rank (rank 0 dashed)")
    a.legend(fontsize=7)
    for name in POLLERS:
        if name in results["series"]:
            b.plot(worlds, [s["store_total"] for s in results["series"][name]], marker="o", label=name)
    b.set(xscale="log", xlabel="ranks", ylabel="store operations per second (whole job)",
          title=f"store load of the pollers (budget {results['budget']:g} ops/s each)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(worlds: str = "2,4,8,16,32", steps: int = 40, budget: float = 20.0, startup_worlds: str = "1,2,4,8,16",
         rounds: int = 3, skip_startup: bool = False):
    """`budget`: the store-ops budget per poller for this run (ddp_kit's default is 2000 ops/s): a small
    one makes the poll period's growth visible at 32 ranks, where the default would not yet apply."""
    ws = _ints(worlds)
    series: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as d:
        for w in ws:
            ops = summarize(run_world(w, Path(d), steps, budget))
            print(f"world {w}: " + ", ".join(f"{k} {v['bytes_per_call']:.0f}B" for k, v in ops.items()), flush=True)
            for name, v in ops.items():
                series.setdefault(name, []).append({"world": w, **v})
        start_rows = [] if skip_startup else startup(_ints(startup_worlds), rounds, Path(d))
    rows = []
    for name, s in series.items():
        if len(s) != len(ws):
            continue  # an operation that did not run at every size (none expected)
        row = {"op": name, "calls": s[-1]["calls"]}
        for field in ("bytes_per_call", "rank0_bytes_per_call", "store_per_rank", "store_rank0", "store_total"):
            f = fit(ws, [x[field] for x in s])
            row[field] = {"at": [x[field] for x in s], "fit": f, "extrapolated": {n: predict(f, n) for n in EXTRAPOLATE}}
        row["ms_per_call"] = [x["ms_per_call"] for x in s]
        rows.append(row)
    results = {"worlds": ws, "budget": budget, "steps": steps, "rows": rows, "series": series, "startup": start_rows}
    (HERE / "control_plane_results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, HERE / "control_plane.png")
    print(markdown(results))


def _ints(x) -> list[int]:
    """fire hands "2,4" over as a tuple, "2" as an int."""
    return [int(w) for w in (x if isinstance(x, (list, tuple)) else str(x).split(","))]


def _b(x: float) -> str:
    return f"{x:.0f}" if x < 10_000 else f"{x / 1024:.0f} KiB" if x < 10 * 2**20 else f"{x / 2**20:.0f} MiB"


def markdown(results: dict) -> str:
    ws = results["worlds"]
    out = ["| operation | per rank (ranks ≠ 0), bytes per call at " + ", ".join(map(str, ws)) + " | growth | "
           "rank 0, bytes per call | growth | at 10,000 ranks (rank ≠ 0 / rank 0) | ms per call at "
           + ", ".join(map(str, ws)) + " |", "|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        pb, p0 = r["bytes_per_call"], r["rank0_bytes_per_call"]
        if max(pb["at"] + p0["at"]) == 0:
            continue
        ms = ", ".join("-" if m is None else f"{m:.2f}" for m in r["ms_per_call"])
        out.append(f"| {r['op']} | {', '.join(_b(x) for x in pb['at'])} | {pb['fit']['order']} | "
                   f"{', '.join(_b(x) for x in p0['at'])} | {p0['fit']['order']} ({p0['fit']['formula']}) | "
                   f"{_b(pb['extrapolated'][10_000])} / {_b(p0['extrapolated'][10_000])} | {ms} |")
    out += ["", "| store traffic | unit | per rank (≠ 0) at " + ", ".join(map(str, ws)) + " | rank 0 | whole job | "
            "whole job: growth | whole job at 10,000 ranks |", "|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        so, s0, tot = r["store_per_rank"], r["store_rank0"], r["store_total"]
        if max(so["at"] + s0["at"] + tot["at"]) == 0:
            continue
        if r["op"] in POLLERS:  # on a clock: bounded by the budget once N * ops_per_poll / base period passes it
            unit, k = "ops/s", tot["at"][0] / ws[0]
            growth = f"min({k:.2g}*N, budget): O(1) per job above {results['budget'] / k:.0f} ranks here"
            at10k = f"{min(k * 10_000, DEFAULT_BUDGET):.0f} ops/s (default budget {DEFAULT_BUDGET:.0f})"
        else:
            unit, growth = "ops per call", f"{tot['fit']['order']} ({tot['fit']['formula']})"
            at10k = f"{tot['extrapolated'][10_000]:.0f} ops per call"
        out.append(f"| {r['op']} | {unit} | {_fmt(so['at'])} | {_fmt(s0['at'])} | {_fmt(tot['at'])} | {growth} | {at10k} |")
    if results.get("startup"):
        out += ["", "| ranks | raw torchrun script, launch to step 1 | ddp_kit | ratio (min..max) |", "|---|---|---|---|"]
        for s in results["startup"]:
            out.append(f"| {s['world']} | {s['raw_s']:.2f} s | {s['api_s']:.2f} s | {s['ratio']:.2f} "
                       f"({s['ratio_min']:.2f}..{s['ratio_max']:.2f}) |")
    return "\n".join(out)


if __name__ == "__main__":
    fire.Fire(main)


def _fmt(xs) -> str:
    return ", ".join(f"{x:.1f}" for x in xs)

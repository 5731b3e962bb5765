"""The library API's step boundary with every feature on (api_ddp.py) against a bare DDP loop
(raw_ddp.py), alternated in one run so machine drift hits both.

    python bench/api_bench.py [--rounds 7] [--steps 300] [--worlds 1,2]

Both loops run with the same glibc malloc thresholds (ddp_kit's, given to both through MALLOC_*
variables, which ddp_kit then leaves alone), so the ratio is the step boundary alone.
Per round and world size: the ratio of median step times (api / raw) and of total loop times
(first to last step end: checkpoint and sync-check steps included). Reports the median ratio and
its spread (min..max over rounds); writes bench/api_results.json and prints the table rows.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

import fire
from run import HERE, VARIANTS, launch, step_median

VARIANTS.update({"api": ["api_ddp.py"]})


def main(rounds: int = 7, steps: int = 300, skip: int = 20, worlds: str = "1,2"):
    from ddp_kit.dist.resources import MMAP_THRESHOLD, TRIM_THRESHOLD

    os.environ.update(MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), MALLOC_TRIM_THRESHOLD_=str(TRIM_THRESHOLD))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for world in [int(w) for w in str(worlds).split(",")]:
            med, total = {"raw": [], "api": []}, {"raw": [], "api": []}
            for r in range(rounds):
                for v in (("raw", "api") if r % 2 == 0 else ("api", "raw")):
                    ends = launch(v, world, steps, Path(d))["ends"]
                    med[v].append(step_median(ends, skip))
                    total[v].append(ends[-1] - ends[skip])
            step_ratios = [a / b for a, b in zip(med["api"], med["raw"])]
            total_ratios = [a / b for a, b in zip(total["api"], total["raw"])]
            row = {"world": world, "raw_step_ms": statistics.median(med["raw"]) * 1e3,
                   "api_step_ms": statistics.median(med["api"]) * 1e3,
                   "step_ratio": statistics.median(step_ratios), "step_ratio_min": min(step_ratios),
                   "step_ratio_max": max(step_ratios), "total_ratio": statistics.median(total_ratios),
                   "total_ratio_min": min(total_ratios), "total_ratio_max": max(total_ratios),
                   "rounds": rounds, "steps": steps}
            rows.append(row)
            print(f"| {world} | {row['raw_step_ms']:.3f} | {row['api_step_ms']:.3f} | {row['step_ratio']:.3f} "
                  f"({row['step_ratio_min']:.3f}..{row['step_ratio_max']:.3f}) | {row['total_ratio']:.3f} "
                  f"({row['total_ratio_min']:.3f}..{row['total_ratio_max']:.3f}) |", flush=True)
    (HERE / "api_results.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    fire.Fire(main)

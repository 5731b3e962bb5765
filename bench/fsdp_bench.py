"""FSDP's step time against DDP's: the same job (`python -m ddp_kit.train`), the same model, seed and
global batch, only --strategy differs; runs alternate so machine drift hits both.

    python bench/fsdp_bench.py [--rounds 5] [--steps 200] [--nproc 2] [--hidden 2048]

Per round: the median step time of each run (rank 0's per-window `step_s` in metrics.jsonl, the
first two windows skipped: startup and warm-up), and each rank's parameter + gradient + optimizer
bytes. Reports the median ratio fsdp/ddp (and for FSDP with
--fsdp_reshard_after_forward false) with its spread (min..max over rounds), writes
bench/fsdp_results.json and prints the BENCHMARKS.md rows.

On CPU (gloo) this is the price of sharding where memory is not short: FSDP all-gathers each
unit's weights for the forward and again for the backward, and reduce-scatters gradients, where
DDP all-reduces once and overlaps it with the backward.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import fire

HERE = Path(__file__).resolve().parent


# The variants: the strategy and its extra flags. `fsdp_keep` keeps each unit's gathered weights from
# the forward to the backward (one all-gather per unit per step instead of two): the knob a user turns
# when FSDP's communication, not memory, is what hurts.
VARIANTS = {"ddp": ["--strategy", "ddp"], "fsdp": ["--strategy", "fsdp"],
            "fsdp_keep": ["--strategy", "fsdp", "--fsdp_reshard_after_forward", "false"]}


def one(variant: str, nproc: int, steps: int, hidden: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "ddp_kit.train", *VARIANTS[variant], "--model_args", json.dumps({"hidden": hidden}),
           "--max_steps", str(steps), "--log_every", "10", "--ckpt_every", "0", "--sync_check_every", "0",
           "--eval_every_epoch", "false", "--progress", "false", "--run_dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("event") == "train" and "ranks" in r][2:]
    step_s = statistics.median(r["ranks"][0]["step_s"] for r in train)
    state = [x["param_bytes"] + x["grad_bytes"] + x["optim_bytes"] for x in train[-1]["ranks"]]
    return {"step_s": step_s, "state_bytes": state}


def main(rounds: int = 5, steps: int = 200, nproc: int = 2, hidden: int = 2048):
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    with tempfile.TemporaryDirectory() as d:
        for r in range(rounds):
            for variant in (order if r % 2 == 0 else order[::-1]):
                runs[variant].append(one(variant, nproc, steps, hidden, Path(d) / f"{variant}{r}"))
    ratios = [f["step_s"] / p["step_s"] for f, p in zip(runs["fsdp"], runs["ddp"])]
    keep = [f["step_s"] / p["step_s"] for f, p in zip(runs["fsdp_keep"], runs["ddp"])]
    ddp_bytes, fsdp_bytes = runs["ddp"][-1]["state_bytes"], runs["fsdp"][-1]["state_bytes"]
    result = {"nproc": nproc, "steps": steps, "hidden": hidden, "rounds": rounds,
              "step_ratio_median": statistics.median(ratios), "step_ratio_min": min(ratios),
              "step_ratio_max": max(ratios),
              "keep_step_ratio_median": statistics.median(keep), "keep_step_ratio_min": min(keep),
              "keep_step_ratio_max": max(keep),
              "ddp_step_ms": [round(x["step_s"] * 1e3, 3) for x in runs["ddp"]],
              "fsdp_step_ms": [round(x["step_s"] * 1e3, 3) for x in runs["fsdp"]],
              "fsdp_keep_step_ms": [round(x["step_s"] * 1e3, 3) for x in runs["fsdp_keep"]],
              "ddp_state_bytes_per_rank": ddp_bytes, "fsdp_state_bytes_per_rank": fsdp_bytes,
              "state_ratio_per_rank": [f / p for f, p in zip(fsdp_bytes, ddp_bytes)]}
    (HERE / "fsdp_results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"| FSDP / DDP median step time, {nproc} ranks, CPU gloo, mlp hidden {hidden} | "
          f"{result['step_ratio_median']:.2f} ({min(ratios):.2f}..{max(ratios):.2f}) |")
    print(f"| same, --fsdp_reshard_after_forward false | "
          f"{result['keep_step_ratio_median']:.2f} ({min(keep):.2f}..{max(keep):.2f}) |")
    print(f"| per-rank parameter + gradient + optimizer bytes, FSDP / DDP | "
          f"{statistics.mean(result['state_ratio_per_rank']):.3f} ({fsdp_bytes[0]:,} of {ddp_bytes[0]:,} bytes) |")


if __name__ == "__main__":
    fire.Fire(main)

"""What the replay check costs (`sdc_check_every`, docs/sdc.md): the reference job with its defaults (the check
off), and with a check every 100 and every 10 steps, in one run, alternated so that machine drift hits all three.

    python bench/replay_cost.py [--rounds 5] [--steps 600] [--skip 100]      # CPU: 2 ranks, gloo

Each variant is `torchrun --standalone --nproc_per_node=2 bench/kit_ddp.py` (the reference MLP on synthetic data,
as bench/defaults_cost.py runs it). A check step computes the step's forward and backward once more, so the
cost shows in the whole loop's mean step (the median step is a step without a check), and in rank 0's CPU time
per step. Reported: the median over rounds of the per-round ratios against the defaults, with their range, the
expected ratio (one forward and backward more every N steps, from the defaults' own step split: the replay is
about the step minus the optimizer's and the loader's share, so at most 1 + 1/N), and whether every variant
ended on the same weights (a checked run trains bit for bit as an unchecked one). Writes
bench/replay_cost_results.json (or --out).
"""
from __future__ import annotations

import os
import platform
import tempfile
from pathlib import Path

import fire
from defaults_cost import VARIANTS, cpu_step_s, launch, loop_step_s, shown, spread, write_results

CHECKED = {"defaults": ["kit_ddp.py"], "every_100": ["kit_ddp.py", "--sdc_check_every", "100"],
           "every_10": ["kit_ddp.py", "--sdc_check_every", "10"]}


def main(rounds: int = 5, steps: int = 600, skip: int = 100, out: str | None = None):
    VARIANTS.clear()
    VARIANTS.update(CHECKED)  # launch() looks the variant's command up there
    names = list(CHECKED)
    runs: dict[str, list[dict]] = {v: [] for v in names}
    with tempfile.TemporaryDirectory() as d:
        for r in range(rounds):
            for v in names[r % len(names):] + names[:r % len(names)]:  # ABC, BCA, CAB, ...
                runs[v].append(launch(v, 2, steps, "cpu", Path(d)))
            print(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{v} {loop_step_s(runs[v][-1], skip) * 1e3:.3f} ms" for v in names), flush=True)
    loop = {v: [loop_step_s(x, skip) for x in runs[v]] for v in names}
    cpu = {v: [cpu_step_s(x, skip) for x in runs[v]] for v in names}

    def ratio(times: dict[str, list[float]], a: str) -> dict:
        return spread([x / y for x, y in zip(times[a], times["defaults"])])

    import torch

    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}",
        "rounds": rounds, "steps": steps, "skip": skip,
        "loop_step_ms": {v: spread([x * 1e3 for x in loop[v]]) for v in names},
        "loop_ratio": {v: ratio(loop, v) for v in names[1:]},
        "cpu_ratio": {v: ratio(cpu, v) for v in names[1:]},
        "at_most": {"every_100": 1.01, "every_10": 1.1},
        "weights_bitwise_equal": len({x["param_sha256"] for v in names for x in runs[v]}) == 1,
    }
    path = write_results(result, out, "replay_cost_results.json")
    print(f"cpu, 2 ranks, {rounds} rounds of {steps} steps (whole loop's mean step after {skip}):")
    for v in names:
        print(f"  {v:10s} {shown(result['loop_step_ms'][v], ' ms')}")
    for kind in ("loop_ratio", "cpu_ratio"):
        for v, s in result[kind].items():
            print(f"  {kind} {v}/defaults {shown(s)}; at most {result['at_most'][v]}")
    print(f"  weights bitwise equal: {result['weights_bitwise_equal']}  -> {path}")
    if not result["weights_bitwise_equal"]:
        raise SystemExit("replay_cost: a checked run ended on other weights than the unchecked one")


if __name__ == "__main__":
    fire.Fire(main)

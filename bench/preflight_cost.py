"""What the pre-flight health gate costs at an attempt's start: the reference job started with the gate off,
quick (the default) and thorough, alternated in one run so machine drift hits all three.

    python bench/preflight_cost.py [--rounds 5] [--worlds 1,2] [--hosts 3]

One host: `torchrun --standalone` with 1 and 2 ranks. `--hosts 3` (root, iproute2): three network-namespace
hosts, one rank each (tests/netns.py), so the links between hosts are timed too. From each run's ledger
(run_dir/attempts.jsonl): start-up = the first step's end less the launch (what `status` books as start-up,
the first step included), and the gate's own seconds (its "health" line). Reports per mode the median start-up,
its ratio to the gate off, and the gate's share of its start-up; writes bench/preflight_results.json.
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
ROOT = HERE.parent
MODES = ("off", "quick", "thorough")
JOB = ["--max_steps", "3", "--ckpt_every", "0", "--progress", "false", "--batch_size", "60"]


def _ledger(run_dir: Path) -> tuple[float, float]:
    """(start-up seconds, the gate's seconds) of the run's one attempt."""
    records = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["event"] == "start")
    first = next(r for r in records if r["event"] == "first_step")
    gate = next((r for r in records if r["event"] == "health"), {"seconds": 0.0})
    return first["t"] - start["launched_t"], float(gate["seconds"])


def _one_host(world: int, mode: str, run_dir: Path) -> tuple[float, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           "-m", "ddp_kit.train", *JOB, "--health_check", mode, "--run_dir", str(run_dir)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"{mode} at world {world} failed:\n{res.stderr[-3000:]}")
    return _ledger(run_dir)


def _three_hosts(mode: str, run_dir: Path, hosts: list) -> tuple[float, float]:
    sys.path.insert(0, str(ROOT / "tests"))
    import netns

    env = {**os.environ, "NNODES": str(len(hosts)), "NPROC_PER_NODE": "1", "RDZV_HOST": hosts[0].name,
           "RDZV_PORT": "29531", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "RDZV_CONF": "join_timeout=60,last_call_timeout=2"}
    procs = [subprocess.Popen(h.command(str(ROOT / "launch" / "torchrun.sh"), *JOB, "--health_check", mode,
                                        "--run_dir", str(run_dir)), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for h in hosts]
    outs = netns.finish(procs, timeout=180)
    if any(p.returncode for p in procs):
        raise SystemExit(f"{mode} on {len(hosts)} hosts failed:\n" + "\n=====\n".join(o[-2000:] for o in outs))
    return _ledger(run_dir)


def _row(label: str, got: dict[str, list[tuple[float, float]]]) -> dict:
    med = {m: statistics.median(s for s, _ in got[m]) for m in MODES}
    gate = {m: statistics.median(g for _, g in got[m]) for m in MODES}
    return {"setup": label, "runs_per_mode": len(got["off"]),
            **{f"startup_s_{m}": round(med[m], 3) for m in MODES},
            **{f"gate_s_{m}": round(gate[m], 3) for m in MODES if m != "off"},
            **{f"ratio_{m}": round(med[m] / med["off"], 3) for m in MODES if m != "off"},
            **{f"share_{m}": round(gate[m] / med[m], 3) for m in MODES if m != "off"}}


def main(rounds: int = 5, worlds: str = "1,2", hosts: int = 0) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        n = 0
        listed = worlds if isinstance(worlds, (tuple, list)) else str(worlds).split(",")  # fire reads 1,2 as a tuple
        for world in [int(w) for w in listed if str(w)]:
            got: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
            for r in range(rounds):
                for m in (MODES if r % 2 == 0 else MODES[::-1]):
                    n += 1
                    got[m].append(_one_host(world, m, Path(d) / f"r{n}"))
            rows.append(_row(f"1 host, {world} rank(s)", got))
            print(json.dumps(rows[-1]), flush=True)
        if hosts:
            sys.path.insert(0, str(ROOT / "tests"))
            import netns

            got = {m: [] for m in MODES}
            with netns.hosts([f"bench{i}" for i in range(hosts)], subnet="10.233.0") as made:
                for r in range(rounds):
                    for m in (MODES if r % 2 == 0 else MODES[::-1]):
                        n += 1
                        got[m].append(_three_hosts(m, Path(d) / f"r{n}", made))
            rows.append(_row(f"{hosts} netns hosts, 1 rank each", got))
            print(json.dumps(rows[-1]), flush=True)
    (HERE / "preflight_results.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    fire.Fire(main)

"""The memory tier against the durable tier, in one run each (issue 38).

    python bench/mem_tier.py blocking [--mb 100] [--repeats 7]   # a save's blocking time
    python bench/mem_tier.py kill [--steps 300] [--at 140]       # what a SIGKILLed worker costs

`blocking`: one process; an MLP and its AdamW moments, about `mb` MB. Each round times, in turn, a
plain torch.save of the state to local disk (no fsync, as most scripts do), the same with fsync,
and a memory-tier save (MemoryTier.save: the copy into node memory the loop waits for), then the
tier's background work (sealing) apart. Medians over rounds, and the first memory save apart (it
allocates its slots' pages); ratios against torch.save in the same rounds.

`kill`: the reference job on 2 ranks (torchrun, CPU, gloo, --max-restarts 1), `steps` steps with a
durable checkpoint every 50: uninterrupted; then with rank 1 SIGKILLed at step `at`, durable tier
only; then the same kill with a memory copy every 5 steps. Each killed run's extra wall time over
the uninterrupted one, and its parts from the run ledger (python -m ddp_kit.status --json):
`down` (the kill's detection and torchrun's restart: from the first attempt's end to the second's
launch), `startup` (imports, rendezvous, the restore), `replayed` (steps trained twice), and the
rest. Results go to bench/mem_tier_results.json (merged by part).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fire
import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "mem_tier_results.json"


def _save_results(part: str, report: dict) -> None:
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    RESULTS.write_text(json.dumps({**old, part: report}, indent=2) + "\n")


def blocking(mb: float = 100, repeats: int = 7, dir: str = "/tmp/ddp_kit_mem_bench", device: str = "cpu") -> dict:
    """`device` cuda: the state on the GPU; the save then blocks for the device-to-host copy into the
    tier's page-locked slot (nothing is deferred), and torch.save copies to the host as it writes."""
    from ckpt_bench import make_state

    from ddp_kit.checkpoint.memory_tier import MemoryTier
    from ddp_kit.dist import distributed
    from ddp_kit.env import DistEnv

    root = Path(dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    model, opt = make_state(mb)
    if device != "cpu":
        model.to(device)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, model[0].in_features, device=device)).sum().backward()
        opt.step()
    state = {"shared": {"model": model.state_dict(), "optimizer": opt.state_dict()}, "per_rank": {"rng": torch.get_rng_state()}}
    size_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 2**20
    # What the boundary defers (saving.save_memory): parameters and optimizer state, which only opt.step writes.
    written = {p.data_ptr() for p in model.parameters()} | {
        v.data_ptr() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.numel()}
    x = torch.randn(8, model[0].in_features, device=device)
    times: dict[str, list[float]] = {"torch_save": [], "torch_save_fsync": [], "mem_blocking": [], "mem_background": []}
    first = None
    with distributed(DistEnv(), device=device) as ctx:
        tier = MemoryTier(ctx, str(root / "job"), root=Path(tempfile.mkdtemp(prefix="ddp_kit_mem_", dir="/dev/shm")))
        opt.register_step_pre_hook(lambda *_: tier.wait_copy())
        try:
            for i in range(repeats + 1):
                t = time.perf_counter()
                torch.save(state["shared"], root / "plain.pt")
                plain = time.perf_counter() - t
                t = time.perf_counter()
                with open(root / "plain_fsync.pt", "wb") as f:
                    torch.save(state["shared"], f)
                    f.flush()
                    os.fsync(f.fileno())
                fsynced = time.perf_counter() - t
                t = time.perf_counter()
                tier.save(i, state, {}, say=lambda msg: None, later=lambda t: t.data_ptr() in written)
                blocked = time.perf_counter() - t
                before = tier.blocking_s[-1]
                model(x).sum().backward()  # the next step's forward and backward, as the loop goes on
                opt.step()  # its pre-step hook waits for the copy of what it writes (as core.stepping does)
                blocked += tier.blocking_s[-1] - before  # the save, and the hook's wait
                opt.zero_grad()
                t = time.perf_counter()
                tier.wait()
                background = time.perf_counter() - t
                if i == 0:  # its slots' pages are allocated now: once per run
                    first = blocked
                    continue
                for k, v in zip(times, (plain, fsynced, blocked, background)):
                    times[k].append(v)
        finally:
            tier.close(clean=True)
            shutil.rmtree(tier.root, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = [b / p for b, p in zip(times["mem_blocking"], times["torch_save"])]
    report = {"device": device, "state_mb": round(size_mb, 1), "repeats": repeats, "median_s": {k: round(v, 4) for k, v in med.items()},
              "first_mem_save_s": round(first or 0.0, 4),
              "mem_blocking_over_torch_save": {"median_of_rounds": round(statistics.median(ratios), 4),
                                               "range": [round(min(ratios), 4), round(max(ratios), 4)]},
              "mem_blocking_over_torch_save_fsync": round(med["mem_blocking"] / med["torch_save_fsync"], 4)}
    print(json.dumps(report, indent=2))
    _save_results("blocking" if device == "cpu" else f"blocking_{device}", report)
    return report


def _job(run_dir: Path, mem_dir: Path, steps: int, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "-m", "ddp_kit.train", "--max_steps", str(steps),
           "--ckpt_every", "50", "--progress", "false", "--log_every", "10", "--run_dir", str(run_dir), *extra]
    env = {**os.environ, "DDP_KIT_MEM_DIR": str(mem_dir), "OMP_NUM_THREADS": "1"}
    t = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return took


def _parts(run_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "ddp_kit.status", str(run_dir), "--json"], capture_output=True, text=True,
                         check=True).stdout
    acc = json.loads(out)
    first, second = acc["attempts"][0], acc["attempts"][-1]
    lines = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines() if x.strip()]
    # the second attempt's start line (the run folder checked, the watchdog up) to its resume line:
    # the script builds its model and data, then the state is found and restored
    mine = {r["event"]: r["t"] for r in reversed(lines) if r.get("attempt") == second["number"]}
    return {"attempts": len(acc["attempts"]), "resumed_step": second["resumed_step"],
            "resumed_tier": second.get("resumed_tier"), "replayed_steps": acc["replayed_steps"],
            "parts_s": {"detection_and_restart": round(second["seconds"]["down"], 2),  # killed attempt's end -> relaunch
                        "startup": round(second["seconds"]["startup"], 2),  # relaunch -> first step, restore included
                        "of_which_build_and_restore": round(mine["resume"] - mine["start"], 2)
                        if "resume" in mine and "start" in mine else None,
                        "replay": round(first["seconds"]["replayed"], 2),
                        "teardown_and_other": round(first["seconds"]["other"] + second["seconds"]["other"], 2)}}


def kill(steps: int = 300, at: int = 140, mem_every: int = 5, dir: str = "/tmp/ddp_kit_mem_kill") -> dict:
    root = Path(dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    inject = ["--inject", f"kill:rank=1:step={at}"]
    runs = {"uninterrupted": [], "durable_only": inject, "memory_tier": [*inject, "--mem_ckpt_every", str(mem_every)]}
    report: dict = {"steps": steps, "kill_at": at, "ckpt_every": 50, "mem_ckpt_every": mem_every}
    wall = {}
    for name, extra in runs.items():
        run_dir = root / name
        wall[name] = _job(run_dir, root / f"{name}_shm", steps, extra)
        report[name] = {"wall_s": round(wall[name], 2), **(_parts(run_dir) if extra else {})}
    for name in ("durable_only", "memory_tier"):
        report[name]["cost_s"] = round(wall[name] - wall["uninterrupted"], 2)
    print(json.dumps(report, indent=2))
    _save_results("kill", report)
    shutil.rmtree(root, ignore_errors=True)
    return report


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    fire.Fire({"blocking": blocking, "kill": kill})

"""Checkpoint blocking time against a plain torch.save of the same state to the same disk.

    python bench/ckpt_bench.py [--mb 100] [--repeats 5] [--dir /tmp/ddp_kit_ckpt_bench]

State: an MLP plus its AdamW moments, about `mb` MB in all. Each round times, in turn, a plain
torch.save (no fsync, as most scripts do), torch.save + fsync, ddp_kit's sync save (commit
protocol, checksums, fsync) and ddp_kit's async save (time until the loop may continue). Medians
over rounds; ratios are against plain torch.save measured in the same rounds.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path

import fire
import torch

from ddp_kit.checkpoint.checkpointer import Checkpointer
from ddp_kit.dist import distributed
from ddp_kit.env import DistEnv


def make_state(mb: float):
    width = 2048
    layers = max(1, int(mb * 2**20 / 4 / 3 / (width * width)))  # params + two AdamW moments
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def main(mb: float = 100, repeats: int = 5, dir: str = "/tmp/ddp_kit_ckpt_bench", out: str | None = None):
    root = Path(dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    model, opt = make_state(mb)
    shared = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    size_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 2**20
    times: dict[str, list[float]] = {"torch_save": [], "torch_save_fsync": [], "sync": [], "async_blocking": [], "async_total": []}
    with distributed(DistEnv(), device="cpu") as ctx:
        sync = Checkpointer(ctx, root / "sync", keep_last=1)
        asyn = Checkpointer(ctx, root / "async", keep_last=1, async_save=True)
        for i in range(repeats):
            t = time.perf_counter()
            torch.save(shared, root / "plain.pt")
            times["torch_save"].append(time.perf_counter() - t)
            t = time.perf_counter()
            with open(root / "plain_fsync.pt", "wb") as f:
                torch.save(shared, f)
                f.flush()
                os.fsync(f.fileno())
            times["torch_save_fsync"].append(time.perf_counter() - t)
            t = time.perf_counter()
            sync.save(i, shared, {"rng": torch.get_rng_state()}, {})
            times["sync"].append(time.perf_counter() - t)
            t = time.perf_counter()
            asyn.save(i, shared, {"rng": torch.get_rng_state()}, {})
            times["async_blocking"].append(time.perf_counter() - t)
            asyn.wait()
            times["async_total"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["torch_save"]
    report = {"state_mb": round(size_mb, 1), "repeats": repeats, "median_s": {k: round(v, 4) for k, v in med.items()},
              "ratio_to_torch_save": {k: round(v / base, 3) for k, v in med.items()}}
    print(json.dumps(report, indent=2))
    if out:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    return None


if __name__ == "__main__":
    fire.Fire(main)

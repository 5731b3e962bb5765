"""raw_ddp.py's loop converted with README's "Your own script" lines, every feature of the step
boundary on: checkpoints every 100 steps, sync checks every 100, preemption agreement every 10,
a metrics record with per-rank times every 50, the hang watchdog, fail-fast. Same work, seed and
global batch as raw_ddp.py (the data order differs: ddp_kit shards with its own sampler).
Run under torchrun; writes one JSON line of timings to --out.
"""
import json
import math
import os
import resource
import time

import fire
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ddp_kit
from ddp_kit.datasets import build_dataset
from ddp_kit.models import build_model
from ddp_kit.reliability.sync_checks import param_sha256


def main(out: str, steps: int = 300, batch_size: int = 128, lr: float = 3e-3, seed: int = 0, size: int = 4096):
    run = ddp_kit.init(run_dir=os.path.join(os.path.dirname(out), f"run_{os.path.basename(out)}"), seed=seed,
                       ckpt_every=100, sync_check_every=100, log_every=50, preempt_check_every=10)
    torch.manual_seed(seed + run.rank)
    spec = build_dataset("synthetic", seed=seed, synthetic_size=size)
    model = build_model("mlp", spec.input_shape, spec.num_classes, seed=seed)
    loader = DataLoader(spec.train, batch_size=batch_size, shuffle=True, drop_last=True)
    model, loader = run.prepare(model, loader)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    run.resume(optimizer=opt, scheduler=sched)
    ends, step = [], 0
    while step < steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step = run.step(loss)
            ends.append(time.perf_counter())
            if step == 1:
                first_wall = time.time()
            if step == steps:
                break
    if run.is_main:
        with open(out, "w") as f:
            json.dump({"ends": ends, "first_step_after_launch_s": first_wall - float(os.environ["BENCH_LAUNCH_T"]),
                       "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                       "param_sha256": param_sha256(run.unwrap(model))}, f)


if __name__ == "__main__":
    fire.Fire(main)

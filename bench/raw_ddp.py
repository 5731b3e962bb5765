"""Baseline: a hand-written DDP training loop in the style of the PyTorch DDP tutorial.

Same model, data, seed and global batch as ddp_kit's job (it borrows ddp_kit's dataset and model
builders, nothing of its loop), and by default the same threads per rank and malloc thresholds.
Run under torchrun; writes one JSON line of timings to --out.
"""
import math
import os
import resource
import time

import fire
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddp_kit.datasets import build_dataset
from ddp_kit.models import build_model
from ddp_kit.reliability.sync_checks import param_sha256


def main(out: str, steps: int = 300, batch_size: int = 128, lr: float = 3e-3, seed: int = 0, size: int = 4096,
         same_settings: bool = True):
    """`same_settings`: the threads per rank and glibc malloc thresholds ddp_kit sets at init (its
    apply_cpu_settings, nothing else of it), so that a comparison is of the loops alone."""
    if same_settings:
        from ddp_kit.dist.resources import apply_cpu_settings
        from ddp_kit.env import detect

        apply_cpu_settings(detect(), torch.device("cpu"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed + rank)
    spec = build_dataset("synthetic", seed=seed, synthetic_size=size)
    sampler = DistributedSampler(spec.train, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(spec.train, batch_size=batch_size // world, sampler=sampler, drop_last=True)
    model = build_model("mlp", spec.input_shape, spec.num_classes, seed=seed)
    if world > 1:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    ends, faults, stimes, utimes, step, epoch = [], [], [], [], 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            loss.item()
            step += 1
            ends.append(time.perf_counter())
            ru = resource.getrusage(resource.RUSAGE_SELF)  # ~1 us; page faults and CPU time per step
            faults.append(ru.ru_minflt)
            stimes.append(ru.ru_stime)
            utimes.append(ru.ru_utime)
            if step == 1:
                first_wall = time.time()
            if step == steps:
                break
        epoch += 1
    sha = param_sha256(model.module if world > 1 else model)
    if rank == 0:
        import json

        with open(out, "w") as f:
            json.dump({"ends": ends, "first_step_after_launch_s": first_wall - float(os.environ["BENCH_LAUNCH_T"]),
                       "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "param_sha256": sha,
                       "minflt": faults, "stime": stimes, "utime": utimes}, f)
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    fire.Fire(main)

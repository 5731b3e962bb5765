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
         same_settings: bool = True, device: str = "cpu"):
    """`same_settings`: the threads per rank and glibc malloc thresholds ddp_kit sets at init (its
    apply_cpu_settings, nothing else of it), so that a comparison is of the loops alone.
    `device` cuda: one GPU per rank (LOCAL_RANK), NCCL, and what ddp_kit's job does there too: TF32
    and cuDNN autotuning on, a fused AdamW, the loss read at every 50th step only (no sync per step)."""
    dev = torch.device("cpu")
    if device == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.benchmark = True
    if same_settings:
        from ddp_kit.dist.resources import apply_cpu_settings
        from ddp_kit.env import detect

        apply_cpu_settings(detect(), dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed + rank)
    spec = build_dataset("synthetic", seed=seed, synthetic_size=size)
    sampler = DistributedSampler(spec.train, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(spec.train, batch_size=batch_size // world, sampler=sampler, drop_last=True)
    model = build_model("mlp", spec.input_shape, spec.num_classes, seed=seed).to(dev)
    if world > 1:
        model = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, **({"fused": True} if dev.type == "cuda" else {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    ends, faults, stimes, utimes, step, epoch = [], [], [], [], 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if dev.type == "cpu" or step % 50 == 0:  # on a GPU a read is a sync: at log steps only
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

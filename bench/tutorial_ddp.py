"""The PyTorch DDP tutorial's loop, as a user would write it: a DataLoader over a TensorDataset with a
DistributedSampler, batch 64 per rank, the reference MLP on synthetic 3x32x32 data, AdamW with a cosine
LambdaLR, the loss printed every 50 steps. The held-out comparison of bench/tutorial_cost.py (issue 48).

Beside bench/raw_ddp.py (the project's own raw loop, which reads the loss and the rusage every step):
this one has no per-step instrumentation, since tutorial_cost.py counts time from outside, by the
difference between a short and a long run. It borrows from ddp_kit only the data and model builders
(the same samples and the same initial weights) and apply_cpu_settings (the same threads per rank and
glibc malloc thresholds as the job). Run under torchrun.
"""
import math

import fire
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_kit.datasets import build_dataset
from ddp_kit.dist.resources import apply_cpu_settings
from ddp_kit.env import detect
from ddp_kit.models import build_model


def main(steps: int = 500, batch_size: int = 64, lr: float = 3e-3, seed: int = 0, size: int = 4096, log_every: int = 50):
    """`batch_size` is per rank, as in the tutorial."""
    apply_cpu_settings(detect(), torch.device("cpu"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(seed + rank)
    spec = build_dataset("synthetic", seed=seed, synthetic_size=size)
    train = TensorDataset(*spec.train.tensors)
    sampler = DistributedSampler(train, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(train, batch_size=batch_size, sampler=sampler, drop_last=True)
    model = DDP(build_model("mlp", spec.input_shape, spec.num_classes, seed=seed))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % log_every == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step == steps:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    fire.Fire(main)

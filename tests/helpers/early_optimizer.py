"""Under torchrun: the optimizer is made before run.prepare(model, strategy=argv[2]), so under FSDP it
holds none of the sharded parameters. argv: run_dir strategy where (resume: passed to run.resume;
step: only passed to run.prepare, found at the first step)."""
import sys

import torch
from torch import nn

import ddp_kit

run_dir, strategy, where = sys.argv[1:4]
with ddp_kit.init(run_dir=run_dir, ckpt_every=0) as run:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if where == "resume":
        model = run.prepare(model, strategy=strategy)
        run.resume(optimizer=opt)
    else:
        model, opt = run.prepare(model, opt, strategy=strategy)
    for step in range(3):
        model(torch.randn(4, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        run.step()
        print(f"rank {run.rank}: step {step + 1} done", flush=True)

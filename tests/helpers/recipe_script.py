"""A user's own script rerun with another lr. argv: run_dir lr with_config(0|1) steps. With a
config, ddp_kit.init(config={"lr": ..., "max_steps": ...}) is checked against the checkpoint's as the
reference job's is; without one, the resume line names the optimizer settings that differ."""
import sys

import torch
from torch import nn

import ddp_kit

run_dir, lr, with_config, steps = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
config = {"lr": lr, "max_steps": steps} if with_config else None
with ddp_kit.init(run_dir=run_dir, config=config) as run:
    model = run.prepare(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    start = run.resume(optimizer=opt, scheduler=sched)
    for _ in range(int(start), steps):
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        run.step()
    run.print(f"trained to step {run.steps_done}")

"""A user's script whose LR scheduler raises at step 2 (after optimizer.step()): the error line must
name the phase it was raised in, not forward/backward."""
import torch
from torch import nn

import ddp_kit


class Broken(torch.optim.lr_scheduler.LambdaLR):
    def step(self, *args, **kwargs):
        if self.last_epoch >= 1:
            raise RuntimeError("scheduler broke")
        super().step(*args, **kwargs)


with ddp_kit.init() as run:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = Broken(opt, lambda s: 1.0)
    model, opt = run.prepare(model, opt)  # the optimizer is watched: its steps mark the phases
    for _ in range(3):
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        run.step()

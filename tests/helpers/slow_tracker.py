"""A user's script with a tracker of its own (one module plus one registry line, trackers/__init__.py) whose
close takes 120 s: a tracking server that stopped answering as the pod is evicted.

    DDP_KIT_GRACE_PERIOD_S=8 python slow_tracker.py RUN_DIR    (then SIGTERM it)

Prints "ready" once training runs."""
import sys
import time

import torch
import torch.nn.functional as F

import ddp_kit
from ddp_kit.trackers import TRACKERS
from ddp_kit.trackers.base import Tracker


class Slow(Tracker):
    package = "json"  # installed everywhere: the tool this tracker "needs"

    def open(self, opening):
        self.location = "http://tracker.example:5000"
        return "run-1"

    def log(self, step, scalars, wall_time):
        pass

    def close(self, exit_code):
        time.sleep(120)


TRACKER = Slow
TRACKERS["slow"] = __name__ if __name__ != "__main__" else "slow_tracker"
sys.modules.setdefault("slow_tracker", sys.modules[__name__])

run = ddp_kit.init(run_dir=sys.argv[1], trackers=["slow"], ckpt_every=1000, log_every=2)
model = run.prepare(torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run.resume(optimizer=optimizer)
for i in range(100000):
    loss = F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 2))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    run.step(loss)
    if i == 5:
        print("ready", flush=True)
    time.sleep(0.01)

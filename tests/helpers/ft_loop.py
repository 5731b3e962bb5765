"""A plain loop under strategy ft for tests/parallel/test_ft.py, with two test hooks:

- busy: while RUN_DIR/busy exists, replica group 0 does not ask for its next quorum, as an
  evaluation or a synchronous checkpoint keeps it from doing (it says so in RUN_DIR/busy_since and
  stays alive for the watchdog), for at most 90 s;
- late (third argument): replica group 1, once restarted, starts only after group 0 has written its
  summary (finished the job), for at most 60 s;
- slow (third argument): replica group 2 asks for the quorums of steps 11 and 21 2.5 s after the
  others, as a slower evaluation (or a checkpoint of the script's own) makes a group late.

    python -m ddp_kit.launch ft --groups 2 --script tests/helpers/ft_loop.py -- RUN_DIR STEPS [late|slow]
"""
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_kit

run_dir, steps, mode = Path(sys.argv[1]), int(sys.argv[2]), (sys.argv[3:] or [""])[0]
group = int(os.environ.get("DDP_KIT_REPLICA_GROUP", "0"))
if mode == "late" and group == 1 and int(os.environ.get("DDP_KIT_GROUP_RESTARTS", "0")) > 0:
    end = time.monotonic() + 60
    while not (run_dir / "replica_0" / "summary.json").exists() and time.monotonic() < end:
        time.sleep(0.1)
torch.manual_seed(0)
data = TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
run = ddp_kit.init(run_dir=str(run_dir), log_every=5, ckpt_every=5)
model = nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, loader, optimizer = run.prepare(model, DataLoader(data, batch_size=24, shuffle=True), optimizer, strategy="ft")
run.resume()
while run.steps_done < steps:
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        run.step()
        time.sleep(0.04)
        if mode == "slow" and group == 2 and run.steps_done in (10, 20):
            time.sleep(2.5)
        busy = run_dir / "busy"
        if group == 0 and busy.exists():
            (run_dir / "busy_since").write_text(str(run.steps_done))
            end = time.monotonic() + 90
            while busy.exists() and time.monotonic() < end:
                run.heartbeat("eval")
                time.sleep(0.2)
        if run.steps_done >= steps:
            break

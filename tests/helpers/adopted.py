"""A script that creates the process group itself, as Ray Train or a framework does, then hands it
to ddp_kit.init(); run under torchrun.

    python adopted.py RUN_DIR [KILL_AT_STEP]

Trains a small MLP on the digits with a checkpoint every 5 steps; with KILL_AT_STEP, rank 1 SIGKILLs
itself at that step (the job fails; running the command again resumes, as Ray's restart of the
worker group does: a new group on a new store). Rank 0 writes RUN_DIR/final.json
(the weights' digest and whether the group outlived ddp_kit's Run); each rank then destroys the
group it made.
"""
import hashlib
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_kit

run_dir = Path(sys.argv[1])
kill_at = int(sys.argv[2]) if len(sys.argv) > 2 else 0
# The user's own group, on torchrun's variables (env://), before ddp_kit sees it.
tdist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
torch.manual_seed(0)
x, y = load_digits(return_X_y=True)
dataset = TensorDataset(torch.tensor(x[:640], dtype=torch.float32) / 16.0, torch.tensor(y[:640]))
run = ddp_kit.init(run_dir, ckpt_every=5, hang_timeout_s=60)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
model, loader = run.prepare(model, DataLoader(dataset, batch_size=32, shuffle=True))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
run.resume(optimizer=optimizer)
for _epoch in run.epochs(2):
    for data, target in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()
        if kill_at and run.steps_done + 1 == kill_at and tdist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
params = torch.cat([p.detach().flatten() for p in run.unwrap(model).parameters()])
digest = hashlib.sha256(params.numpy().tobytes()).hexdigest()
rank = tdist.get_rank()
run.close()
if rank == 0:
    (run_dir / "final.json").write_text(json.dumps({"sha": digest, "group_alive": tdist.is_initialized()}))
tdist.destroy_process_group()

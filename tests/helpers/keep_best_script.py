"""A user's loop with keep_best (tests/checkpoint/test_keep_best.py):

    python keep_best_script.py RUN_DIR STEPS rank0|every

A checkpoint every 2 steps, keep_last 1, keep_best 2 by val.score (min). Before each even step's boundary
(where its checkpoint is saved) the script reports val.score with run.log_event: on rank 0 only (rank0),
or on every rank, each its own value (every), from the tables below.
"""
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ddp_kit

RANK0 = {2: 5.0, 4: 1.0, 6: 4.0, 8: 4.5, 10: 6.0, 12: 7.0, 14: 2.0}
RANK1 = {2: -3.0, 4: 9.0, 6: 4.0, 8: 4.5}  # with RANK0, means of 1.0, 5.0, 4.0, 4.5

run_dir, steps, who = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
data = TensorDataset(torch.randn(512, 4), torch.randint(0, 2, (512,)))  # 32 steps an epoch: no epoch ends
run = ddp_kit.init(run_dir=run_dir, ckpt_every=2, keep_last=1, keep_best=2, monitor="val.score", mode="min",
                   log_every=0, sync_check_every=0)
model, loader = run.prepare(torch.nn.Linear(4, 2), DataLoader(data, batch_size=16))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run.resume(optimizer=optimizer)
table = RANK0 if run.rank == 0 else RANK1
for x, y in loader:
    upcoming = run.steps_done + 1
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if upcoming % 2 == 0 and (who == "every" or run.rank == 0):
        run.log_event({"event": "val", "step": upcoming, "score": table[upcoming]})
    if run.step(loss) >= steps:
        break
run.close()

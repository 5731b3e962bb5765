"""A user's epoch loop with work at both ends of each epoch, converted with README's lines:

    python epoch_script.py RUN_DIR explicit|implicit

- a per-epoch draw at the top of each epoch (it must not run twice around a resume);
- a per-epoch LR schedule after the last batch (a checkpoint must not fall before it);
- checkpoints every 8 steps = once per epoch, at the epoch's last step.
Writes RUN_DIR/final.pt (rank 0) with the final weights and the draws.
"""
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ddp_kit

run_dir, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 8), torch.randint(0, 3, (256,)))
run = ddp_kit.init(run_dir=run_dir, ckpt_every=8, log_every=4)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
model, loader = run.prepare(model, DataLoader(data, batch_size=32, shuffle=True))
optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
draws = []
run.resume(optimizer=optimizer, scheduler=scheduler)
for _epoch in run.epochs(4):
    scale = 1.0 + torch.rand(()).item()  # per-epoch randomness at the top of the epoch
    for x, y in loader:
        loss = F.cross_entropy(model(x * scale), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if mode == "explicit":
            run.step(loss)
    scheduler.step()
if run.is_main:
    torch.save(run.unwrap(model).state_dict(), f"{run_dir}/final.pt")

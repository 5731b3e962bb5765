"""examples/ddp.py on fault-tolerant replica groups: the same loop, with the optimizer handed to
run.prepare (strategy ft decides at each step whether it counts) and a run folder for the groups'
checkpoints and metrics. Launch it with

    python -m ddp_kit.launch ft --groups 2 --nproc_per_node 1 --script examples/ft/train_ft.py -- runs/ft 20

and SIGKILL a worker of one group: the other trains on, the killed group is restarted and takes
the weights, optimizer state and data position live from it.
"""
import sys

import ddp_kit
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

run_dir, epochs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
torch.manual_seed(0)
x, y = load_digits(return_X_y=True)
dataset = TensorDataset(torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y))
run = ddp_kit.init(run_dir=run_dir, log_every=5)
device = run.device
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
train_loader = DataLoader(dataset, batch_size=64, shuffle=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, train_loader, optimizer = run.prepare(model, train_loader, optimizer, strategy="ft")
run.resume()

for epoch in run.epochs(epochs):
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
    run.print(f"epoch {epoch} loss {loss.item():.4f}")

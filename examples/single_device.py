"""A typical single-device PyTorch training script, in the style of pytorch/examples' MNIST.

Runs on scikit-learn's bundled digits so that it needs no download. `ddp.py` beside it is the
same script after the ddp_kit changes; `diff single_device.py ddp.py` shows them.
"""
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
x, y = load_digits(return_X_y=True)
dataset = TensorDataset(torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y))
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
train_loader = DataLoader(dataset, batch_size=64, shuffle=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

for epoch in range(10):
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
    print(f"epoch {epoch} loss {loss.item():.4f}")

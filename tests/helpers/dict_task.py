"""A user's task module for `python -m ddp_kit.train --model m:f --dataset m:g --loss m:h`:
dict batches, a regression loss with its own metric. Tests copy it into their working directory."""
import torch
from torch import nn
from torch.utils.data import Dataset


class Pairs(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "target": self.y[i]}


def data(n=512, dim=8):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n + n // 4, dim, generator=g)
    y = x @ torch.randn(dim, 1, generator=g)
    return Pairs(x[:n], y[:n]), Pairs(x[n:], y[n:])


class Regressor(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, features):
        return self.net(features)


def model(dim=8, hidden=16):
    return Regressor(dim, hidden)


def loss(model, batch):
    pred = model(batch["features"])
    return nn.functional.mse_loss(pred, batch["target"]), {"mae": (pred - batch["target"]).abs().mean()}


def not_a_model():
    return "a string"

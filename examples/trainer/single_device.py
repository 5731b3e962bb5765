"""A Trainer-class single-device script, in the manner of the PyTorch DDP tutorial series:
`_run_batch`, `_run_epoch`, a snapshot saved every few epochs and loaded at start.

It fits a linear regression on generated data, so it needs no download. `ddp.py` beside it is
the same script after the ddp_kit changes: `diff single_device.py ddp.py` shows them.
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

SNAPSHOT = "snapshot.pt"


class Trainer:
    def __init__(self, model, train_data, optimizer, device, save_every):
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        if os.path.exists(SNAPSHOT):
            self._load_snapshot()

    def _load_snapshot(self):
        snapshot = torch.load(SNAPSHOT, map_location=self.device)
        self.model.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.epochs_run = snapshot["epochs_run"]
        print(f"resuming from the snapshot at epoch {self.epochs_run}")

    def _save_snapshot(self, epoch):
        snapshot = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "epochs_run": epoch + 1}
        torch.save(snapshot, SNAPSHOT)
        print(f"epoch {epoch}: snapshot saved to {SNAPSHOT}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss

    def _run_epoch(self, epoch):
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            loss = self._run_batch(source, targets)
        print(f"epoch {epoch}: {len(self.train_data)} batches, last loss {loss.item():.5f}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 20, generator=generator)
    y = x @ torch.randn(20, 1, generator=generator) + 0.1 * torch.randn(2048, 1, generator=generator)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    return TensorDataset(x, y), model, optimizer


def main(total_epochs, save_every, batch_size):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dataset, model, optimizer = load_train_objs()
    train_data = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    trainer = Trainer(model, train_data, optimizer, device, save_every)
    trainer.train(total_epochs)


if __name__ == "__main__":
    epochs, every, batch = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (8, 1, 32)
    main(epochs, every, batch)

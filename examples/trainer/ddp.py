"""`single_device.py` after the ddp_kit changes (`diff single_device.py ddp.py`): the same Trainer
on 1..N ranks. ddp_kit's checkpoints replace the snapshot: atomic, with the optimizer, the data
position and every rank's RNG, so a resumed run continues mid-epoch exactly.

    python ddp.py                                            # one process
    torchrun --standalone --nproc_per_node=2 ddp.py          # two ranks; rerun to resume
"""
import sys

import ddp_kit
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

class Trainer:
    def __init__(self, model, train_data, optimizer, run, save_every):
        self.run, self.device = run, run.device
        self.model, self.train_data = run.prepare(model.to(self.device), train_data)
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = run.resume(optimizer=optimizer).epoch

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
                self.run.save()


def load_train_objs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 20, generator=generator)
    y = x @ torch.randn(20, 1, generator=generator) + 0.1 * torch.randn(2048, 1, generator=generator)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    return TensorDataset(x, y), model, optimizer


def main(total_epochs, save_every, batch_size):
    run = ddp_kit.init(run_dir="runs/trainer")
    dataset, model, optimizer = load_train_objs()
    train_data = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    trainer = Trainer(model, train_data, optimizer, run, save_every)
    trainer.train(total_epochs)


if __name__ == "__main__":
    epochs, every, batch = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (8, 1, 32)
    main(epochs, every, batch)

"""Under torchrun: record which sample indices each rank sees, per epoch, for training and eval."""
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import ddp_kit

out = Path(sys.argv[1])
n_train, n_test, batch = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
run = ddp_kit.init()
train = TensorDataset(torch.arange(n_train))
test = TensorDataset(torch.arange(n_test))
loader = run.train_loader(torch.utils.data.DataLoader(train, batch_size=batch, shuffle=True))
epochs = [[int(i) for (b,) in loader for i in b] for _ in range(2)]  # iterating twice = two epochs
ev = [int(i) for (b,) in run.eval_loader(torch.utils.data.DataLoader(test, batch_size=7)) for i in b]
count = run.sum(len(ev))[0]
(out / f"rank{run.rank}.json").write_text(json.dumps({"epochs": epochs, "eval": ev, "eval_count": count}))
run.close()

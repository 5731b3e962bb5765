"""Under torchrun, 2 ranks: run.eval_loader before run.prepare(model, strategy="fsdp") must be
refused in one line: its batches were split for DDP (17 and 16 samples: 5 and 4 batches of 4), and
rank 1 would finish its evaluation while rank 0 waits in an all-gather. argv: run_dir."""
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_kit

data = TensorDataset(torch.randn(33, 4), torch.randint(0, 2, (33,)))
with ddp_kit.init(run_dir=sys.argv[1]) as run:
    test = run.eval_loader(DataLoader(data, batch_size=4))
    model = run.prepare(nn.Linear(4, 2), strategy="fsdp")
    with torch.no_grad():
        calls = sum(1 for x, _ in test if model(x) is not None)
    print(f"rank {run.rank}: {calls} eval forwards (the refusal did not happen)")

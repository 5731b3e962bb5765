"""Under torchrun, 2 ranks: run.eval_loader before run.prepare(model, strategy="fsdp") is refused in
one line (its batches were split for DDP: unequal counts per rank would hang FSDP's all-gathers);
the other order works. argv: run_dir, order ("eval_first" or "model_first")."""
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_kit

data = TensorDataset(torch.randn(33, 4), torch.randint(0, 2, (33,)))  # 17 + 16: 5 and 4 batches of 4
with ddp_kit.init(run_dir=sys.argv[1]) as run:
    loader = DataLoader(data, batch_size=4)
    if sys.argv[2] == "eval_first":
        test = run.eval_loader(loader)
        model = run.prepare(nn.Linear(4, 2), strategy="fsdp")
    else:
        model = run.prepare(nn.Linear(4, 2), strategy="fsdp")
        test = run.eval_loader(loader)
    with torch.no_grad():
        calls = sum(1 for x, _ in test if model(x) is not None)
    print(f"rank {run.rank}: {calls} eval forwards")

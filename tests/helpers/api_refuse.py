"""Make a mistake that ddp_kit refuses, as a user's script would (plain, or under torchrun).

    python api_refuse.py iterable|weighted|init_option|init_twice|prepare_twice
"""
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

import ddp_kit


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(100))


case = sys.argv[1]
if case == "init_option":
    run = ddp_kit.init(strategy="fsdp")  # Fabric-style: the strategy belongs to run.prepare here
run = ddp_kit.init()
if case == "init_twice":
    run = ddp_kit.init()
elif case == "prepare_twice":
    model = run.prepare(nn.Linear(4, 2))
    model = run.prepare(model)
elif case == "iterable":
    run.prepare(DataLoader(Stream(), batch_size=8))
else:
    ds = TensorDataset(torch.arange(100))
    run.prepare(DataLoader(ds, batch_size=8, sampler=WeightedRandomSampler(torch.ones(100), 100)))
print("NOT REFUSED", flush=True)

"""Prepare a loader that ddp_kit refuses, as a user's script would (plain, or under torchrun).

    python api_refuse.py iterable|weighted
"""
import sys

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

import ddp_kit


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(100))


run = ddp_kit.init()
if sys.argv[1] == "iterable":
    loader = DataLoader(Stream(), batch_size=8)
else:
    ds = TensorDataset(torch.arange(100))
    loader = DataLoader(ds, batch_size=8, sampler=WeightedRandomSampler(torch.ones(100), 100))
loader = run.prepare(loader)
print("NOT REFUSED", flush=True)

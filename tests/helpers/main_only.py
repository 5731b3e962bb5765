"""Under torchrun: rank 0 calls a collective inside main_only(); it must raise at once. Then the same
for the forward of an FSDP model, whose all-gather is torch's own call, not the user's."""
import sys
import time

import torch
import torch.distributed as tdist
from torch import nn

import ddp_kit
from ddp_kit.reliability.sync_checks import CollectiveInMainOnly, main_only


def rank0_only(what, fn):
    t0 = time.monotonic()
    with main_only(run.ctx) as main:
        if main:
            try:
                fn()
            except CollectiveInMainOnly as exc:
                print(f"{what}: raised after {time.monotonic() - t0:.3f}s: {exc}", flush=True)
            else:
                print(f"{what}: NOT RAISED", flush=True)


run = ddp_kit.init(timeout_s=60)
rank0_only("all_reduce", lambda: tdist.all_reduce(torch.ones(1)))
run.barrier()  # the collective did not run, so the ranks are still in step
tdist.all_reduce(torch.ones(1))  # and collectives work again outside the guard
model = run.prepare(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), strategy="fsdp")
rank0_only("fsdp forward", lambda: model(torch.ones(1, 4)))
run.barrier()
run.close()
sys.exit(0)

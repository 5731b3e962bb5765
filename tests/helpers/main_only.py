"""Under torchrun: rank 0 calls a collective inside main_only(); it must raise at once."""
import sys
import time

import torch
import torch.distributed as tdist

import ddp_kit
from ddp_kit.sync import CollectiveInMainOnly, main_only

run = ddp_kit.init(timeout_s=60)
t0 = time.monotonic()
with main_only(run.ctx) as main:
    if main:
        try:
            tdist.all_reduce(torch.ones(1))
        except CollectiveInMainOnly as exc:
            print(f"raised after {time.monotonic() - t0:.3f}s: {exc}", flush=True)
        else:
            print("NOT RAISED", flush=True)
run.barrier()  # the collective did not run, so the ranks are still in step
tdist.all_reduce(torch.ones(1))  # and collectives work again outside the guard
run.close()
sys.exit(0)

"""Under torchrun (gloo, CPU): `run.load_weights(model, FILE)` into the built-in mlp prepared with
STRATEGY, each rank starting from other random weights. Rank 0 checks the gathered weights against the
file; every rank checks its outputs against a plain model loaded from it, and prints one line.

    torchrun --nproc_per_node=2 tests/helpers/load_weights.py FILE STRATEGY RUN_DIR
"""
import sys

import torch

import ddp_kit
from ddp_kit.checkpoint import read_weights
from ddp_kit.models import REGISTRY

path, strategy, run_dir = sys.argv[1:4]
run = ddp_kit.init(run_dir=run_dir, device="cpu", resume="never", log_every=0, sync_check_every=0)
torch.manual_seed(100 + run.rank)
model = run.prepare(REGISTRY["mlp"]((1, 8, 8), 10), strategy=strategy)
head = run.load_weights(model, path)
state, _ = read_weights(path)
full = run.full_state_dict(model)
if run.is_main and not (full.keys() == state.keys() and all(torch.equal(full[k], state[k]) for k in state)):
    raise SystemExit("rank 0: the gathered weights are not the file's")
plain = REGISTRY["mlp"]((1, 8, 8), 10)
plain.load_state_dict(state)
x = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(run.rank))
with torch.no_grad():
    if not torch.equal(model(x), plain(x)):
        raise SystemExit(f"rank {run.rank}: outputs differ from the file's model")
print(f"rank {run.rank} loaded: same weights, same outputs (step {head['step']}, strategy {head['strategy']})", flush=True)
run.close()

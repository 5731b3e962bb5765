"""Under torchrun (gloo, CPU), 2 ranks: what the sync check compares under FSDP, and the plain
state_dict gathered from the shards (rank 0 saves it to <out_dir>/full.pt, beside the weights the
model had before sharding, <out_dir>/before.pt).

A sharded parameter has one owner per shard and is not compared; a buffer (replicated) and the
optimizer's step count are. Each rank writes <out_dir>/rank<R>.json with the verdict of each case."""
import json
import sys
from pathlib import Path

import torch
from torch import nn

from ddp_kit.dist import distributed
from ddp_kit.errors import UserError
from ddp_kit.parallel.fsdp import full_state_dict
from ddp_kit.parallel.wrap import sync_gradients, wrap_model
from ddp_kit.reliability.sync_checks import check_consistency, optimizer_steps


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * self.scale


def verdict(ctx, model, opt):
    try:
        return check_consistency(ctx, model, 1, extra=optimizer_steps({"optimizer": opt})) or "same"
    except UserError as err:
        return str(err)


with distributed() as ctx:
    torch.manual_seed(0)
    plain = Net()
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    model = wrap_model(plain, ctx, strategy="fsdp")
    full = full_state_dict(model, keep=ctx.rank == 0)
    if ctx.rank == 0:
        torch.save(full, Path(sys.argv[1], "full.pt"))
        torch.save(before, Path(sys.argv[1], "before.pt"))
    elif full:
        raise SystemExit(f"rank {ctx.rank} kept a copy: {list(full)}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    out = {"clean": verdict(ctx, model, opt)}
    with torch.no_grad():
        if ctx.rank == 1:
            model.a.weight.to_local().add_(1.0)  # its own shard: nobody else holds it
    out["own_shard_changed"] = verdict(ctx, model, opt)
    if ctx.rank == 1:
        model.scale.add_(1.0)
    out["buffer_changed"] = verdict(ctx, model, opt)
    if ctx.rank == 1:
        model.scale.sub_(1.0)
        for state in opt.state.values():
            state["step"] += 1
    out["optimizer_step_changed"] = verdict(ctx, model, opt)
    # Accumulation as a user writes it: run.accumulate on the first micro-step only, the last one bare.
    opt.zero_grad(set_to_none=True)
    with sync_gradients(model, False):
        model(torch.randn(3, 4)).sum().backward()
    model(torch.randn(3, 4)).sum().backward()
    out["accumulated_grads_reduced"] = all(p.grad is not None for p in model.parameters())
    Path(sys.argv[1], f"rank{ctx.rank}.json").write_text(json.dumps(out))

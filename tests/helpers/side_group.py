"""Under torchrun (gloo, CPU): ddp_kit's control collectives on a CPU side group of their own.

On a GPU the side group is what keeps control traffic off the device (the default group is NCCL
there; NCCL cannot exist on this machine, so the side group is forced on beside a gloo default
group). Every torch.distributed call the control-plane helpers make is recorded with its group;
each rank writes <out_dir>/rank<R>.json: the calls, and whether each went to the side group (a file,
not stdout: two ranks' long lines on one pipe can interleave)."""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

from ddp_kit.dist import distributed
from ddp_kit.dist.collectives import all_reduce_sum, all_same, all_true, barrier, broadcast_object, gather_object
from ddp_kit.errors import UserError
from ddp_kit.reliability.metrics import StepTimer, gather_ranks
from ddp_kit.reliability.numerics import NonFiniteLoss
from ddp_kit.reliability.preemption import PreemptFlag, agree_stop
from ddp_kit.reliability.sync_checks import check_agreement, check_consistency

calls = []


def record(name):
    inner = getattr(tdist, name)

    def call(*args, **kwargs):
        calls.append((name, kwargs.get("group")))
        return inner(*args, **kwargs)
    setattr(tdist, name, call)


for name in ("all_reduce", "broadcast", "barrier", "gather_object", "all_gather_object", "broadcast_object_list"):
    record(name)

with distributed(side_group=True) as ctx:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    calls.clear()
    all_same(ctx, b"same")
    all_true(ctx, True)
    all_reduce_sum(ctx, [1.0])
    gather_object(ctx, ctx.rank)
    broadcast_object(ctx, "x")
    barrier(ctx)
    agree_stop(ctx, PreemptFlag(ctx.rank), False)
    NonFiniteLoss().check(ctx)
    timer = StepTimer()
    timer.mark("forward")
    timer.steps = 1
    gather_ranks(ctx, timer.window(), 4)
    check_agreement(ctx, {"seed": 0})
    check_consistency(ctx, model, 1)
    if ctx.rank == 1:  # the divergence path: rank 0's table goes out, the names come back
        with torch.no_grad():
            model.weight.add_(1.0)
    try:
        check_consistency(ctx, model, 2)
        diverged = None
    except UserError as err:
        diverged = err.message
    Path(sys.argv[1], f"rank{ctx.rank}.json").write_text(json.dumps(
        {"rank": ctx.rank, "side": ctx.control_group is not None, "diverged": diverged,
         "calls": [[n, g is not None and g is ctx.control_group] for n, g in calls]}))

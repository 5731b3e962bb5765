"""Under torchrun: model calls on one rank alone. argv: mode [run_dir].

local   (2 ranks) a DDP model with BatchNorm is trained a step, then called inside main_only(): the
        forward runs on rank 0's own module at once (no buffer broadcast to ranks that are not there);
        an FSDP model's run.full_state_dict and a DTensor's full_tensor inside main_only() raise at once.
empty   (3 ranks, 2 test samples) exact eval through run.eval_loader with the DDP-wrapped BatchNorm
        model: the rank with an empty shard calls no forward and nobody waits; every rank evaluates
        rank 0's buffers.
saved   (2 ranks) ranks train on very different data (their BatchNorm statistics differ widely), then
        evaluate through run.eval_loader with the unwrapped module (as the reference job and many
        scripts do: no DDP forward, so DDP's own buffer broadcast never runs): the output printed is the one the final
        checkpoint's model.pt gives (the test recomputes it in one process).
save    (2 ranks) the script saves model.state_dict() of the wrapped model itself, on every rank, twice:
        one warning, printed once.
stall   (2 ranks) rank 0 sleeps inside main_only() past hang_timeout_s: the hang report names it.
local+save  (2 ranks) local's, then save's, in one launch (one run per process; each test reads its own lines).
"""
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_kit
from ddp_kit.errors import UserError
from ddp_kit.reliability.sync_checks import CollectiveInMainOnly

mode = sys.argv[1]


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def train_one_step(run, model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4) + run.rank  # different batches: each rank's running statistics differ
    model(x).sum().backward()
    opt.step()
    run.step()


def timed(what, fn):
    t0 = time.monotonic()
    try:
        out = fn()
    except (CollectiveInMainOnly, UserError) as exc:
        said = exc.line() if isinstance(exc, UserError) else exc  # a UserError as the user reads it, with its hint
        print(f"{what}: raised after {time.monotonic() - t0:.3f}s: {said}", flush=True)
        return None
    print(f"{what}: returned after {time.monotonic() - t0:.3f}s", flush=True)
    return out


def save_wrapped(run, out):
    """save: the wrapped model's state_dict saved by the script itself, on every rank, twice."""
    model = run.prepare(bn_model())
    for _ in range(2):
        torch.save(model.state_dict(), f"{out}/rank{run.rank}.pt")
    run.print(f"keys: {sorted(model.state_dict())[:1]}")


if mode in ("local", "local+save"):  # local+save: both in one launch (one run per process)
    run = ddp_kit.init(timeout_s=60, hang_timeout_s=30)
    model = run.prepare(bn_model())
    train_one_step(run, model)
    x = torch.ones(3, 4)
    with run.main_only() as main:
        if main:
            model.eval()
            with torch.no_grad():
                out = timed("ddp forward", lambda: model(x))
                same = torch.equal(out, run.unwrap(model)(x))
            print(f"ddp forward is the module's own: {same}", flush=True)
    run.barrier()
    sharded = run.prepare(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), strategy="fsdp")
    with run.main_only() as main:
        if main:
            timed("full_state_dict", lambda: run.full_state_dict(sharded))
            weight = next(sharded.parameters())
            timed("full_tensor", lambda: weight.full_tensor())
    run.barrier()
    whole = run.full_state_dict(sharded)  # outside the block, on every rank: it works
    print(f"rank {run.rank}: full_state_dict outside main_only has {len(whole)} entries", flush=True)
    if mode == "local+save":
        save_wrapped(run, sys.argv[2])
    run.close()
elif mode == "empty":
    run = ddp_kit.init(timeout_s=60, hang_timeout_s=30)
    model = run.prepare(bn_model())
    train_one_step(run, model)
    test = run.eval_loader(DataLoader(TensorDataset(torch.randn(2, 4)), batch_size=4))
    model.eval()
    n = 0
    t0 = time.monotonic()
    with torch.no_grad():
        for (x,) in test:
            model(x)
            n += len(x)
    stats = run.gather([round(float(b.double().sum()), 12) for b in run.unwrap(model).buffers()
                        if b.is_floating_point()])
    print(f"rank {run.rank}: {n} eval samples in {time.monotonic() - t0:.3f}s; buffers agree: "
          f"{all(s == stats[0] for s in stats)}", flush=True)
    run.close()
elif mode == "saved":
    run = ddp_kit.init(run_dir=sys.argv[2], timeout_s=60, hang_timeout_s=30)
    model = run.prepare(bn_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run.resume(optimizer=opt)
    g = torch.Generator().manual_seed(100 + run.rank)
    for _ in range(5):
        x = torch.randn(8, 4, generator=g) * (1 + 4 * run.rank) + 3 * run.rank
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        run.step()
    data = TensorDataset(torch.randn(10, 4, generator=torch.Generator().manual_seed(5)))
    total = 0.0
    model.eval()
    with torch.no_grad():
        for (x,) in run.eval_loader(DataLoader(data, batch_size=4)):
            total += float(run.unwrap(model)(x).double().sum())
    (total,) = run.sum(total)
    run.print(f"eval output sum: {total!r}")
    run.close()
elif mode == "save":
    run = ddp_kit.init(timeout_s=60)
    save_wrapped(run, sys.argv[2])
    run.close()
elif mode == "stall":
    run = ddp_kit.init(run_dir=sys.argv[2], timeout_s=60, hang_timeout_s=6, peer_timeout_s=0)
    model = run.prepare(bn_model())
    train_one_step(run, model)
    with run.main_only() as main:
        if main:
            time.sleep(120)  # rank-0-only work that takes too long: the others wait at the barrier
    run.barrier()
    run.close()

"""One rank of the control-plane simulation (run by bench/control_plane.py under torchrun).

A tiny model trained through the public API with every control-plane feature on, and counters
installed before `ddp_kit.init` on the two channels ddp_kit's own traffic uses:
- collectives (`torch.distributed.all_reduce`, `broadcast`, `gather_object`, ...): payload bytes this
  rank hands in (sent) and gets back (received), and the wall time of each call;
- the rendezvous store (`Store.set/get/check/wait/...`): operations and key+value bytes.
Each call is booked to the ddp_kit operation that issued it, found on the Python stack (the sync
check, the preemption agreement, the rank metrics, the checkpoint commit, the watchdog's poll, ...),
so the numbers come from the real code paths, not from a model of them. DDP's own gradient
all-reduce happens in C++ and is not counted: it is the data plane.

Writes one JSON file per rank to --out_dir.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time
from collections import defaultdict

import fire
import torch
import torch.distributed as tdist

# ddp_kit function (qualified name; the innermost match on the stack wins) -> the operation it belongs to
OPS = {
    "prepare_run_dir": "run dir check",
    "check_agreement": "startup agreement",
    "check_consistency": "sync check",
    "agree_stop": "preemption agreement",
    "NonFiniteLoss.check": "NaN guard",
    "gather_ranks": "rank metrics",
    "Checkpointer._commit_files": "checkpoint commit",
    "Watchdog._tick": "watchdog poll",
    "peer_failure": "fail-fast poll",
    "all_reduce_sum": "log values",
}
COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "gather_object",
               "broadcast_object_list", "gather", "reduce", "scatter")
STORE_OPS = ("set", "get", "check", "wait", "add", "compare_set", "multi_get", "multi_set", "delete_key")

_lock = threading.Lock()
stats: dict = defaultdict(lambda: {"calls": 0, "sent": 0, "received": 0, "seconds": [], "store_ops": 0, "store_bytes": 0})


def _op() -> str | None:
    f = sys._getframe(2)
    while f is not None:
        op = OPS.get(f.f_code.co_qualname)
        if op and "ddp_kit" in f.f_code.co_filename:
            return op
        f = f.f_back
    return None


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return len(pickle.dumps(x)) if x is not None else 0


def _count_collective(name, fn):
    def wrapped(*args, **kwargs):
        op = _op()
        if op is None:
            return fn(*args, **kwargs)
        rank = tdist.get_rank()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        dt = time.perf_counter() - t0
        sent = received = 0
        if name in ("all_reduce", "reduce"):
            sent = received = _nbytes(args[0])
        elif name == "broadcast":
            src = kwargs.get("src", args[1] if len(args) > 1 else 0)
            sent, received = (_nbytes(args[0]), 0) if rank == src else (0, _nbytes(args[0]))
        elif name == "broadcast_object_list":
            src = kwargs.get("src", args[1] if len(args) > 1 else 0)
            n = _nbytes(list(args[0]))
            sent, received = (n, 0) if rank == src else (0, n)
        elif name in ("gather_object", "gather"):
            sent = _nbytes(args[0])
            gathered = kwargs.get("object_gather_list", args[1] if len(args) > 1 else None)
            received = _nbytes(list(gathered)) if gathered else 0
        elif name in ("all_gather_object", "all_gather"):
            sent, received = _nbytes(args[1]), _nbytes(list(args[0]))
        with _lock:
            s = stats[op]
            s["calls"] += 1
            s["sent"] += sent
            s["received"] += received
            s["seconds"].append(dt)
        return out
    return wrapped


def _count_store(name, fn):
    def wrapped(self, *args, **kwargs):
        op = _op() or "other store"
        n = sum(len(a) if isinstance(a, (str, bytes)) else sum(len(k) for k in a) if isinstance(a, list) else 0
                for a in args)
        with _lock:
            stats[op]["store_ops"] += 1
            stats[op]["store_bytes"] += n
        return fn(self, *args, **kwargs)
    return wrapped


def install() -> None:
    from ddp_kit.checkpoint.checkpointer import Checkpointer  # a commit is store traffic only: count the calls here

    commit = Checkpointer._commit_files

    def counted(self, *args, **kwargs):
        with _lock:
            stats["checkpoint commit"]["calls"] += 1
        return commit(self, *args, **kwargs)

    Checkpointer._commit_files = counted
    for name in COLLECTIVES:
        setattr(tdist, name, _count_collective(name, getattr(tdist, name)))
    for name in STORE_OPS:
        if hasattr(tdist.Store, name):
            setattr(tdist.Store, name, _count_store(name, getattr(tdist.Store, name)))


def main(out_dir: str, steps: int = 40, poll_window_s: float = 6.0):
    install()  # before ddp_kit binds anything
    import ddp_kit

    world = int(os.environ.get("WORLD_SIZE", "1"))
    run = ddp_kit.init(run_dir=os.path.join(out_dir, "run"), seed=0, ckpt_every=20, sync_check_every=5,
                       log_every=5, preempt_check_every=5, hang_timeout_s=120)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    data = torch.utils.data.TensorDataset(torch.randn(64 * world * steps, 16), torch.randint(0, 4, (64 * world * steps,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8 * world, shuffle=True, drop_last=True)  # 8 per rank
    model, loader = run.prepare(model, loader)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run.resume(optimizer=opt)
    step = 0
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step = run.step(loss)
        if step >= steps:
            break
    # The pollers (watchdog, fail-fast) run in their own threads at their own period: count their
    # store operations over a quiet window, with the rank alive and idle between two barriers.
    run.barrier()
    with _lock:
        before = {k: v["store_ops"] for k, v in stats.items()}
    t0 = time.monotonic()
    while time.monotonic() - t0 < poll_window_s:
        run.heartbeat("eval")  # idle, but not stalled: the watchdog must not fire
        time.sleep(0.2)
    window = time.monotonic() - t0
    with _lock:
        rates = {k: (v["store_ops"] - before.get(k, 0)) / window for k, v in stats.items()}
    run.barrier()
    out = {"rank": run.rank, "world": world, "steps": step,
           "ops": {k: {**{f: v[f] for f in ("calls", "sent", "received", "store_ops", "store_bytes")},
                       "seconds": v["seconds"], "store_ops_per_s": rates.get(k, 0.0)} for k, v in stats.items()}}
    with open(os.path.join(out_dir, f"rank{run.rank}.json"), "w") as f:
        json.dump(out, f)
    run.close()


if __name__ == "__main__":
    fire.Fire(main)

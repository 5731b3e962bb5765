"""The step boundary's own work per step, in microseconds, on a model that does almost nothing.

    python bench/step_overhead.py [--steps 3000] [--rounds 7] [--out bench/step_overhead_results.json]
    torchrun --standalone --nproc_per_node=2 bench/step_overhead.py          # world size 2

One process (per rank) holds both loops, on the same process group, threads and allocator
settings, the same pre-batched tensors, the same tiny model (Linear 8->2, wrapped in DDP at world
size 2) and optimizer: the raw loop (forward, backward, step, zero_grad) and the same loop with
`run.step(loss)` under ddp_kit.init with every scheduled feature off (no checkpoints, sync checks,
metrics records, watchdog). Rounds alternate raw / ddp_kit; per-step time is the median over a
round's steps, and the result is the median over rounds of (ddp_kit - raw).

Then each part the boundary and the reference loop run per step is timed alone (median of
repeated calls): the optimizer's pre/post hooks, progress marks, the step timer, the loss and
non-finite folding, the loader wrapper against a plain DataLoader over the same data, the
accumulation and autocast contexts and the disabled GradScaler, the fault-injection check.
Rank 0 prints the table and writes --out.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from contextlib import nullcontext

import fire
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_kit
from ddp_kit.parallel import autocast
from ddp_kit.parallel.precision import grad_scaler
from ddp_kit.train.inject import Injector


def _per_call_us(fn, n: int = 20000, repeats: int = 5) -> float:
    best = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best.append((time.perf_counter_ns() - t) / n / 1e3)
    return statistics.median(best)


def main(steps: int = 3000, rounds: int = 7, out: str = "bench/step_overhead_results.json"):
    # one folder for every rank of this launch (torchrun's run id), a fresh one per launch
    run_dir = os.path.join(tempfile.gettempdir(), f"ddp_kit-overhead-{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}")
    run = ddp_kit.init(run_dir, resume="never", ckpt_every=0, ckpt_every_s=0, sync_check_every=0, log_every=0,
                       rank_metrics=False, hang_timeout_s=0, peer_timeout_s=0, preempt_check_every=0)
    torch.manual_seed(0)
    batches = [(torch.randn(16, 8), torch.randint(0, 2, (16,))) for _ in range(steps)]
    world = run.world_size

    raw_model = nn.Linear(8, 2)
    if world > 1:
        raw_model = nn.parallel.DistributedDataParallel(raw_model)
    raw_opt = torch.optim.SGD(raw_model.parameters(), lr=0.01)
    kit_model = run.prepare(nn.Linear(8, 2))
    kit_opt = torch.optim.SGD(kit_model.parameters(), lr=0.01)
    run.resume(optimizer=kit_opt)

    def raw_loop() -> list[float]:
        ends = []
        for x, y in batches:
            loss = F.cross_entropy(raw_model(x), y)
            loss.backward()
            raw_opt.step()
            raw_opt.zero_grad(set_to_none=True)
            ends.append(time.perf_counter())
        return ends

    def kit_loop() -> list[float]:
        ends = []
        for x, y in batches:
            loss = F.cross_entropy(kit_model(x), y)
            loss.backward()
            kit_opt.step()
            kit_opt.zero_grad(set_to_none=True)
            run.step(loss)
            ends.append(time.perf_counter())
        return ends

    def per_step(ends: list[float]) -> float:
        return statistics.median(b - a for a, b in zip(ends, ends[1:])) * 1e6

    raw_loop(), kit_loop()  # warm-up
    raw_us, kit_us = [], []
    for r in range(rounds):
        order = (raw_loop, kit_loop) if r % 2 == 0 else (kit_loop, raw_loop)
        for loop in order:
            (raw_us if loop is raw_loop else kit_us).append(per_step(loop()))
    diffs = [k - r for k, r in zip(kit_us, raw_us)]

    # ---- the parts, one at a time -----------------------------------------------------------------
    b = run._boundary
    loss = torch.tensor(0.5)
    parts: dict[str, float] = {}
    x, y = batches[0]
    parts["forward, plain model (reference)"] = _per_call_us(lambda: raw_model(x), n=5000)
    parts["forward, prepared model"] = _per_call_us(lambda: kit_model(x), n=5000)
    with torch.no_grad():
        parts["optimizer.step, plain (reference)"] = _per_call_us(raw_opt.step, n=5000)
        parts["optimizer.step, registered (ddp_kit's hooks)"] = _per_call_us(kit_opt.step, n=5000)
    parts["optimizer hooks (pre + post)"] = _per_call_us(lambda: (b.stepping(), b.stepped()))
    parts["progress mark (one phase change)"] = _per_call_us(lambda: b.progress.enter("after step", 1))
    parts["step timer mark"] = _per_call_us(lambda: b.timer.mark("other"))
    parts["loss + non-finite, CPU loss (host read)"] = _per_call_us(
        lambda: (b.records.add_loss(float(loss)), b.nonfinite.update_host(float(loss), 1)))
    parts["loss + non-finite, device path (3 ops + 1 add)"] = _per_call_us(
        lambda: (b.records.add_loss(loss), b.nonfinite.update(loss, 1)), n=5000)
    b.records._window_loss = None
    parts["run.step(loss), everything off"] = _per_call_us(lambda: run.step(loss), n=5000)
    ds = TensorDataset(torch.randn(16 * 4096, 8), torch.randint(0, 2, (16 * 4096,)))
    plain = DataLoader(ds, batch_size=16, shuffle=True, drop_last=True)
    kit_loader = run.train_loader(DataLoader(ds, batch_size=16 * world, shuffle=True, drop_last=True))
    parts["batch fetch, plain DataLoader"] = _fetch_us(plain)
    parts["batch fetch, ddp_kit's train loader"] = _fetch_us(kit_loader)
    scaler = grad_scaler("off", run.device)
    parts["disabled GradScaler (scale, step-check, update)"] = _per_call_us(lambda: (scaler.scale(loss), scaler.update()))
    parts["autocast context, amp off"] = _per_call_us(lambda: _enter(autocast("off", run.device)))
    parts["accumulation context (last micro-step)"] = _per_call_us(lambda: _enter(run.accumulate(kit_model, True)))
    parts["nullcontext (for scale)"] = _per_call_us(lambda: _enter(nullcontext()))
    faults = Injector((), run.rank, armed=True)
    parts["fault-injection check (none armed)"] = _per_call_us(lambda: bool(faults))

    result = {"world_size": world, "steps": steps, "rounds": rounds, "raw_us": raw_us, "kit_us": kit_us,
              "diff_us": diffs, "diff_median_us": statistics.median(diffs), "parts_us": parts,
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    run.close()
    if run.is_main:
        print(f"world {world}: raw {statistics.median(raw_us):.1f} us/step, ddp_kit {statistics.median(kit_us):.1f} "
              f"us/step, ddp_kit - raw: median {statistics.median(diffs):.1f} us (rounds {min(diffs):.1f}..{max(diffs):.1f})")
        for name, us in parts.items():
            print(f"  {name:52s} {us:8.2f} us")
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        path = out.replace(".json", f"_w{world}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"  -> {path}")


def _enter(ctx) -> None:
    with ctx:
        pass


def _fetch_us(loader, n: int = 2000) -> float:
    it = iter(loader)
    next(it)
    t = time.perf_counter_ns()
    for _ in range(n):
        next(it)
    return (time.perf_counter_ns() - t) / n / 1e3


if __name__ == "__main__":
    fire.Fire(main)

"""Where the defaults' per-step cost goes, feature by feature: the reference job (bench/kit_ddp.py's work)
with timers around each scheduled piece. Run under torchrun; rank 0 writes --out (JSON).

    torchrun --standalone --nproc_per_node=2 bench/defaults_parts.py --out parts.json [--steps 600] [--flag value ...]

Each piece is timed where it runs (wall and this thread's CPU, perf_counter_ns / thread_time_ns) and
reported per call and per training step (per call x calls / steps):
- the boundary's own hooks on every step (timer marks and heartbeat: loader fetch, optimizer pre/post, run.step);
- the forward hooks of the per-rank time split: the share of steps that had them, and their cost per
  hooked forward (the prepared model's forward with and without them, alternated, after the run);
- the preemption agreement (its wait at the check step, and where it is started ahead, the start);
- per-rank records (the log record, and its per-rank gather);
- sync checks; the watchdog thread's poll (its CPU: what it takes from the step thread's core).
The step gaps (between step ends, after --skip) are split into plain steps and preemption-check steps.
Extra flags go to the job's config, as in kit_ddp.py (e.g. --rank_metrics false).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import fire
import torch

from ddp_kit.boundary import core, records, stopping
from ddp_kit.reliability import watchdog
from ddp_kit.train import loop
from ddp_kit.train.command import run
from ddp_kit.train.config import resolve

WALL: dict[str, list[int]] = {}
CPU: dict[str, list[int]] = {}


def _timed(owner: Any, name: str, key: str) -> None:
    """Wrap owner.name (if it exists in this version of the code) to time every call."""
    fn = getattr(owner, name, None)
    if fn is None:
        return

    def wrapper(*args, **kwargs):
        t, c = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            WALL.setdefault(key, []).append(time.perf_counter_ns() - t)
            CPU.setdefault(key, []).append(time.thread_time_ns() - c)
    setattr(owner, name, wrapper)


PIECES = [  # (owner, attribute, what)
    (core.StepBoundary, "fetching", "step path: loader fetch hook"),
    (core.StepBoundary, "fetched", "step path: loader batch hook"),
    (core.StepBoundary, "stepping", "step path: optimizer pre-hook"),
    (core.StepBoundary, "stepped", "step path: optimizer post-hook"),
    (core.StepBoundary, "step", "step path: run.step (all it schedules included)"),
    (stopping, "signalled", "preemption agreement: at the check step"),
    (stopping, "start_ahead", "preemption agreement: started a step ahead"),
    (records.MetricsRecords, "log", "log record (with per-rank records when on)"),
    (records, "gather_ranks", "per-rank records: the gather"),
    (core, "check_consistency", "sync check"),
    (watchdog.Watchdog, "_tick", "watchdog poll (its own thread)"),
]


def _hooks(module: torch.nn.Module) -> list[dict]:
    inner = getattr(module, "module", None)
    return [module._forward_hooks, module._forward_pre_hooks] + ([inner._forward_pre_hooks] if inner is not None else [])


def main(out: str, steps: int = 600, skip: int = 100, batch_size: int = 128, size: int = 4096, **flags):
    for owner, name, key in PIECES:
        _timed(owner, name, key)
    ends: list[int] = []
    hooked: list[bool] = []
    seen: dict[str, Any] = {}
    step_fn = loop.train_step

    def timed(job, micro):
        model = job.model
        dicts = _hooks(model)
        hooked.append(any(dicts))
        if any(dicts) and "hooks" not in seen:  # a copy of the split's hooks, for the forward's cost below
            seen["hooks"] = [dict(d) for d in dicts]
        seen["model"], seen["x"] = model, micro[0][0][:1].to(job.run.device)  # one row: the hooks, not the matmul
        loss = step_fn(job, micro)
        ends.append(time.perf_counter_ns())
        return loss

    loop.train_step = timed
    cfg = resolve(None, {"model": "mlp", "dataset": "synthetic", "synthetic_size": size, "batch_size": batch_size,
                         "max_steps": steps, "epochs": 10_000, "progress": False, "eval_every_epoch": False,
                         "resume": "never", "run_dir": os.path.join(os.path.dirname(os.path.abspath(out)), "parts_run"),
                         **flags})
    summary = run(cfg)
    every = cfg.preempt_check_every
    gaps = [(i + 1, b - a) for i, (a, b) in enumerate(zip(ends, ends[1:]))][skip:]  # (step whose boundary it holds, ns)
    plain = [g for s, g in gaps if not (every and s % every == 0)]
    checks = [g for s, g in gaps if every and s % every == 0 and s % cfg.log_every]
    result: dict[str, Any] = {"steps": len(ends), "skip": skip, "flags": flags,
                              "gap_ms": {"all": statistics.median(g for _, g in gaps) / 1e6,
                                         "plain steps": statistics.median(plain) / 1e6,
                                         "check steps": statistics.median(checks) / 1e6 if checks else None},
                              "hooked_share": sum(hooked) / max(len(hooked), 1), "pieces": {}}
    for _, _, key in PIECES:
        if key in WALL:
            w, c = WALL[key], CPU[key]
            result["pieces"][key] = {"calls": len(w), "per_call_us": statistics.median(w) / 1e3,
                                     "cpu_per_call_us": statistics.median(c) / 1e3,
                                     "per_step_us": statistics.mean(w) * len(w) / len(ends) / 1e3}
    if "hooks" in seen:  # the split's forward hooks: the same forward with and without them, alternated
        model, x, hooks = seen["model"], seen["x"], seen["hooks"]
        dicts = _hooks(model)
        with_us, without_us = [], []
        with torch.no_grad():
            for _ in range(7):
                for on in (True, False):
                    for d, h in zip(dicts, hooks):
                        d.clear()
                        if on:
                            d.update(h)
                    t = time.perf_counter_ns()
                    for _ in range(200):
                        model(x)
                    (with_us if on else without_us).append((time.perf_counter_ns() - t) / 200 / 1e3)
        for d in dicts:
            d.clear()
        per = statistics.median(a - b for a, b in zip(with_us, without_us))
        result["forward_hooks"] = {"per_hooked_forward_us": per, "per_step_us": per * result["hooked_share"]}
    if summary["world_size"] and int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    fire.Fire(main)

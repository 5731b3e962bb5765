"""The reference job's training loop, written against the public API: micro-steps with no_sync
accumulation, the step boundary (`run.step`), exact evaluation, log lines.

Checkpoints, preemption, sync checks, the NaN guard, the hang watchdog and metrics.jsonl are the
step boundary's business (boundary/core.py); this loop adds what is particular to the
reference job: the loss function's metrics, throughput and MFU in each record, and the console lines.
"""
from __future__ import annotations

import functools
import inspect
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from ..api import Run
from ..parallel import autocast, to_device
from .job import Job
from .workload import batch_size, split_loss


def _channels_last(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.contiguous(memory_format=torch.channels_last) if batch.dim() == 4 else batch
    if isinstance(batch, (list, tuple)):
        return type(batch)(_channels_last(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _channels_last(v) for k, v in batch.items()}
    return batch


_ONE_STEP = nullcontext()  # one micro-batch: nothing to accumulate, the step syncs as any step does


def _float32(value: Any) -> torch.Tensor:
    """`value` as a float32 tensor off the graph, with no op where it is one already (a step's
    metrics: each op is a few microseconds, every step)."""
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    t = t.detach() if t.requires_grad else t
    return t if t.dtype == torch.float32 else t.float()


@functools.cache
def _has_metrics_keyword(fn: Callable) -> bool:
    try:
        return "metrics" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _takes_metrics(fn: Callable) -> bool:
    """Whether a loss function can be asked to leave its metrics out (a `metrics` keyword); looked up
    once per function (a signature is tens of microseconds), never for an unhashable callable."""
    try:
        return _has_metrics_keyword(fn)
    except TypeError:
        return False


def _shown(job: Job) -> bool:
    """Whether a log line shows the coming step's metrics (train_accuracy...): they are that step's own,
    averaged over ranks, computed on that step only rather than folded on the device every step."""
    upcoming, every = job.run.steps_done + 1, job.cfg.log_every
    return bool(every and upcoming % every == 0) or upcoming == job.total_steps


def train_step(job: Job, micro_batches: list) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One optimizer step over `grad_accum` micro-batches; returns this rank's mean loss and metrics
    as tensors (metrics only on a step a log line shows: a loss taking `metrics` is not asked for them
    on the others). No `.item()` here: on CUDA that would wait for the GPU every step. With one
    micro-batch nothing is divided or summed into a fresh zero (the same numbers, fewer ops), no
    accumulation context is looked up, a disabled GradScaler is not called at all, and on CPU the
    batch is not "copied" to where it is (each a few microseconds of every step)."""
    cfg, model, run = job.cfg, job.model, job.run
    n = len(micro_batches)
    scaler = job.scaler if job.scaler.is_enabled() else None
    on_cpu = run.device.type == "cpu"  # the loader's batches are there already
    metrics_wanted = _shown(job)
    quiet = {} if metrics_wanted or not _takes_metrics(job.loss_fn) else {"metrics": False}
    total: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = {}
    if job.faults:
        job.faults.before_backward(run.steps_done + 1, run.unwrap(model))
    for i, batch in enumerate(micro_batches):
        if not on_cpu:
            batch = to_device(batch, run.device)
        if cfg.channels_last:
            batch = _channels_last(batch)
        got: list = []

        def forward(batch: Any = batch, got: list = got) -> torch.Tensor:  # a replay check computes it again
            with autocast(cfg.amp, run.device):
                loss, parts = split_loss(cfg.loss, job.loss_fn(model, batch, **quiet))
                if n > 1:
                    loss = loss / n
            if job.faults:
                loss = loss * job.faults.loss_factor(run.steps_done + 1)
            got[:] = [parts]
            return loss

        with run.accumulate(model, last=(i == n - 1)) if n > 1 else _ONE_STEP:
            loss = run.forward_backward(model, forward, scaler)
        parts = got[0]
        value = _float32(loss)
        total = value if total is None else total + value
        for k, v in (parts if metrics_wanted else {}).items():
            part = _float32(v)
            part = part / n if n > 1 else part
            metrics[k] = metrics[k] + part if k in metrics else part
    if scaler is not None:
        scaler.step(job.optimizer)
        scaler.update()
    else:
        job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    return total, metrics


@torch.no_grad()
def evaluate(job: Job) -> dict[str, float]:
    """Loss and the loss function's metrics over the whole test set: each rank sums its exact shard
    on the device, reads the sums once, and the sums are all-reduced."""
    run, cfg = job.run, job.cfg
    module = run.unwrap(job.model)  # the plain module: DDP's forward would sync buffers, and shards are uneven
    was_training = module.training
    module.eval()
    sums: dict[str, torch.Tensor] = {}
    count = 0
    for batch in job.test_loader:  # every batch is a heartbeat: long evals are progress too
        batch = to_device(batch, run.device)
        n = batch_size(batch)
        with autocast(cfg.amp, run.device):
            loss, parts = split_loss(cfg.loss, job.loss_fn(module, batch))
        for k, v in {"loss": loss, **parts}.items():
            sums[k] = sums.get(k, 0.0) + torch.as_tensor(v).detach().double() * n
        count += n
    module.train(was_training)
    # A rank with an empty shard (fewer test samples than ranks) has no names of its own; rank 0
    # always has the most samples, but the union says it without relying on that.
    names = sorted(set().union(*run.gather(sorted(sums))))
    values = (torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float64, device=run.device) for k in names]).tolist()
              if names else [])
    # ^ one device->host read for all metrics, after the whole shard
    *totals, count = run.sum(*values, count)
    return {**{f"eval_{k}": v / max(count, 1) for k, v in zip(names, totals)}, "eval_samples": int(count)}


def train(job: Job) -> dict[str, Any]:
    cfg, run, loader = job.cfg, job.run, job.train_loader
    bar = _progress(cfg, run, job.total_steps)
    say = (lambda msg: bar.write(msg)) if bar else run.print
    start, start_step = time.perf_counter(), run.steps_done
    window: dict[str, Any] = {}
    ev: dict[str, float] = {}
    ev_step = -1
    logged: dict[str, float] = {}
    epoch = loader.epoch

    def on_log(record: dict) -> None:  # every rank, at each log event
        record["epoch"] = epoch  # the epoch this step belongs to (the loader may have rolled over)
        names = sorted(window)
        if names:
            sums = run.sum(*(float(window[k]) / max(window["_n"], 1) for k in names if k != "_n"))
            record.update({f"train_{k}": v / run.world_size for k, v in zip([k for k in names if k != "_n"], sums)})
        window.clear()
        if "loss" in record:  # not a record of no steps (the one a rollback's step still writes: docs/sdc.md)
            _add_rates(job, record)
            logged.update(record)
            say(_line(record, job.total_steps))

    run.on_log(on_log)
    while run.steps_done < job.total_steps:
        micro: list = []
        epoch = loader.epoch
        for batch in loader:
            micro.append(batch)
            if len(micro) < cfg.grad_accum:
                continue
            upcoming = run.steps_done + 1
            shown = _shown(job)
            loss, metrics = train_step(job, micro)
            micro = []
            if shown:  # a log line's metrics are its own step's (_shown)
                window.clear()
                window.update(metrics, _n=1)
            if job.faults:
                run.heartbeat("after step")  # where a hang or crash of a fault is reported
                job.faults.at_step(upcoming, run.unwrap(job.model))
            step = run.step(loss)
            if step < upcoming:  # rolled back to an earlier checkpoint (docs/sdc.md): the loader continues from there
                epoch = loader.epoch
            if bar:
                bar.update(step - bar.n)
            if step % cfg.log_every and step == job.total_steps:
                run.log()  # the final step is always logged
            if step >= job.total_steps:
                break
        if loader.position == 0 and (cfg.eval_every_epoch or run.steps_done >= job.total_steps):
            ev, ev_step = _evaluate_epoch(job, epoch, say)
    if bar:
        bar.close()
    if ev_step != run.steps_done:  # stopped mid-epoch (max_steps): evaluate the final weights
        ev = evaluate(job)
        run.log_event({"event": "eval", "step": run.steps_done, "epoch": loader.epoch, **ev})
    wall = time.perf_counter() - start
    return {"train_loss": logged.get("loss"), "wall_s": wall,
            "samples_per_s": (run.steps_done - start_step) * cfg.batch_size / max(wall, 1e-9), **ev}


def _line(record: dict, total_steps: int) -> str:
    return (f"step {record['step']}/{total_steps} epoch {record['epoch']} loss {record['loss']:.4f} "
            f"lr {record['lr']:.2e} {record.get('samples_per_s', 0):.0f} samples/s"
            + (f" mfu {record['mfu']:.1%}" if "mfu" in record else ""))


def _add_rates(job: Job, record: dict) -> None:
    """A log record's ETA, and its model TFLOP/s and MFU where the model's FLOPs are known, from its
    throughput (a record without one gets none)."""
    if "samples_per_s" in record:
        record["eta_s"] = (job.total_steps - record["step"]) * job.cfg.batch_size / max(record["samples_per_s"], 1e-9)
        if job.flops_per_sample:
            record["model_tflops_per_s"] = job.flops_per_sample * record["samples_per_s"] / 1e12
            if job.peak_tflops:
                record["mfu"] = record["model_tflops_per_s"] / (job.peak_tflops * job.run.world_size)


def _evaluate_epoch(job: Job, epoch: int, say: Callable[[str], None]) -> tuple[dict[str, float], int]:
    """The evaluation at an epoch's end: its metrics, recorded and said, and the step it followed."""
    ev, ev_step = evaluate(job), job.run.steps_done
    job.run.log_event({"event": "eval", "step": ev_step, "epoch": epoch, **ev})
    say(f"eval epoch {epoch}: loss {ev['eval_loss']:.4f}"
        + (f" accuracy {ev['eval_accuracy']:.4f}" if "eval_accuracy" in ev else "")
        + f" ({ev['eval_samples']} samples)")
    return ev, ev_step


def _progress(cfg, run: Run, total: int):
    if not (run.is_main and cfg.progress):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=run.steps_done, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0,
                file=sys.stderr, disable=None)  # disable=None: no bar when stderr is not a terminal


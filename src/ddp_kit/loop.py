"""The reference training loop: micro-steps with no_sync accumulation, logging, periodic checks, exact eval.

Each phase is announced to `job.progress` (two attribute writes), which is what the hang
watchdog reports when a rank stops moving.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import TrainConfig
from .dist import DistContext, all_reduce_sum, set_collective_timeout, barrier
from .job import Job, save_checkpoint
from .metrics import gather_ranks
from .outputs import RunWriter
from .preempt import Preempted, agreed_signal
from .sync import check_consistency
from .wrap import autocast, sync_gradients, to_device, unwrap


def train_step(job: Job, micro_batches: list) -> torch.Tensor:
    """One optimizer step over `grad_accum` micro-batches; returns this rank's mean loss as a tensor.

    No `.item()` here: on CUDA that would wait for the GPU every step. The loop reads the loss
    once per log event."""
    cfg, model = job.cfg, job.model
    total = torch.zeros((), device=job.ctx.device)
    timer = job.timer
    job.progress.enter("forward/backward")
    for i, (x, y) in enumerate(micro_batches):
        x, y = to_device((x, y), job.ctx.device)
        if cfg.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with sync_gradients(model, sync=(i == len(micro_batches) - 1)):
            with autocast(cfg.amp, job.ctx.device):
                loss = F.cross_entropy(model(x), y) / len(micro_batches)
            if job.faults:
                loss = loss * job.faults.loss_factor(job.step + 1)
            timer.mark("forward")
            job.scaler.scale(loss).backward()
            timer.mark("backward")
        total += loss.detach().float()
    job.progress.enter("optimizer")
    job.scaler.step(job.optimizer)
    job.scaler.update()
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    timer.mark("optimizer")
    timer.steps += 1
    return total


@torch.no_grad()
def evaluate(model: nn.Module, loader, ctx: DistContext, amp: str = "off", progress=None) -> dict[str, float]:
    """Loss and accuracy over the whole test set: each rank sums its exact shard, then sums are all-reduced."""
    module = unwrap(model)  # the plain module: DDP's forward would sync buffers, and shards are uneven
    was_training = module.training
    module.eval()
    loss_sum = correct = count = 0.0
    for x, y in loader:
        x, y = to_device((x, y), ctx.device)
        with autocast(amp, ctx.device):
            out = module(x)
        loss_sum += F.cross_entropy(out.float(), y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        count += len(y)
        if progress is not None:
            progress.enter("eval")  # long evals are progress too
    module.train(was_training)
    loss_sum, correct, count = all_reduce_sum(ctx, [loss_sum, correct, count])
    return {"eval_loss": loss_sum / max(count, 1), "eval_accuracy": correct / max(count, 1), "eval_samples": int(count)}


def train(job: Job, writer: RunWriter) -> dict[str, Any]:
    cfg, ctx, loader = job.cfg, job.ctx, job.train_loader
    say = rank0_printer(ctx)
    bar = _progress(cfg, ctx, job.total_steps, job.step)
    start = last_t = time.perf_counter()
    start_step = last_step = job.step
    window_loss, window_n, ev, ev_step, logged_loss = 0.0, 0, {}, -1, None
    progress = job.progress
    first_step_done = False
    while job.step < job.total_steps:
        micro: list = []
        epoch = loader.epoch
        progress.enter("data", job.step + 1)
        job.timer.mark("other")
        for batch in loader:
            job.timer.mark("data")
            micro.append(batch)
            if len(micro) < cfg.grad_accum:
                continue
            step_loss = train_step(job, micro)
            window_loss += step_loss
            window_n += 1
            micro = []
            job.step += 1
            job.nonfinite.update(step_loss, job.step)
            progress.enter("after step")
            if job.faults:
                job.faults.at_step(job.step, unwrap(job.model))
            if not first_step_done:
                # Startup is over (data ready, kernels compiled): from here a collective that takes
                # longer than collective_timeout_s is a fault, not a slow start.
                barrier(ctx)
                set_collective_timeout(ctx, cfg.collective_timeout_s)
                first_step_done = progress.warm = True
                if job.preempt is not None:
                    job.preempt.started()  # from here a stop signal is agreed on and checkpointed
            if bar:
                bar.update(1)
            timer = job.timer
            if job.step % cfg.preempt_check_every == 0:
                stop_if_signalled(job)
            if cfg.sync_check_every and job.step % cfg.sync_check_every == 0:
                with waiting_on_ranks(job, "sync check"):
                    job.nonfinite.check(ctx, job.ckpt)  # NaN weights would read as divergence
                    warning = check_consistency(ctx, job.model, job.step, cfg.sync_fix)
                if warning:
                    say(f"ddp_kit: warning: {warning}", bar)
            if cfg.ckpt_every and job.step % cfg.ckpt_every == 0:
                with waiting_on_ranks(job, None):  # save_checkpoint announces its own phase
                    save_checkpoint(job)
                stop_if_signalled(job)  # a signal that came during the save is acted on now
            if job.step % cfg.log_every == 0 or job.step == job.total_steps:
                with waiting_on_ranks(job, "log all-reduce"):
                    job.nonfinite.check(ctx, job.ckpt)
                now = time.perf_counter()
                with waiting_on_ranks(job, "log all-reduce"):
                    (loss,) = all_reduce_sum(ctx, [float(window_loss) / max(window_n, 1)])
                record = {"event": "train", "step": job.step, "epoch": epoch, "loss": loss / ctx.world_size,
                          "lr": job.scheduler.get_last_lr()[0],
                          "samples_per_s": (job.step - last_step) * cfg.batch_size / max(now - last_t, 1e-9)}
                record["eta_s"] = (job.total_steps - job.step) * cfg.batch_size / max(record["samples_per_s"], 1e-9)
                if job.flops_per_sample:
                    record["model_tflops_per_s"] = job.flops_per_sample * record["samples_per_s"] / 1e12
                    if job.peak_tflops:
                        record["mfu"] = record["model_tflops_per_s"] / (job.peak_tflops * ctx.world_size)
                if cfg.rank_metrics:
                    window = timer.window()
                    with waiting_on_ranks(job, "log all-reduce"):
                        record["ranks"] = gather_ranks(ctx, window, job.train_loader.micro_batch * cfg.grad_accum)
                    for line in job.stragglers.update(record["ranks"]):
                        say(f"ddp_kit: warning: {line}", bar)
                writer.log(record)
                say(f"step {job.step}/{job.total_steps} epoch {epoch} loss {record['loss']:.4f} "
                    f"lr {record['lr']:.2e} {record['samples_per_s']:.0f} samples/s"
                    + (f" mfu {record['mfu']:.1%}" if "mfu" in record else ""), bar)
                window_loss, window_n, last_t, last_step, logged_loss = 0.0, 0, now, job.step, record["loss"]
            if job.step >= job.total_steps:
                break
            progress.enter("data", job.step + 1)
            job.timer.mark("other")
        end_of_epoch = loader.position == 0
        if end_of_epoch and (cfg.eval_every_epoch or job.step >= job.total_steps):
            ev, ev_step = evaluate(job.model, job.test_loader, ctx, cfg.amp, progress), job.step
            writer.log({"event": "eval", "step": job.step, "epoch": epoch, **ev})
            say(f"eval epoch {epoch}: loss {ev['eval_loss']:.4f} accuracy {ev['eval_accuracy']:.4f} "
                f"({ev['eval_samples']} samples)", bar)
            if job.step < job.total_steps:
                stop_if_signalled(job)  # a signal that came during eval is acted on now
    if bar:
        bar.close()
    if ev_step != job.step:  # stopped mid-epoch (max_steps): evaluate the final weights
        ev = evaluate(job.model, job.test_loader, ctx, cfg.amp, progress)
        writer.log({"event": "eval", "step": job.step, "epoch": loader.epoch, **ev})
    wall = time.perf_counter() - start
    # The final step is always logged, so the last logged loss is the last window's mean over ranks.
    return {"train_loss_last_window": logged_loss, "wall_s": wall,
            "samples_per_s": (job.step - start_step) * cfg.batch_size / max(wall, 1e-9), **ev}


def stop_if_signalled(job: Job) -> None:
    """The ranks agree on any stop signal received so far; all raise Preempted together."""
    if job.preempt is None:
        return
    with waiting_on_ranks(job, "preemption check"):
        signum = agreed_signal(job.ctx, job.preempt)
    if signum:
        raise Preempted(signum)


@contextmanager
def waiting_on_ranks(job: Job, phase: str | None):
    """A block that waits for the other ranks (a collective): announced to the watchdog, and timed as
    "comm" so that this rank's own-work figure (and so the straggler check) leaves the wait out."""
    if phase:
        job.progress.enter(phase)
    job.timer.mark("other")
    yield
    job.timer.mark("comm")


def rank0_printer(ctx: DistContext):
    def say(msg: str, bar=None) -> None:
        if not ctx.is_main:
            return
        if bar is not None:
            bar.write(msg)
        else:
            print(msg, flush=True)
    return say


def _progress(cfg: TrainConfig, ctx: DistContext, total: int, initial: int):
    if not (ctx.is_main and cfg.progress):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0,
                file=sys.stderr, disable=None)  # disable=None: no bar when stderr is not a terminal



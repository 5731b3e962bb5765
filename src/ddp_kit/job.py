"""The reference job's parts and their persistence: build them from a config, save and restore them.

A Job is the training state the loop touches. `save_checkpoint` and `resume` turn it into the
plain dicts `checkpoint.py` writes, and back.
"""
from __future__ import annotations

import math
from pathlib import Path
from dataclasses import dataclass, field

import torch
from torch import nn

from . import __version__
from .checkpoint import Checkpointer, rng_state, set_rng_state
from .config import TrainConfig, describe_changes, recipe_changes
from .data import TrainLoader, eval_loader
from .datasets import build_dataset
from .dist import DistContext
from .errors import UserError
from .faults import Injector, parse as parse_faults
from .metrics import StepTimer, StragglerWatch, model_flops_per_sample, peak_tflops
from .models import build_model
from .numerics import NonFiniteLoss
from .preempt import PreemptFlag
from .watchdog import Progress
from .wrap import check_amp, grad_scaler, settle_ddp_buckets, unwrap, wrap_model


@dataclass
class Job:
    """Everything the loop touches; built once by `build()`."""

    cfg: TrainConfig
    ctx: DistContext
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    train_loader: TrainLoader
    test_loader: torch.utils.data.DataLoader
    total_steps: int
    ckpt: Checkpointer
    faults: Injector
    step: int = 0
    saved_step: int = -1
    resumed_from: int | None = None
    resumed_path: Path | None = None
    progress: Progress = field(default_factory=Progress)
    preempt: PreemptFlag | None = None
    timer: StepTimer = field(default_factory=StepTimer)
    stragglers: StragglerWatch = field(default_factory=StragglerWatch)
    flops_per_sample: float | None = None
    peak_tflops: float | None = None
    nonfinite: NonFiniteLoss = field(default_factory=NonFiniteLoss)


def build(cfg: TrainConfig, ctx: DistContext, progress: Progress | None = None) -> Job:
    check_amp(cfg.amp, ctx.device)
    torch.manual_seed(cfg.seed + ctx.rank)  # per-rank stream for augmentation; weights use their own seed
    spec = build_dataset(cfg.dataset, cfg.data_root, cfg.download, cfg.seed, cfg.synthetic_size)
    pin = ctx.device.type == "cuda"
    train_loader = TrainLoader(spec.train, global_batch=cfg.batch_size, world_size=ctx.world_size, rank=ctx.rank,
                               grad_accum=cfg.grad_accum, seed=cfg.seed, num_workers=cfg.num_workers, pin_memory=pin)
    test_loader = eval_loader(spec.test, batch_size=max(train_loader.micro_batch, 256), world_size=ctx.world_size,
                              rank=ctx.rank, num_workers=cfg.num_workers, pin_memory=pin)
    model = build_model(cfg.model, spec.input_shape, spec.num_classes, seed=cfg.seed)
    model = wrap_model(model, ctx, sync_bn=cfg.sync_bn, compile=cfg.compile, channels_last=cfg.channels_last)
    if cfg.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    total = cfg.epochs * train_loader.steps_per_epoch
    total = min(total, cfg.max_steps) if cfg.max_steps else total
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=_schedule(cfg.lr_schedule, total))
    ckpt = Checkpointer(ctx, f"{cfg.run_dir}/checkpoints", keep_last=cfg.keep_last, async_save=cfg.async_ckpt,
                        timeout_s=cfg.init_timeout_s, write_delay_s=cfg.debug_ckpt_delay_s)
    faults = Injector(parse_faults(cfg.inject), ctx.rank, armed=ctx.env.restart_count == 0)
    job = Job(cfg, ctx, model, optimizer, scheduler, grad_scaler(cfg.amp, ctx.device), train_loader, test_loader,
              total, ckpt, faults, progress=progress or Progress(), stragglers=StragglerWatch(cfg.straggler_margin))
    if cfg.rank_metrics:
        x0 = torch.utils.data.default_collate([spec.train[0]])[0].to(ctx.device)
        job.flops_per_sample = model_flops_per_sample(unwrap(model), x0)
        job.peak_tflops = peak_tflops(ctx.device)
    return job


# ---- checkpoint state: what the loop is, as plain dicts ----------------------------------------------

def save_checkpoint(job: Job) -> None:
    if job.saved_step == job.step:
        return
    job.nonfinite.check(job.ctx, job.ckpt)  # never save a run whose loss went NaN/inf
    shared = {"model": unwrap(job.model).state_dict(), "optimizer": job.optimizer.state_dict(),
              "scheduler": job.scheduler.state_dict(), "scaler": job.scaler.state_dict(),
              "loop": {"step": job.step}, "data": job.train_loader.state_dict()}
    meta = {"config": job.cfg.to_dict(), "config_hash": job.cfg.hash(), "ddp_kit": __version__,
            "torch": torch.__version__, "epoch": job.train_loader.epoch, "position": job.train_loader.position}
    phase = job.progress.phase
    job.progress.enter("checkpoint")
    job.ckpt.save(job.step, shared, {"rng": rng_state()}, meta)
    job.progress.enter(phase)
    job.saved_step = job.step


def resume(job: Job, say) -> None:
    """Continue from the checkpoint `cfg.resume` names (auto: the newest valid one), if any."""
    cfg, ctx = job.cfg, job.ctx
    found = job.ckpt.find(cfg.resume, warn=lambda msg: say(f"ddp_kit: warning: {msg}"))
    if found is None:
        return
    shared, own, meta = job.ckpt.load(found)
    # Before any state is loaded: a changed optimizer fails deep inside torch, and a changed lr or
    # batch would be silently overridden by (or silently mixed with) the restored state.
    refused, applied = recipe_changes(meta.get("config") or {}, cfg.to_dict())
    if refused:
        raise UserError(f"cannot resume from {found.path}: the recipe changed since it was saved "
                        f"({describe_changes(refused)})",
                        "use a new --run_dir, or --resume never to start over in this one")
    try:
        unwrap(job.model).load_state_dict(shared["model"])
        job.optimizer.load_state_dict(shared["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise UserError(f"checkpoint {found.path} does not fit this model/optimizer ({str(exc).splitlines()[0][:160]})",
                        "use a new --run_dir, or --resume never to start over in this one") from None
    job.scheduler.load_state_dict(shared["scheduler"])
    job.scaler.load_state_dict(shared["scaler"])
    job.step = job.saved_step = int(shared["loop"]["step"])
    job.resumed_from, job.resumed_path = job.step, found.path
    job.faults = Injector((), ctx.rank, armed=False)  # a resumed run is the recovery, not the fault
    note = job.train_loader.load_state_dict(shared["data"])
    if ctx.world_size > 1:  # only DDP has buckets to settle
        settle_ddp_buckets(job.model, job.train_loader.sample_batch(), ctx.device)
    if own is not None and meta.get("world_size") == ctx.world_size:
        set_rng_state(own["rng"])
    else:
        torch.manual_seed(cfg.seed + ctx.rank + 1_000_003 * job.step)
    extra = []
    if meta.get("world_size") != ctx.world_size:
        extra.append(f"written by {meta.get('world_size')} rank(s), resumed on {ctx.world_size}: "
                     f"data order continues, per-rank RNG streams are reseeded")
    if applied:
        extra.append(f"changed since that checkpoint and applied: {describe_changes(applied)}")
    elif meta.get("config_hash") != cfg.hash():  # keys this version does not compare (another ddp_kit)
        extra.append("its config differs from this run's (see its meta.json)")
    say(f"ddp_kit: resumed from {found.path} (step {job.step}, epoch {job.train_loader.epoch})"
        + ("; " + "; ".join(extra) if extra else ""))
    if note:
        say(f"ddp_kit: warning: {note}")


def _schedule(kind: str, total: int):
    if kind == "constant":
        return lambda step: 1.0
    return lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))



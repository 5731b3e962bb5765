"""The reference job's parts, built from its config through the public API (`run.prepare`,
`run.eval_loader`): the workload (model, data, loss), the optimizer and schedule, the fault hooks."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..api import AUTO, Run
from ..parallel import check_amp, grad_scaler, to_device
from ..reliability import model_flops_per_sample, peak_tflops
from .auto_batch import settle
from .config import TrainConfig
from .inject import Injector
from .inject import parse as parse_faults
from .workload import build as build_workload


@dataclass
class Job:
    """The reference job's parts: everything the loop touches; built once by `build()`."""

    cfg: TrainConfig
    run: Run
    model: nn.Module
    loss_fn: Callable
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    train_loader: Any  # ddp_kit.data.TrainLoader, from run.prepare
    test_loader: Any  # run.eval_loader: this rank's exact share
    total_steps: int
    faults: Injector
    flops_per_sample: float | None = None
    peak_tflops: float | None = None
    batch: dict[str, Any] | None = None  # --batch_size auto: what was settled (auto_batch.py), as recorded


def build(cfg: TrainConfig, run: Run) -> Job:
    """The job's parts. With `--batch_size auto` the returned job's cfg holds the global batch settled
    (auto_batch.py) between building the optimizer and the loader, and `job.batch` its record."""
    check_amp(cfg.amp, run.device, is_main=run.is_main)
    torch.manual_seed(cfg.seed + run.rank)  # per-rank stream for augmentation; weights use their own seed
    auto = 0 if cfg.device_data else run.loader_workers
    workers = auto if cfg.num_workers < 0 else cfg.num_workers
    work = build_workload(cfg.model, cfg.model_args, cfg.dataset, cfg.dataset_args, cfg.loss, seed=cfg.seed,
                          data_root=cfg.data_root, download=cfg.download, synthetic_size=cfg.synthetic_size)
    model = run.prepare(work.model, sync_bn=cfg.sync_bn, compile=cfg.compile,  # placed (FSDP: shard by shard)
                        channels_last=cfg.channels_last, strategy=cfg.strategy, amp=cfg.amp, **_strategy_options(cfg))
    optimizer = build_optimizer(cfg.optimizer, list(model.parameters()), run.device.type, lr=cfg.lr,
                                momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    faults = Injector(parse_faults(cfg.inject), run.rank, armed=run.ctx.env.restart_count == 0)
    record = None
    if cfg.batch_size == AUTO:  # the model and optimizer are in memory now, the loader not yet
        record = settle(cfg, run, model, optimizer, work.train, work.loss, faults.batch_trial)
        cfg = dataclasses.replace(cfg, batch_size=record["global_batch"])
    train_loader = run.prepare(DataLoader(work.train, batch_size=cfg.batch_size, shuffle=True, num_workers=workers,
                                          drop_last=True), grad_accum=cfg.grad_accum, device_data=cfg.device_data)
    test_loader = run.eval_loader(DataLoader(work.test, batch_size=max(train_loader.micro_batch, 256),
                                             num_workers=workers))
    total = cfg.epochs * train_loader.steps_per_epoch
    total = min(total, cfg.max_steps) if cfg.max_steps else total
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=_schedule(cfg.lr_schedule, total))
    job = Job(cfg, run, model, work.loss, optimizer, scheduler, grad_scaler(cfg.amp, run.device), train_loader,
              test_loader, total, faults, batch=record)
    if cfg.rank_metrics:
        sample = to_device(train_loader.sample_batch(), run.device)
        x0 = sample[0] if isinstance(sample, (list, tuple)) else None
        if isinstance(x0, torch.Tensor):
            job.flops_per_sample = model_flops_per_sample(run.unwrap(model), x0)
        job.peak_tflops = peak_tflops(run.device, cfg.amp, cfg.tf32)
    return job


def build_optimizer(name: str, params: list[torch.Tensor], device_type: str, *, lr: float, momentum: float,
                    weight_decay: float) -> torch.optim.Optimizer:
    """SGD or AdamW over `params` (plain tensors, or FSDP's DTensors), fused where that works."""
    options = optimizer_options(name, device_type, sharded=any(_is_dtensor(p) for p in params))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **options)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **options)


def optimizer_options(name: str, device_type: str, sharded: bool) -> dict[str, bool]:
    """`fused=True` on CUDA: one kernel for the whole update, and GradScaler's inf check stays on the
    device (a non-fused step reads found_inf on the host: a sync every step). Not for SGD over
    sharded parameters: DTensor has a sharding rule for aten._fused_adam(w)_ but none for
    aten._fused_sgd_ (torch 2.11 to 2.14), so FSDP's SGD keeps torch's default, foreach on CUDA
    (FSDP refuses fp16, so no GradScaler waits on it)."""
    if device_type != "cuda" or (sharded and name == "sgd"):
        return {}
    return {"fused": True}


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed: no DTensors either
        return False
    return isinstance(t, DTensor)


def _strategy_options(cfg: TrainConfig) -> dict[str, Any]:
    from ..parallel import find_strategy as strategy  # the strategy knows which of the job's keys are its options

    return strategy(cfg.strategy).prepare_options({k: getattr(cfg, k) for k in strategy(cfg.strategy).config_keys})


def _schedule(kind: str, total: int):
    if kind == "constant":
        return lambda step: 1.0
    return lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))

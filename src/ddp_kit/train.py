"""The reference training job: `python -m ddp_kit.train [CONFIG.yaml] [--key value ...]`.

The same command runs as one process or under torchrun/srun; nothing here branches on it.
Parse -> build -> train -> summarize, inside `distributed()`, which always tears down.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import __version__
from .config import TrainConfig, help_text, resolve
from .checkpoint import Checkpointer, rng_state, set_rng_state
from .data import TrainLoader, build_dataset, eval_loader, per_rank_batch
from .dist import DistContext, all_reduce_sum, distributed
from .env import DistEnv, detect
from .errors import EXIT_USER_ERROR, UserError, report_user_error
from .faults import Injector, parse as parse_faults
from .models import build_model
from .outputs import RunWriter
from .sync import disagreeing_ranks, param_sha256
from .wrap import autocast, check_amp, grad_scaler, sync_gradients, to_device, unwrap, wrap_model


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


def build(cfg: TrainConfig, ctx: DistContext) -> Job:
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
    return Job(cfg, ctx, model, optimizer, scheduler, grad_scaler(cfg.amp, ctx.device), train_loader, test_loader,
               total, ckpt, faults)


# ---- checkpoint state: what the loop is, as plain dicts ----------------------------------------------

def save_checkpoint(job: Job) -> None:
    if job.saved_step == job.step:
        return
    shared = {"model": unwrap(job.model).state_dict(), "optimizer": job.optimizer.state_dict(),
              "scheduler": job.scheduler.state_dict(), "scaler": job.scaler.state_dict(),
              "loop": {"step": job.step}, "data": job.train_loader.state_dict()}
    meta = {"config": job.cfg.to_dict(), "config_hash": job.cfg.hash(), "ddp_kit": __version__,
            "torch": torch.__version__, "epoch": job.train_loader.epoch, "position": job.train_loader.position}
    job.ckpt.save(job.step, shared, {"rng": rng_state()}, meta)
    job.saved_step = job.step


def resume(job: Job, say) -> None:
    """Continue from the checkpoint `cfg.resume` names (auto: the newest valid one), if any."""
    cfg, ctx = job.cfg, job.ctx
    found = job.ckpt.find(cfg.resume, warn=lambda msg: say(f"ddp_kit: warning: {msg}"))
    if found is None:
        return
    shared, own, meta = job.ckpt.load(found)
    try:
        unwrap(job.model).load_state_dict(shared["model"])
        job.optimizer.load_state_dict(shared["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise UserError(f"checkpoint {found.path} does not fit this model/optimizer ({str(exc).splitlines()[0][:160]})",
                        "use a new --run_dir, or --resume never to start over in this one") from None
    job.scheduler.load_state_dict(shared["scheduler"])
    job.scaler.load_state_dict(shared["scaler"])
    job.step = job.saved_step = int(shared["loop"]["step"])
    job.resumed_from = job.step
    job.faults = Injector((), ctx.rank, armed=False)  # a resumed run is the recovery, not the fault
    note = job.train_loader.load_state_dict(shared["data"])
    if own is not None and meta.get("world_size") == ctx.world_size:
        set_rng_state(own["rng"])
    else:
        torch.manual_seed(cfg.seed + ctx.rank + 1_000_003 * job.step)
    extra = []
    if meta.get("world_size") != ctx.world_size:
        extra.append(f"written by {meta.get('world_size')} rank(s), resumed on {ctx.world_size}: "
                     f"data order continues, per-rank RNG streams are reseeded")
    if meta.get("config_hash") != cfg.hash():
        extra.append("its config differs from this run's (see its meta.json)")
    say(f"ddp_kit: resumed from {found.path} (step {job.step}, epoch {job.train_loader.epoch})"
        + ("; " + "; ".join(extra) if extra else ""))
    if note:
        say(f"ddp_kit: warning: {note}")


def _schedule(kind: str, total: int):
    if kind == "constant":
        return lambda step: 1.0
    return lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))


def train_step(job: Job, micro_batches: list) -> float:
    """One optimizer step over `grad_accum` micro-batches; returns this rank's mean loss."""
    cfg, model = job.cfg, job.model
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        x, y = to_device((x, y), job.ctx.device)
        if cfg.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with sync_gradients(model, sync=(i == len(micro_batches) - 1)), autocast(cfg.amp, job.ctx.device):
            loss = F.cross_entropy(model(x), y) / len(micro_batches)
            job.scaler.scale(loss).backward()
        total += loss.detach().item()
    job.scaler.step(job.optimizer)
    job.scaler.update()
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    return total


@torch.no_grad()
def evaluate(model: nn.Module, loader, ctx: DistContext, amp: str = "off") -> dict[str, float]:
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
    module.train(was_training)
    loss_sum, correct, count = all_reduce_sum(ctx, [loss_sum, correct, count])
    return {"eval_loss": loss_sum / max(count, 1), "eval_accuracy": correct / max(count, 1), "eval_samples": int(count)}


def train(job: Job, writer: RunWriter) -> dict[str, Any]:
    cfg, ctx, loader = job.cfg, job.ctx, job.train_loader
    say = _printer(ctx)
    bar = _progress(cfg, ctx, job.total_steps, job.step)
    start = last_t = time.perf_counter()
    start_step = last_step = job.step
    window_loss, window_n, ev, ev_step, logged_loss = 0.0, 0, {}, -1, None
    while job.step < job.total_steps:
        micro: list = []
        epoch = loader.epoch
        for batch in loader:
            micro.append(batch)
            if len(micro) < cfg.grad_accum:
                continue
            window_loss += train_step(job, micro)
            window_n += 1
            micro = []
            job.step += 1
            if job.faults:
                job.faults.at_step(job.step, unwrap(job.model))
            if bar:
                bar.update(1)
            if cfg.ckpt_every and job.step % cfg.ckpt_every == 0:
                save_checkpoint(job)
            if job.step % cfg.log_every == 0 or job.step == job.total_steps:
                now = time.perf_counter()
                (loss,) = all_reduce_sum(ctx, [window_loss / max(window_n, 1)])
                record = {"event": "train", "step": job.step, "epoch": epoch, "loss": loss / ctx.world_size,
                          "lr": job.scheduler.get_last_lr()[0],
                          "samples_per_s": (job.step - last_step) * cfg.batch_size / max(now - last_t, 1e-9)}
                writer.log(record)
                say(f"step {job.step}/{job.total_steps} epoch {epoch} loss {record['loss']:.4f} "
                    f"lr {record['lr']:.2e} {record['samples_per_s']:.0f} samples/s", bar)
                window_loss, window_n, last_t, last_step, logged_loss = 0.0, 0, now, job.step, record["loss"]
            if job.step >= job.total_steps:
                break
        end_of_epoch = loader.position == 0
        if end_of_epoch and (cfg.eval_every_epoch or job.step >= job.total_steps):
            ev, ev_step = evaluate(job.model, job.test_loader, ctx, cfg.amp), job.step
            writer.log({"event": "eval", "step": job.step, "epoch": epoch, **ev})
            say(f"eval epoch {epoch}: loss {ev['eval_loss']:.4f} accuracy {ev['eval_accuracy']:.4f} "
                f"({ev['eval_samples']} samples)", bar)
    if bar:
        bar.close()
    if ev_step != job.step:  # stopped mid-epoch (max_steps): evaluate the final weights
        ev = evaluate(job.model, job.test_loader, ctx, cfg.amp)
        writer.log({"event": "eval", "step": job.step, "epoch": loader.epoch, **ev})
    wall = time.perf_counter() - start
    # The final step is always logged, so the last logged loss is the last window's mean over ranks.
    return {"train_loss_last_window": logged_loss, "wall_s": wall,
            "samples_per_s": (job.step - start_step) * cfg.batch_size / max(wall, 1e-9), **ev}


def _printer(ctx: DistContext):
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


def finish(job: Job, result: dict[str, Any], writer: RunWriter) -> dict[str, Any]:
    ctx = job.ctx
    digest = param_sha256(unwrap(job.model))
    differ = disagreeing_ranks(ctx, digest)
    if differ:
        raise UserError(f"final parameters differ across ranks: ranks {sorted(differ)} disagree with rank 0",
                        "a rank desynchronised; rerun with the sync checks on to find where")
    summary = {"world_size": ctx.world_size, "steps": job.step, "epochs": job.train_loader.epoch,
               "train_loss": result.pop("train_loss_last_window"), **result, "param_sha256": digest,
               "param_sha256_all_ranks_equal": True, "config_hash": job.cfg.hash(),
               "ddp_kit": __version__, "torch": torch.__version__, "backend": ctx.backend, "device": str(ctx.device),
               "resumed_from_step": job.resumed_from}
    writer.write_summary(summary)
    return summary


def run(cfg: TrainConfig, env: DistEnv | None = None) -> dict[str, Any]:
    """Run the job described by `cfg` in this process's place in the job; returns the summary."""
    env = detect() if env is None else env
    per_rank_batch(cfg.batch_size, env.world_size, cfg.grad_accum)  # refuse before any rendezvous
    with distributed(env, cfg.backend, cfg.device, cfg.init_timeout_s) as ctx:
        writer = RunWriter(cfg.run_dir, ctx.is_main)
        try:
            writer.write_config(cfg.to_dict())
            job = build(cfg, ctx)
            if ctx.is_main:
                print(f"ddp_kit: {cfg.model} on {cfg.dataset}, {ctx.world_size} rank(s) ({ctx.backend}, {ctx.device}), "
                      f"global batch {cfg.batch_size} = {ctx.world_size} x {job.train_loader.micro_batch} x {cfg.grad_accum} "
                      f"accum, {job.total_steps} steps, run_dir {cfg.run_dir}", flush=True)
            resume(job, _printer(ctx))
            try:
                result = train(job, writer)
                save_checkpoint(job)  # the final one; returns at once if this step is already saved
            finally:
                job.ckpt.wait()  # never leave with an async save half-written
            summary = finish(job, result, writer)
            if ctx.is_main:
                print(f"done: {summary['steps']} steps, eval accuracy {summary['eval_accuracy']:.4f} on "
                      f"{summary['eval_samples']} samples, {summary['wall_s']:.1f}s, param_sha256 {summary['param_sha256'][:16]}",
                      flush=True)
            return summary
        finally:
            writer.close()


def cli(config: str | None = None, dry_run: bool = False, help_config: bool = False, preflight_world_size: int = 0,
        **flags: Any) -> None:
    """python -m ddp_kit.train [CONFIG.yaml] [--key value ...] [--dry_run] [--help_config]

    --preflight_world_size N (with --dry_run): check the config as if N ranks will run it; the launch
    scripts use it to refuse a bad config before torchrun starts any worker.
    """
    rank = 0
    try:
        env = detect()
        rank = env.rank
        if help_config:
            if env.is_main:
                print(help_text())
            return
        cfg = resolve(config, flags)
        if dry_run:
            world = int(preflight_world_size) or env.world_size
            micro = per_rank_batch(cfg.batch_size, world, cfg.grad_accum)
            if env.is_main:
                import yaml

                print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
                print(f"# world_size {world} ({env.launcher}); per-rank micro-batch {micro}; config hash {cfg.hash()}")
            return
        run(cfg, env)
    except UserError as err:
        report_user_error(err, rank)
        sys.exit(EXIT_USER_ERROR)


def main() -> None:
    import fire

    fire.Fire(cli)


if __name__ == "__main__":
    main()

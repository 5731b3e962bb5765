"""The reference job's command: `python -m ddp_kit.train [CONFIG.yaml] [--key value ...]`.

A client of the public API, as a user's own script would be (it imports only package faces:
tests/test_layering.py checks): `ddp_kit.init()` gives the process group, the run folder and the
reliability layer; the reference job builds its parts (job.py), runs its loop (loop.py) and writes
its summary. The same command runs as one process or under torchrun/srun; nothing here branches
on it. Every failure goes through the failure policy (reliability/failures.py) when the `with` block
exits, so this file has no error handling of its own beyond the CLI's.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import torch

from .. import __version__
from ..api import AUTO, Run, init, init_options
from ..data import per_rank_batch
from ..dist import announce
from ..doctor import findings_for_error, oom_report
from ..env import DistEnv, detect
from ..errors import EXIT_USER_ERROR, UserError, hold_for_rank0, report_user_error
from ..reliability import param_sha256, refuse_changed
from .config import TrainConfig, help_text, resolve
from .inject import parse as parse_faults
from .job import build
from .loop import train


def _injected_config(cfg: TrainConfig, rank: int) -> TrainConfig:
    """Test hooks `config:rank=R` (that rank trains with a different seed, as if it had read another
    file) and `nodata:rank=R` (that rank's data_root is missing, as on a node without the files)."""
    faults = [f for f in parse_faults(cfg.inject) if f.rank == rank]
    if any(f.kind == "config" for f in faults):
        cfg = dataclasses.replace(cfg, seed=cfg.seed + 1)
    if any(f.kind == "nodata" for f in faults):
        cfg = dataclasses.replace(cfg, data_root=f"{cfg.data_root}/.not-on-this-node")
    return cfg


def policy(cfg: TrainConfig) -> dict[str, Any]:
    """The config keys that are `ddp_kit.init`'s options (the step boundary's policy), by the same names."""
    names = set(init_options()) - {"ckpt_every_s", "ckpt_write_delay_s"}
    return {**{n: getattr(cfg, n) for n in names}, "ckpt_every_s": 0.0, "ckpt_write_delay_s": cfg.debug_ckpt_delay_s}


def refuse_changed_recipe(cfg: TrainConfig, batch: dict | None = None):
    """A resume must not silently mix recipes: a changed optimizer fails deep inside torch, and a
    changed lr or batch would be silently overridden by (or mixed with) the restored state. `cfg` as
    given (batch_size auto stays "auto"); `batch`: what auto settled on, against what the checkpoint's did."""
    def check(meta: dict) -> str | None:
        note = refuse_changed(meta.get("config") or {}, cfg.to_dict(), meta["path"],
                              "use a new --run_dir, or --resume never to start over in this one")
        saved = (meta.get(AUTO_BATCH_META) or {}).get("global_batch")
        if batch is not None and saved is not None and saved != batch["global_batch"]:
            raise UserError(f"cannot resume from {meta['path']}: it trained with a global batch of {saved} (batch_size "
                            f"auto), and this start settled on {batch['global_batch']} (no run_dir/batch_size.json to "
                            f"read it from?)", f"write {{\"global_batch\": {saved}}} into run_dir/batch_size.json, or use "
                            "--resume never to start over", verdict=True)
        return note
    return check


AUTO_BATCH_META = "batch_size_auto"  # every checkpoint's meta.json: what --batch_size auto settled on


def run(cfg: TrainConfig, env: DistEnv | None = None) -> dict[str, Any]:
    """Run the reference job described by `cfg` as this process's rank; returns the summary.
    A failure ends the process (SystemExit with the failure policy's code)."""
    env = detect() if env is None else env
    if cfg.batch_size != AUTO:
        per_rank_batch(cfg.batch_size, env.world_size, cfg.grad_accum)  # refuse before any rendezvous
    cfg = _injected_config(cfg, env.rank)
    with init(cfg.run_dir, backend=cfg.backend, device=cfg.device, timeout_s=cfg.init_timeout_s, seed=cfg.seed,
              env=env, config=cfg.to_dict(), tf32=cfg.tf32, cudnn_benchmark=cfg.cudnn_benchmark,
              deterministic=cfg.deterministic, **policy(cfg)) as run:
        run.explain_cuda_errors(lambda err: cuda_notes(cfg, run, err))
        return _job(cfg, run)


def cuda_notes(cfg: TrainConfig, run: Run, err: BaseException) -> list[str]:
    """Printed beside a CUDA error: on OOM what this rank held and what to change; the doctor's findings."""
    oom = isinstance(err, torch.cuda.OutOfMemoryError) and cfg.batch_size != AUTO  # auto: before it is settled
    micro = run.micro_batch(cfg.batch_size, cfg.grad_accum) if oom else 0
    return (oom_report(run.device, micro, cfg.batch_size, cfg.grad_accum, cfg.amp) if oom else []) + \
        findings_for_error(err, cfg.amp)


def _job(given: TrainConfig, run: Run) -> dict[str, Any]:
    job = build(given, run)
    cfg = job.cfg  # batch_size auto: the global batch settled
    run.explain_cuda_errors(lambda err: cuda_notes(cfg, run, err))
    env = run.ctx.env
    engine = getattr(env, "engine", None)
    launcher = f"{env.launcher} under {engine}" if engine else env.launcher
    run.print(f"ddp_kit: {cfg.model} on {cfg.dataset}, {run.world_size} rank(s) ({run.ctx.backend}, {run.device}, "
              f"{launcher}), "
              f"global batch {cfg.batch_size} = {run.world_size} x {job.train_loader.micro_batch} x {cfg.grad_accum} "
              f"accum, {job.total_steps} steps, run_dir {cfg.run_dir}")
    start = run.resume(optimizer=job.optimizer, scheduler=job.scheduler, scaler=job.scaler,
                       check=refuse_changed_recipe(given, job.batch),
                       meta={AUTO_BATCH_META: {k: job.batch[k] for k in ("global_batch", "per_rank_batch")}}
                       if job.batch else None)
    if start:
        # A resumed run is the recovery, not the fault; only a deterministic (:always=1) one fires again.
        job.faults = type(job.faults)(job.faults.faults, run.rank, armed=False)
    result = train(job)
    run.save()  # the final checkpoint; returns at once if this step is already saved
    run.heartbeat("finish")
    digest = param_sha256(run.unwrap(job.model))
    # Under FSDP every rank hashes the same gathered weights: equal by construction, so no exchange
    # and no verdict (null in the summary).
    from ..parallel import find_strategy as strategy

    sharded = strategy(cfg.strategy).sharded
    differ = [] if sharded else [r for r, d in enumerate(run.gather(digest)) if d != digest]
    if differ:
        raise UserError(f"final parameters differ across ranks: ranks {differ} disagree with this one",
                        "a rank desynchronised; rerun with the sync checks on to find where")
    summary = {"world_size": run.world_size, "steps": run.steps_done, "epochs": job.train_loader.epoch, **result,
               "param_sha256": digest, "config_hash": given.hash(), "batch_size": cfg.batch_size,
               "per_rank_batch": job.train_loader.micro_batch,
               "param_sha256_all_ranks_equal": None if sharded else True,
               "ddp_kit": __version__, "torch": torch.__version__, "backend": run.ctx.backend,
               "device": str(run.device), "resumed_from_step": int(start) or None, "strategy": cfg.strategy,
               "model_state_bytes": run.memory}
    run.write_summary(summary)
    if run.memory:
        m = run.memory
        run.print(f"model state per rank ({cfg.strategy}, rank 0): parameters {m['param_bytes'] / 2**20:.2f} MiB, "
                  f"gradients {m['grad_bytes'] / 2**20:.2f} MiB, optimizer {m['optim_bytes'] / 2**20:.2f} MiB")
    acc = f", eval accuracy {summary['eval_accuracy']:.4f}" if "eval_accuracy" in summary else ""
    run.print(f"done: {summary['steps']} steps{acc}, eval loss {summary['eval_loss']:.4f} on "
              f"{summary['eval_samples']} samples, {summary['wall_s']:.1f}s, param_sha256 {summary['param_sha256'][:16]}")
    return summary


def _micro_batches(batch_size: int | str, worlds: list[int], grad_accum: int) -> list[int | str]:
    """The per-rank micro-batch at each world size; with several (an elastic job), a batch that does
    not split at one of them is refused with a size that splits at all of them."""
    if batch_size == AUTO:  # settled at the run's start, by trials on the GPUs
        return [AUTO for _ in worlds]
    try:
        return [per_rank_batch(batch_size, world, grad_accum) for world in worlds]
    except UserError as err:
        if len(worlds) < 2:
            raise
        parts = math.lcm(*worlds) * grad_accum
        sizes = ", ".join(map(str, worlds))
        raise UserError(f"{err.message}, one of the world sizes this elastic job may run at ({sizes})",
                        f"use a multiple of {parts}, e.g. batch_size {max(parts, batch_size // parts * parts)}") from None


def cli(config: str | None = None, dry_run: bool = False, help_config: bool = False,
        preflight_world_size: int | tuple[int, ...] = 0, **flags: Any) -> None:
    """python -m ddp_kit.train [CONFIG.yaml] [--key value ...] [--dry_run] [--help_config]

    --preflight_world_size N (with --dry_run): check the config as if N ranks will run it; the launch
    scripts use it to refuse a bad config before torchrun starts any worker. N1,N2,...: every world
    size an elastic job may run at.
    """
    rank, env = 0, None
    # `--help` is what a user types first; fire hands it to **flags like any other key
    help_config = help_config or bool(flags.pop("help", False)) or bool(flags.pop("h", False))
    try:
        env = detect()
        rank = env.rank
        if help_config:
            if env.is_main:
                print(f"{cli.__doc__.splitlines()[0]}\n\n{help_text()}")
            return
        cfg = resolve(config, flags)
        if dry_run:
            sizes = preflight_world_size if isinstance(preflight_world_size, (tuple, list)) else (preflight_world_size,)
            worlds = [int(w) or env.world_size for w in sizes]
            micros = _micro_batches(cfg.batch_size, worlds, cfg.grad_accum)
            if env.is_main:
                import yaml

                print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
                for world, micro in zip(worlds, micros):
                    print(f"# world_size {world} ({env.launcher}); per-rank micro-batch {micro}; config hash {cfg.hash()}")
            return
        run(cfg, env)
    except UserError as err:  # before the run exists (config, layout, rendezvous)
        report_user_error(err, rank)
        if err.local and env is not None and not getattr(err, "posted", False):
            announce(env, err)  # the others may be waiting for this rank in the rendezvous
        hold_for_rank0(err, rank)
        sys.exit(EXIT_USER_ERROR)


def main() -> None:
    import fire

    fire.Fire(cli)

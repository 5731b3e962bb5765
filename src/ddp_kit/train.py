"""The reference training job: `python -m ddp_kit.train [CONFIG.yaml] [--key value ...]`.

The same command runs as one process or under torchrun/srun; nothing here branches on it.
Parse -> build -> train -> summarize, inside `distributed()`, which always tears down.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
import traceback
from typing import Any

import torch

from . import __version__
from .config import TrainConfig, help_text, resolve
from .data import per_rank_batch
from .dist import distributed
from .doctor import findings_for_error, is_cuda_error, oom_report
from .env import DistEnv, detect
from .errors import EXIT_USER_ERROR, UserError, report_user_error
from .faults import parse as parse_faults
from .job import Job, build, resume, save_checkpoint
from .loop import rank0_printer, train
from .outputs import RunWriter
from .preempt import EXIT_PREEMPTED, PreemptFlag, Preempted, requeue
from .sync import check_agreement, disagreeing_ranks, param_sha256, shapes_digest
from .watchdog import (EXIT_HANG, EXIT_PEER_FAILED, Progress, Watchdog, diagnose_peer_loss, disable_crash_dump,
                       enable_crash_dump, is_comm_error, peer_failure, post_failure, stop_line)
from .wrap import unwrap


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


class Reported(Exception):
    """An error already printed with its rank; the CLI only sets the exit code."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def startup_agreement(job: Job) -> None:
    """Before step 1: every rank must hold the same recipe, versions, data and model shapes."""
    cfg, ctx, loader = job.cfg, job.ctx, job.train_loader
    facts = {"config": cfg.hash(), "world_size": ctx.world_size, "ddp_kit": __version__, "torch": torch.__version__,
             "dataset_len": len(loader.dataset), "steps_per_epoch": loader.steps_per_epoch,
             "param_shapes": shapes_digest(unwrap(job.model)), "resumed_step": job.step}
    check_agreement(ctx, facts, details={"config": cfg.to_dict()})


def _injected_config(cfg: TrainConfig, rank: int) -> TrainConfig:
    """Test hook `config:rank=R`: that rank trains with a different seed, as if it had read another file."""
    if any(f.kind == "config" and f.rank == rank for f in parse_faults(cfg.inject)):
        return dataclasses.replace(cfg, seed=cfg.seed + 1)
    return cfg


def run(cfg: TrainConfig, env: DistEnv | None = None) -> dict[str, Any]:
    """Run the job described by `cfg` in this process's place in the job; returns the summary."""
    env = detect() if env is None else env
    per_rank_batch(cfg.batch_size, env.world_size, cfg.grad_accum)  # refuse before any rendezvous
    cfg = _injected_config(cfg, env.rank)
    progress = Progress()
    preempt_flag = PreemptFlag().install()
    hang_dir = f"{cfg.run_dir}/hang"
    with distributed(env, cfg.backend, cfg.device, cfg.init_timeout_s, dump_dir=hang_dir) as ctx:
        writer = RunWriter(cfg.run_dir, ctx.is_main)
        watchdog = Watchdog(ctx.rank, ctx.world_size, progress, cfg.hang_timeout_s, cfg.init_timeout_s, hang_dir).start()
        crash_file = enable_crash_dump(hang_dir, ctx.rank)
        progress.mirror(f"{hang_dir}/rank{ctx.rank}.progress")
        try:
            writer.write_config(cfg.to_dict())
            job = build(cfg, ctx, progress)
            if ctx.is_main:
                print(f"ddp_kit: {cfg.model} on {cfg.dataset}, {ctx.world_size} rank(s) ({ctx.backend}, {ctx.device}), "
                      f"global batch {cfg.batch_size} = {ctx.world_size} x {job.train_loader.micro_batch} x {cfg.grad_accum} "
                      f"accum, {job.total_steps} steps, run_dir {cfg.run_dir}", flush=True)
            resume(job, rank0_printer(ctx))
            startup_agreement(job)
            job.preempt = preempt_flag
            try:
                result = train(job, writer)
                save_checkpoint(job)  # the final one; returns at once if this step is already saved
            except Preempted as stop:
                save_checkpoint(job)
                job.ckpt.wait()
                wants_requeue = stop.signum == signal.SIGUSR2 and "SLURM_JOB_ID" in os.environ
                if ctx.is_main:
                    # Printed before the requeue: SLURM ends this job the moment it requeues it.
                    print(f"ddp_kit: preempted by {signal.Signals(stop.signum).name} after step {job.step}: checkpoint "
                          f"saved; {'requeueing the job' if wants_requeue else 'not requeued'}; exiting with "
                          f"{EXIT_PREEMPTED}", file=sys.stderr, flush=True)
                    if wants_requeue:
                        print(f"ddp_kit: {requeue()}", file=sys.stderr, flush=True)
                raise Reported(EXIT_PREEMPTED) from None
            finally:
                job.ckpt.wait()  # never leave with an async save half-written
            progress.enter("finish")
            summary = finish(job, result, writer)
            if ctx.is_main:
                print(f"done: {summary['steps']} steps, eval accuracy {summary['eval_accuracy']:.4f} on "
                      f"{summary['eval_samples']} samples, {summary['wall_s']:.1f}s, param_sha256 {summary['param_sha256'][:16]}",
                      flush=True)
            return summary
        except UserError as err:
            if err.rank is not None:  # only this rank hit it: the others must not wait for it
                post_failure(ctx.rank, progress, err)
            raise
        except Reported:
            raise
        except Exception as err:
            if watchdog.aborting.is_set():  # the hang report is out; this error is its echo
                time.sleep(30)  # the watchdog ends the process with the hang exit code
                raise Reported(EXIT_HANG) from err
            failed = peer_failure(ctx.rank)
            if failed:  # another rank failed first; this error (a broken connection) follows from it
                print(stop_line(ctx.rank, failed), file=sys.stderr, flush=True)
                raise Reported(EXIT_PEER_FAILED) from err
            if is_comm_error(err):  # perhaps a peer died without posting: find it and name it
                line = diagnose_peer_loss(ctx.rank, ctx.world_size, hang_dir)
                if line:
                    if ctx.is_main or "stopping:" in line:
                        print(line, file=sys.stderr, flush=True)
                    raise Reported(EXIT_PEER_FAILED) from err
            # Print before telling the others: once they stop, torchrun may kill this process.
            print(f"ddp_kit: error: rank {ctx.rank} failed at step {progress.step} in {progress.phase}: "
                  f"{type(err).__name__}: {err}\n" + "".join(traceback.format_exception(err)), file=sys.stderr, flush=True)
            if is_cuda_error(err):
                notes = oom_report(ctx.device, per_rank_batch(cfg.batch_size, ctx.world_size, cfg.grad_accum),
                                   cfg.batch_size, cfg.grad_accum, cfg.amp) if isinstance(err, torch.cuda.OutOfMemoryError) else []
                for line in notes + findings_for_error(err, cfg.amp):
                    print(f"ddp_kit: [rank {ctx.rank}] {line}", file=sys.stderr, flush=True)
            post_failure(ctx.rank, progress, err)
            raise Reported(1) from err
        finally:
            preempt_flag.restore()
            watchdog.stop()
            writer.close()
            progress.unmirror()
            disable_crash_dump(crash_file)


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
    except Reported as done:
        sys.exit(done.code)


def main() -> None:
    import fire

    fire.Fire(cli)


if __name__ == "__main__":
    main()

"""The reference training job: `python -m ddp_kit.train [CONFIG.yaml] [--key value ...]`.

The same command runs as one process or under torchrun/srun; nothing here branches on it.
Parse -> build -> train -> summarize, inside `distributed()`, which always tears down.
"""
from __future__ import annotations

import dataclasses
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .ckpt_folder import archive_abandoned
from .config import TrainConfig, help_text, resolve
from .data import per_rank_batch
from .dist import DistContext, all_gather_object, barrier, distributed, hosts_store, rank0_verdict
from .doctor import findings_for_error, is_cuda_error, oom_report
from .env import DistEnv, detect
from .errors import EXIT_USER_ERROR, UserError, report_user_error
from .failfast import EXIT_PEER_FAILED, LINGER_S, announce, peer_failure, post, same_error, say_stop
from .faults import parse as parse_faults
from .job import Job, build, resume, save_checkpoint
from .loop import rank0_printer, train
from .outputs import RunWriter
from .preempt import PreemptFlag, Preempted, exit_code, requeue
from .rundir import RunDir, RunLock, check_writable, new_token, remove_token, sees_token, write_token
from .sync import check_agreement, disagreeing_ranks, param_sha256, shapes_digest
from .watchdog import (EXIT_HANG, Progress, Watchdog, diagnose_peer_loss, disable_crash_dump, enable_crash_dump,
                       is_comm_error)
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
    """Test hooks `config:rank=R` (that rank trains with a different seed, as if it had read another
    file) and `nodata:rank=R` (that rank's data_root is missing, as on a node without the files)."""
    faults = [f for f in parse_faults(cfg.inject) if f.rank == rank]
    if any(f.kind == "config" for f in faults):
        cfg = dataclasses.replace(cfg, seed=cfg.seed + 1)
    if any(f.kind == "nodata" for f in faults):
        cfg = dataclasses.replace(cfg, data_root=f"{cfg.data_root}/.not-on-this-node")
    return cfg


def prepare_run_dir(ctx: DistContext, rd: RunDir) -> RunLock | None:
    """Before any work: the folder is writable, no other job uses it, and every rank sees it."""
    lock = None

    def rank0() -> str:
        nonlocal lock  # stays on rank 0: only the token travels
        check_writable(rd.path)
        lock = RunLock(rd.path / ".lock", ctx.env.job_id).acquire()
        token = new_token()
        write_token(rd.path, token) if ctx.world_size > 1 else None
        return token

    token = rank0_verdict(ctx, rank0)
    if ctx.world_size > 1:
        seen = all_gather_object(ctx, (sees_token(rd.path, token), socket.gethostname()))
        if ctx.is_main:
            remove_token(rd.path, token)
        blind = [(r, host) for r, (ok, host) in enumerate(seen) if not ok]
        if blind:
            r, host = blind[0]
            more = f" (and {len(blind) - 1} more rank(s))" if len(blind) > 1 else ""
            raise UserError(f"run_dir {str(rd.path)!r} is not one shared folder: rank {r} on {host}{more} cannot see a "
                            f"file rank 0 wrote there; checkpoints need every rank to write into the same folder",
                            "put run_dir on storage every node mounts (an absolute path); per-node run folders are not supported")
    return lock


def fresh_or_continue(job: Job, rd: RunDir, writer: RunWriter, say) -> None:
    """One lineage per run folder: what a fresh start (`--resume never`) or a resume from an older
    checkpoint leaves behind (higher steps, their metrics) moves to run_dir/archive/<time>/."""
    if not job.ctx.is_main:
        return
    if job.resumed_from is None and job.cfg.resume != "never":
        if not (rd.checkpoints / "latest").exists():
            writer.supersede(None, rd.archive)  # a first run: earlier metrics without checkpoints are not ours
        return
    ours = job.resumed_path is not None and job.resumed_path.resolve().parent == rd.checkpoints.resolve()
    # A checkpoint from another folder starts a new lineage here: whatever this folder held is abandoned.
    moved = archive_abandoned(rd.checkpoints, job.resumed_from if ours else None, rd.archive)
    writer.supersede(job.resumed_from if ours else None, rd.archive)
    if moved:
        say(f"ddp_kit: moved checkpoint(s) {', '.join(f'step_{s}' for s in moved)} of an abandoned run to {rd.archive}/")


def closing(ctx: DistContext, flag: PreemptFlag) -> None:
    """This process handles its own failure now: no follow-on exit by fail-fast, and a SIGTERM that
    torchrun sends to the survivors is not mistaken for a preemption."""
    if ctx.failfast is not None:
        ctx.failfast.quiet()
    flag.closing = True


def linger(ctx: DistContext) -> None:
    """The store host stays a moment after posting a failure, so the others read it (see LINGER_S)."""
    if hosts_store(ctx.env):
        time.sleep(LINGER_S)


def run(cfg: TrainConfig, env: DistEnv | None = None) -> dict[str, Any]:
    """Run the job described by `cfg` in this process's place in the job; returns the summary."""
    env = detect() if env is None else env
    per_rank_batch(cfg.batch_size, env.world_size, cfg.grad_accum)  # refuse before any rendezvous
    cfg = _injected_config(cfg, env.rank)
    progress = Progress()
    box: dict[str, Job] = {}
    preempt_flag = PreemptFlag(env.rank, where=lambda: (progress.step, box["job"].saved_step if box else None)).install()
    rd = RunDir(Path(cfg.run_dir))
    hang_dir = str(rd.hang)
    try:
        with distributed(env, cfg.backend, cfg.device, cfg.init_timeout_s, dump_dir=hang_dir) as ctx:
            return _run(cfg, ctx, rd, progress, preempt_flag, box)
    finally:
        preempt_flag.restore()


def _run(cfg: TrainConfig, ctx: DistContext, rd: RunDir, progress: Progress, preempt_flag: PreemptFlag,
         box: dict) -> dict[str, Any]:
    hang_dir = str(rd.hang)
    lock = writer = crash_file = None
    watchdog = Watchdog(ctx.store_client() if cfg.hang_timeout_s > 0 else None, ctx.rank, ctx.world_size, progress, cfg.hang_timeout_s, cfg.init_timeout_s, hang_dir)
    try:
        lock = prepare_run_dir(ctx, rd)
        writer = RunWriter(cfg.run_dir, ctx.is_main)
        watchdog.start()
        crash_file = enable_crash_dump(hang_dir, ctx.rank)
        progress.mirror(f"{hang_dir}/rank{ctx.rank}.progress")
        job = box["job"] = build(cfg, ctx, progress)
        say = rank0_printer(ctx)
        say(f"ddp_kit: {cfg.model} on {cfg.dataset}, {ctx.world_size} rank(s) ({ctx.backend}, {ctx.device}), "
            f"global batch {cfg.batch_size} = {ctx.world_size} x {job.train_loader.micro_batch} x {cfg.grad_accum} "
            f"accum, {job.total_steps} steps, run_dir {cfg.run_dir}")
        resume(job, say)
        progress.enter(progress.phase, job.step)
        fresh_or_continue(job, rd, writer, say)
        writer.write_config(cfg.to_dict())
        startup_agreement(job)
        job.preempt = preempt_flag
        try:
            result = train(job, writer)
            save_checkpoint(job)  # the final one; returns at once if this step is already saved
        except Preempted as stop:
            save_checkpoint(job)
            progress.enter("checkpoint")  # an async save may still be writing: a slow phase, not a hang
            job.ckpt.wait()
            wants_requeue = stop.signum == signal.SIGUSR2 and ctx.env.batch_job_id is not None
            code = exit_code(stop.signum)
            if ctx.is_main:
                # Printed before the requeue: SLURM ends this job the moment it requeues it.
                what = "interrupted" if stop.signum == signal.SIGINT else "preempted"
                print(f"ddp_kit: {what} by {signal.Signals(stop.signum).name} after step {job.step}: checkpoint "
                      f"saved; {'requeueing the job' if wants_requeue else 'rerun the same command to resume'}; "
                      f"exiting with {code}", file=sys.stderr, flush=True)
                if wants_requeue:
                    print(f"ddp_kit: {requeue()}", file=sys.stderr, flush=True)
            # No rank exits before the requeue is done: under `srun --kill-on-bad-exit` the first
            # rank to exit non-zero gets every other task (and rank 0's scontrol) killed.
            barrier(ctx)
            raise Reported(code) from None
        finally:
            job.ckpt.wait()  # never leave with an async save half-written
        progress.enter("finish")
        summary = finish(job, result, writer)
        say(f"done: {summary['steps']} steps, eval accuracy {summary['eval_accuracy']:.4f} on "
            f"{summary['eval_samples']} samples, {summary['wall_s']:.1f}s, param_sha256 {summary['param_sha256'][:16]}")
        return summary
    except UserError as err:
        closing(ctx, preempt_flag)
        err.at(ctx.rank)
        stands = post(ctx.store, ctx.rank, progress.step, progress.phase, err)
        # Once for the job: the rank whose failure stands prints it; a rank with a different local
        # problem (another missing file) prints its own too.
        if stands is None or stands["rank"] == ctx.rank or (err.local and not same_error(stands, err)):
            print(err.line(), file=sys.stderr, flush=True)
        linger(ctx)
        raise Reported(EXIT_USER_ERROR) from None
    except Reported:
        raise
    except Exception as err:
        closing(ctx, preempt_flag)
        if watchdog.aborting.is_set():  # the hang report is out; this error is its echo
            time.sleep(30)  # the watchdog ends the process with the hang exit code
            raise Reported(EXIT_HANG) from err
        failed = peer_failure(ctx.store, ctx.rank)
        if failed:  # another rank failed first; this error (a broken connection) follows from it
            say_stop(ctx.rank, failed)
            raise Reported(EXIT_PEER_FAILED) from err
        if is_comm_error(err):  # perhaps a peer died without posting: find it and name it
            line = diagnose_peer_loss(ctx.store, ctx.rank, ctx.world_size, hang_dir)
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
        post(ctx.store, ctx.rank, progress.step, progress.phase, err)
        linger(ctx)
        raise Reported(1) from err
    finally:
        watchdog.stop()
        if writer is not None:
            writer.close()
        progress.unmirror()
        if crash_file is not None:
            disable_crash_dump(crash_file)
        if lock is not None:
            lock.release()


def cli(config: str | None = None, dry_run: bool = False, help_config: bool = False, preflight_world_size: int = 0,
        **flags: Any) -> None:
    """python -m ddp_kit.train [CONFIG.yaml] [--key value ...] [--dry_run] [--help_config]

    --preflight_world_size N (with --dry_run): check the config as if N ranks will run it; the launch
    scripts use it to refuse a bad config before torchrun starts any worker.
    """
    rank, env = 0, None
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
        if err.local and env is not None and not getattr(err, "posted", False):
            announce(env, err)  # the others may be waiting for this rank in the rendezvous
        sys.exit(EXIT_USER_ERROR)
    except Reported as done:
        sys.exit(done.code)


def main() -> None:
    import fire

    fire.Fire(cli)


if __name__ == "__main__":
    main()

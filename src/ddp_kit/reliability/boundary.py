"""The reliability layer behind `ddp_kit.init()`: run folder, checkpoints, preemption, hang watch,
sync checks and metrics, driven from any training loop by one call per optimizer step.

`Guard.step()` is the step boundary. A loop calls it as `run.step(loss)` after `optimizer.step()`,
or not at all: then every registered optimizer's `step()` is counted (a post-hook) and the
boundary runs when the loop next asks the loader from `run.prepare` for a batch (or at
`run.save()`, `run.close()`). By then the loop's own per-step work (a per-step LR scheduler,
zero_grad, a per-epoch scheduler after the last batch) is done, so what a checkpoint holds is
one consistent point of the run. Iterations with several optimizer steps (two optimizers) count once.

Everything the boundary does that involves the other ranks happens every N steps, on every rank
at the same step, so the ranks stay in lockstep without extra agreement:

    every step                 heartbeat (two attribute writes), loss folded into a device scalar
    preempt_check_every        one all-reduce: a stop signal on any rank, and "a timed checkpoint is
                               due" (rank 0's clock); then checkpoint, requeue on SLURM, exit 75
    sync_check_every           parameter/buffer checksums compared across ranks
    ckpt_every / ckpt_every_s  an atomic checkpoint of everything registered
    log_every                  one metrics.jsonl record (loss, lr, samples/s, per-rank time split)

Library code: it takes plain arguments (a Policy, a DistContext), never the job's config.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import __version__
from ..checkpoint.checkpointer import Checkpointer, rng_state, set_rng_state
from ..checkpoint.layout import archive_abandoned
from ..data import TrainLoader
from ..dist import (DistContext, all_reduce_sum, all_true, barrier, broadcast_object, gather_object, rank0_verdict,
                   set_collective_timeout)
from ..errors import UserError
from .crash import handle
from .metrics import GpuSpans, StepTimer, StragglerWatch, gather_ranks, summarize_ranks
from .numerics import NonFiniteLoss
from .outputs import RunWriter
from .preemption import PreemptFlag, agree_stop, exit_code, requeue
from .recipe import hyperparameters, is_scheduler, overridden, refuse_changed
from .run_dir import RunDir, RunLock, check_writable, new_token, remove_token, sees_token, write_token
from .train_state import TrainState
from ..parallel.fsdp import load_state_dicts, memory_bytes, state_dicts
from .sync_checks import check_agreement, check_consistency, optimizer_steps, param_sha256, shapes_digest
from .peer_loss import disable_crash_dump, enable_crash_dump
from .progress import Progress
from .watchdog import Watchdog
from ..parallel.wrap import settle_ddp_buckets, sync_ddp_buffers, unwrap


@dataclass(frozen=True)
class Policy:
    """What the step boundary does, and how often. Every field is a keyword of `ddp_kit.init()`."""

    run_dir: str | None = None  # checkpoints, metrics.jsonl, hang reports; None: no checkpoints
    resume: str = "auto"  # auto: the newest valid checkpoint in run_dir; never; or a step_<N> folder
    ckpt_every: int = 0  # optimizer steps between checkpoints (0: by time only)
    ckpt_every_s: float = 1800.0  # seconds between checkpoints (0: by steps only); checked every preempt_check_every
    keep_last: int = 3  # checkpoints kept (0: all)
    async_ckpt: bool = False  # write checkpoints in a background thread
    hang_timeout_s: float = 180.0  # no progress on a rank for this long: report the lagging rank, exit 3 (0: off)
    peer_timeout_s: float = 30.0  # a rank's heartbeat silent this long: it is named as gone, every rank exits (0: off)
    collective_timeout_s: float = 300.0  # every collective's timeout after step 1
    preempt_check_every: int = 10  # steps between the ranks' agreement on a stop signal
    sync_check_every: int = 100  # steps between cross-rank checksum comparisons (0: off)
    sync_fix: str = "error"  # on divergence: error, or broadcast rank 0's weights
    log_every: int = 50  # steps between metrics.jsonl records (0: off)
    rank_metrics: bool = True  # each record holds every rank's time split; stragglers are named
    rank_records_max: int = 64  # above this world size a record holds median/max/argmax per field instead
    straggler_margin: float = 0.2  # a rank this much slower than the median, twice in a row, is named
    ckpt_write_delay_s: float = 0.0  # test hook: slow every checkpoint write down


def _say(ctx: DistContext) -> Callable[[str], None]:
    def say(msg: str) -> None:
        if ctx.is_main:
            print(msg, flush=True)
    return say


class Guard:
    """One per process; made by `ddp_kit.init()`. `close()` is guaranteed by the Run's ExitStack."""

    def __init__(self, ctx: DistContext, policy: Policy, progress: Progress, flag: PreemptFlag):
        self.ctx, self.policy, self.progress, self.flag = ctx, policy, progress, flag
        self.rd = RunDir(Path(policy.run_dir)) if policy.run_dir else None
        # Without a run folder a hang still leaves its stacks somewhere findable.
        self.hang_dir = str(self.rd.hang) if self.rd else os.path.join(tempfile.gettempdir(), f"ddp_kit-hang-{os.getuid()}")
        self.state = TrainState()
        self.loaders: list[TrainLoader] = []
        self.models: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.meta: dict[str, Any] = {}
        self.strategy = "ddp"  # "fsdp" once run.prepare shards a model: its state is checkpointed by DCP
        self.memory: dict[str, int] = {}  # this rank's parameter/gradient/optimizer bytes (fsdp.memory_bytes)
        self._measure_grads = True  # at the next optimizer step: gradients exist only until zero_grad
        self._not_a_step = False  # an optimizer step that is not training (see _state_io)
        self.config: dict[str, Any] | None = None  # the run's own config: meta.json, config.yaml, startup agreement
        self.cuda_notes: Callable[[BaseException], list[str]] | None = None
        self.on_log: list[Callable[[dict], None]] = []
        self.say = _say(ctx)
        self.done = 0  # optimizer steps completed (resumed ones included)
        self.saved_step = -1
        self.resumed_from: int | None = None
        self.resumed_path: Path | None = None
        self.pending = False  # an optimizer stepped since the last boundary (implicit mode)
        self.owed: tuple[bool, bool] = (False, False)  # (checkpoint, stop check) deferred past an epoch's end
        self.resumed = False  # run.resume has run: objects registered later would never be restored
        self.explicit = False  # the loop calls run.step() itself: optimizer hooks count nothing
        self.stopped = False  # a stop signal was acted on: no final checkpoint at close
        self.failed = False  # this process ends on an error: no final checkpoint at close
        gpu_spans = ctx.device.type == "cuda" and policy.rank_metrics and policy.log_every > 0
        self.timer = StepTimer(gpu=GpuSpans() if gpu_spans else None)
        self.stragglers = StragglerWatch(policy.straggler_margin)
        self.nonfinite = NonFiniteLoss()
        self._window_loss: torch.Tensor | None = None
        self._window_n = 0
        self._last_log = (time.perf_counter(), 0)
        self._last_save_t = time.monotonic()
        self._started = time.perf_counter()
        self._summary_written = False  # the script (or the reference job) wrote summary.json itself
        self._last_eval: dict[str, Any] = {}  # the last record logged with event "eval" (run.log_event)
        self._last_train: dict[str, Any] = {}
        self._agreed = False
        self._ckpt: Checkpointer | None = None
        self._lock: RunLock | None = None
        self._writer: RunWriter | None = None
        self._crash_file = None
        self.watchdog = Watchdog(_watch_store(ctx) if policy.hang_timeout_s > 0 else None,
                                 ctx.rank, ctx.world_size, progress, policy.hang_timeout_s, ctx.timeout_s, self.hang_dir,
                                 peer_timeout_s=policy.peer_timeout_s)

    # ---- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> "Guard":
        """Before any work: the run folder is checked and locked, the watchdog runs."""
        if self.rd is not None:
            self._lock = prepare_run_dir(self.ctx, self.rd)
            self._writer = RunWriter(self.rd, self.ctx.is_main)
            if self.config is not None:
                self._writer.write_config(self.config)
            self._crash_file = enable_crash_dump(self.hang_dir, self.ctx.rank)
            self.progress.mirror(f"{self.hang_dir}/rank{self.ctx.rank}.progress")
        self.watchdog.start()
        return self

    def close(self) -> None:
        try:
            if self._ckpt is not None:
                self._ckpt.close()  # never leave with an async save half-written; frees its host buffers
        except Exception:
            if not self.failed:  # after a failure, the failure is what gets reported
                raise
        finally:
            self.watchdog.stop()
            if self._writer is not None:
                self._writer.close()
            self.progress.unmirror()
            if self._crash_file is not None:
                disable_crash_dump(self._crash_file)
            if self._lock is not None:
                self._lock.release()
            # Let go of the model, optimizer and loaders before the process group is destroyed: a
            # DDP reducer still alive then can abort the process at exit (pytorch#190489; the
            # teardown's gc.collect frees it only if nothing holds it).
            self.models.clear()
            self.optimizers.clear()
            self.loaders.clear()
            self.state.objects.clear()
            self.on_log.clear()
            self.cuda_notes = None

    def fail(self, err: BaseException) -> int:
        """This process ends on `err`: say what the failure policy says, return the exit code."""
        self.failed = True
        self.ctx.failing.set()
        if self.ctx.failfast is not None:
            self.ctx.failfast.quiet()
        self.flag.closing = True  # torchrun's SIGTERM to the survivors is not a preemption
        return handle(err, self.ctx, self.progress.step, self.progress.phase, self.hang_dir,
                      hang_declared=self.watchdog.aborting.is_set(), notes=self.cuda_notes)

    # ---- registration ---------------------------------------------------------------------------------

    def track(self, obj: Any, name: str | None = None) -> None:
        """Register `obj` for checkpointing (models, ddp_kit loaders, optimizers are also watched)."""
        if self.state.holds(obj):
            return
        if self.resumed:
            raise UserError(f"{type(obj).__name__} registered after run.resume(): it would never be restored "
                            f"from a checkpoint", "call run.prepare(...) and pass every object before run.resume(...)")
        if isinstance(obj, nn.Module):
            self.models.append(obj)
            obj.register_forward_hook(lambda *_: self.timer.mark("forward"))
            if isinstance(obj, DDP):
                # DDP's pre-forward broadcasts rank 0's buffers (BatchNorm statistics) to every rank,
                # a wait on the others: booked as comm (the loop's own work before the call as
                # other), and the forward is timed from the inner module's start. Only inside DDP's
                # call: the inner module alone (an eval) marks nothing.
                inside = [False]

                def entering(*_):
                    self.timer.mark("other")
                    inside[0] = True

                def inner_start(*_):
                    if inside[0]:
                        inside[0] = False
                        self.timer.mark("comm", gpu="forward start")
                obj.register_forward_pre_hook(entering)
                obj.module.register_forward_pre_hook(inner_start)
            base = "model"
        elif isinstance(obj, TrainLoader):
            self.loaders.append(obj)
            obj.on_fetch, obj.on_batch, obj.on_end = self._fetching, self._fetched, self._epoch_end
            base = "data"
        elif isinstance(obj, torch.optim.Optimizer):
            self.optimizers.append(obj)
            obj.register_step_pre_hook(self._stepping)  # backward and DDP's wait end here
            obj.register_step_post_hook(self._stepped)
            base = "optimizer"
        else:
            base = type(obj).__name__.lower()
        self.state.add(name or self.state.next_name(base), obj)

    def _stepping(self, *_) -> None:
        if self._not_a_step:
            return
        self.progress.enter("optimizer", self.done + 1)  # an error in optimizer.step() is named as being there
        self.timer.mark("backward")
        if self._measure_grads:
            self._measure_grads = False
            self.memory = memory_bytes(self.models, self.optimizers)

    def _stepped(self, *_) -> None:
        if self._not_a_step:
            return
        # The loop's own work after the optimizer step (scheduler.step(), zero_grad) is not forward/backward.
        self.progress.enter("after step", self.done + 1)
        self.timer.mark("optimizer")
        self.pending = not self.explicit

    def flush(self) -> None:
        """Run the boundary of an optimizer step the loop has not reached the next batch after, and
        what an epoch's last step owes (see step)."""
        if self.pending:
            self.step(None, implicit=True)
        save, check = self.owed
        if save or check:
            self.owed = (False, False)
            if check:
                save = self._stop_if_signalled() or save
            if save:
                self.save()
                self._stop_if_signalled()

    def _fetching(self) -> None:
        self.flush()
        self.progress.enter("data", self.done + 1)
        self.timer.mark("other")

    def _epoch_end(self) -> None:
        # The loop's own work between epochs (eval, a per-epoch scheduler) is a slow phase, not a hang.
        self.progress.enter("between epochs")

    def _fetched(self) -> None:
        self.timer.mark("data")
        self.progress.enter("forward/backward")

    @contextmanager
    def _state_io(self):
        """torch's get_state_dict gives an optimizer without state one step at lr 0 to create its state
        (so that a checkpoint can be loaded into it): that step is not the loop's, and must not count."""
        self._not_a_step = True
        try:
            yield
        finally:
            self._not_a_step = False

    def _named(self, kind: type) -> dict[str, Any]:
        return {n: o for n, o in self.state.objects.items() if isinstance(o, kind)}

    def _sharded(self) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
        """The registered models and optimizers whose state DCP saves (strategy fsdp); ({}, {}) under ddp."""
        if self.strategy != "fsdp":
            return {}, {}
        return self._named(nn.Module), self._named(torch.optim.Optimizer)

    @property
    def epoch(self) -> int:
        """Epochs the first registered loader has completed (0 when none is registered)."""
        return self.loaders[0].epoch if self.loaders else 0

    # ---- resume ---------------------------------------------------------------------------------------

    def checkpointer(self) -> Checkpointer:
        if self.rd is None:
            raise UserError("checkpoints need a run folder, and this run has none",
                            "pass run_dir to ddp_kit.init(run_dir=\"runs/my_run\")")
        if self._ckpt is None:
            p = self.policy
            self._ckpt = Checkpointer(self.ctx, self.rd.checkpoints, keep_last=p.keep_last, async_save=p.async_ckpt,
                                      timeout_s=self.ctx.timeout_s, write_delay_s=p.ckpt_write_delay_s)
        return self._ckpt

    def resume(self, objects: dict[str, Any], check: Callable[[dict], str | None] | None = None) -> int:
        """Register `objects`, then continue from the checkpoint `policy.resume` names (if any)."""
        for name, obj in objects.items():
            self.track(obj, name)
        self.resumed = True
        self.check_optimizers()
        ckpt = self.checkpointer()
        self.progress.enter("startup")
        found = ckpt.find(self.policy.resume, warn=lambda msg: self.say(f"ddp_kit: warning: {msg}"))
        if found is not None:
            shared, own, meta = ckpt.load(found)
            if check is None and self.config is not None:  # a script's own config: the reference job's rules
                check = lambda m: refuse_changed(m.get("config") or {}, self.config, m["path"],  # noqa: E731
                                                 "use a new run_dir, or resume='never' to start over in this one")
            scheduled = any(is_scheduler(o) for o in self.state.objects.values())
            scripted = hyperparameters(self._named(torch.optim.Optimizer), scheduled)
            # Before any state is loaded: the caller may refuse this checkpoint, or say what changed.
            said = check({**meta, "path": str(found.path)}) if check is not None else None
            written = meta.get("strategy", "ddp")
            if written != self.strategy:
                raise UserError(f"checkpoint {found.path} was written with strategy {written}; this run uses "
                                f"{self.strategy}",
                                f"resume it with strategy {written}, or export its weights (python -m ddp_kit.checkpoint "
                                f"export) and start a new run_dir from them")
            models, optimizers = self._sharded()
            notes = self.state.load_state_dict(shared, str(found.path), skip=frozenset(models) | frozenset(optimizers))
            if self.strategy == "fsdp":
                with self._state_io():
                    load_state_dicts(models, optimizers, ckpt.sharded_keys(found),
                                     lambda template: ckpt.load_sharded(found, template))
            self.done = self.saved_step = int(shared["loop"]["step"])
            self.resumed_from, self.resumed_path = self.done, found.path
            self._last_log = (time.perf_counter(), self.done)  # samples/s counts this process's steps only
            self.progress.enter("startup", self.done)
            if self.ctx.world_size > 1 and self.loaders:
                for model in self.models:  # see wrap.settle_ddp_buckets: bit-identical resume needs it
                    settle_ddp_buckets(model, self.loaders[0].sample_batch(), self.ctx.device)
            if own is not None and meta.get("world_size") == self.ctx.world_size:
                set_rng_state(own["rng"])
            else:
                torch.manual_seed(1_000_003 * self.done + self.ctx.rank)
            extra = [said] if said else []
            extra += overridden(scripted, hyperparameters(self._named(torch.optim.Optimizer), scheduled))
            if meta.get("world_size") != self.ctx.world_size:
                extra.append(f"written by {meta.get('world_size')} rank(s), resumed on {self.ctx.world_size}: "
                             f"data order continues, per-rank RNG streams are reseeded")
            self.say(f"ddp_kit: resumed from {found.path} (step {self.done}, epoch {self.epoch})"
                     + ("; " + "; ".join(extra) if extra else ""))
            for note in notes:
                self.say(f"ddp_kit: warning: {note}")
        self._archive_abandoned()
        if self.policy.ckpt_every == 0 and self.rd is not None:
            every = self.policy.ckpt_every_s
            self.say(f"ddp_kit: checkpoints {f'every {every / 60:g} min (ckpt_every_s) and ' if every > 0 else ''}at the "
                     f"end, none by step (ckpt_every=0); pass ckpt_every=N to ddp_kit.init for one every N steps")
        return self.done

    def _archive_abandoned(self) -> None:
        """One lineage per run folder: a fresh start (resume='never') or a resume from an older
        checkpoint moves what it abandons (higher steps, their metrics) to run_dir/archive/<time>/."""
        if not self.ctx.is_main or self.rd is None:
            return
        rd, writer = self.rd, self._writer
        if self.resumed_from is None and self.policy.resume != "never":
            if not (rd.checkpoints / "latest").exists():
                writer.supersede(None, rd.archive)  # a first run: earlier metrics without checkpoints are not ours
            return
        ours = self.resumed_path is not None and self.resumed_path.resolve().parent == rd.checkpoints.resolve()
        # A checkpoint from another folder starts a new lineage here: whatever this folder held is abandoned.
        moved = archive_abandoned(rd.checkpoints, self.resumed_from if ours else None, rd.archive)
        writer.supersede(self.resumed_from if ours else None, rd.archive)
        if moved:
            self.say(f"ddp_kit: moved checkpoint(s) {', '.join(f'step_{s}' for s in moved)} of an abandoned run "
                     f"to {rd.archive}/")

    def agree(self, facts: dict[str, Any] | None = None, details: dict[str, dict] | None = None) -> None:
        """Before step 1: every rank holds the same versions, data, model shapes and resumed step
        (plus the caller's `facts`); else every rank stops with one line naming the rank."""
        if self._agreed:
            return
        self._agreed = True
        mine = {"world_size": self.ctx.world_size, "ddp_kit": __version__, "torch": torch.__version__,
                "resumed_step": self.done, **(facts or {})}
        if self.config is not None:
            mine["config"] = config_hash(self.config)
            details = {**(details or {}), "config": self.config}
        for i, loader in enumerate(self.loaders):
            mine[f"loader{i}_dataset_len"] = len(loader.dataset)
            mine[f"loader{i}_steps_per_epoch"] = loader.steps_per_epoch
        for i, model in enumerate(self.models):
            mine[f"model{i}_param_shapes"] = shapes_digest(unwrap(model))
        with self.collective("startup"):
            check_agreement(self.ctx, mine, details)

    # ---- the step boundary ----------------------------------------------------------------------------

    def step(self, loss: torch.Tensor | float | None = None, implicit: bool = False) -> int:
        self.pending = False
        self.explicit = self.explicit or not implicit
        for loader in self.loaders:
            loader.commit()  # the batches this step used are consumed: the position a checkpoint keeps
        self.done += 1
        done, p, pol = self.done, self.progress, self.policy
        self.progress.enter("after step", done)
        # Since the optimizer step: the loop's own work (local). Without a registered optimizer, all of
        # it since the forward: backward (with DDP's wait) and the optimizer.
        self.timer.mark("other" if self.optimizers else "backward")
        self.timer.steps += 1
        if loss is not None:
            value = loss.detach().float() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
            self._window_loss = value if self._window_loss is None else self._window_loss + value
            self._window_n += 1
            self.nonfinite.update(value, done)
        if not p.warm:
            self._first_step_over()
        save = bool(self.state and pol.ckpt_every and done % pol.ckpt_every == 0)
        check = bool(pol.preempt_check_every and done % pol.preempt_check_every == 0)
        if not implicit and self.loaders and self.loaders[0].position == 0:
            # The last step of an epoch, called from inside the loop: the loop's end-of-epoch work (a
            # per-epoch scheduler step, an eval) is still to come, and a checkpoint taken now would
            # skip it on resume. Its checkpoint and stop check run at the next batch or epoch instead.
            self.owed = (self.owed[0] or save, self.owed[1] or check)
            save = check = False
        if check:
            save = self._stop_if_signalled() or save
        if pol.sync_check_every and done % pol.sync_check_every == 0:
            with self.collective("sync check"):
                self.nonfinite.check(self.ctx, self._ckpt)  # NaN weights would read as divergence
                steps = optimizer_steps(self._named(torch.optim.Optimizer))
                for i, model in enumerate(self.models):
                    warning = check_consistency(self.ctx, model, done, pol.sync_fix, extra=steps if i == 0 else [])
                    if warning:
                        self.say(f"ddp_kit: warning: {warning}")
        if save:
            self.save()
            self._stop_if_signalled()  # a signal that came during the save is acted on now
        if pol.log_every and done % pol.log_every == 0:
            self.log()
        self.progress.enter("after step")
        return done

    def check_optimizers(self) -> None:
        """Every registered optimizer steps parameters of a registered model; else the run would train
        nothing, or (FSDP) fail only at its first checkpoint, possibly hours later. The usual cause:
        the optimizer was made before run.prepare, which under FSDP replaces the parameters."""
        if not self.models:
            return
        owned = {id(p) for m in self.models for p in m.parameters()}
        for name, opt in self._named(torch.optim.Optimizer).items():
            params = [p for g in opt.param_groups for p in g["params"]]
            if not params or any(id(p) in owned for p in params):
                continue
            if self.strategy == "fsdp":
                raise UserError(f"optimizer {name!r} holds none of the prepared model's parameters (run.prepare(..., "
                                f"strategy='fsdp') replaces them with sharded ones): it would train nothing, and its "
                                f"checkpoint would fail",
                                "create the optimizer after run.prepare, from the model it returned: "
                                "optimizer = AdamW(model.parameters())", verdict=True)
            # Under DDP the parameters stay the same tensors: an optimizer over another module's (a
            # learnable loss head) is legitimate, but it is worth a word once.
            self.say(f"ddp_kit: warning: optimizer {name!r} holds none of the prepared models' parameters; if it "
                     f"should train the model, create it from the model run.prepare returned")

    def _first_step_over(self) -> None:
        if not self.resumed:  # run.resume checked them already
            self.check_optimizers()
        self.agree()
        # Startup is over (data ready, kernels compiled): from here a collective that takes longer
        # than collective_timeout_s is a fault, not a slow start.
        with self.collective("after step"):
            barrier(self.ctx)
        set_collective_timeout(self.ctx, self.policy.collective_timeout_s)
        self.progress.warm = True
        self.flag.started()  # from here a stop signal is agreed on and checkpointed

    def _stop_if_signalled(self) -> bool:
        """The ranks agree on any stop signal so far (acted on: this never returns) and on whether a
        timed checkpoint is due (returned)."""
        due = (self.ctx.is_main and bool(self.state) and self.policy.ckpt_every_s > 0 and self.rd is not None
               and time.monotonic() - self._last_save_t >= self.policy.ckpt_every_s)
        with self.collective("preemption check"):
            signum, due = agree_stop(self.ctx, self.flag, due)
        if signum:
            self.stop(signum)
        return due

    def stop(self, signum: int) -> None:
        """Checkpoint, requeue under SLURM (USR2), and exit 75 (130 for Ctrl-C), all ranks together."""
        saved = bool(self.state) and self.rd is not None
        if saved:
            self.save()
            self.progress.enter("checkpoint")  # an async save may still be writing: a slow phase, not a hang
            self._ckpt.wait()
        wants_requeue = signum == signal.SIGUSR2 and self.ctx.env.requeue_command is not None
        code = exit_code(signum)
        if self.ctx.is_main:
            # Printed before the requeue: SLURM ends this job the moment it requeues it.
            what = "interrupted" if signum == signal.SIGINT else "preempted"
            kept = ("checkpoint saved" if saved else "no checkpoint (no run_dir)" if self.rd is None
                    else "no checkpoint (nothing registered with run.resume)")
            print(f"ddp_kit: {what} by {signal.Signals(signum).name} after step {self.done}: {kept}; "
                  f"{'requeueing the job' if wants_requeue else 'rerun the same command to resume'}; "
                  f"exiting with {code}", file=sys.stderr, flush=True)
            if wants_requeue:
                print(f"ddp_kit: {requeue(self.ctx.env.requeue_command)}", file=sys.stderr, flush=True)
        # No rank exits before the requeue is done: under `srun --kill-on-bad-exit` the first rank
        # to exit non-zero gets every other task (and rank 0's scontrol) killed.
        barrier(self.ctx)
        self.stopped = True
        raise SystemExit(code)

    def save(self) -> None:
        """Checkpoint everything registered at this step (collective; returns at once if already saved)."""
        self.flush()
        ckpt = self.checkpointer()
        if not self.state or self.saved_step == self.done:
            return
        self.nonfinite.check(self.ctx, ckpt)  # never save a run whose loss went NaN/inf
        for model in self.models:  # model.pt holds rank 0's buffers: from here every rank has those too
            sync_ddp_buffers(model)
        models, optimizers = self._sharded()
        shared = {**self.state.state_dict(skip=frozenset(models) | frozenset(optimizers)), "loop": {"step": self.done}}
        with self._state_io():
            sharded = state_dicts(models, optimizers) if self.strategy == "fsdp" else None
        meta = {"ddp_kit": __version__, "torch": torch.__version__, "strategy": self.strategy, **self.meta}
        if self.config is not None:
            meta.update(config=self.config, config_hash=config_hash(self.config))
        if self.loaders:
            meta.update(epoch=self.loaders[0].epoch, position=self.loaders[0].position)
        phase = self.progress.phase
        self.progress.enter("checkpoint")
        ckpt.save(self.done, shared, {"rng": rng_state()}, meta, sharded=sharded)
        self.progress.enter(phase)
        self.saved_step = self.done
        self._last_save_t = time.monotonic()

    def log(self) -> dict[str, Any]:
        """One metrics record: loss (mean over ranks and steps since the last record), lr, samples/s
        and, with rank_metrics, every rank's time split; named stragglers are warned about."""
        ctx, done = self.ctx, self.done
        with self.collective("log all-reduce"):
            self.nonfinite.check(ctx, self._ckpt)
            now = time.perf_counter()
            record: dict[str, Any] = {"event": "train", "step": done, "epoch": self.epoch}
            if self._window_loss is not None:
                (loss,) = all_reduce_sum(ctx, [float(self._window_loss) / max(self._window_n, 1)])
                record["loss"] = loss / ctx.world_size
            if self.optimizers:
                record["lr"] = self.optimizers[0].param_groups[0]["lr"]
            t0, s0 = self._last_log
            if self.loaders:
                record["samples_per_s"] = (done - s0) * self.loaders[0].global_batch / max(now - t0, 1e-9)
            if self.policy.rank_metrics:
                per_step = (self.loaders[0].global_batch // ctx.world_size) if self.loaders else 0
                # Gradients exist between backward and zero_grad: their bytes are the ones seen at the last
                # measured optimizer step (_stepping), and measured again at the next one.
                self.memory = {**memory_bytes(self.models, self.optimizers), "grad_bytes": self.memory.get("grad_bytes", 0)}
                self._measure_grads = True
                ranks = gather_ranks(ctx, self.timer.window(), per_step, self.memory)
                if ranks is not None:  # rank 0: per-rank records are per-rank by nature, so they reach it only
                    if len(ranks) <= self.policy.rank_records_max:
                        record["ranks"] = ranks
                    else:  # metrics.jsonl stays O(1) per record; the straggler check still sees every rank
                        record["rank_summary"] = summarize_ranks(ranks)
                    for line in self.stragglers.update(ranks):
                        self.say(f"ddp_kit: warning: {line}")
        for fn in self.on_log:
            fn(record)
        self.write(record)
        self._window_loss, self._window_n, self._last_log = None, 0, (now, done)
        return record

    def write(self, record: dict[str, Any]) -> None:
        if record.get("event") == "eval":
            self._last_eval = record
        elif record.get("event") == "train":
            self._last_train = record
        if self._writer is not None:
            self._writer.log(record)

    def write_summary(self, summary: dict[str, Any]) -> None:
        self._summary_written = True
        if self._writer is not None:
            self._writer.write_summary(summary)

    def _default_summary(self) -> dict[str, Any]:
        """What the reference job's summary.json holds, for a script that writes none: the same
        keys where they exist, the last eval record's values, and the final weights' digest. Collective."""
        model = self.models[0] if self.models else None
        digest = param_sha256(unwrap(model)) if model is not None else None
        equal = None
        if digest is not None and self.strategy != "fsdp":  # FSDP: every rank hashes the same gathered weights
            digests = gather_object(self.ctx, digest)
            equal = None if digests is None else all(d == digest for d in digests)
        evals = {k: v for k, v in self._last_eval.items() if k not in ("event", "step", "epoch", "time")}
        out = {"world_size": self.ctx.world_size, "steps": self.done, "epochs": self.epoch,
               "train_loss": self._last_train.get("loss"), "wall_s": time.perf_counter() - self._started, **evals,
               "param_sha256": digest, "param_sha256_all_ranks_equal": equal,
               "ddp_kit": __version__, "torch": torch.__version__, "backend": self.ctx.backend,
               "device": str(self.ctx.device), "resumed_from_step": self.resumed_from or None,
               "strategy": self.strategy, "model_state_bytes": self.memory}
        if self.config is not None:
            out["config_hash"] = config_hash(self.config)
        return out

    def finish(self) -> None:
        """At a clean end: a final checkpoint (if anything is registered and this step is not saved)."""
        if self.stopped or self.failed:
            return
        self.flush()
        if self.resumed_from is not None and self.done == self.resumed_from:
            self.say(f"ddp_kit: nothing left to train: this run resumed at step {self.done} (epoch {self.epoch}), where "
                     f"it had already finished; to start afresh pass resume='never' (--resume never; the old "
                     f"checkpoints move to {self.rd.archive}/) or a new run_dir, or raise the epochs/steps to go on")
        if self.policy.log_every and self.done > self._last_log[1]:
            self.log()  # the last steps since the last record: the picture and the summary end where the run did
        if self.state and self.rd is not None and not (self.stopped or self.failed):
            self.save()
        # Rank 0's word: a script may write its summary on rank 0 only, and the default one is collective.
        if self.rd is not None and not broadcast_object(self.ctx, self._summary_written if self.ctx.is_main else None):
            self.write_summary(self._default_summary())

    def heartbeat(self, phase: str) -> None:
        self.progress.enter(phase)

    @contextmanager
    def collective(self, phase: str):
        """A block that waits for the other ranks: announced to the watchdog, and timed as "comm" so
        that this rank's own-work figure (and so the straggler check) leaves the wait out."""
        self.progress.enter(phase)
        self.timer.mark("other")
        yield
        self.timer.mark("comm")


def _watch_store(ctx: DistContext) -> Any:
    """Where the watchdog publishes: the rendezvous store; at world size 1 under a launcher (torchrun,
    SLURM) a store in this process, so that a single-rank job that hangs is reported (stacks, NCCL's
    flight recorder) and ends rather than holding its allocation. A plain `python` run (a debug
    session, perhaps in a debugger) gets none."""
    if ctx.world_size > 1:
        return ctx.store_client()
    import torch.distributed as tdist

    return tdist.HashStore() if ctx.env.launched else None


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
        sees = sees_token(rd.path, token)
        everyone = all_true(ctx, sees)  # 4 bytes per rank; who is blind is asked only if someone is
        if ctx.is_main:
            remove_token(rd.path, token)
        if not everyone:
            gathered = gather_object(ctx, None if sees else (ctx.rank, socket.gethostname()))
            blind = broadcast_object(ctx, [g for g in gathered if g] if ctx.is_main else None)
            r, host = blind[0]
            more = f" (and {len(blind) - 1} more rank(s))" if len(blind) > 1 else ""
            raise UserError(f"run_dir {str(rd.path)!r} is not one shared folder: rank {r} on {host}{more} cannot see a "
                            f"file rank 0 wrote there; checkpoints need every rank to write into the same folder",
                            "put run_dir on storage every node mounts (an absolute path); per-node run folders are not supported")
    return lock

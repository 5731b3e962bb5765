"""The step boundary behind `ddp_kit.init()`: what runs between two optimizer steps of any training
loop, driven by one call per step.

`StepBoundary.step()` is the boundary. A loop calls it as `run.step(loss)` after `optimizer.step()`,
or not at all: then every registered optimizer's `step()` is counted (a post-hook) and the
boundary runs when the loop next asks the loader from `run.prepare` for a batch (or at
`run.save()`, `run.close()`). By then the loop's own per-step work (a per-step LR scheduler,
zero_grad, a per-epoch scheduler after the last batch) is done, so what a checkpoint holds is
one consistent point of the run. Iterations with several optimizer steps (two optimizers) count once.

Everything the boundary does that involves the other ranks happens every N steps, on every rank
at the same step, so the ranks stay in lockstep without extra agreement:

    every step                 heartbeat (two attribute writes), loss folded into a device scalar
    preempt_check_every        one all-reduce (sent a step ahead, read at the check): a stop signal on
                               any rank, and "a timed checkpoint is due" (rank 0's clock); then
                               checkpoint, requeue, exit 75 (stopping.py)
    sync_check_every           parameter/buffer checksums compared across ranks
    ckpt_every / ckpt_every_s  an atomic checkpoint of everything registered (saving.py)
    log_every                  one metrics.jsonl record (loss, lr, samples/s, per-rank time split; records.py)

This class holds the step state (hooks.StepState) and what is registered, and schedules; each
concern it schedules is a module of its own beside it (docs/architecture.md names them), and what a
strategy or a service adds at a step comes through hooks.StepHooks. Only this class saves. Library
code: plain arguments (a Policy, a DistContext), never the job's config.
"""
from __future__ import annotations

import dataclasses
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from ..checkpoint.backend import CheckpointBackend
from ..checkpoint.memory_tier import MemoryTier
from ..data import TrainLoader
from ..dist import DistContext
from ..dist.collectives import broadcast_object
from ..dist.failfast import posted_failure
from ..errors import EXIT_USER_ERROR, UserError
from ..hooks import StepHooks, StepState
from ..parallel.fsdp import memory_bytes
from ..parallel.strategy import DEFAULT, Strategy, strategy
from ..reliability.failures import handle
from ..reliability.numerics import NonFiniteLoss
from ..reliability.preemption import PreemptFlag
from ..reliability.progress import Progress
from ..reliability.recipe import is_scheduler
from ..reliability.sync_checks import check_consistency, optimizer_steps
from ..reliability.verdicts import EXIT_HANG, Verdict, deterministic, of_failure, repeats
from ..reliability.watchdog import Watchdog
from ..run_folder import RunDir, hang_folder
from . import agreement, attempts, grace_period, registration, resume, saving, stopping
from .checkpoint_io import open_checkpointer, tier_location
from .ledger import RunLedger
from .lifecycle import RunResources, watch_store
from .policy import Policy
from .records import MetricsRecords
from .run_writer import RunWriter
from .train_state import TrainState


def _say(ctx: DistContext) -> Callable[[str], None]:
    def say(msg: str) -> None:
        if ctx.is_main:
            print(msg, flush=True)
    return say


class StepBoundary:
    """One per process; made by `ddp_kit.init()`. `close()` is guaranteed by the Run's ExitStack."""

    def __init__(self, ctx: DistContext, policy: Policy, progress: Progress, flag: PreemptFlag):
        self.ctx, self.policy, self.progress, self.flag = ctx, policy, progress, flag
        self.rd = RunDir(Path(policy.run_dir), policy.ckpt_dir) if policy.run_dir else None
        self.hang_dir = hang_folder(policy.run_dir)
        self.say = _say(ctx)
        self.state = TrainState()
        self.loaders: list[TrainLoader] = []
        self.models: list[nn.Module] = []  # as prepared (wrapped): the forward hooks, DDP's buffers
        self.modules: list[nn.Module] = []  # the same models unwrapped, once: digests and shapes
        self.optimizers: list[torch.optim.Optimizer] = []
        self.meta: dict[str, Any] = {}
        self.strategy: Strategy = strategy(DEFAULT)  # run.prepare sets the one it wrapped the models with
        # What strategies and services add at each step (hooks.py): strategy ft's quorum, ...
        self.hooks: list[StepHooks] = []
        self.steps = StepState()
        self.config: dict[str, Any] | None = None  # the run's own config: meta.json, config.yaml, startup agreement
        self.cuda_notes: Callable[[BaseException], list[str]] | None = None
        self.attempt = 0  # this attempt's number in the run ledger (rank 0; 0 elsewhere, and without a run folder)
        self.previous_end: dict[str, Any] | None = None  # the previous attempt's end line (attempts.begin)
        self.verdict: Verdict | None = None  # how this attempt ends, once it fails (fail)
        self.memory: dict[str, int] = {}  # this rank's parameter/gradient/optimizer bytes (fsdp.memory_bytes)
        self.nonfinite = NonFiniteLoss()
        self.records = MetricsRecords(ctx, policy)
        self.timer = self.records.timer
        self._ckpt: CheckpointBackend | None = None
        self._mem: MemoryTier | None = None
        self.stop_ahead: Callable[[], tuple[int, bool]] | None = None  # the next stop check, sent a step early (stopping.py)
        self.watchdog = Watchdog(watch_store(ctx) if policy.hang_timeout_s > 0 else None,
                                 ctx.rank, ctx.world_size, progress, policy.hang_timeout_s, ctx.timeout_s, self.hang_dir,
                                 peer_timeout_s=policy.peer_timeout_s)
        self.resources = RunResources(ctx, self.rd, progress, self.watchdog, self.hang_dir)

    # ---- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> StepBoundary:
        """Before any work: the run folder is checked and locked, the watchdog runs."""
        self.resources.start(self.config)
        self.records.writer = self.resources.writer
        grace_period.check_at_start(self)
        # A crash loop or a deterministic failure stops here, before any work.
        self.attempt = attempts.begin(self, self.resources.leftover)
        if self.attempt and self.rd is not None:  # rank 0: the run ledger's lines of this attempt
            self.attach(RunLedger(self.rd.path / attempts.FILE, self.attempt))
            self.watchdog.on_hang = self._hung
            if self.ctx.failfast is not None:
                self.ctx.failfast.on_stop = self._peer_failed
        return self

    def _peer_failed(self, posted: dict[str, Any]) -> int | None:
        """Rank 0, stopped by another rank's failure: the end line names that failure; the same one at the
        same step as the previous attempt's ends this one with exit 2 too."""
        error = RuntimeError(str(posted.get("error", "")))
        verdict = of_failure(1, error, posted, self.ctx.rank, socket.gethostname(), self.progress.step)
        code = None
        if repeats(verdict, self.previous_end):
            verdict, code = deterministic(verdict), EXIT_USER_ERROR
        attempts.record_end(self, code or 1, verdict)
        return code

    def _hung(self, stalled_s: float) -> None:
        step = self.progress.step
        attempts.record_end(self, EXIT_HANG, Verdict("hang", True, f"no progress for {stalled_s:.0f}s at step {step} in "
                                                     f"{self.progress.phase} (stacks in {self.hang_dir})",
                                                     "read the hang report; a restart resumes from the last checkpoint",
                                                     rank=0, step=step), stalled_s=round(stalled_s, 3))

    @property
    def writer(self) -> RunWriter | None:
        return self.resources.writer

    def close(self) -> None:
        try:
            if self._ckpt is not None:
                self._ckpt.close()  # never leave with an async save half-written; frees its host buffers
                grace_period.note_timings(self)  # the last (async) save's time, while metrics.jsonl is open
            attempts.end(self, self.steps.exit_code)
            if self._mem is not None:  # a clean end frees the node's memory; a failed one leaves it to the restart
                self._mem.close(clean=not (self.steps.failed or self.steps.stopped or self.steps.exit_code))
        except Exception:
            if not self.steps.failed:  # after a failure, the failure is what gets reported
                raise
        finally:
            try:
                for hook in self.hooks:
                    hook.close(self)
            finally:
                self.resources.close()
            # Let go of the model, optimizer and loaders before the process group is destroyed: a
            # DDP reducer still alive then can abort the process at exit (pytorch#190489; the
            # teardown's gc.collect frees it only if nothing holds it).
            for held in (self.models, self.modules, self.optimizers, self.loaders, self.state):
                held.clear()
            self.records.clear()
            self.cuda_notes = None

    def fail(self, err: BaseException) -> int:
        """This process ends on `err`: say what the failure policy says, return the exit code."""
        self.steps.failed = True
        self.ctx.failing.set()
        if self.ctx.failfast is not None:
            self.ctx.failfast.quiet()
        self.flag.closing = True  # torchrun's SIGTERM to the survivors is not a preemption
        step = self.progress.step
        found: list[str] = []
        code = handle(err, self.ctx, step, self.progress.phase, self.hang_dir,
                      hang_declared=self.watchdog.aborting.is_set(), notes=self.cuda_notes, found=found)
        verdict = of_failure(code, err, posted_failure(self.ctx.store), self.ctx.rank, socket.gethostname(), step)
        if found and verdict.name == "lost_peer":  # the peer that vanished, named, is the cause
            verdict = dataclasses.replace(verdict, cause=found[0].removeprefix("ddp_kit: "))
        if repeats(verdict, self.previous_end):
            verdict, code = deterministic(verdict), EXIT_USER_ERROR
            if verdict.rank == self.ctx.rank or self.ctx.is_main and verdict.rank is None:
                print(f"ddp_kit: error: {verdict.cause}: not retrying, exiting with {code} (hint: {verdict.fix})",
                      file=sys.stderr, flush=True)
        self.verdict, self.steps.exit_code = verdict, code
        return code

    # ---- registration and the hooks that drive the implicit boundary ----------------------------------

    def attach(self, hook: StepHooks) -> None:
        """`hook` takes part in every step from now on (hooks.py)."""
        self.hooks.append(hook)
        hook.attach(self)
        for obj in self.state.objects.values():  # registered before the hook came (run.resume before run.prepare)
            if isinstance(obj, torch.optim.Optimizer) or is_scheduler(obj):
                hook.gate(obj, scheduler=is_scheduler(obj))

    def track(self, obj: Any, name: str | None = None, module: nn.Module | None = None) -> None:
        """Register `obj` for checkpointing (see registration.track)."""
        registration.track(self, obj, name, module)

    def stepping(self, *_: object) -> None:
        if self.steps.not_a_step:
            return
        if self._mem is not None and self._mem.copying is not None:  # the memory tier still reads what this step writes
            self._mem.wait_copy()
        self.progress.enter("optimizer", self.steps.done + 1)  # an error in optimizer.step() is named as being there
        self.timer.mark("backward")
        if self.steps.measure_grads:
            self.steps.measure_grads = False
            self.memory = memory_bytes(self.models, self.optimizers)

    def stepped(self, *_: object) -> None:
        if self.steps.not_a_step:
            return
        # The loop's own work after the optimizer step (scheduler.step(), zero_grad) is not forward/backward.
        self.progress.enter("after step", self.steps.done + 1)
        self.timer.mark("optimizer")
        self.steps.pending = not self.steps.explicit

    def fetching(self) -> None:
        self.flush()
        for hook in self.hooks:
            hook.before_batch(self)
        self.progress.enter("data", self.steps.done + 1)
        self.timer.mark("other")

    def epoch_end(self) -> None:
        # The loop's own work between epochs (eval, a per-epoch scheduler) is a slow phase, not a hang.
        self.progress.enter("between epochs")
        for hook in self.hooks:
            hook.epoch_ended(self)

    def fetched(self) -> None:
        self.timer.mark("data")
        self.progress.enter("forward/backward")

    @contextmanager
    def state_io(self) -> Iterator[None]:
        """torch's get_state_dict gives an optimizer without state one step at lr 0 to create its state
        (so that a checkpoint can be loaded into it): that step is not the loop's, and must not count."""
        self.steps.not_a_step = True
        try:
            yield
        finally:
            self.steps.not_a_step = False

    def named(self, kind: type) -> dict[str, Any]:
        return {n: o for n, o in self.state.objects.items() if isinstance(o, kind)}

    def sharded(self) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
        """The registered models and optimizers whose state the strategy saves (DCP); ({}, {}) where it has none."""
        if not self.strategy.sharded:
            return {}, {}
        return self.named(nn.Module), self.named(torch.optim.Optimizer)

    @property
    def epoch(self) -> int:
        """Epochs the first registered loader has completed (0 when none is registered)."""
        return self.loaders[0].epoch if self.loaders else 0

    # ---- the step boundary ----------------------------------------------------------------------------

    def step(self, loss: torch.Tensor | float | None = None, implicit: bool = False) -> int:
        self.steps.pending = False
        if self._mem is not None and self._mem.copying is not None:  # a step an optimizer did not take (ft's gate)
            self._mem.wait_copy()
        self.steps.explicit = self.steps.explicit or not implicit
        for loader in self.loaders:
            loader.commit()  # the batches this step used are consumed: the position a checkpoint keeps
        if not all([hook.counts(self) for hook in self.hooks]):  # every hook is asked
            self.progress.enter("after step", self.steps.done + 1)
            return self.steps.done  # discarded (strategy ft's quorum): not a step (its batches stay consumed)
        self.steps.done += 1
        for hook in self.hooks:
            hook.after_step(self)
        done, p, pol = self.steps.done, self.progress, self.policy
        self.progress.enter("after step", done)
        # Since the optimizer step: the loop's own work (local). Without a registered optimizer, all of
        # it since the forward: backward (with DDP's wait) and the optimizer.
        self.timer.mark("other" if self.optimizers else "backward")
        self.timer.steps += 1
        if loss is not None:
            if isinstance(loss, torch.Tensor) and (loss.device.type != "cpu" or loss.numel() != 1):
                on_device = loss.detach().float()  # stays on the device: folded there, read only at log events
                self.records.add_loss(on_device)
                self.nonfinite.update(on_device, done)
            else:  # on the host a read waits for nothing: plain floats, no tensor ops per step
                on_host = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
                self.records.add_loss(on_host)
                self.nonfinite.update_host(on_host, done)
        if not p.warm:
            agreement.first_step_over(self)
        save = bool(self.state and pol.ckpt_every and done % pol.ckpt_every == 0)
        mem = bool(self.state and pol.mem_ckpt_every and done % pol.mem_ckpt_every == 0)
        check = bool(pol.preempt_check_every and done % pol.preempt_check_every == 0)
        if not implicit and self.loaders and self.loaders[0].position == 0:
            # The last step of an epoch, called from inside the loop: the loop's end-of-epoch work (a
            # per-epoch scheduler step, an eval) is still to come, and a checkpoint taken now would
            # skip it on resume. Its checkpoint and stop check run at the next batch or epoch instead.
            self.steps.owed_save |= save
            self.steps.owed_check |= check
            self.steps.owed_mem |= mem
            save = check = mem = False
        if check:
            save = self._stop_check() or save
        if pol.sync_check_every and done % pol.sync_check_every == 0:
            with self.collective("sync check"):
                self.nonfinite.check(self.ctx, self._ckpt)  # NaN weights would read as divergence
                steps = optimizer_steps(self.named(torch.optim.Optimizer))
                for i, model in enumerate(self.models):
                    warning = check_consistency(self.ctx, model, done, pol.sync_fix, extra=steps if i == 0 else [])
                    if warning:
                        self.say(f"ddp_kit: warning: {warning}")
        if save:
            self.save()
            self._stop_check()  # a signal that came during the save is acted on now
        elif mem:
            self.save_memory()
        if pol.log_every and done % pol.log_every == 0:
            self.log()
        if self.records.split is not None:  # the forward hooks, on the first steps of a window only
            self.records.split.after_step()
        if pol.preempt_check_every and (done + 1) % pol.preempt_check_every == 0:
            stopping.start_ahead(self)
        if p.phase != "after step":  # back from a check's own phase (its time is not the loop's)
            self.progress.enter("after step")
        return done

    def flush(self) -> None:
        """Run the boundary of an optimizer step the loop has not reached the next batch after, and
        what an epoch's last step owes (see step)."""
        if self.steps.pending:
            self.step(None, implicit=True)
        save, check, mem = self.steps.owed_save, self.steps.owed_check, self.steps.owed_mem
        if save or check or mem:
            self.steps.owed_save = self.steps.owed_check = self.steps.owed_mem = False
            if check:  # after the epoch's end (an eval): on what the ranks know now, not a step ago
                save = self._stop_check(fresh=True) or save
            if save:
                self.save()
                self._stop_check()
            elif mem:
                self.save_memory()

    def finish(self) -> None:
        """At a clean end: a final checkpoint (if anything is registered and this step is not saved)."""
        if self.steps.stopped or self.steps.failed:
            return
        self.flush()
        if self.rd is not None and self.steps.resumed_from is not None and self.steps.done == self.steps.resumed_from:
            self.say(f"ddp_kit: nothing left to train: this run resumed at step {self.steps.done} (epoch {self.epoch}), where "
                     f"it had already finished; to start afresh pass resume='never' (--resume never; the old "
                     f"checkpoints move to {self.rd.archive}/) or a new run_dir, or raise the epochs/steps to go on")
        if self.policy.log_every and self.steps.done > self.records.last_log[1]:
            self.log()  # the last steps since the last record: the picture and the summary end where the run did
        if self.state and self.rd is not None and not (self.steps.stopped or self.steps.failed):
            self.save()
        # Rank 0's word: a script may write its summary on rank 0 only, and the default one is collective.
        if self.rd is not None and not broadcast_object(self.ctx, self.records.summary_written if self.ctx.is_main else None):
            self.write_summary(self.records.default_summary(self))
        self.may_report()  # strategy ft without a summary (no run folder): the result is recorded all the same

    # ---- what the boundary schedules, each in its own module ------------------------------------------

    def checkpointer(self) -> CheckpointBackend:
        if self.rd is None:
            raise UserError("checkpoints need a run folder, and this run has none",
                            "pass run_dir to ddp_kit.init(run_dir=\"runs/my_run\")")
        if self._ckpt is None:
            self._ckpt = open_checkpointer(self.ctx, self.rd, self.policy)
        return self._ckpt

    def checkpointer_if_open(self) -> CheckpointBackend | None:
        return self._ckpt

    def memory_tier(self) -> MemoryTier:
        """This job's memory tier on this node (collective the first time: a gloo group of its own)."""
        if self._mem is None:
            self._mem = MemoryTier(self.ctx, tier_location(self.checkpointer()), self.resources.run_id or "")
        return self._mem

    def memory_blocking(self) -> float:
        """Seconds the loop waited for the memory tier since the last call (0 without one)."""
        return self._mem.take_blocking() if self._mem is not None else 0.0

    def save_memory(self) -> None:
        """A memory-tier copy of everything registered at this step (collective: every rank at once)."""
        if self.rd is not None and self.state and self.steps.saved != self.steps.done:
            saving.save_memory(self, self.memory_tier())

    def resume(self, objects: dict[str, Any], check: Callable[[dict[str, Any]], str | None] | None = None) -> int:
        return resume.resume(self, objects, check)

    def agree(self, facts: dict[str, Any] | None = None, details: dict[str, dict[str, Any]] | None = None) -> None:
        """Before step 1, once: see agreement.agree."""
        if not self.steps.agreed:
            self.steps.agreed = True
            agreement.agree(self, facts, details)

    def check_optimizers(self) -> None:
        agreement.check_optimizers(self)

    def save(self) -> None:
        """Checkpoint everything registered at this step (collective; at once if this step is saved)."""
        self.flush()
        ckpt = self.checkpointer()
        if self.state and self.steps.saved != self.steps.done:
            saving.save(self, ckpt)

    def _stop_check(self, fresh: bool = False) -> bool:
        """Act on a stop signal any rank has seen (this never returns then); whether a timed checkpoint is due."""
        signum, due = stopping.signalled(self, fresh)
        if signum:
            self.stop(signum)
        return due

    def stop(self, signum: int) -> NoReturn:
        """Checkpoint, requeue where the launcher can, and exit 75 (130 for Ctrl-C), all ranks together."""
        if self.policy.log_every and self.steps.done > self.records.last_log[1]:
            self.log()  # the steps since the last record, as at a clean end: the resume starts after them
        saved = bool(self.state) and self.rd is not None
        took = time.monotonic()
        if saved:
            self.save()
            self.progress.enter("checkpoint")  # an async save may still be writing: a slow phase, not a hang
            self.checkpointer().wait()
            grace_period.note_timings(self)
        stopping.leave(self, signum, saved, time.monotonic() - took)

    def log(self) -> dict[str, Any]:
        return self.records.log(self)

    def write(self, record: dict[str, Any]) -> None:
        """A metrics.jsonl record (rank 0 writes it), told to every hook."""
        self.records.write(record)
        self.tell(record)

    def tell(self, record: dict[str, Any]) -> None:
        """An event of the run for the hooks only (the run ledger): the first step, a resume, ..."""
        for hook in self.hooks:
            hook.event(self, record)

    def write_summary(self, summary: dict[str, Any]) -> None:
        if not self.may_report():  # strategy ft: another group finished the job with other weights
            return
        for hook in self.hooks:
            summary = {**summary, **hook.summary(self)}
        self.records.write_summary(summary)

    def may_report(self) -> bool:
        return all([hook.may_report(self) for hook in self.hooks])

    def restart_window(self, step: int) -> None:
        """The metrics window starts over at `step` (a peer's state was taken in)."""
        self.records.restart_window(step)

    @property
    def on_log(self) -> list[Callable[[dict[str, Any]], None]]:
        return self.records.on_log

    def heartbeat(self, phase: str) -> None:
        self.progress.enter(phase)

    @contextmanager
    def collective(self, phase: str) -> Iterator[None]:
        """A block that waits for the other ranks: announced to the watchdog, and timed as "comm" so
        that this rank's own-work figure (and so the straggler check) leaves the wait out."""
        self.progress.enter(phase)
        self.timer.mark("other")
        yield
        self.timer.mark("comm")

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
    preempt_check_every        one all-reduce (sent a step ahead): a stop signal on any rank, and "a timed
                               checkpoint is due"; then checkpoint, requeue, exit 75 (stopping.py)
    sync_check_every           parameter/buffer checksums compared across ranks
    each tier's cadence        a save of everything registered (the durable tier: ckpt_every, ckpt_every_s)
    log_every                  one metrics.jsonl record (loss, lr, samples/s, per-rank time split; records.py)

This class holds the step state, what is registered, the hooks and the checkpoint tiers, and
schedules; each concern is a module beside it (docs/architecture.md), and what a strategy or a service
(service_registry.py) adds comes through hooks.StepHooks and hooks.Tier, never by name here.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from .. import service_registry as services
from ..checkpoint.backend import CheckpointBackend
from ..data import TrainLoader
from ..dist import DistContext
from ..errors import UserError
from ..hooks import StepHooks, StepState, Tier
from ..parallel.strategy import DEFAULT, Strategy, strategy
from ..reliability.numerics import NonFiniteLoss
from ..reliability.preemption import PreemptFlag
from ..reliability.progress import Progress
from ..reliability.recipe import is_scheduler
from ..reliability.verdicts import Verdict
from ..reliability.watchdog import Watchdog
from ..run_folder import RunDir, hang_folder
from . import agreement, ending, failing, grace_period, registration, resume, saving, stopping
from .checkpoint_io import open_checkpointer
from .durable_tier import DurableTier
from .lifecycle import RunResources, watch_store
from .policy import Policy
from .records import MetricsRecords
from .run_writer import RunWriter
from .train_state import TrainState


def _say(ctx: DistContext) -> Callable[[str], None]:
    return lambda msg: print(msg, flush=True) if ctx.is_main else None


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
        # What strategies and services add at each step (hooks.py; services/)
        self.hooks: list[StepHooks] = []
        # Where a step's state is saved, each tier at its own cadence; the durable one first (hooks.Tier)
        self.tiers: list[Tier] = [DurableTier(self)]
        self.steps = StepState()
        self.config: dict[str, Any] | None = None  # the run's own config: meta.json, config.yaml, startup agreement
        self.cuda_notes: Callable[[BaseException], list[str]] | None = None
        self.attempt = 0  # this attempt's number in the run's history (rank 0; 0 elsewhere, and without a run folder)
        self.previous_end: dict[str, Any] | None = None  # how the previous attempt ended, as recorded (the repeat rule)
        self.verdict: Verdict | None = None  # how this attempt ends, once it fails (fail)
        self.memory: dict[str, int] = {}  # this rank's parameter/gradient/optimizer bytes (fsdp.memory_bytes)
        self.nonfinite = NonFiniteLoss()
        self.records = MetricsRecords(ctx, policy)
        self.timer = self.records.timer
        self._ckpt: CheckpointBackend | None = None
        self.stop_ahead: Callable[[], tuple[int, int]] | None = None  # the next stop check, sent a step early (stopping.py)
        self.watchdog = Watchdog(watch_store(ctx) if policy.hang_timeout_s > 0 else None,
                                 ctx.rank, ctx.world_size, progress, policy.hang_timeout_s, ctx.timeout_s, self.hang_dir,
                                 peer_timeout_s=policy.peer_timeout_s)
        self.resources = RunResources(ctx, self.rd, progress, self.watchdog, self.hang_dir)

    # ---- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> StepBoundary:
        """Before any work: the run folder is checked and locked, the watchdog runs."""
        # The health gate (a service, run below) checks ckpt_dir on every node: one that refuses rank 0 is its finding
        self.resources.start(self.config, gate_checks_ckpt=self.policy.settings.get("health_check", "off") != "off")
        self.records.writer = self.resources.writer
        grace_period.check_at_start(self)
        for made in services.start(self, self.policy.settings):  # every service's hooks and tiers (services/)
            if isinstance(made, StepHooks):
                self.attach(made)
            if isinstance(made, Tier):
                self.tiers.append(made)
        for hook in list(self.hooks):
            hook.started(self)  # a hook may refuse the start (a crash loop), before any work
        return self

    @property
    def writer(self) -> RunWriter | None:
        return self.resources.writer

    def close(self) -> None:
        try:
            code, durable = self.steps.exit_code, [t for t in self.tiers if t.durable]
            clean = not (self.steps.failed or self.steps.stopped or code)
            # Durable saves are complete before the attempt's end is told; other copies are freed (a clean end) or left after it.
            for tier in durable:
                tier.close(clean)
            for hook in self.hooks:
                hook.ending(self, code)
            for tier in [t for t in self.tiers if t not in durable]:
                tier.close(clean)
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
        """This process ends on `err`: say what the failure policy says, return the exit code (failing.py)."""
        return failing.fail(self, err)

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
        for hook in self.hooks:  # a step whose optimizer did not step (ft's gate) lets go of what it would have
            hook.optimizer_step(self)
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
            self.records.take_loss(loss, done, self.nonfinite)
        if not p.warm:
            agreement.first_step_over(self)
        due = {t.name for t in self.tiers if t.due(done)} if self.state else set()
        check = bool(pol.preempt_check_every and done % pol.preempt_check_every == 0)
        if not implicit and self.loaders and self.loaders[0].position == 0:
            # The last step of an epoch, called from inside the loop: the loop's end-of-epoch work (a
            # per-epoch scheduler step, an eval) is still to come, and a checkpoint taken now would
            # skip it on resume. Its saves and stop check run at the next batch or epoch instead.
            self.steps.owed |= due
            self.steps.owed_check |= check
            due, check = set(), False
        if check and (timed := self._stop_check()):  # a timed checkpoint is due
            due.add(timed)
        if pol.sync_check_every and done % pol.sync_check_every == 0 and agreement.compare_weights(self, done):
            # Rolled back (sync_fix rollback): this step's saves and log record belong to the abandoned steps.
            self.progress.enter("after step", self.steps.done)
            return self.steps.done
        self._save_tiers(due)
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
        due, check = set(self.steps.owed), self.steps.owed_check
        if due or check:
            self.steps.owed, self.steps.owed_check = set(), False
            if check and (timed := self._stop_check(fresh=True)):  # after the epoch's end (an eval): on what the ranks know now
                due.add(timed)
            self._save_tiers(due)

    def _save_tiers(self, due: set[str]) -> None:
        """Save the tiers due at this step: a durable save supersedes the copies of this step in the
        tiers that are not durable (they would hold what it holds)."""
        durable = [t for t in self.tiers if t.name in due and t.durable]
        for tier in durable or [t for t in self.tiers if t.name in due]:
            began = time.perf_counter()
            tier.save(self)
            for hook in self.hooks:  # what the loop waited: an automatic interval's cost (services/cadence.py)
                hook.saved(self, tier.name, time.perf_counter() - began)
        if durable:
            self._stop_check()  # a signal that came during the save is acted on now

    def finish(self) -> None:
        """At a clean end: a final checkpoint (if anything is registered and this step is not saved)."""
        ending.finish(self)

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

    def _stop_check(self, fresh: bool = False) -> str | None:
        """Act on a stop signal any rank has seen (this never returns then); the tier a clock says is due."""
        signum, due = stopping.signalled(self, fresh)
        if signum:
            self.stop(signum)
        return stopping.due_tier(self, due)

    def stop(self, signum: int) -> NoReturn:
        """Checkpoint, requeue where the launcher can, and exit 75 (130 for Ctrl-C), all ranks together."""
        ending.stop(self, signum)

    def log(self) -> dict[str, Any]:
        return self.records.log(self)

    def write(self, record: dict[str, Any]) -> None:
        """A metrics.jsonl record (rank 0 writes it), told to every hook."""
        self.records.write(record)
        for hook in self.hooks:
            hook.logged(self, record)
        self.tell(record)

    def tell(self, record: dict[str, Any]) -> None:
        """An event of the run for the hooks only: the first step, a resume, ..."""
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

"""The run's metrics record: the loss window between log events, one metrics.jsonl record per log
event (loss, lr, samples/s, every rank's time split, stragglers named) that the experiment trackers
get too, and summary.json: the script's own, or a default one at close."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..dist import DistContext
from ..dist.collectives import all_reduce_sum, gather_object
from ..parallel.digest import param_sha256
from ..parallel.fsdp import memory_bytes
from ..reliability.metrics import GpuSpans, StepTimer, StragglerWatch, gather_ranks, summarize_ranks
from ..reliability.numerics import LossBuffer, NonFiniteLoss
from ..reliability.recipe import config_hash, not_recipe
from ..version import __version__
from .forward_split import ForwardSplit
from .policy import Policy
from .run_writer import RunWriter

if TYPE_CHECKING:  # the core imports its parts: they name what they use of it (protocol.py), not the core
    from .protocol import Boundary



class MetricsRecords:
    """What the records are made of between two log events, and what was last written."""

    def __init__(self, ctx: DistContext, policy: Policy):
        self.ctx, self.policy = ctx, policy
        gpu_spans = ctx.device.type == "cuda" and policy.rank_metrics and policy.log_every > 0
        self.timer = StepTimer(gpu=GpuSpans() if gpu_spans else None)
        # the forward hooks of the time split, on a few steps of each window (none without per-rank metrics)
        self.split = ForwardSplit(self.timer) if policy.rank_metrics and policy.log_every > 0 else None
        self.stragglers = StragglerWatch(policy.straggler_margin)
        self.on_log: list[Callable[[dict[str, Any]], None]] = []
        self.writer: RunWriter | None = None  # set once the run folder is open (lifecycle)
        self.summary_written = False  # the script (or the reference job) wrote summary.json itself
        self.last_eval: dict[str, Any] = {}  # the last record logged with event "eval" (run.log_event)
        self.last_train: dict[str, Any] = {}
        self.started = time.perf_counter()
        self._window_loss: float | None = None  # losses read on the host
        self._window_n = 0
        # losses on a device: one slot a log window's step, read at the log event (no host sync a step)
        self._device_losses: LossBuffer | None = None
        self.first_step = (0.0, 0)  # (when, at which step) the first step ended: the ledger's windows start there
        self.last_log = (time.perf_counter(), 0)  # (when, at which step) the last record was made

    def take_loss(self, loss: torch.Tensor | float, done: int, nonfinite: NonFiniteLoss) -> None:
        """Step `done`'s loss into the window and the non-finite watch."""
        if isinstance(loss, torch.Tensor) and (loss.device.type != "cpu" or loss.numel() != 1):
            if self._device_losses is None:  # a window of log_every slots; a fold on the device when it overflows
                self._device_losses = LossBuffer(min(self.policy.log_every or 256, 1024))
                nonfinite.watch(self._device_losses)
            self._device_losses.put(loss, done)  # one copy kernel; summed and checked when read at a log event
        else:  # on the host a read waits for nothing: plain floats, no tensor ops per step
            on_host = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
            self.add_loss(on_host)
            nonfinite.update_host(on_host, done)

    def add_loss(self, value: float) -> None:
        """A step's loss, read on the host."""
        self._window_loss = value if self._window_loss is None else self._window_loss + value
        self._window_n += 1

    def first_step_over(self, done: int) -> None:
        self.first_step = (time.perf_counter(), done)

    def restart_window(self, done: int) -> None:
        self.last_log = (time.perf_counter(), done)

    def log(self, b: Boundary) -> dict[str, Any]:
        """One metrics record: loss (mean over ranks and steps since the last record), lr, samples/s
        and, with rank_metrics, every rank's time split; named stragglers are warned about."""
        ctx, done = self.ctx, b.steps.done
        with b.collective("log all-reduce"):
            b.nonfinite.check(ctx, b.checkpointer_if_open())
            now = time.perf_counter()
            record: dict[str, Any] = {"event": "train", "step": done, "epoch": b.epoch}
            ranks = None
            total, n = self._device_losses.take() if self._device_losses is not None else (0.0, 0)
            if self._window_loss is not None or n:  # after nonfinite.check: the device window may be taken
                total, n = total + (self._window_loss or 0.0), n + self._window_n
                (loss,) = all_reduce_sum(ctx, [total / max(n, 1)])
                record["loss"] = loss / ctx.world_size
            if b.optimizers:
                record["lr"] = b.optimizers[0].param_groups[0]["lr"]
            t0, s0 = self.last_log
            if b.loaders:
                record["samples_per_s"] = (done - s0) * b.loaders[0].global_batch / max(now - t0, 1e-9)
            if self.policy.rank_metrics:
                per_step = (b.loaders[0].global_batch // ctx.world_size) if b.loaders else 0
                # Gradients exist between backward and zero_grad: their bytes are the ones seen at the last
                # measured optimizer step (the optimizer's pre-hook), and measured again at the next one.
                b.memory = {**memory_bytes(b.models, b.optimizers), "grad_bytes": b.memory.get("grad_bytes", 0)}
                b.steps.measure_grads = True
                ranks = gather_ranks(ctx, self.timer.window(), per_step, b.memory)
                if ranks is not None:  # rank 0: per-rank records are per-rank by nature, so they reach it only
                    if len(ranks) <= self.policy.rank_records_max:
                        record["ranks"] = ranks
                    else:  # metrics.jsonl stays O(1) per record; the straggler check still sees every rank
                        record["rank_summary"] = summarize_ranks(ranks)
                    for line in self.stragglers.update(ranks):
                        b.say(f"ddp_kit: warning: {line}")
        for fn in self.on_log:
            fn(record)
        b.write(record)
        t1, s1 = max(self.last_log, self.first_step)  # the window, less the start-up before the first step
        window = {"event": "progress", "step": done, "window_s": round(now - t1, 4), "steps": done - s1}
        for tier in b.tiers:  # the loop's waits for a tier (the memory tier's "mem_s"): checkpoint time, not steps
            window.update({key: round(s, 4) for key, s in tier.take_blocking().items() if s})
        if ranks:  # the rank whose own work (not its waits) was slowest in this window
            slowest = max(ranks, key=lambda x: x.get("local_s", 0.0))
            window.update(slowest_rank=slowest["rank"], slowest_host=slowest.get("host"))
        b.tell(window)
        self._window_loss, self._window_n, self.last_log = None, 0, (now, done)
        return record

    def write(self, record: dict[str, Any]) -> None:
        if record.get("event") == "eval":
            self.last_eval = record
        elif record.get("event") == "train":
            self.last_train = record
        if self.writer is not None:
            self.writer.log(record)

    def write_summary(self, summary: dict[str, Any]) -> None:
        self.summary_written = True
        if self.writer is not None:
            self.writer.write_summary(summary)

    def default_summary(self, b: Boundary) -> dict[str, Any]:
        """What the reference job's summary.json holds, for a script that writes none: the same
        keys where they exist, the last eval record's values, and the final weights' digest. Collective."""
        module = b.modules[0] if b.modules else None
        digest = param_sha256(module) if module is not None else None
        equal = None
        if digest is not None and not b.strategy.sharded:  # sharded: every rank hashes the same gathered weights
            digests = gather_object(self.ctx, digest)
            equal = None if digests is None else all(d == digest for d in digests)
        evals = {k: v for k, v in self.last_eval.items() if k not in ("event", "step", "epoch", "time")}
        out = {"world_size": self.ctx.world_size, "steps": b.steps.done, "epochs": b.epoch,
               "train_loss": self.last_train.get("loss"), "wall_s": time.perf_counter() - self.started, **evals,
               "param_sha256": digest, "param_sha256_all_ranks_equal": equal,
               "ddp_kit": __version__, "torch": torch.__version__, "backend": self.ctx.backend,
               "device": str(self.ctx.device), "resumed_from_step": b.steps.resumed_from or None,
               "strategy": b.strategy.name, "model_state_bytes": b.memory}
        if b.config is not None:
            out["config_hash"] = config_hash(b.config, leave_out=not_recipe())  # the recipe's, as summary.json and meta.json
        return out

    def clear(self) -> None:
        self.on_log.clear()
        if self.split is not None:
            self.split.clear()

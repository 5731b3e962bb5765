"""`Run`: what `ddp_kit.init()` returns, every method a script calls (which is why it is long: each is
a few lines that hand over to the module doing the work), and `Resumed`, what `run.resume` returns.
The face is ddp_kit.api (init, Run); docs/architecture.md says where the work lives."""
from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from torch import nn
from torch.utils.data import DataLoader

from .boundary import replay_check
from .boundary.core import StepBoundary
from .boundary.eval_pass import EvalLoader
from .data import TrainLoader, eval_loader, per_rank_batch
from .data.resample import loader_sampling
from .dist import DistContext
from .dist.collectives import all_gather_object, all_reduce_sum, barrier
from .dist.resources import loader_workers
from .errors import UserError
from .parallel.fsdp import full_state_dict, is_sharded
from .parallel.strategy import DEFAULT as DEFAULT_STRATEGY
from .parallel.strategy import option_keywords, strategy_of
from .parallel.strategy import strategy as find_strategy
from .parallel.wrap import sync_gradients, unwrap, unwrap_ddp, wrap_model
from .reliability.sync_checks import in_main_only, main_only


class Run:
    """A live distributed context plus the helpers a training script needs. Create it with `init()`."""

    def __init__(self, ctx: DistContext, stack: ExitStack, boundary: StepBoundary, split_batches: bool, seed: int):
        self.ctx = ctx
        self._stack = stack
        self._boundary = boundary
        self._closed = False
        self.split_batches = split_batches
        self.seed = seed
        self._uneven_eval = False  # an eval loader split for DDP exists (FSDP needs even batch counts)
        # models this Run's prepare returned -> the module it was given (unwrapped once, here)
        self._prepared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if stack is not None:  # let go of the modules before the process group goes (see StepBoundary.close)
            stack.callback(self._prepared.clear)
        self._said_wrapped_state = False

    device = property(lambda self: self.ctx.device)
    rank = property(lambda self: self.ctx.rank)
    world_size = property(lambda self: self.ctx.world_size)
    is_main = property(lambda self: self.ctx.is_main)

    run_dir = property(lambda self: self._boundary.rd.path if self._boundary.rd else None)

    @property
    def data_place(self) -> tuple[int, int]:
        """(shard, shards) this rank's training data is: its rank among every rank of every replica
        group of a fault-tolerant run (env.replica_groups), else (rank, world_size)."""
        return self.ctx.env.data_place(self.rank, self.world_size)

    def micro_batch(self, batch_size: int, grad_accum: int = 1) -> int:
        """The samples one rank loads per forward pass for a GLOBAL `batch_size` split over this run's
        ranks and `grad_accum` micro-steps; a batch that does not split evenly is refused (UserError).
        Before init (no Run yet) `ddp_kit.data.per_rank_batch(batch_size, world_size, grad_accum)`."""
        return per_rank_batch(batch_size, self.data_place[1], grad_accum)

    @property
    def loader_workers(self) -> int:
        """DataLoader workers for this rank when you have no number of your own: 0 on CPU; on CUDA
        this rank's share of the node's CPUs less one, at most 8 (lowered by `prepare` to what
        in-memory data or a short epoch needs)."""
        return loader_workers(self.ctx.env, self.device)

    def prepare(self, *objs: Any, sync_bn: bool = False, compile: bool = False, channels_last: bool = False,
                grad_accum: int = 1, ddp: dict[str, Any] | None = None, device_data: bool = False,
                strategy: str = DEFAULT_STRATEGY, fsdp: dict[str, Any] | None = None, amp: str = "off",
                **options: dict[str, Any] | None) -> Any:
        """Wrap each nn.Module (device + DDP) and shard each DataLoader; anything else passes through.

        Everything returned that has state_dict/load_state_dict (the model, the loader with its data
        position, an optimizer or scheduler passed along) is registered for checkpoints. With
        `grad_accum=k` a loader yields k micro-batches per optimizer step (the global batch split
        over ranks and micro-steps); use `run.accumulate` on the first k-1. `ddp`: DDP's own options
        (e.g. {"bucket_cap_mb": 50, "static_graph": True}); gradient_as_bucket_view is on by default.
        `device_data`: a loader over an in-memory TensorDataset keeps it on the device and indexes
        batches there (the same batches; no per-step collate or copy).

        `strategy="fsdp"` shards each model with FSDP2 instead of replicating it (fsdp.py): `fsdp`
        takes blocks (the per-block policy: a callable or class names), cpu_offload and
        reshard_after_forward; `amp="bf16"` gives it FSDP's mixed-precision policy. Checkpoints of
        the models and the optimizers over their parameters are then sharded (DCP): create the
        optimizer from the model this returns. `options`: another strategy's own options, a dict
        under its name (parallel/<name>.py declares them)."""
        unknown = sorted(set(options) - option_keywords())
        if unknown:  # as Python words it for a keyword the signature lacks
            raise TypeError(f"Run.prepare() got an unexpected keyword argument '{unknown[0]}'")
        chosen = find_strategy(strategy)
        models = any(isinstance(o, nn.Module) for o in objs)
        if chosen.sharded and models:
            if self._uneven_eval:
                raise UserError(f"run.eval_loader was called before run.prepare(model, strategy='{chosen.name}'): its "
                                "batches were split for DDP, and under a sharded strategy ranks with fewer eval batches would leave the "
                                "others waiting in an all-gather", "call run.prepare on the model first, then "
                                "run.eval_loader")
        if models:
            self._boundary.strategy = chosen
            replay_check.refuse_strategy(self._boundary.policy.sdc_check_every, chosen)
        out = [self._prepare_one(o, sync_bn, compile, channels_last, grad_accum, ddp, device_data,
                                 dict(strategy=strategy, fsdp=fsdp, amp=amp, **options)) for o in objs]
        if models:  # what the strategy adds at each step (strategy ft: the replica group's quorum)
            wrapped = [o for o in out if isinstance(o, nn.Module)]
            replay_check.refuse_sync_bn(self._boundary.policy.sdc_check_every, wrapped, self.ctx.world_size)
            for hook in chosen.step_hooks(wrapped, self.ctx.env, self._boundary.hooks):
                self._boundary.attach(hook)
        for o in out:
            if callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)):
                self._boundary.track(o, module=self._prepared.get(o) if isinstance(o, nn.Module) else None)
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_one(self, obj: Any, sync_bn: bool, compile: bool, channels_last: bool, grad_accum: int,
                     ddp: dict[str, Any] | None, device_data: bool, sharding: dict[str, Any]) -> Any:
        if isinstance(obj, nn.Module):
            held = strategy_of(obj)
            kind = held.label if held is not None else ""
            if kind or obj in self._prepared:
                raise UserError(f"run.prepare got a model that is already prepared{f' (wrapped in {kind})' if kind else ''}",
                                "prepare the plain model once and keep what run.prepare returned")
            model = wrap_model(obj, self.ctx, sync_bn=sync_bn, compile=compile, channels_last=channels_last, ddp=ddp,
                               **sharding)
            # The module that trains (sync_bn may replace a top-level BatchNorm): unwrapped once, here. At
            # world size 1 the model comes back unwrapped, and this map is how a second prepare is known.
            self._prepared[model] = unwrap(model)
            ddp = unwrap_ddp(model)
            hook = getattr(ddp, "register_state_dict_post_hook", None)  # (torch >= 2.5)
            if hook is not None:  # ddp_kit's own saves take the unwrapped module's state_dict: only yours get here
                hook(lambda *_: self._wrapped_state_dict())  # a function: torch marks the hook it is given
            return model
        if isinstance(obj, DataLoader):
            return self.train_loader(obj, grad_accum, device_data)
        return obj

    def _wrapped_state_dict(self) -> None:
        """Once, on rank 0: the script took the DDP wrapper's state_dict (usually to torch.save it)."""
        if self._said_wrapped_state:
            return
        self._said_wrapped_state = True
        if self.is_main:
            print("ddp_kit: warning: model.state_dict() of the DDP-wrapped model: its keys start with 'module.' (a plain "
                  "model will not load them), and a torch.save on every rank writes one file from each; save "
                  "run.unwrap(model).state_dict() under `if run.is_main:` (or run.full_state_dict(model)), or rely on "
                  "the checkpoint's model.pt", file=sys.stderr, flush=True)

    def train_loader(self, loader: DataLoader, grad_accum: int = 1, device_data: bool = False) -> TrainLoader:
        """A sharded, epoch-aware copy of `loader` that samples as `loader` did, or a one-line refusal.

        SequentialSampler (shuffle=False): the shard in order. RandomSampler (shuffle=True):
        reshuffled each epoch, seeded by the loader's (or sampler's) `generator`, else by
        `init(seed=...)`. SubsetRandomSampler: the same over its indices. Refused (UserError):
        sampling with replacement or by weight, a num_samples, a DistributedSampler, any other
        sampler, a batch_sampler, batch_size=None, an IterableDataset. `worker_init_fn` and
        `collate_fn` are kept. Only whole global batches are used: a tail that cannot fill one is
        skipped each epoch, which rank 0 points out unless the loader has drop_last=True.
        """
        dataset, shuffle, seed = loader_sampling(loader, self.seed)
        shard, shards = self.data_place
        batch = loader.batch_size * (1 if self.split_batches else shards)
        self.micro_batch(batch, grad_accum)  # an error that stops the run comes first, alone
        tail = len(dataset) % batch
        if tail and not loader.drop_last and self.is_main and len(dataset) >= batch:
            which = f"a different {tail} each epoch" if shuffle else f"the last {tail}, every epoch"
            print(f"ddp_kit: note: {tail} of {len(dataset)} samples do not fill a whole global batch of {batch} and are "
                  f"skipped ({which}); pass drop_last=True to the DataLoader to say that is intended",
                  file=sys.stderr, flush=True)
        return TrainLoader(dataset, global_batch=batch, world_size=shards, rank=shard,
                           grad_accum=grad_accum, shuffle=shuffle, seed=seed, num_workers=loader.num_workers,
                           pin_memory=self.device.type == "cuda" and not device_data, collate_fn=loader.collate_fn,
                           worker_init_fn=loader.worker_init_fn, resident=self.device if device_data else None)

    def eval_loader(self, loader: DataLoader) -> DataLoader:
        """This rank's exact share of `loader`'s dataset: every sample once over all ranks, no padding.

        The order is irrelevant to sums, so any sampler that takes each sample once is accepted
        (SubsetRandomSampler: its indices); the rest is refused as in `train_loader`, and so is
        drop_last=True, which would leave samples out."""
        dataset, _, _ = loader_sampling(loader, self.seed)
        if loader.drop_last:
            raise UserError("run.eval_loader evaluates every sample exactly once, so it cannot honour drop_last=True",
                            "pass drop_last=False to the evaluation DataLoader")
        # Sharded models gather their weights in every forward, so every rank must make the same number
        # of calls: under FSDP each rank's exact share comes in the same number of batches.
        shard = eval_loader(dataset, batch_size=loader.batch_size, world_size=self.world_size, rank=self.rank,
                            num_workers=loader.num_workers, pin_memory=self.device.type == "cuda",
                            collate_fn=loader.collate_fn, worker_init_fn=loader.worker_init_fn,
                            even_batches=self._boundary.strategy.sharded)
        self._uneven_eval = self._uneven_eval or (not self._boundary.strategy.sharded and self.world_size > 1)
        b = self._boundary
        return EvalLoader(shard, lambda: b.heartbeat("eval"), b.models,
                          done=lambda s: b.tell({"event": "eval_pass", "step": b.steps.done, "seconds": round(s, 3)}))

    # ---- the reliability layer: checkpoints, preemption, watchdog, sync checks (reliability/) -------

    def resume(self, *, check: Callable[[dict], str | None] | None = None, meta: dict | None = None, **objects: Any) -> int:
        """Register `objects` (name=obj, each with state_dict/load_state_dict) beside what `prepare`
        returned, and restore all of them, with this rank's RNG, from the checkpoint `init(resume=...)`
        names (auto: the newest valid one in run_dir/checkpoints). Returns the number of optimizer
        steps already done (0 on a fresh start); `run.epoch` says how many epochs.

        `meta` is written into every checkpoint's meta.json; `check(meta)` is called with a found
        checkpoint's meta (plus its "path") before anything is loaded: it may refuse it by raising
        a UserError, or return a note for the "resumed from" line."""
        if meta:
            self._boundary.meta.update(meta)
        done = self._boundary.resume(objects, check)
        self._boundary.agree()
        return Resumed(done, self.epoch)

    def step(self, loss: Any = None) -> int:
        """Call once per optimizer step, after `optimizer.step()`; `loss` (a tensor, never read on the
        spot) feeds metrics.jsonl and the NaN check. Returns the steps done. May save a checkpoint,
        and on a stop signal saves, requeues under SLURM and exits 75 (130 for Ctrl-C) on every rank. After a
        rollback (sync_fix rollback, docs/sdc.md) the steps done are the restored checkpoint's."""
        self._boundary.step(loss)
        return self._boundary.steps.done

    def forward_backward(self, model: nn.Module, compute: Callable[[], Any], scaler: Any = None) -> Any:
        """`loss = compute()` (the forward on this step's batch), then its backward, scaled by `scaler` (a
        GradScaler) when given; returns the loss. Call it where `loss.backward()` would be, inside
        `run.accumulate` with micro-batches. Every `sdc_check_every` steps the step is computed again and
        compared before the optimizer sees it (docs/sdc.md): `compute` must depend only on the batch, the model
        and torch's random state."""
        def backward(loss: Any) -> None:
            (scaler.scale(loss) if scaler is not None and scaler.is_enabled() else loss).backward()
        return replay_check.forward_backward(self._boundary, model, compute, backward)

    def save(self) -> None:
        """Checkpoint now (every rank must call it); resumable by `run.resume`."""
        self._boundary.save()

    @property
    def steps_done(self) -> int:
        """Optimizer steps done, the one whose boundary is still to run (at the next batch) included."""
        return self._boundary.steps.done + int(self._boundary.steps.pending)

    @property
    def memory(self) -> dict[str, int]:
        """This rank's parameter, gradient and optimizer-state bytes (its shards under FSDP), as last
        measured at a log event or the first optimizer step; {} before that."""
        return dict(self._boundary.memory)

    @property
    def epoch(self) -> int:
        """Epochs completed by the (first) loader from `prepare`; after a resume, the checkpoint's."""
        return self._boundary.epoch

    def epochs(self, start_or_stop: int, stop: int | None = None) -> Iterator[int]:
        """`range(start, stop)` without the epochs a resumed run already completed:
        `for epoch in run.epochs(1, args.epochs + 1)` in place of `range(1, args.epochs + 1)`.

        Between two epochs (after your end-of-epoch work, before the next epoch's first line) it
        runs the step boundary still due, so a checkpoint never falls between the two."""
        start, stop = (0, start_or_stop) if stop is None else (start_or_stop, stop)
        epoch = start + self.epoch
        while epoch < stop:
            yield epoch
            self._boundary.flush()
            # Read anew where a peer's state came in during the epoch (strategy ft's live recovery), or a rollback
            # restored an earlier step (sync_fix rollback): the run is in that state's epoch now. (Elsewhere a loop
            # may iterate its loader twice per epoch of its own.)
            jumped, self._boundary.steps.jumped = self._boundary.steps.jumped, False
            epoch = start + self.epoch if jumped else epoch + 1

    def heartbeat(self, phase: str = "eval") -> None:
        """Long work between steps (an eval, a big save of your own): this rank is alive. "eval",
        "checkpoint" and "finish" get the startup timeout instead of hang_timeout_s."""
        self._boundary.heartbeat(phase)

    def on_log(self, fn: Callable[[dict], None]) -> None:
        """Call `fn(record)` on every rank at each log event, before rank 0 writes it to metrics.jsonl
        (it may add fields, and run collectives: every rank calls it at the same step)."""
        self._boundary.on_log.append(fn)

    def log(self) -> dict:
        """A log event now (every rank must call it): the record of the steps since the last one."""
        return self._boundary.log()

    def log_event(self, record: dict) -> None:
        """Append `record` to run_dir/metrics.jsonl and send it to the trackers (rank 0; a no-op elsewhere)."""
        self._boundary.write(record)

    def write_summary(self, summary: dict) -> None:
        """run_dir/summary.json, written atomically by rank 0."""
        self._boundary.write_summary(summary)

    def explain_cuda_errors(self, fn: Callable[[BaseException], list[str]]) -> None:
        """On a CUDA/NCCL error the failing rank prints `fn(err)`'s lines beside it (default: the
        doctor's findings), e.g. what the batch held on out-of-memory."""
        self._boundary.cuda_notes = fn

    # ---- small helpers ----------------------------------------------------------------------------

    def sum(self, *values: float) -> list[float]:
        """Sum numbers over ranks (e.g. correct and count from eval_loader shards)."""
        return all_reduce_sum(self.ctx, list(values))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), on every rank, in rank order."""
        return all_gather_object(self.ctx, obj)

    def accumulate(self, model: nn.Module, last: bool):
        """`with run.accumulate(model, last=(i % k == k - 1)):` skips the all-reduce on non-final micro-steps."""
        return sync_gradients(model, last)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Your module under the DDP / torch.compile wrappers (under FSDP its parameters stay sharded:
        see full_state_dict)."""
        try:
            module = self._prepared.get(model)
        except TypeError:  # not weak-referenceable, so not a model this Run prepared
            module = None
        return module if module is not None else unwrap(model)

    def full_state_dict(self, model: nn.Module, rank0_only: bool = True) -> dict[str, Any]:
        """Your model's plain state_dict (whole CPU tensors, the keys of the unwrapped module) for
        `torch.save` or another process, under any strategy. Under FSDP every rank must call it (the
        shards are gathered one tensor at a time); with rank0_only the other ranks get {}."""
        module = self.unwrap(model)
        if in_main_only() and is_sharded(module):
            raise UserError("run.full_state_dict(model) was called inside main_only() on a sharded (FSDP) model: it "
                            "gathers the shards from every rank, and the other ranks skip the block",
                            "call it on every rank before main_only() (rank 0 keeps the result), then use the dict inside")
        return full_state_dict(module, keep=self.is_main or not rank0_only)

    def load_weights(self, model: nn.Module, path: str | os.PathLike, strict: bool = True) -> dict[str, str]:
        """Load a safetensors file (`python -m ddp_kit.checkpoint export RUN --format safetensors`) into
        `model`, before or after `prepare`, under any strategy and world size: every rank calls it (under
        FSDP each keeps its shards). Nothing is unpickled. Returns the file's header (step, strategy,
        config_hash, versions: strings). Without a Run: ddp_kit.checkpoint.load_weights."""
        from .checkpoint.weights import load_weights

        module = self.unwrap(model)
        if in_main_only() and is_sharded(module):
            raise UserError("run.load_weights(model, ...) was called inside main_only() on a sharded (FSDP) model: "
                            "it splits the tensors into shards with every rank, and the other ranks skip the block",
                            "call it on every rank, outside main_only()")
        return load_weights(module, path, strict=strict)

    @contextmanager
    def main_only(self) -> Iterator[bool]:
        """`with run.main_only() as main: if main: ...`: rank-0-only code in which collectives raise at
        once, and a DDP model's forward runs on its own module (see sync.main_only). A hang report
        names the rank that is inside the block."""
        progress = self._boundary.progress
        phase = progress.phase
        if self.is_main and self.world_size > 1:
            progress.enter("main_only")
        try:
            with main_only(self.ctx) as main:
                yield main
        finally:
            if progress.phase == "main_only":
                progress.enter(phase)

    def seed_everything(self, seed: int | None = None, per_rank: bool = True) -> int:
        """Seed Python's, NumPy's (when imported) and torch's generators (CPU and every GPU) with
        `seed` (default: init's seed) plus this rank (per_rank=True, as Accelerate's
        set_seed(device_specific=True)): each rank draws different augmentation and dropout noise,
        and a rerun draws the same. Call it after building the model, or with per_rank=False before:
        DDP broadcasts rank 0's initial weights, FSDP keeps each rank's. Returns the seed used."""
        import random

        import torch

        used = (self.seed if seed is None else seed) + (self.rank if per_rank else 0)
        random.seed(used)
        torch.manual_seed(used)  # every CUDA device too
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(used % 2**32)
        return used

    def print(self, *args, **kwargs) -> None:
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def barrier(self) -> None:
        barrier(self.ctx)

    def close(self, at_exit: bool = False) -> None:
        """A clean end: a final checkpoint of what is registered (if this step is not saved yet), then
        teardown. Runs by itself at interpreter exit; after a failure only the teardown runs.

        A failure of the final checkpoint (disk full, NaN weights, a stop signal that arrived
        during the last epoch) goes through the failure policy like any other and sets the exit
        code, also at interpreter exit, where Python would otherwise ignore it."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self._boundary.steps.failed:
                self._boundary.finish()
        except BaseException as err:
            code = err.code if isinstance(err, SystemExit) else self._boundary.fail(err)
            self._stack.close()
            if at_exit:  # an exception here would be printed and ignored, and the exit code lost
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code if isinstance(code, int) else 1)
            raise SystemExit(code) from None
        self._stack.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind, err, tb) -> None:
        if err is None or isinstance(err, SystemExit):
            self.close()
            return
        code = self._boundary.fail(err)  # the failure policy, while the store and process group still exist
        self.close()
        raise SystemExit(code) from None


class Resumed(int):
    """The optimizer steps already done (an int), with `.epoch`, the epochs already done."""

    def __new__(cls, steps: int, epoch: int) -> Resumed:
        out = super().__new__(cls, steps)
        out.epoch = epoch
        return out

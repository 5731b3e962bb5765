"""The library API for users' own scripts: four lines turn a single-device loop into a DDP one,
and four more give it checkpoints, preemption, the hang watchdog and sync checks.

    import ddp_kit
    run = ddp_kit.init(run_dir="runs/mnist")             # process group, device, run folder, teardown
    device = run.device                                   # instead of torch.device("cuda" if ...)
    model, train_loader = run.prepare(model, train_loader)
    start = run.resume(optimizer=optimizer)               # + model and loader: restored if a checkpoint exists
    for epoch in run.epochs(10):                          # continues with the epoch the checkpoint was in
        ...
        optimizer.step()
        run.step(loss)                                    # the step boundary (see guard.py)

`loss.backward()` and `optimizer.step()` stay as they are. The loader's batch_size is read as
the GLOBAL batch (split over ranks) so that the recipe is the same on 1 and N ranks; pass
`split_batches=False` to keep it per rank, as Accelerate does by default.

A loader is sharded the way it samples, or refused in one line (`Run.train_loader`). Any error
that ends the script is handled as in `python -m ddp_kit.train` (failure.py): a UserError is one
line and exit 2; another exception is printed once, by the rank that raised it, and the other
ranks stop within seconds, naming it.
"""
from __future__ import annotations

import atexit
import dataclasses
import difflib
import inspect
import os
import sys
import threading
import time
import weakref
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed as tdist
from torch import nn
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, RandomSampler, SequentialSampler, Subset,
                              SubsetRandomSampler, WeightedRandomSampler)

from .data import TrainLoader, check_sized, eval_loader, per_rank_batch
from .dist import DistContext, all_gather_object, all_reduce_sum, barrier, distributed
from .env import DistEnv, detect
from .errors import EXIT_USER_ERROR, UserError, report_user_error
from .parallel.fsdp import full_state_dict, is_sharded
from .reliability.boundary import Guard, Policy
from .reliability.preemption import PreemptFlag
from .reliability.run_dir import RunDir
from .reliability.sync_checks import in_main_only, main_only
from .reliability.progress import Progress
from .parallel.wrap import (ddp_local_forward, kernel_settings, sync_ddp_buffers, sync_gradients, unwrap, unwrap_ddp,
                   wrap_model)


class Run:
    """A live distributed context plus the helpers a training script needs. Create it with `init()`."""

    def __init__(self, ctx: DistContext, stack: ExitStack, guard: Guard, split_batches: bool, seed: int):
        self.ctx = ctx
        self._stack = stack
        self._guard = guard
        self._closed = False
        self.split_batches = split_batches
        self.seed = seed
        self._uneven_eval = False  # an eval loader split for DDP exists (FSDP needs even batch counts)
        self._prepared: weakref.WeakSet = weakref.WeakSet()  # models this Run's prepare returned
        self._said_wrapped_state = False

    device = property(lambda self: self.ctx.device)
    rank = property(lambda self: self.ctx.rank)
    world_size = property(lambda self: self.ctx.world_size)
    is_main = property(lambda self: self.ctx.is_main)

    run_dir = property(lambda self: self._guard.rd.path if self._guard.rd else None)

    def prepare(self, *objs: Any, sync_bn: bool = False, compile: bool = False, channels_last: bool = False,
                grad_accum: int = 1, ddp: dict[str, Any] | None = None, device_data: bool = False,
                strategy: str = "ddp", fsdp: dict[str, Any] | None = None, amp: str = "off") -> Any:
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
        optimizer from the model this returns."""
        if strategy == "fsdp" and any(isinstance(o, nn.Module) for o in objs):
            if self._uneven_eval:
                raise UserError("run.eval_loader was called before run.prepare(model, strategy='fsdp'): its batches "
                                "were split for DDP, and under FSDP ranks with fewer eval batches would leave the "
                                "others waiting in an all-gather", "call run.prepare on the model first, then "
                                "run.eval_loader")
            self._guard.strategy = "fsdp"
        out = [self._prepare_one(o, sync_bn, compile, channels_last, grad_accum, ddp, device_data,
                                 dict(strategy=strategy, fsdp=fsdp, amp=amp)) for o in objs]
        for o in out:
            if callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)):
                self._guard.track(o)
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_one(self, obj: Any, sync_bn: bool, compile: bool, channels_last: bool, grad_accum: int,
                     ddp: dict[str, Any] | None, device_data: bool, sharding: dict[str, Any]) -> Any:
        if isinstance(obj, nn.Module):
            kind = "FSDP" if is_sharded(obj) else "DDP" if unwrap_ddp(obj) is not None else ""
            if kind or obj in self._prepared:
                raise UserError(f"run.prepare got a model that is already prepared{f' (wrapped in {kind})' if kind else ''}",
                                "prepare the plain model once and keep what run.prepare returned")
            model = wrap_model(obj, self.ctx, sync_bn=sync_bn, compile=compile, channels_last=channels_last, ddp=ddp,
                               **sharding)
            self._prepared.add(model)  # at world size 1 the model comes back unwrapped: this Run remembers it
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
        dataset, shuffle, seed = self._sampling(loader)
        batch = loader.batch_size * (1 if self.split_batches else self.world_size)
        per_rank_batch(batch, self.world_size, grad_accum)  # an error that stops the run comes first, alone
        tail = len(dataset) % batch
        if tail and not loader.drop_last and self.is_main and len(dataset) >= batch:
            which = f"a different {tail} each epoch" if shuffle else f"the last {tail}, every epoch"
            print(f"ddp_kit: note: {tail} of {len(dataset)} samples do not fill a whole global batch of {batch} and are "
                  f"skipped ({which}); pass drop_last=True to the DataLoader to say that is intended",
                  file=sys.stderr, flush=True)
        return TrainLoader(dataset, global_batch=batch, world_size=self.world_size, rank=self.rank,
                           grad_accum=grad_accum, shuffle=shuffle, seed=seed, num_workers=loader.num_workers,
                           pin_memory=self.device.type == "cuda" and not device_data, collate_fn=loader.collate_fn,
                           worker_init_fn=loader.worker_init_fn, resident=self.device if device_data else None)

    def eval_loader(self, loader: DataLoader) -> DataLoader:
        """This rank's exact share of `loader`'s dataset: every sample once over all ranks, no padding.

        The order is irrelevant to sums, so any sampler that takes each sample once is accepted
        (SubsetRandomSampler: its indices); the rest is refused as in `train_loader`, and so is
        drop_last=True, which would leave samples out."""
        dataset, _, _ = self._sampling(loader)
        if loader.drop_last:
            raise UserError("run.eval_loader evaluates every sample exactly once, so it cannot honour drop_last=True",
                            "pass drop_last=False to the evaluation DataLoader")
        # Sharded models gather their weights in every forward, so every rank must make the same number
        # of calls: under FSDP each rank's exact share comes in the same number of batches.
        shard = eval_loader(dataset, batch_size=loader.batch_size, world_size=self.world_size, rank=self.rank,
                            num_workers=loader.num_workers, pin_memory=self.device.type == "cuda",
                            collate_fn=loader.collate_fn, worker_init_fn=loader.worker_init_fn,
                            even_batches=self._guard.strategy == "fsdp")
        self._uneven_eval = self._uneven_eval or (self._guard.strategy != "fsdp" and self.world_size > 1)
        return _EvalLoader(shard, lambda: self._guard.heartbeat("eval"), self._guard.models)

    def _sampling(self, loader: DataLoader) -> tuple[Dataset, bool, int]:
        """(dataset to shard, shuffle, seed) that reproduce `loader`'s sampling; refuses what cannot be sharded."""
        check_sized(loader.dataset)
        yourself = "shard it yourself by run.rank and run.world_size and use that DataLoader without run.prepare"
        if loader.batch_size is None:
            if loader.batch_sampler is not None:
                raise UserError(f"the DataLoader has a batch_sampler ({type(loader.batch_sampler).__name__}): ddp_kit "
                                f"builds the batches itself to split each one over ranks",
                                f"pass batch_size (the global batch) and shuffle instead, or {yourself}")
            raise UserError("the DataLoader has batch_size=None (no batching): ddp_kit splits whole batches over ranks",
                            "pass batch_size (the global batch)")
        sampler = loader.sampler
        generator = getattr(sampler, "generator", None) or loader.generator
        seed = generator.initial_seed() % 2**63 if generator is not None else self.seed
        kind = type(sampler)
        if kind is SequentialSampler:
            return loader.dataset, False, seed
        if kind is RandomSampler and not sampler.replacement and sampler.num_samples == len(sampler.data_source):
            return loader.dataset, True, seed
        if kind is SubsetRandomSampler:
            return Subset(loader.dataset, [int(i) for i in sampler.indices]), True, seed
        if isinstance(sampler, DistributedSampler):
            raise UserError(f"the DataLoader already has a {kind.__name__}: run.prepare shards a plain DataLoader itself "
                            f"(its batch_size is the global batch)",
                            "pass a plain DataLoader with shuffle=True/False; ddp_kit shards it")
        per_rank = ("draw on each rank yourself (num_samples // run.world_size, a generator seeded with seed + run.rank) "
                    "and use that DataLoader without run.prepare")
        if isinstance(sampler, WeightedRandomSampler):
            how = "by weight, with replacement" if sampler.replacement else "by weight"
            raise UserError(f"the DataLoader's sampler {kind.__name__} draws {how}: ddp_kit cannot split that over ranks "
                            f"without changing what is sampled", per_rank)
        if kind is RandomSampler:  # with replacement, or not one whole epoch
            what, how = (("replacement=True", "with replacement") if sampler.replacement else
                         (f"num_samples={sampler.num_samples}",
                          f"{sampler.num_samples} samples per epoch from {len(sampler.data_source)}"))
            raise UserError(f"the DataLoader's sampler RandomSampler({what}) draws {how}: ddp_kit cannot split that "
                            f"over ranks without changing what is sampled", f"use shuffle=True, or {per_rank}")
        raise UserError(f"the DataLoader's sampler {kind.__name__} is not one ddp_kit can shard (it shards "
                        f"SequentialSampler, RandomSampler and SubsetRandomSampler)",
                        f"use shuffle=True/False, or {yourself}")

    # ---- the reliability layer: checkpoints, preemption, watchdog, sync checks (guard.py) -------------

    def resume(self, *, check: Callable[[dict], str | None] | None = None, meta: dict | None = None, **objects: Any) -> int:
        """Register `objects` (name=obj, each with state_dict/load_state_dict) beside what `prepare`
        returned, and restore all of them, with this rank's RNG, from the checkpoint `init(resume=...)`
        names (auto: the newest valid one in run_dir/checkpoints). Returns the number of optimizer
        steps already done (0 on a fresh start); `run.epoch` says how many epochs.

        `meta` is written into every checkpoint's meta.json; `check(meta)` is called with a found
        checkpoint's meta (plus its "path") before anything is loaded: it may refuse it by raising
        a UserError, or return a note for the "resumed from" line."""
        if meta:
            self._guard.meta.update(meta)
        done = self._guard.resume(objects, check)
        self._guard.agree()
        return Resumed(done, self.epoch)

    def step(self, loss: Any = None) -> int:
        """Call once per optimizer step, after `optimizer.step()`; `loss` (a tensor, never read on the
        spot) feeds metrics.jsonl and the NaN check. Returns the steps done. May save a checkpoint,
        and on a stop signal saves, requeues under SLURM and exits 75 (130 for Ctrl-C) on every rank."""
        return self._guard.step(loss)

    def save(self) -> None:
        """Checkpoint now (every rank must call it); resumable by `run.resume`."""
        self._guard.save()

    @property
    def steps_done(self) -> int:
        """Optimizer steps done, the one whose boundary is still to run (at the next batch) included."""
        return self._guard.done + int(self._guard.pending)

    @property
    def memory(self) -> dict[str, int]:
        """This rank's parameter, gradient and optimizer-state bytes (its shards under FSDP), as last
        measured at a log event or the first optimizer step; {} before that."""
        return dict(self._guard.memory)

    @property
    def epoch(self) -> int:
        """Epochs completed by the (first) loader from `prepare`; after a resume, the checkpoint's."""
        return self._guard.epoch

    def epochs(self, start_or_stop: int, stop: int | None = None) -> Iterator[int]:
        """`range(start, stop)` without the epochs a resumed run already completed:
        `for epoch in run.epochs(1, args.epochs + 1)` in place of `range(1, args.epochs + 1)`.

        Between two epochs (after your end-of-epoch work, before the next epoch's first line) it
        runs the step boundary still due, so a checkpoint never falls between the two."""
        start, stop = (0, start_or_stop) if stop is None else (start_or_stop, stop)
        for epoch in range(start + self.epoch, stop):
            yield epoch
            self._guard.flush()

    def heartbeat(self, phase: str = "eval") -> None:
        """Long work between steps (an eval, a big save of your own): this rank is alive. "eval",
        "checkpoint" and "finish" get the startup timeout instead of hang_timeout_s."""
        self._guard.heartbeat(phase)

    def on_log(self, fn: Callable[[dict], None]) -> None:
        """Call `fn(record)` on every rank at each log event, before rank 0 writes it to metrics.jsonl
        (it may add fields, and run collectives: every rank calls it at the same step)."""
        self._guard.on_log.append(fn)

    def log(self) -> dict:
        """A log event now (every rank must call it): the record of the steps since the last one."""
        return self._guard.log()

    def log_event(self, record: dict) -> None:
        """Append `record` to run_dir/metrics.jsonl (rank 0 writes; a no-op elsewhere)."""
        self._guard.write(record)

    def write_summary(self, summary: dict) -> None:
        """run_dir/summary.json, written atomically by rank 0."""
        self._guard.write_summary(summary)

    def explain_cuda_errors(self, fn: Callable[[BaseException], list[str]]) -> None:
        """On a CUDA/NCCL error the failing rank prints `fn(err)`'s lines beside it (default: the
        doctor's findings), e.g. what the batch held on out-of-memory."""
        self._guard.cuda_notes = fn

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
        return unwrap(model)

    def full_state_dict(self, model: nn.Module, rank0_only: bool = True) -> dict[str, Any]:
        """Your model's plain state_dict (whole CPU tensors, the keys of the unwrapped module) for
        `torch.save` or another process, under any strategy. Under FSDP every rank must call it (the
        shards are gathered one tensor at a time); with rank0_only the other ranks get {}."""
        if in_main_only() and is_sharded(unwrap(model)):
            raise UserError("run.full_state_dict(model) was called inside main_only() on a sharded (FSDP) model: it "
                            "gathers the shards from every rank, and the other ranks skip the block",
                            "call it on every rank before main_only() (rank 0 keeps the result), then use the dict inside")
        return full_state_dict(unwrap(model), keep=self.is_main or not rank0_only)

    @contextmanager
    def main_only(self) -> Iterator[bool]:
        """`with run.main_only() as main: if main: ...`: rank-0-only code in which collectives raise at
        once, and a DDP model's forward runs on its own module (see sync.main_only). A hang report
        names the rank that is inside the block."""
        progress = self._guard.progress
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
            if not self._guard.failed:
                self._guard.finish()
        except BaseException as err:
            code = err.code if isinstance(err, SystemExit) else self._guard.fail(err)
            self._stack.close()
            if at_exit:  # an exception here would be printed and ignored, and the exit code lost
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code if isinstance(code, int) else 1)
            raise SystemExit(code) from None
        self._stack.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, kind, err, tb) -> None:
        if err is None or isinstance(err, SystemExit):
            self.close()
            return
        code = self._guard.fail(err)  # the failure policy, while the store and process group still exist
        self.close()
        raise SystemExit(code) from None


class Resumed(int):
    """The optimizer steps already done (an int), with `.epoch`, the epochs already done."""

    def __new__(cls, steps: int, epoch: int) -> "Resumed":
        out = super().__new__(cls, steps)
        out.epoch = epoch
        return out


class _EvalLoader:
    """A DataLoader whose every batch is a heartbeat (long evals are progress too), and before whose
    first batch every prepared DDP model takes rank 0's buffers: the evaluated model is the one a
    checkpoint saves, the same on every rank, and its forwards start no collective (a rank with an
    empty shard may call none). Else the same loader. Every rank iterates it, empty shard or not."""

    def __init__(self, loader: DataLoader, beat: Callable[[], None], models: list[nn.Module]):
        self._loader, self._beat, self._models = loader, beat, models

    def __iter__(self):
        if in_main_only():
            raise UserError("run.eval_loader was iterated inside main_only(): it holds only this rank's share of the "
                            "data, and making it agree on the model's buffers needs every rank",
                            "iterate it on every rank and combine the sums with run.sum(...), or use a plain "
                            "DataLoader over the whole set inside main_only()")
        self._beat()
        for model in self._models:
            sync_ddp_buffers(model)
        for batch in self._loader:
            self._beat()
            for model in self._models:  # an eval forward with gradients on would arm the broadcast again
                ddp_local_forward(model)
            yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _as_json(config: dict | None) -> dict | None:
    """The config as a checkpoint's meta.json will hold it (tuples as lists, keys as strings), so that
    a resume compares like with like; refused in one line when it does not fit in JSON."""
    if config is None:
        return None
    import json

    try:
        return json.loads(json.dumps(config))
    except (TypeError, ValueError) as exc:
        raise UserError(f"ddp_kit.init(config=...) must be JSON-able (numbers, strings, lists, dicts): {exc}",
                        "pass plain values, e.g. str(path) for a path") from None


def _policy(run_dir: str | Path | None, options: dict[str, Any]) -> Policy:
    known = {f.name for f in dataclasses.fields(Policy)} - {"run_dir"}
    unknown = sorted(set(options) - known)
    if unknown:
        prepare = sorted(set(unknown) & set(inspect.signature(Run.prepare).parameters) - {"self", "objs"})
        if prepare:  # Fabric-style Fabric(strategy=...): here the model's options go where the model does
            raise UserError(f"ddp_kit.init() got {', '.join(prepare)}, which {'is an option' if len(prepare) == 1 else 'are options'} "
                            f"of run.prepare", f"pass it with the model: run.prepare(model, ..., "
                            f"{', '.join(f'{k}=...' for k in prepare)})")
        own = [n for n, p in inspect.signature(init).parameters.items() if p.kind == p.KEYWORD_ONLY or n == "run_dir"]
        everything = sorted(set(own) | known)
        near = [m for k in unknown for m in difflib.get_close_matches(k, everything, n=2, cutoff=0.6)]
        raise UserError(f"ddp_kit.init() got unknown option(s) {', '.join(unknown)}",
                        f"did you mean {' or '.join(dict.fromkeys(near))}? known: {', '.join(everything)}" if near
                        else f"known: {', '.join(everything)}")
    if run_dir is None and (options.get("ckpt_every") or options.get("async_ckpt")):
        raise UserError("checkpoint options were given but no run_dir to write checkpoints into",
                        'pass run_dir to ddp_kit.init(run_dir="runs/my_run", ...)')
    return Policy(run_dir=None if run_dir is None else str(run_dir), **options)


def init(run_dir: str | Path | None = None, *, backend: str = "auto", device: str = "auto", timeout_s: float = 600.0,
         split_batches: bool = True, seed: int = 0, config: dict | None = None, env: DistEnv | None = None,
         tf32: bool = True, cudnn_benchmark: bool = True, deterministic: bool = False, **options: Any) -> Run:
    """Join the job this process was launched into (or run alone) and return its Run.

    `run_dir` holds checkpoints, metrics.jsonl and hang reports; without it there are no
    checkpoints. `options` are guard.Policy's fields: resume, ckpt_every, ckpt_every_s, keep_last,
    async_ckpt, hang_timeout_s, peer_timeout_s, collective_timeout_s, preempt_check_every, sync_check_every,
    sync_fix, log_every, rank_metrics, rank_records_max, straggler_margin. `timeout_s` bounds the rendezvous and
    every collective until step 1 has finished. `config` (your hyperparameters, a JSON-able dict)
    goes to run_dir/config.yaml and every checkpoint's meta.json, and every rank must hold the
    same one at startup (a rank with a different one is named). `tf32`, `cudnn_benchmark` and
    `deterministic` are the process's kernel switches (wrap.kernel_settings); bit-identical resume
    on a GPU needs deterministic=True.

    Teardown (and a final checkpoint after a clean end) happens at `run.close()`, at `with` exit,
    or at interpreter exit. An error that ends the script goes through the failure policy first.
    """
    joining = _Failures(None)  # for errors while joining: there is no process group yet
    env = detect() if env is None else env
    joining.rank = env.rank  # before anything is checked: a mistake every rank makes is printed by rank 0 only
    if tdist.is_initialized():
        raise UserError("ddp_kit.init() was called while a process group already exists (a second ddp_kit.init(), "
                        "or your own init_process_group)", "call ddp_kit.init() once and pass the Run it returns "
                        "around; it sets up the process group itself")
    policy = _policy(run_dir, options)
    progress = Progress()
    box: list[Guard] = []
    flag = PreemptFlag(env.rank, where=lambda: (progress.step, box[0].saved_step if box else None)).install()
    stack = ExitStack()
    stack.callback(flag.restore)
    hang_dir = str(RunDir(Path(policy.run_dir)).hang) if policy.run_dir else None
    try:
        ctx = stack.enter_context(distributed(env, backend=backend, device=device, timeout_s=timeout_s,
                                              dump_dir=hang_dir))
    except BaseException:
        stack.close()
        raise
    kernel_settings(ctx.device, tf32=tf32, cudnn_benchmark=cudnn_benchmark, deterministic=deterministic)
    guard = Guard(ctx, policy, progress, flag)
    guard.config = _as_json(config)
    box.append(guard)
    stack.callback(guard.close)
    # init_process_group wrapped the hook it found, to prefix stderr lines with the rank; inside that
    # wrapper our line would be lost when we exit. So the first hook steps aside (it stays wrapped
    # but only passes errors on) and a second one goes on the outside, until the Run closes.
    joining.active = False
    stack.callback(_Failures(guard).uninstall)
    run = Run(ctx, stack, guard, split_batches, seed)
    # The final checkpoint writes with threads: it must run before interpreter shutdown stops
    # thread pools from taking work, i.e. among threading's exit hooks (they run when the main
    # thread ends, in reverse order: ours, registered last, before concurrent.futures' own).
    register = getattr(threading, "_register_atexit", atexit.register)
    register(lambda: run.close(at_exit=True))
    atexit.register(lambda: run.close(at_exit=True))  # a no-op once closed
    try:
        guard.start()
    except BaseException as err:
        code = guard.fail(err)  # e.g. the run folder is another job's: one line, once, for every rank
        run.close()
        raise SystemExit(code) from None
    return run


class _Failures:
    """sys.excepthook while a Run is open: the failure policy (failure.py) decides what this rank
    prints and its exit code. While joining (no guard yet) only a UserError is handled: one line."""

    def __init__(self, guard: Guard | None, rank: int = 0):
        self.guard = guard
        self.rank = guard.ctx.rank if guard is not None else rank
        self.active = True
        self.previous = sys.excepthook
        sys.excepthook = self

    def __call__(self, kind, err, tb) -> None:
        if not self.active:
            return self.previous(kind, err, tb)
        if self.guard is None and isinstance(self.previous, _Failures) and self.previous.guard is not None:
            return self.previous(kind, err, tb)  # a Run is open (a second ddp_kit.init): its policy decides
        if self.guard is not None:
            # SystemExit from an excepthook sets the exit code; atexit (teardown, no final save) still runs.
            sys.exit(self.guard.fail(err))
        if not isinstance(err, UserError):
            return self.previous(kind, err, tb)
        report_user_error(err, self.rank)
        if self.rank != 0 and not err.local:
            time.sleep(1.0)  # rank 0 prints it; torchrun stops all ranks once one exits, so give rank 0 a moment
        sys.exit(EXIT_USER_ERROR)

    def uninstall(self) -> None:
        if sys.excepthook is self:
            sys.excepthook = self.previous

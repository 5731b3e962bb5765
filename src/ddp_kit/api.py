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
        run.step(loss)                                    # the step boundary (boundary/core.py)

`loss.backward()` and `optimizer.step()` stay as they are. The loader's batch_size is read as
the GLOBAL batch (split over ranks) so that the recipe is the same on 1 and N ranks; pass
`split_batches=False` to keep it per rank, as Accelerate does by default.

A loader is sharded the way it samples, or refused in one line (`Run.train_loader`). Any error
that ends the script is handled as in `python -m ddp_kit.train` (reliability/failures.py): a UserError
is one line and exit 2; another exception is printed once, by the rank that raised it, and the
other ranks stop within seconds, naming it.

This module is the face only: `init`, `Run` (every method a script calls, which is why it is long:
each is a few lines that hand over to the module doing the work) and `Resumed`; docs/architecture.md says
where the work lives.
"""
from __future__ import annotations

import atexit
import inspect
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import DataLoader

from .boundary.core import StepBoundary
from .boundary.eval_pass import EvalLoader
from .boundary.excepthook import Failures
from .boundary.policy import Policy
from .data import TrainLoader, eval_loader, per_rank_batch
from .data.resample import loader_sampling
from .dist import DistContext, distributed
from .dist.collectives import all_gather_object, all_reduce_sum, barrier
from .dist.resources import loader_workers
from .doctor import findings_for_error
from .env import DistEnv, detect
from .errors import UserError
from .integrations.ray import reporter as ray_reporter
from .options import Option
from .parallel.fsdp import full_state_dict, is_sharded
from .parallel.strategy import DEFAULT as DEFAULT_STRATEGY
from .parallel.strategy import option_keywords, strategy_of
from .parallel.strategy import strategy as find_strategy
from .parallel.wrap import kernel_settings, sync_gradients, unwrap, unwrap_ddp, wrap_model
from .reliability.preemption import PreemptFlag
from .reliability.progress import Progress
from .reliability.sync_checks import in_main_only, main_only
from .run_folder import hang_folder
from .run_options import config_as_json, in_part, policy_from_options
from .service_registry import options


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
                raise UserError("run.eval_loader was called before run.prepare(model, strategy='fsdp'): its batches "
                                "were split for DDP, and under FSDP ranks with fewer eval batches would leave the "
                                "others waiting in an all-gather", "call run.prepare on the model first, then "
                                "run.eval_loader")
        if models:
            self._boundary.strategy = chosen
        out = [self._prepare_one(o, sync_bn, compile, channels_last, grad_accum, ddp, device_data,
                                 dict(strategy=strategy, fsdp=fsdp, amp=amp, **options)) for o in objs]
        if models:  # what the strategy adds at each step (strategy ft: the replica group's quorum)
            for hook in chosen.step_hooks([o for o in out if isinstance(o, nn.Module)], self.ctx.env,
                                          self._boundary.hooks):
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
        and on a stop signal saves, requeues under SLURM and exits 75 (130 for Ctrl-C) on every rank."""
        return self._boundary.step(loss)

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
            # Read anew where a peer's state came in during the epoch (strategy ft's live recovery): the run is in its
            # peer's epoch now. (Elsewhere a loop may iterate its loader twice per epoch of its own.)
            jumped, self._boundary.steps.jumped = self._boundary.steps.jumped, False
            epoch = max(epoch + 1, start + self.epoch) if jumped else epoch + 1

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


def service_options() -> list[Option]:
    """Every service's settings (service_registry.py), each a keyword of `init` and, with a `key`, a config key."""
    return options()


def init_options() -> tuple[str, ...]:
    """The names `init(**options)` takes besides its own arguments: the step boundary's policy
    (checkpoints, watchdog, sync checks, metrics), so that a script can pass its config's keys by name."""
    return tuple(k for k in Policy.keywords() if k != "run_dir")


def init(run_dir: str | Path | None = None, *, backend: str = "auto", device: str = "auto", timeout_s: float = 600.0,
         split_batches: bool = True, seed: int = 0, config: dict | None = None, env: DistEnv | None = None,
         tf32: bool = True, cudnn_benchmark: bool = True, deterministic: bool = False, **options: Any) -> Run:
    """Join the job this process was launched into (or run alone) and return its Run.

    `run_dir` holds checkpoints, metrics.jsonl and hang reports; without it there are no
    checkpoints. `options` are the step boundary's settings (boundary/policy.py: resume, ckpt_dir for
    checkpoints in another folder or at a URL, ckpt_every, ckpt_every_s, keep_last, async_ckpt, timeouts,
    checks, logging) and every service's, each declared in the service's own file (services/: the run
    ledger's max_failed_attempts, the trackers' trackers, the memory tier's mem_ckpt_every, ...); the list is
    `init_options()`, and docs/getting-started.md says what each does. `timeout_s` bounds the rendezvous and
    every collective until step 1 has finished. `config` (your hyperparameters, a JSON-able dict)
    goes to run_dir/config.yaml and every checkpoint's meta.json, and every rank must hold the
    same one at startup (a rank with a different one is named). `tf32`, `cudnn_benchmark` and
    `deterministic` are the process's kernel switches (wrap.kernel_settings); bit-identical resume
    on a GPU needs deterministic=True.

    Teardown (and a final checkpoint after a clean end) happens at `run.close()`, at `with` exit,
    or at interpreter exit. An error that ends the script goes through the failure policy first.
    """
    joining = Failures(None)  # for errors while joining: there is no process group yet
    env = detect() if env is None else env
    joining.rank = env.rank  # before anything is checked: a mistake every rank makes is printed by rank 0 only
    # A process group that exists already (Ray Train's, your own init_process_group) is adopted by
    # distributed() below; a second ddp_kit.init() is refused there.
    policy = policy_from_options(run_dir, options, _keywords(Run.prepare) - {"objs", "options"} | option_keywords(),
                                 _keywords(init, own=True))
    policy = in_part(policy, env.part)
    progress = Progress()
    box: list[StepBoundary] = []
    flag = PreemptFlag(env.rank, where=lambda: (progress.step, box[0].saved_step if box else None)).install()
    stack = ExitStack()
    stack.callback(flag.restore)
    hang_dir = hang_folder(policy.run_dir) if policy.run_dir else None  # no run folder: NCCL's own default
    try:
        ctx = stack.enter_context(distributed(env, backend=backend, device=device, timeout_s=timeout_s,
                                              dump_dir=hang_dir, fail_fast=True))
    except BaseException:
        stack.close()
        raise
    kernel_settings(ctx.device, tf32=tf32, cudnn_benchmark=cudnn_benchmark, deterministic=deterministic)
    boundary = StepBoundary(ctx, policy, progress, flag)
    boundary.config = config_as_json(config)
    boundary.cuda_notes = findings_for_error  # the doctor's findings beside a CUDA/NCCL error (explain_cuda_errors replaces them)
    box.append(boundary)
    to_ray = ray_reporter()  # inside a Ray Train worker: every log record also goes to ray.train.report
    if to_ray is not None:
        boundary.on_log.append(to_ray)
    stack.callback(boundary.close)
    # init_process_group wrapped the hook it found, to prefix stderr lines with the rank; inside that
    # wrapper our line would be lost when we exit. So the first hook steps aside (it stays wrapped
    # but only passes errors on) and a second one goes on the outside, until the Run closes.
    joining.active = False
    stack.callback(Failures(boundary).uninstall)
    run = Run(ctx, stack, boundary, split_batches, seed)
    # The final checkpoint writes with threads: it must run before interpreter shutdown stops
    # thread pools from taking work, i.e. among threading's exit hooks (they run when the main
    # thread ends, in reverse order: ours, registered last, before concurrent.futures' own).
    register = getattr(threading, "_register_atexit", atexit.register)
    register(lambda: run.close(at_exit=True))
    atexit.register(lambda: run.close(at_exit=True))  # a no-op once closed
    try:
        boundary.start()
    except BaseException as err:
        code = boundary.fail(err)  # e.g. the run folder is another job's: one line, once, for every rank
        run.close()
        raise SystemExit(code) from None
    return run


def _keywords(fn: Callable, own: bool = False) -> set[str]:
    """The keyword names `fn` takes (own: keyword-only ones and run_dir, without **options)."""
    params = inspect.signature(fn).parameters.items()
    return {n for n, p in params if not own or p.kind == p.KEYWORD_ONLY or n == "run_dir"} - {"self"}

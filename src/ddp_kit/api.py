"""The library API for users' own scripts: four lines turn a single-device loop into a DDP one.

    import ddp_kit
    run = ddp_kit.init()                                  # process group, device, teardown at exit
    device = run.device                                   # instead of torch.device("cuda" if ...)
    model, train_loader = run.prepare(model, train_loader)

`loss.backward()` and `optimizer.step()` stay as they are. The loader's batch_size is read as
the GLOBAL batch (split over ranks) so that the recipe is the same on 1 and N ranks; pass
`split_batches=False` to keep it per rank, as Accelerate does by default.

A loader is sharded the way it samples, or refused in one line (`Run.train_loader`); a
`UserError` that reaches the top of the script prints as one line and exits 2, as in the CLI.
"""
from __future__ import annotations

import atexit
import sys
import time
from contextlib import ExitStack
from typing import Any

from torch import nn
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, RandomSampler, SequentialSampler, Subset,
                              SubsetRandomSampler, WeightedRandomSampler)

from .data import TrainLoader, check_sized, eval_loader
from .dist import DistContext, all_reduce_sum, barrier, distributed
from .env import DistEnv, detect
from .errors import EXIT_USER_ERROR, UserError, report_user_error
from .sync import main_only
from .wrap import sync_gradients, unwrap, wrap_model


class Run:
    """A live distributed context plus the helpers a training script needs. Create it with `init()`."""

    def __init__(self, ctx: DistContext, stack: ExitStack, split_batches: bool, seed: int):
        self.ctx = ctx
        self._stack = stack
        self.split_batches = split_batches
        self.seed = seed

    device = property(lambda self: self.ctx.device)
    rank = property(lambda self: self.ctx.rank)
    world_size = property(lambda self: self.ctx.world_size)
    is_main = property(lambda self: self.ctx.is_main)

    def prepare(self, *objs: Any, sync_bn: bool = False, compile: bool = False) -> Any:
        """Wrap each nn.Module (device + DDP) and shard each DataLoader; anything else passes through."""
        out = [self._prepare_one(o, sync_bn, compile) for o in objs]
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_one(self, obj: Any, sync_bn: bool, compile: bool) -> Any:
        if isinstance(obj, nn.Module):
            return wrap_model(obj, self.ctx, sync_bn=sync_bn, compile=compile)
        if isinstance(obj, DataLoader):
            return self.train_loader(obj)
        return obj

    def train_loader(self, loader: DataLoader) -> TrainLoader:
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
        tail = len(dataset) % batch
        if tail and not loader.drop_last and self.is_main and len(dataset) >= batch:
            which = f"a different {tail} each epoch" if shuffle else f"the last {tail}, every epoch"
            print(f"ddp_kit: note: {tail} of {len(dataset)} samples do not fill a whole global batch of {batch} and are "
                  f"skipped ({which}); pass drop_last=True to the DataLoader to say that is intended",
                  file=sys.stderr, flush=True)
        return TrainLoader(dataset, global_batch=batch, world_size=self.world_size, rank=self.rank,
                           shuffle=shuffle, seed=seed, num_workers=loader.num_workers,
                           pin_memory=self.device.type == "cuda", collate_fn=loader.collate_fn,
                           worker_init_fn=loader.worker_init_fn)

    def eval_loader(self, loader: DataLoader) -> DataLoader:
        """This rank's exact share of `loader`'s dataset: every sample once over all ranks, no padding.

        The order is irrelevant to sums, so any sampler that takes each sample once is accepted
        (SubsetRandomSampler: its indices); the rest is refused as in `train_loader`, and so is
        drop_last=True, which would leave samples out."""
        dataset, _, _ = self._sampling(loader)
        if loader.drop_last:
            raise UserError("run.eval_loader evaluates every sample exactly once, so it cannot honour drop_last=True",
                            "pass drop_last=False to the evaluation DataLoader")
        return eval_loader(dataset, batch_size=loader.batch_size, world_size=self.world_size, rank=self.rank,
                           num_workers=loader.num_workers, pin_memory=self.device.type == "cuda",
                           collate_fn=loader.collate_fn, worker_init_fn=loader.worker_init_fn)

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

    def sum(self, *values: float) -> list[float]:
        """Sum numbers over ranks (e.g. correct and count from eval_loader shards)."""
        return all_reduce_sum(self.ctx, list(values))

    def accumulate(self, model: nn.Module, last: bool):
        """`with run.accumulate(model, last=(i % k == k - 1)):` skips the all-reduce on non-final micro-steps."""
        return sync_gradients(model, last)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return unwrap(model)

    def main_only(self):
        """`with run.main_only() as main: if main: ...`: rank-0-only code in which collectives raise at once."""
        return main_only(self.ctx)

    def print(self, *args, **kwargs) -> None:
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def barrier(self) -> None:
        barrier(self.ctx)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def init(*, backend: str = "auto", device: str = "auto", timeout_s: float = 600.0, split_batches: bool = True,
         seed: int = 0, env: DistEnv | None = None) -> Run:
    """Join the job this process was launched into (or run alone) and return its Run.

    The process group is destroyed at `run.close()`, at `with` exit, or at interpreter exit.
    Until then a UserError that ends the script (a loader `run.prepare` refuses, a bad layout)
    prints as one line, once for the job, and exits 2, as `python -m ddp_kit.train` does.
    """
    joining = _OneLineUserErrors()  # for errors while joining: there is no process group yet
    env = detect() if env is None else env
    joining.rank = env.rank
    stack = ExitStack()
    ctx = stack.enter_context(distributed(env, backend=backend, device=device, timeout_s=timeout_s))
    # init_process_group wrapped the hook it found, to prefix stderr lines with the rank; inside that
    # wrapper our line would be lost when we exit. So the first hook steps aside (it stays wrapped
    # but only passes errors on) and a second one goes on the outside, until the Run closes.
    joining.active = False
    stack.callback(_OneLineUserErrors(ctx.rank).uninstall)
    run = Run(ctx, stack, split_batches, seed)
    atexit.register(stack.close)
    return run


class _OneLineUserErrors:
    """sys.excepthook while a Run is open: an uncaught UserError is one line and exit 2; the rest as before."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.active = True
        self.previous = sys.excepthook
        sys.excepthook = self

    def __call__(self, kind, err, tb) -> None:
        if not (self.active and isinstance(err, UserError)):
            return self.previous(kind, err, tb)
        report_user_error(err, self.rank)
        if self.rank != 0 and not err.local:
            time.sleep(1.0)  # rank 0 prints it; torchrun stops all ranks once one exits, so give rank 0 a moment
        # SystemExit from an excepthook sets the exit code; atexit (process group teardown) still runs.
        sys.exit(EXIT_USER_ERROR)

    def uninstall(self) -> None:
        if sys.excepthook is self:
            sys.excepthook = self.previous



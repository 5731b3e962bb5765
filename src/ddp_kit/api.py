"""The library API for users' own scripts: four lines turn a single-device loop into a DDP one.

    import ddp_kit
    run = ddp_kit.init()                                  # process group, device, teardown at exit
    device = run.device                                   # instead of torch.device("cuda" if ...)
    model, train_loader = run.prepare(model, train_loader)

`loss.backward()` and `optimizer.step()` stay as they are. The loader's batch_size is read as
the GLOBAL batch (split over ranks) so that the recipe is the same on 1 and N ranks; pass
`split_batches=False` to keep it per rank, as Accelerate does by default.
"""
from __future__ import annotations

import atexit
from contextlib import ExitStack
from typing import Any

from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from .data import TrainLoader, eval_loader
from .dist import DistContext, all_reduce_sum, barrier, distributed
from .env import DistEnv
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
        """A sharded, epoch-aware copy of `loader` (reshuffles each epoch by itself when the original shuffled)."""
        batch = loader.batch_size * (1 if self.split_batches else self.world_size)
        return TrainLoader(loader.dataset, global_batch=batch, world_size=self.world_size, rank=self.rank,
                           shuffle=isinstance(loader.sampler, RandomSampler), seed=self.seed,
                           num_workers=loader.num_workers, pin_memory=self.device.type == "cuda",
                           collate_fn=loader.collate_fn)

    def eval_loader(self, loader: DataLoader) -> DataLoader:
        """This rank's exact share of `loader`'s dataset: every sample once over all ranks, no padding."""
        return eval_loader(loader.dataset, batch_size=loader.batch_size, world_size=self.world_size, rank=self.rank,
                           num_workers=loader.num_workers, pin_memory=self.device.type == "cuda",
                           collate_fn=loader.collate_fn)

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
    """
    stack = ExitStack()
    ctx = stack.enter_context(distributed(env, backend=backend, device=device, timeout_s=timeout_s))
    run = Run(ctx, stack, split_batches, seed)
    atexit.register(stack.close)
    return run



"""The largest per-rank batch that fits in memory, found by trials that every rank agrees on.

    found = find_batch_size(lambda b: one_step(model, optimizer, batch_of(b)), start=8, cap=1024,
                            model=model, optimizer=optimizer)
    found.batch          # the same number on every rank

`try_batch(b)` runs what a training step holds at its peak with a per-rank batch of `b` (forward,
backward, optimizer step) and lets an out-of-memory error out. After each trial the ranks all-reduce
one small tensor (MAX): an out-of-memory on any rank counts as one on every rank, so every rank takes
the same next step and ends with the same batch. Any other error is carried in the same tensor: every
rank stops together, the rank that failed raising its own error and the others a line naming it
(raised at once, it left the others waiting in the all-reduce until the collective timeout). Taking a rank's own verdict instead (halving on the
rank that ran out, as a per-process retry loop does) leaves the ranks on different batches, and the
first collective with unequal work hangs.

The search: double from `start` until a trial runs out of memory or `cap` is reached, then bisect
between the largest size that fit and the smallest that did not; at most `max_trials` trials.

A trial must make no collective of its own: if one rank runs out of memory half-way, the others would
wait in that collective for a rank that has gone to the agreement instead. So a DDP model is tried as
its own module (`run.unwrap(model)`), without DDP's gradient all-reduce; a sharded model (FSDP), whose
forward gathers its weights, cannot be tried this way.
"""
from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from ..errors import UserError

# Out-of-memory errors torch raises as a plain RuntimeError: the host allocator's, cuBLAS's and cuDNN's failed
# allocations (torch says "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling ..." and "cuDNN error: <status>":
# cuDNN 8's CUDNN_STATUS_ALLOC_FAILED, cuDNN 9's INTERNAL_ERROR_{HOST,DEVICE}_ALLOCATION_FAILED), and cuDNN's
# refusal of a batch too big for its kernels, which a smaller batch cures as a smaller one cures an OOM.
_OOM_PHRASES = ("out of memory", "DefaultCPUAllocator: can't allocate memory", "CUBLAS_STATUS_ALLOC_FAILED",
                "CUDNN_STATUS_ALLOC_FAILED", "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
                "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED", "CUDNN_STATUS_NOT_SUPPORTED")


@dataclass(frozen=True)
class BatchSearch:
    """What `find_batch_size` found: the same on every rank."""

    batch: int  # the largest per-rank batch that fit on every rank
    trials: tuple[tuple[int, bool], ...]  # (per-rank batch, fit on every rank), in the order tried
    exact: bool  # the search closed (next size up ran out, or cap reached); False: max_trials ran out first
    capped: bool  # nothing ran out of memory up to `cap`: memory was not the limit
    seconds: float
    ran_out_rank: int = -1  # the lowest rank that ran out at the smallest size that did not fit (-1: none did)


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` says the device (or the host) ran out of memory."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(p in str(err) for p in _OOM_PHRASES)


def find_batch_size(try_batch: Callable[[int], Any], *, start: int = 1, cap: int = 1 << 16, max_trials: int = 24,
                    group: Any = None, model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None) -> BatchSearch:
    """The largest per-rank batch in [1, cap] for which `try_batch` does not run out of memory on any rank.

    Every rank of `group` (default: the default process group when there is one; none: this process
    alone) must call it with the same start, cap and max_trials. `model` and `optimizer`, when given, come
    back as they were (weights, buffers, optimizer state, train/eval mode) and have their gradients
    dropped between trials; an optimizer without state takes one step over zero gradients before a trial
    so that its state (Adam's moments) is in memory during every trial, as it is during training. The RNG streams are
    restored too, so a run that searched draws what a run given the number draws. Raises UserError when
    not even the smallest size tried fits. A trial that fails otherwise on any rank ends the search on every
    rank after that trial's agreement: that rank raises its own error, the others a UserError naming it."""
    if not 1 <= start <= cap or max_trials < 1:
        raise ValueError(f"find_batch_size needs 1 <= start <= cap and max_trials >= 1; got start={start}, "
                         f"cap={cap}, max_trials={max_trials}")
    began = time.perf_counter()
    fit, over, first_oom_rank = 0, 0, -1  # largest size that fit; smallest that did not (0: none yet)
    trials: list[tuple[int, bool]] = []
    size: int | None = start
    with _kept(model, optimizer):
        while size is not None and len(trials) < max_trials:
            ran_out, error = _trial(try_batch, size, model, optimizer)
            ran_out, rank, failed = _agree(ran_out, error is not None, size, group)
            if failed >= 0:
                _stop_together(error, failed, size)
            trials.append((size, not ran_out))
            if ran_out:
                over, first_oom_rank = size, rank
            else:
                fit = size
            size = _next_size(fit, over, cap)
    if not fit:
        raise UserError(f"no per-rank batch fits in memory: even {over} ran out (rank {first_oom_rank} first) after "
                        f"{len(trials)} trial(s)", "free the device (another process on it?), shrink the model or its "
                        "inputs, use bf16 autocast, or shard the model (FSDP) with a batch size you give", verdict=True)
    return BatchSearch(fit, tuple(trials), exact=size is None, capped=not over and fit == cap,
                       seconds=time.perf_counter() - began, ran_out_rank=first_oom_rank)


def _next_size(fit: int, over: int, cap: int) -> int | None:
    """The next size to try, or None when the search is closed."""
    if not over:  # growing: nothing has run out yet
        return min(fit * 2, cap) if fit < cap else None
    return (fit + over) // 2 if over - fit > 1 else None


def _trial(try_batch: Callable[[int], Any], size: int, model: torch.nn.Module | None,
           optimizer: torch.optim.Optimizer | None) -> tuple[bool, Exception | None]:
    """Run one trial: (whether it ran out of memory, the error it failed with otherwise). Not raised here: the
    other ranks are about to wait in the agreement for this one. What it allocated is released before returning."""
    ran_out, error = False, None
    try:
        _prime(optimizer)
        try_batch(size)
    except Exception as err:
        if not is_out_of_memory(err):
            error = err  # kept whole, traceback too: this rank raises it after the agreement
        else:
            ran_out = True
            # The traceback's frames keep the trial's locals (activations, the batch) alive for as long as
            # the error lives; clear them so that the memory is free for the next trial.
            traceback.clear_frames(err.__traceback__)
    # here, outside the `except`, an out-of-memory error and its traceback are gone
    _drop_grads(model, optimizer)
    if ran_out:
        gc.collect(1)  # the young generations: a half-run step's reference cycles (a full collection: ~0.2 s)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # give the cached blocks back: the next trial is measured from scratch
    return ran_out, error


def _agree(ran_out: bool, failed: bool, size: int, group: Any) -> tuple[bool, int, int]:
    """(whether any rank ran out of memory, the lowest rank that did or -1, the lowest rank whose trial failed
    otherwise or -1), from one all-reduce (MAX) of four integers; a rank that tried another size than the
    others is refused here. A lower rank is coded higher (world - rank), so that MAX finds the lowest."""
    world, rank = _place(group)
    mine = [world - rank if ran_out else 0, size, -size, world - rank if failed else 0]
    oom, high, neg_low, failure = mine if world == 1 else _max_over_ranks(mine, group)
    if high != -neg_low:
        raise UserError(f"the ranks tried different batch sizes ({-neg_low} to {high}) in the same trial",
                        "call find_batch_size with the same start, cap and max_trials on every rank", verdict=True)
    return bool(oom), world - oom if oom else -1, world - failure if failure else -1


def _place(group: Any) -> tuple[int, int]:
    """(world size, rank) in `group`; (1, 0) without a process group: this process alone."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return 1, 0
    return tdist.get_world_size(group), tdist.get_rank(group)


def _max_over_ranks(values: list[int], group: Any) -> list[int]:
    """`values` maximised element-wise over the ranks of `group` (one all-reduce)."""
    on_gpu = tdist.get_backend(group) == "nccl"  # NCCL moves only GPU tensors; gloo, host ones
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    flag = torch.tensor(values, dtype=torch.int64, device=device)
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=group)
    return [int(v) for v in flag.tolist()]


def _stop_together(error: Exception | None, failed: int, size: int) -> None:
    """Every rank ends the search at the same trial: the one that failed with its own error."""
    if error is not None:
        raise error
    raise UserError(f"rank {failed} failed during the batch-size search (a trial at per-rank batch {size}, not out of "
                    "memory), so this rank stops with it", f"see rank {failed}'s own error, printed by that rank")


def _drop_grads(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> None:
    if model is not None:
        model.zero_grad(set_to_none=True)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)


@contextmanager
def _kept(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Run the trials, then put back the weights, buffers, mode, optimizer state and RNG streams."""
    weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()} if model is not None else None
    training = model.training if model is not None else False
    opt_state = _cpu_copy(optimizer.state_dict()) if optimizer is not None else None
    gpus = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=gpus):
        try:
            if model is not None:
                model.train()
            yield
        finally:
            _drop_grads(model, optimizer)
            if model is not None and weights is not None:
                model.load_state_dict(weights)
                model.train(training)
            if optimizer is not None and opt_state is not None:
                optimizer.load_state_dict(opt_state)  # its state as it was (none for a new optimizer): moments freed
            if gpus:  # what training is about to need: a full collection (~0.2 s) and the cached blocks back
                gc.collect()
                torch.cuda.empty_cache()


def _prime(optimizer: torch.optim.Optimizer | None) -> None:
    """One step over zero gradients where the optimizer holds no state yet: its state (Adam's moments) is
    in memory before the trial's forward, as it is in every training step but the first. Inside the trial,
    so that running out of memory here is an answer like any other (the weights it moves, by weight decay,
    are put back afterwards)."""
    if optimizer is None:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if all(optimizer.state.get(p) for p in params):
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _cpu_copy(obj: Any) -> Any:
    """A deep copy of a state dict with every tensor on the host (the device keeps no second copy)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj

"""The reference job's `--batch_size auto`: the global batch, settled once at the run's first start.

The per-rank micro-batch is the largest that fits in every rank's memory (`find_batch_size`: trial steps on
the job's own model, optimizer, loss and samples, after which the ranks agree), and

    global batch = per-rank x world_size x grad_accum      (grad_accum as given)
    lr           = as given: not scaled with the batch found

Rank 0 writes it to run_dir/batch_size.json, and every later start of the run (a resume, a restart) takes
the global batch from there without searching: a search on another day, or beside another process on the
GPU, could find another number, and a changed batch is a changed recipe (a resumed checkpoint carries the
number too, and a start that settled on another one is refused). `--resume never` searches afresh.
"""
from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..api import BatchSearch, Run, find_batch_size
from ..errors import UserError
from ..parallel import autocast, to_device
from .workload import split_loss

RECORD = "batch_size.json"
START = 8  # per rank: the first trial; doubled from there
MAX_TRIALS = 24  # 8 -> 65536 by doubling is 13 trials, and bisecting the last doubling 12 more at most


def settle(cfg: Any, run: Run, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_set: Dataset,
           loss_fn: Callable, on_trial: Callable[[int], None]) -> dict[str, Any]:
    """The run's batch record (global_batch, per_rank_batch, ...): the run folder's, else found now and
    written there. The same on every rank. `on_trial(per_rank_batch)` runs before each trial (fault injection)."""
    shards = run.data_place[1]
    if shards != run.world_size:
        raise UserError("batch_size auto searches within one process group, and the replica groups of this run would "
                        "each settle on their own batch", "give --batch_size a number", verdict=True)
    path = Path(run.run_dir) / RECORD if run.run_dir else None
    kept = _recorded(run, path) if cfg.resume != "never" else None
    if kept is not None:
        record = {**kept, "per_rank_batch": _per_rank(run, kept["global_batch"], cfg.grad_accum, path),
                  "world_size": shards, "grad_accum": cfg.grad_accum}
        run.print(f"ddp_kit: batch_size auto: global batch {record['global_batch']} as recorded in {path} at the "
                  f"run's start, not searched again = per-rank {record['per_rank_batch']} x {shards} rank(s) x "
                  f"{cfg.grad_accum} accum; lr {cfg.lr:.2e} as given")
        return record
    found = _search(cfg, run, model, optimizer, train_set, loss_fn, on_trial)
    record = {"global_batch": found.batch * shards * cfg.grad_accum, "per_rank_batch": found.batch,
              "world_size": shards, "grad_accum": cfg.grad_accum, "lr": cfg.lr, "lr_rule": "as given",
              "trials": [list(t) for t in found.trials], "exact": found.exact, "capped": found.capped,
              "ran_out_rank": found.ran_out_rank, "seconds": round(found.seconds, 3), "device": str(run.device)}
    if run.is_main and path is not None:
        _write(path, record)
    where = f"; recorded in {path}" if path is not None else ""
    run.print(f"ddp_kit: batch_size auto: per-rank {found.batch} x {shards} rank(s) x {cfg.grad_accum} accum = "
              f"global batch {record['global_batch']}; lr {cfg.lr:.2e} as given (not scaled with the batch); "
              f"{_why(found)}; {len(found.trials)} trials in {found.seconds:.1f}s{where}")
    return record


def _why(found: BatchSearch) -> str:
    if found.capped:
        return "the cap (the training set in one optimizer step per epoch): memory was not the limit"
    if not found.exact:
        return f"the largest that fit when the {len(found.trials)} trials ran out"
    over = min(size for size, fit in found.trials if not fit)
    return f"{over} ran out of memory (rank {found.ran_out_rank} first)"


def _search(cfg: Any, run: Run, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_set: Dataset,
            loss_fn: Callable, on_trial: Callable[[int], None]) -> BatchSearch:
    """Trial steps on the model's own module (no DDP all-reduce inside a trial: see find_batch_size) with
    batches made of the training set's first samples, repeated to the size tried."""
    shards = run.data_place[1]
    cap = len(train_set) // (shards * cfg.grad_accum)  # one optimizer step per epoch at most
    if cap < 1:
        raise UserError(f"batch_size auto: the training set ({len(train_set)} samples) has fewer samples than ranks x "
                        f"micro-steps ({shards} x {cfg.grad_accum})", "use fewer ranks or a smaller --grad_accum",
                        verdict=True)
    sample = first_samples(train_set, min(cap, 64), run.device)
    module = run.unwrap(model)

    def try_batch(size: int) -> None:
        run.heartbeat("startup")  # progress for the hang watchdog: each trial is a step of the start
        on_trial(size)
        batch = to_device(_resized(sample, size), run.device)
        with autocast(cfg.amp, run.device):
            loss, _ = split_loss(cfg.loss, loss_fn(module, batch))
        loss.backward()
        optimizer.step()  # where AdamW's memory peaks: gradients, moments and the update at once

    with _held_for_data(train_set, run.device, cfg.device_data):
        return find_batch_size(try_batch, start=min(START, cap), cap=cap, max_trials=MAX_TRIALS,
                               group=run.ctx.control_group, model=module, optimizer=optimizer)


def first_samples(train_set: Dataset, n: int, device: torch.device) -> Any:
    """The training set's first `n` samples as one batch, drawn without moving an RNG the training draws from:
    a loader's iterator takes its base seed from torch's generator, and a random transform may draw from torch's,
    Python's or numpy's. So a run with --batch_size auto trains bit-identically to one given the number found."""
    gpus = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" and torch.cuda.is_initialized() else []
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=gpus):
        try:
            return next(iter(DataLoader(train_set, batch_size=n)))
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def _resized(batch: Any, n: int) -> Any:
    """`batch` with `n` samples: its own, repeated as often as needed (the shapes and values are real ones)."""
    if isinstance(batch, torch.Tensor):
        return batch[torch.arange(n) % len(batch)] if batch.dim() else batch
    if isinstance(batch, (list, tuple)):
        return type(batch)(_resized(b, n) for b in batch)
    if isinstance(batch, dict):
        return {k: _resized(v, n) for k, v in batch.items()}
    return batch


@contextmanager
def _held_for_data(train_set: Dataset, device: torch.device, device_data: bool) -> Iterator[None]:
    """With --device_data the training set moves to the GPU after the search (the loader is built with the
    batch found): hold that much memory during the trials, so that it is not counted twice as free."""
    tensors = getattr(train_set, "tensors", ()) if device_data and device.type == "cuda" else ()
    size = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor) and t.device != device)
    held = torch.empty(size, dtype=torch.uint8, device=device) if size else None
    try:
        yield
    finally:
        del held


def _recorded(run: Run, path: Path | None) -> dict[str, Any] | None:
    """The run folder's record as rank 0 reads it, on every rank (None: there is none)."""
    verdict: tuple[str, Any] | None = None
    if run.is_main and path is not None and path.exists():
        try:
            data = json.loads(path.read_text())
            if not (isinstance(data, dict) and isinstance(data.get("global_batch"), int) and data["global_batch"] >= 1):
                raise ValueError("no positive integer global_batch")
            verdict = ("ok", data)
        except (OSError, ValueError) as exc:
            verdict = ("bad", str(exc))
    kind, value = run.gather(verdict)[0] or (None, None)
    if kind == "bad":
        raise UserError(f"batch_size auto: {path} cannot be read ({value})", 'write it back as {"global_batch": N} '
                        "with the batch this run trained with, or use --resume never to search again and start over",
                        verdict=True)
    return value


def _per_rank(run: Run, global_batch: int, grad_accum: int, path: Path | None) -> int:
    try:
        return run.micro_batch(global_batch, grad_accum)
    except UserError:
        world = run.data_place[1]
        raise UserError(f"the global batch {global_batch} recorded in {path} (batch_size auto) does not split over "
                        f"{world} rank(s) x {grad_accum} micro-step(s)", "resume at a world size and --grad_accum that "
                        "divide it, or use --resume never to search again and start over", verdict=True) from None


def _write(path: Path, record: dict[str, Any]) -> None:
    """Rank 0: the record, whole or not at all (a new file renamed over the old one)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{RECORD}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:  # a key a line, each value on its own line whole (the trials too)
            f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in record.items()) + "\n}\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

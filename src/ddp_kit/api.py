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

This module is the face only: `init` here, `Run` and `Resumed` from run.py (every method a script
calls, each a few lines that hand over to the module doing the work); docs/architecture.md says where
the work lives.
"""
from __future__ import annotations

import atexit
import inspect
import threading
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from .boundary.core import StepBoundary
from .boundary.excepthook import Failures
from .boundary.policy import Policy
from .dist import distributed
from .doctor import findings_for_error
from .env import DistEnv, detect
from .errors import UserError
from .integrations.ray import reporter as ray_reporter
from .options import AUTO, Option, every_or_auto
from .parallel.batch_finder import BatchSearch, find_batch_size
from .parallel.strategy import option_keywords
from .parallel.wrap import kernel_settings
from .reliability.preemption import PreemptFlag
from .reliability.progress import Progress
from .run import Resumed, Run
from .run_folder import hang_folder
from .run_options import config_as_json, in_part, policy_from_options
from .service_registry import options

__all__ = ["AUTO", "BatchSearch", "Resumed", "Run", "every_or_auto", "find_batch_size", "init", "init_options",
           "service_options"]


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
    flag = PreemptFlag(env.rank, where=lambda: (progress.step, box[0].steps.saved if box else None)).install()
    stack = ExitStack()
    stack.callback(flag.restore)
    hang_dir = hang_folder(policy.run_dir) if policy.run_dir else None  # no run folder: NCCL's own default
    try:
        ctx = stack.enter_context(distributed(env, backend=backend, device=device, timeout_s=timeout_s,
                                              dump_dir=hang_dir, fail_fast=True))
    except BaseException:
        stack.close()
        raise
    if policy.sdc_check_every and ctx.device.type == "cuda" and not deterministic:
        stack.close()  # before the replay check's first step would accuse a host of what a GPU kernel's atomics do
        raise UserError("sdc_check_every compares two computations of a step bit for bit, and on a GPU without "
                        "deterministic=True some kernels (atomics, cuDNN's autotuned algorithms) differ every time",
                        "pass deterministic=True to ddp_kit.init (--deterministic true), or sdc_check_every=0")
    kernel_settings(ctx.device, tf32=tf32, cudnn_benchmark=cudnn_benchmark, deterministic=deterministic)
    return _start(StepBoundary(ctx, policy, progress, flag), stack, box, joining, config, split_batches, seed)


def _start(boundary: StepBoundary, stack: ExitStack, box: list[StepBoundary], joining: Failures, config: dict | None,
           split_batches: bool, seed: int) -> Run:
    """The Run around a joined process group: its teardown, its error hook, and the boundary started."""
    ctx = boundary.ctx
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

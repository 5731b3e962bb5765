"""The profiler as a service: a torch.profiler window every `profile_every` steps (one warm-up step, then
`profile_active` recorded ones), one Chrome trace per rank in run_dir/profile/; and, with
`memory_history` on a GPU, the CUDA allocator's history recorded with Python stacks and dumped per rank
to run_dir/oom/ when the attempt ends out of GPU memory, the snapshot named beside the OOM report.

Both are off by default and then not made at all: nothing on the step path. The windows are aligned to
the step count (a window's last step is a multiple of profile_every), so the traces of every rank, and
of an attempt resumed mid-run, cover the same steps."""
from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..hooks import Boundary, StepHooks
from ..options import Option, above, at_least_zero
from ..service_registry import Service

OPTIONS = (
    Option("profile_every", 0, key="profile_every", resumable=True, check=at_least_zero("profile_every"),
           help="Steps between torch.profiler windows (one warm-up step, then profile_active recorded steps, ending at a multiple of this, so at least 1 + profile_active), one Chrome trace per rank in run_dir/profile/ (open it in https://ui.perfetto.dev); 0: off. See docs/observability.md."),
    Option("profile_active", 3, key="profile_active", resumable=True, check=above("profile_active", 1, "3"),
           help="Steps each profiler window records (profile_every > 0)."),
    Option("memory_history", False, key="memory_history", resumable=True,
           help="CUDA: record the allocator's history with Python stacks; when the attempt ends out of GPU memory each rank writes a snapshot to run_dir/oom/ (open it in https://pytorch.org/memory_viz). Costs a little on every allocation while on."),
)
WARMUP = 1  # steps the profiler runs before it records (its own start-up is not the step's)
MAX_ENTRIES = 100_000  # allocator events kept: enough for the steps before an OOM, bounded in host memory


class Profiler(StepHooks):
    """One torch.profiler over the attempt, recording in windows aligned to the step count."""

    def __init__(self, every: int, active: int, folder: Path):
        self.every, self.active, self.folder = every, active, folder  # check() refused every < WARMUP + active
        self.prof: Any = None
        self.rank = 0

    def first_step(self, b: Boundary) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.rank = b.ctx.rank
        self.folder.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.ctx.device.type == "cuda" else [])
        # The profiler counts the steps after this one (s+1, s+2, ...). It skips to the first warm-up step
        # whose window ends at a multiple of `every`, without that cycle's wait, so every window ends at a
        # multiple: the same steps on every rank, and after a resume.
        first = b.steps.done + 1
        plan = schedule(skip_first=first_warmup(first, self.every, self.active) - first, skip_first_wait=1, wait=self.every - WARMUP - self.active,
                        warmup=WARMUP, active=self.active)
        self.prof = profile(activities=activities, schedule=plan, on_trace_ready=lambda p: self._write(p, b))
        self.prof.start()
        b.say(f"ddp_kit: profiling {self.active} steps every {self.every} (after {WARMUP} warm-up step): "
              f"one Chrome trace per rank in {self.folder}/ (open it in https://ui.perfetto.dev)")

    def _write(self, prof: Any, b: Boundary) -> None:
        path = self.folder / f"step{b.steps.done}_rank{self.rank}.json"
        prof.export_chrome_trace(str(path))

    def after_step(self, b: Boundary) -> None:
        if self.prof is not None:
            self.prof.step()

    def close(self, b: Boundary) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            try:
                prof.stop()  # a window cut short by the end is dropped, not written half
            except RuntimeError:
                pass


def first_warmup(first: int, every: int, active: int) -> int:
    """The first step from `first` on whose window (WARMUP + `active` steps) ends at a multiple of `every`."""
    return first + ((1 - WARMUP - active - first) % every)


class MemoryHistory(StepHooks):
    """The CUDA allocator's history, recorded from the start; dumped per rank when the attempt's verdict is
    out of memory (the dump must come before the process lets go of the history: at the attempt's end)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.on = False

    def started(self, b: Boundary) -> None:
        import torch

        if b.ctx.device.type != "cuda" or not torch.cuda.is_available():
            b.say("ddp_kit: warning: memory_history records CUDA memory only; this run has no GPU, so it is off")
            return
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
        self.on = True

    def ending(self, b: Boundary, code: int) -> None:
        import torch

        verdict: Any = getattr(b, "verdict", None)
        if not self.on or verdict is None or verdict.name != "out_of_memory":
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{b.ctx.rank}_step{b.steps.done}.pickle"
        try:
            torch.cuda.memory._dump_snapshot(str(path))  # type: ignore[no-untyped-call]
        except (OSError, RuntimeError) as err:
            print(f"ddp_kit: [rank {b.ctx.rank}] out of memory: no memory snapshot ({err})", file=sys.stderr, flush=True)
            return
        print(f"ddp_kit: [rank {b.ctx.rank}] out of memory: the allocator's history is in {path} (drag it onto "
              f"https://pytorch.org/memory_viz: the blocks alive at the failure, with the Python stacks that made them)",
              file=sys.stderr, flush=True)

    def close(self, b: Boundary) -> None:
        if self.on:
            import torch

            torch.cuda.memory._record_memory_history(enabled=None)
            self.on = False


def check(settings: Mapping[str, Any], run_dir: str | None) -> None:
    from ..errors import UserError

    every, active = settings["profile_every"], settings["profile_active"]
    if 0 < every < WARMUP + active:
        # A window (warm-up + active steps) longer than the period cannot end at every multiple of it.
        fewer = f", or profile_active {every - WARMUP}" if every > WARMUP else ""
        raise UserError(f"profile_every {every} is shorter than one profiler window ({WARMUP} warm-up step + "
                        f"profile_active {active} recorded steps)", f"profile_every >= {WARMUP + active}{fewer}")
    if run_dir is None and (every or settings["memory_history"]):
        raise UserError("profile_every and memory_history write into the run folder, and this run has none",
                        'pass run_dir to ddp_kit.init(run_dir="runs/my_run", ...)')


def make(b: Any, settings: Mapping[str, Any]) -> tuple[Profiler | None, MemoryHistory | None] | None:
    if b.rd is None or not (settings["profile_every"] or settings["memory_history"]):
        return None
    root = Path(b.rd.path)
    return (Profiler(settings["profile_every"], settings["profile_active"], root / "profile")
            if settings["profile_every"] else None,
            MemoryHistory(root / "oom") if settings["memory_history"] else None)


SERVICE = Service("profiler", OPTIONS, make, check)

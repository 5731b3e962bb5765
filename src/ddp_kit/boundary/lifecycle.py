"""The resources a Run holds from start to close: the run folder's lock, the metrics writer, the
crash dump, the progress mirror and the hang watchdog. One ExitStack starts them in order and
stops them in reverse, also when a later one fails to start."""
from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from ..dist import DistContext
from ..reliability.peer_loss import disable_crash_dump, enable_crash_dump
from ..reliability.progress import Progress, read_mirror
from ..reliability.watchdog import Watchdog
from ..run_folder import RunDir
from .run_dir_checks import prepare_run_dir
from .run_writer import RunWriter


class RunResources:
    """What `start` opened, until `close`. Without a run folder only the watchdog runs."""

    def __init__(self, ctx: DistContext, rd: RunDir | None, progress: Progress, watchdog: Watchdog, hang_dir: str):
        self.ctx, self.rd, self.progress, self.watchdog, self.hang_dir = ctx, rd, progress, watchdog, hang_dir
        self.writer: RunWriter | None = None
        self.leftover: tuple[int, str] | None = None
        self.run_id: str | None = None  # the run's identity (run_folder.run_identity), rank 0's on every rank
        self._stack = ExitStack()

    def start(self, config: dict[str, Any] | None, gate_checks_ckpt: bool = False) -> None:
        """Before any work: the run folder is checked and locked, the watchdog runs (`gate_checks_ckpt`:
        run_dir_checks.prepare_run_dir)."""
        stack, ctx = self._stack, self.ctx
        if self.rd is not None:
            lock, self.run_id = prepare_run_dir(ctx, self.rd, gate_checks_ckpt)
            if lock is not None:
                stack.callback(lock.release)
            self.writer = RunWriter(self.rd, ctx.is_main)
            stack.callback(self.writer.close)
            if config is not None:
                self.writer.write_config(config)
            crash_file = enable_crash_dump(self.hang_dir, ctx.rank)
            if crash_file is not None:
                stack.callback(disable_crash_dump, crash_file)
            mirror = f"{self.hang_dir}/rank{ctx.rank}.progress"
            self.leftover = read_mirror(mirror)  # a killed attempt's last position (a clean end removes it)
            self.progress.mirror(mirror)
        stack.callback(self.progress.unmirror)
        self.watchdog.start()
        stack.callback(self.watchdog.stop)

    def close(self) -> None:
        """Stop what was started, newest first; also after a start that failed half-way."""
        self._stack.close()


def watch_store(ctx: DistContext) -> Any:
    """Where the watchdog publishes: the rendezvous store; at world size 1 under a launcher (torchrun,
    SLURM) a store in this process, so that a single-rank job that hangs is reported (stacks, NCCL's
    flight recorder) and ends rather than holding its allocation. A plain `python` run (a debug
    session, perhaps in a debugger) gets none."""
    if ctx.world_size > 1:
        return ctx.store_client()
    from torch.distributed import HashStore  # type: ignore[attr-defined]  # (not in torch's __all__)

    return HashStore() if ctx.env.launched else None

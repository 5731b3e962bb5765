"""What a rank is doing right now: its step and phase, written by the training thread in two
attribute writes, read by the hang watchdog, and mirrored into a tiny memory-mapped file that
outlives a crash (so a rank killed by a fatal signal still tells where it was)."""
from __future__ import annotations

import mmap
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

# Phases in the order a step goes through them: progress compares (step, phase index).
PHASES = ("startup", "data", "forward/backward", "optimizer", "after step", "preemption check", "log all-reduce",
          "sync check", "checkpoint", "eval", "between epochs", "finish", "main_only")
# Phases that may legitimately take long; they get the init timeout instead of hang_timeout.
SLOW_PHASES = frozenset({"startup", "checkpoint", "eval", "between epochs", "finish"})
_PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}


_PROGRESS_FMT = "<qB"  # step, phase index: mirrored into a small mmap'd file that outlives a crash
_PACK = struct.Struct(_PROGRESS_FMT).pack_into  # compiled once: a few times a step, right after the heaviest work


@dataclass
class Progress:
    """What this rank is doing; written by the training thread, read by the watchdog.

    With `mirror(path)`, every change is also written (a memory store, no syscall) into a tiny
    memory-mapped file, so a rank that dies by a fatal signal still leaves its last step and phase.
    """

    step: int = 0
    phase: str = "startup"
    since: float = field(default_factory=time.monotonic)
    warm: bool = False  # step 1 has finished: from here on, only SLOW_PHASES get the long timeout
    _map: mmap.mmap | None = None
    _path: str = ""

    def enter(self, phase: str, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        self.phase = phase
        self.since = time.monotonic()
        if self._map is not None:
            _PACK(self._map, 0, self.step, _PHASE_INDEX.get(phase, 255))

    def mirror(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._path = str(path)
        with open(path, "wb+") as f:
            f.write(b"\0" * 16)
            f.flush()
            self._map = mmap.mmap(f.fileno(), 16)
        self.enter(self.phase)

    def unmirror(self) -> None:
        """Stop mirroring and remove the file: only a rank that did not get here leaves one behind."""
        if self._map is not None:
            self._map.close()
            self._map = None
            Path(self._path).unlink(missing_ok=True)


def read_mirror(path: str | Path) -> tuple[int, str] | None:
    try:
        step, idx = struct.unpack_from(_PROGRESS_FMT, Path(path).read_bytes())
    except (OSError, struct.error):
        return None
    return step, PHASES[idx] if idx < len(PHASES) else "?"

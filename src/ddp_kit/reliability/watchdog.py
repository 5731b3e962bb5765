"""Hang diagnosis: per-rank progress, a watchdog thread, and the crash site of a rank that vanished.

The training loop only sets two attributes per phase (`progress.enter(...)`); a thread per rank
publishes them to the rendezvous store once a second. The store lives outside the process group
(in torchrun's agent, or a C++ thread of rank 0), so it still answers while a collective hangs.

- No progress for `hang_timeout` s: every rank dumps its Python stacks to run_dir/hang/rank<R>.txt;
  rank 0 prints one report naming the lagging rank(s) and where each rank waits; all exit 3.
- A rank whose heartbeat stops (its process killed, or frozen) for `peer_timeout` s is named by
  the rank before it in a ring (one extra store read per rank per poll): the failure is posted
  for fail-fast to end every rank. Under NCCL nothing else would notice before the collective
  timeout, since a collective with a dead peer just waits.
- Until step 1 has finished (data preparation, torch.compile, cuDNN autotuning) every phase counts
  as startup and gets the init timeout instead.
- A rank that raises is fail-fast's business (failfast.py), which runs even with the watchdog off;
  one that vanishes is diagnosed by peer_loss.py; what a rank is doing lives in progress.py.
"""
from __future__ import annotations

import faulthandler
import functools
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from ..dist import FR_PREFIX
from ..dist.failfast import post
from ..env import poll_period
from ..exit_codes import EXIT_HANG
from .progress import PHASES, SLOW_PHASES, Progress

_ABORT = "ddp_kit/abort"

_LIBRARY_DIRS = (str(Path(__file__).resolve().parent), str(Path(traceback.__file__).resolve().parent))


def _where(thread_id: int) -> tuple[str, bool]:
    """The innermost frame of a thread, as file:line in function, and whether it is library code
    (torch, ddp_kit, the standard library): a rank blocked in a collective waits there, while a
    rank stuck in its own code (a stalled rank) is somewhere else."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "?", True
    # The innermost frame only: extract_stack would walk (and read the source of) the whole stack,
    # once a poll, holding the GIL the training thread needs.
    filename, lineno, name = frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name
    path = _resolved(filename) if not filename.startswith("<") else filename
    waiting = filename.startswith("<") or "site-packages" in path or path.startswith(_LIBRARY_DIRS)
    return f"{Path(filename).name}:{lineno} in {name}", waiting


@functools.lru_cache(maxsize=256)
def _resolved(filename: str) -> str:
    return str(Path(filename).resolve())  # a few system calls per path: once each


class Watchdog:
    """One daemon thread per rank. `start()` after the process group exists; `stop()` before it goes."""

    def __init__(self, store, rank: int, world_size: int, progress: Progress, hang_timeout_s: float,
                 slow_timeout_s: float, dump_dir: str | Path, poll_s: float = 1.0, host: str = "",
                 peer_timeout_s: float = 30.0):
        self.rank, self.world_size, self.progress = rank, world_size, progress
        # Three store operations per poll (publish, check the abort flag, read the next rank's
        # heartbeat): the period grows past ~700 ranks so the store's load stays bounded (env.poll_period).
        self.hang_timeout_s, self.slow_timeout_s = hang_timeout_s, slow_timeout_s
        self.poll_s = poll_period(world_size, poll_s, 3)
        self.peer_timeout_s = max(peer_timeout_s, 3 * self.poll_s) if peer_timeout_s > 0 else 0.0
        self._peer = (rank + 1) % world_size
        self._peer_seen: tuple[str, float] | None = None  # (its last heartbeat, when it changed, our clock)
        # An early report (a stall before step 1 is over) is printed once per run: the stall's clock
        # restarts when its phase is re-entered (a collective's timeout lands the rank in the error
        # path), and a second report of the same step 1 says nothing new.
        self._early_said = False
        self.dump_dir = Path(dump_dir)
        self.host = host or os.uname().nodename
        self._stop = threading.Event()
        self.aborting = threading.Event()  # set once a hang is declared: later errors are its echoes
        # The training thread is the one that builds the watchdog (ddp_kit.init's caller): the main
        # thread in a script, a worker thread under Ray Train, whose stack is the one a hang report needs.
        self._main_thread = threading.get_ident()
        self._thread = threading.Thread(target=self._loop, name="ddp_kit-watchdog", daemon=True)
        self.store = store
        self.on_hang: Callable[[float], None] | None = None  # rank 0, before it exits: the seconds stuck

    def start(self) -> Watchdog:
        if self.store is not None and self.hang_timeout_s > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
            try:  # a rank that leaves on purpose is not a dead peer
                self.store.set(f"ddp_kit/progress/{self.rank}", json.dumps(
                    {"left": True, "step": self.progress.step, "phase": "finish", "stalled_s": 0.0, "host": self.host,
                     "where": "left the job", "waiting": True, "t": time.time()}))
            except Exception:
                pass

    # ---- the thread ------------------------------------------------------------------------------

    def _loop(self) -> None:
        # A heartbeat at once, then one a poll: a rank killed before its first poll (a fast start)
        # must still be found silent by the peer-loss diagnosis, not missing.
        tick: Callable[[], object] = self._publish
        while True:
            try:
                tick()
            except Exception as exc:  # the store went away: the job is ending anyway
                if not self._stop.is_set():
                    print(f"ddp_kit: [rank {self.rank}] watchdog stopped: {exc}", file=sys.stderr, flush=True)
                return
            tick = self._tick
            if self._stop.wait(self.poll_s):
                return

    def _publish(self, hang: bool = False) -> float:
        """This rank's position and heartbeat ("t"); returns how long it has made no progress."""
        p = self.progress
        stalled_for = time.monotonic() - p.since
        where, waiting = _where(self._main_thread)
        self.store.set(f"ddp_kit/progress/{self.rank}", json.dumps(
            {"step": p.step, "phase": p.phase, "stalled_s": round(stalled_for, 1), "host": self.host,
             "where": where, "waiting": waiting, "t": time.time(), "hang": hang, "pid": os.getpid()}))
        return stalled_for

    def _tick(self) -> None:
        p = self.progress
        stalled_for = self._publish()
        if self.store.check([_ABORT]):
            self.aborting.set()
            self._dump()
            os._exit(EXIT_HANG)
        # A single rank has no peers waiting for it: what stalls is its own work (a long sampling loop
        # between steps, say), so it gets the startup bound everywhere, as slow phases do.
        slow = p.phase in SLOW_PHASES or not p.warm or self.world_size == 1
        limit = self.slow_timeout_s if slow else self.hang_timeout_s
        if stalled_for > limit:
            self._on_hang(stalled_for)
        elif not p.warm and self.world_size > 1 and stalled_for > self.hang_timeout_s and not self._early_said:
            self._early_said = True
            self._early_report(stalled_for)
        if self.peer_timeout_s and p.warm and self.world_size > 1:  # before step 1 is over, startup's own timeout applies
            self._watch_peer()

    def _watch_peer(self) -> None:
        """The next rank's heartbeat ("t" changes at every one of its polls) must keep changing."""
        key = f"ddp_kit/progress/{self._peer}"
        if not self.store.check([key]):
            return  # not started yet: startup has its own timeout
        beat, now = self.store.get(key).decode(), time.monotonic()
        if self._peer_seen is None or beat != self._peer_seen[0]:
            self._peer_seen = (beat, now)
            return
        silent = now - self._peer_seen[1]
        last = json.loads(beat)
        if silent < self.peer_timeout_s or last.get("left") or last.get("hang"):
            return  # left on purpose, or waiting for rank 0's hang report (which it will get)
        self._peer_seen = (beat, now)  # said once
        # A heartbeat is published once a poll: with fast steps the rank's last one trails its last
        # step by many steps, so the step is said as the heartbeat's, beside this rank's own.
        err = RuntimeError(f"rank {self._peer} stopped answering: no heartbeat for {silent:.0f}s (its process was killed "
                           f"or is frozen); its last heartbeat, from {last.get('host')} at step {last.get('step')} in "
                           f"{last.get('phase')}, at {last.get('where')}, may trail its last step by up to "
                           f"{self.poll_s:g}s of steps (rank {self.rank} is at step {self.progress.step})")
        print(f"ddp_kit: [rank {self.rank}] {err}", file=sys.stderr, flush=True)
        post(self.store, self._peer, int(last.get("step") or 0), str(last.get("phase")), err)

    def _dump(self) -> Path:
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        path = self.dump_dir / f"rank{self.rank}.txt"
        with open(path, "w") as f:
            p = self.progress
            f.write(f"rank {self.rank} on {self.host}: step {p.step}, phase {p.phase}, "
                    f"no progress for {time.monotonic() - p.since:.1f}s\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        dump_flight_recorder(flight_recorder_path(self.dump_dir, self.rank))
        return path

    def _on_hang(self, stalled_for: float) -> None:
        declared = time.monotonic()
        self.aborting.set()
        self._dump()
        if self.rank != 0:
            # Rank 0 writes the report; give it time, then leave on our own if it never does.
            # Still beating meanwhile (marked as a declared hang): a rank in a slower phase must not
            # take this silence for a dead process.
            deadline = time.monotonic() + max(10.0, self.hang_timeout_s, 4 * self.poll_s)
            next_beat = 0.0
            while time.monotonic() < deadline and not self.store.check([_ABORT]):
                if time.monotonic() >= next_beat:
                    self._publish(hang=True)
                    next_beat = time.monotonic() + self.poll_s
                time.sleep(0.2)
            if not self.store.check([_ABORT]):
                print(f"ddp_kit: [rank {self.rank}] no progress for {stalled_for:.0f}s in {self.progress.phase} at step "
                      f"{self.progress.step}; stacks in {self.dump_dir}", file=sys.stderr, flush=True)
            os._exit(EXIT_HANG)
        time.sleep(max(2.0, self.poll_s * 1.5))  # let every rank publish its latest position
        print(hang_report(self._positions(), stalled_for, self.dump_dir), file=sys.stderr, flush=True)
        self.store.set(_ABORT, "hang")
        if self.on_hang is not None:
            try:
                self.on_hang(stalled_for + time.monotonic() - declared)  # the stall, and the report after it
            except Exception:
                pass  # the hang report is out; the exit must not wait on anything else
        time.sleep(self.poll_s * 1.5)  # the others see the flag, dump, and exit
        os._exit(EXIT_HANG)

    def _early_report(self, stalled_for: float) -> None:
        """Step 1 may take long (compile, autotuning, a slow first batch), so a stall before it ends
        stops the job only at the startup bound; but where each rank is gets said at the hang timeout
        (a deadlock in step 1, e.g. a parameter unused on one rank, is otherwise silent that long)."""
        if self.rank != 0:
            return
        time.sleep(max(2.0, self.poll_s * 1.5))  # let every rank publish its latest position
        positions = self._positions()
        behind = lagging(positions) if len(positions) > 1 else []
        named = f" (lagging: rank {', '.join(map(str, behind))})" if behind else ""
        report = hang_report(positions, stalled_for, self.dump_dir).splitlines()
        head = (f"ddp_kit: warning: step 1 is taking long: no progress for {stalled_for:.0f}s in "
                f"{self.progress.phase} before it finished"
                f"{named}. It may just be slow "
                f"(torch.compile, autotuning); a real deadlock stops the job at the startup bound "
                f"({self.slow_timeout_s:.0f}s, the init timeout). Where each rank is:")
        print("\n".join([head, *report[1:-1]]), file=sys.stderr, flush=True)

    def _positions(self) -> dict[int, dict]:
        """Every rank's last report, read once at hang time (rank 0 only)."""
        keys = [f"ddp_kit/progress/{r}" for r in range(self.world_size)]
        if self.store.check(keys):  # the usual case: one round trip for all of them
            return {r: json.loads(v) for r, v in enumerate(self.store.multi_get(keys))}
        return {r: json.loads(self.store.get(k)) if self.store.check([k]) else None for r, k in enumerate(keys)}


def flight_recorder_path(dump_dir: str | Path, rank: int) -> Path:
    """Where rank `rank`'s flight recorder trace goes: dump_dir/nccl_trace_rank_<R>."""
    return Path(dump_dir) / f"{FR_PREFIX}{rank}"


def dump_flight_recorder(path: Path) -> bool:
    """NCCL's flight recorder (the last collectives each communicator saw, and which one never
    finished), written by us: the hang timeout ends the job before NCCL's own dump-on-timeout would
    fire at collective_timeout_s. Read the folder with `python -m torch.distributed.flight_recorder.fr_trace DIR`.
    Nothing to write without an NCCL group."""
    try:
        import torch.distributed as tdist
        if not (tdist.is_initialized() and tdist.get_backend() == "nccl"):
            return False
        from torch._C._distributed_c10d import _dump_nccl_trace
        path.write_bytes(_dump_nccl_trace())
        return True
    except Exception as exc:  # a diagnostic must never take the stack dump and the report down with it
        print(f"ddp_kit: warning: could not write NCCL's flight recorder trace to {path}: {exc}", file=sys.stderr)
        return False


def lagging(positions: dict[int, dict | None]) -> list[int]:
    """Ranks that are furthest behind: by step, then by phase order. Ranks with no report lag most.
    Among ranks at the same place, those in their own code while the others wait in library code
    (a collective) are the ones the others wait for."""
    missing = [r for r, p in positions.items() if p is None]
    if missing:
        return missing
    alone = [r for r, p in positions.items() if p["phase"] == "main_only"]
    if alone and len(alone) < len(positions):  # rank-0-only code: the others wait for it, not it for them
        return alone
    key = {r: (p["step"], PHASES.index(p["phase"]) if p["phase"] in PHASES else len(PHASES)) for r, p in positions.items()}
    low = min(key.values())
    behind = [r for r, k in key.items() if k == low]
    if len(behind) == len(key):
        busy = [r for r in behind if positions[r].get("waiting") is False]
        return busy if 0 < len(busy) < len(behind) else []
    return behind


def hang_report(positions: dict[int, dict | None], stalled_for: float, dump_dir: Path) -> str:
    behind = lagging(positions)
    lines = [f"ddp_kit: hang: no progress for {stalled_for:.0f}s. "
             + ("The job's only rank is stuck." if len(positions) == 1
                else f"Lagging: rank {', '.join(map(str, behind))}." if behind
                else "Every rank is at the same place: a collective that never completes (network, NCCL) or the same hang on all ranks.")]
    for r, p in sorted(positions.items()):
        if p is None:
            lines.append(f"  rank {r}: no report (process dead or stuck before its watchdog started)")
        else:
            lines.append(f"  rank {r} ({p['host']}): step {p['step']}, {p['phase']}, at {p['where']}, idle {p['stalled_s']}s")
    if any(p and p["phase"] == "main_only" for p in positions.values()):
        lines.append("  rank 0 is inside run.main_only(): the other ranks went on without it. Work there that takes "
                     "longer than hang_timeout_s, or waits for them, stalls the job; run long evaluations on every rank.")
    lines.append(f"  stacks: {dump_dir}/rank<R>.txt; all ranks exit {EXIT_HANG}. "
                 f"Hint: a rank that skips or adds a collective, or blocks in its own code, stalls the others.")
    return "\n".join(lines)

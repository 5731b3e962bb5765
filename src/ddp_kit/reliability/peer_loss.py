"""A peer that vanished without a word (a fatal signal, SIGKILL, the OOM killer): after a
communication error, find the rank that caused it from its posted failure, its crash dump
(faulthandler, enabled per rank into run_dir/hang/) or its silence, and name it in one line."""
from __future__ import annotations

import faulthandler
import json
import os
import time
from pathlib import Path

from ..dist.failfast import peer_failure, stop_line
from .progress import read_mirror

COMM_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Read error", "Timed out", "timed out",
               "remote process exited", "NCCL error", "Broken pipe", "Socket Timeout")


def is_comm_error(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and any(k in str(err) for k in COMM_ERRORS)


def enable_crash_dump(dump_dir: str | Path, rank: int):
    """Have Python write every thread's stack to hang/rank<R>.crash.txt on a fatal signal (e.g. gloo's
    abort on a collective mismatch). Returns the open file; `disable_crash_dump` removes it if empty."""
    path = Path(dump_dir) / f"rank{rank}.crash.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "w")
    faulthandler.enable(file=f, all_threads=True)
    return f


def disable_crash_dump(f) -> None:
    faulthandler.disable()
    f.close()
    path = Path(f.name)
    if path.exists() and path.stat().st_size == 0:
        path.unlink()
    try:
        path.parent.rmdir()  # only if nothing else (hang stacks, NCCL traces) is in it
    except OSError:
        pass


def _crash_site(text: str) -> str | None:
    """In a faulthandler dump: the main thread's innermost frame outside installed packages
    (the user's or ddp_kit's own line that issued the fatal call)."""
    for block in text.split("\n\n"):
        frames = [line.strip() for line in block.splitlines() if line.strip().startswith("File ")]
        if not frames or "threading.py" in frames[-1]:
            continue  # a helper thread (watchdog, checkpoint writer), not the training thread
        for frame in frames:  # innermost first
            if "site-packages" in frame or "<frozen" in frame:
                continue
            try:
                path, rest = frame[6:].split('", line ', 1)
                return f"{Path(path).name}:{rest}"
            except ValueError:
                return frame
    return None


def _positions(store, world_size: int) -> dict[int, dict | None]:
    """Every rank's last heartbeat (watchdog._publish), None where there is none."""
    positions: dict[int, dict | None] = {}
    for r in range(world_size):
        try:
            key = f"ddp_kit/progress/{r}"
            positions[r] = json.loads(store.get(key)) if store is not None and store.check([key]) else None
        except Exception:
            positions[r] = None
    return positions


def _gone_here(positions: dict[int, dict | None], rank: int) -> list[int]:
    """Peers on this host (by name) whose process no longer exists and that did not leave on purpose."""
    host = os.uname().nodename
    gone = []
    for r, p in positions.items():
        if r == rank or not p or p.get("left") or p.get("host") != host or not isinstance(p.get("pid"), int):
            continue
        if not _running(p["pid"]):
            gone.append(r)
    return gone


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a killed worker is one until its launcher reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def diagnose_peer_loss(store, rank: int, world_size: int, dump_dir: str | Path, wait_s: float = 3.0) -> str | None:
    """After a communication error: find the rank that caused it, from its posted failure, its crash
    dump, or its silence. Returns the one line to print, or None when no peer looks at fault."""
    deadline = time.monotonic() + wait_s
    # A peer on this host whose process is gone cannot post a failure any more: no need to wait for one
    # (the wait is most of what a SIGKILLed worker's detection costs).
    gone = _gone_here(_positions(store, world_size), rank)
    while True:
        failed = peer_failure(store, rank)
        if failed:
            return stop_line(rank, failed)
        crashed = [r for r in range(world_size) if r != rank and (Path(dump_dir) / f"rank{r}.crash.txt").exists()
                   and (Path(dump_dir) / f"rank{r}.crash.txt").stat().st_size > 0]
        if crashed or gone or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    positions = _positions(store, world_size)
    if crashed:
        r = crashed[0]
        path = Path(dump_dir) / f"rank{r}.crash.txt"
        site = _crash_site(path.read_text(errors="replace")) or "?"
        step, phase = read_mirror(Path(dump_dir) / f"rank{r}.progress") or ((positions.get(r) or {}).get("step", "?"), "?")
        return (f"ddp_kit: error: rank {r} crashed (fatal signal) at step {step} in {phase}, at {site}; its stacks "
                f"are in {path} (hint: gloo aborts when ranks run different collectives: check that every rank "
                f"calls the same collectives in the same order)")
    now = time.time()
    silent = gone or [r for r, p in positions.items() if r != rank and p is not None and now - p.get("t", now) > 2.0]
    if silent:
        r = silent[0]
        p = positions[r]
        step, phase = read_mirror(Path(dump_dir) / f"rank{r}.progress") or (p["step"], p["phase"])
        return (f"ddp_kit: error: rank {r} stopped without a word (killed? out of host memory?) at step {step} "
                f"in {phase}, last seen {now - p['t']:.0f}s ago on {p['host']} "
                f"(hint: check that host's kernel log / scheduler for a kill)")
    return None

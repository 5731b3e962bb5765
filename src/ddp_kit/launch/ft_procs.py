"""The ft launcher's child processes (launch/ft.py, ft_lighthouse.py): a free port for each, started so that
they die with the launcher, ended with whatever their sessions left behind, and named when they exit; and
the launcher's one way to speak."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _exit_name(rc: int) -> str:
    return f"{rc} ({signal.Signals(-rc).name})" if rc < 0 and -rc in signal.valid_signals() else str(rc)


def _marked(needle: bytes) -> list[int]:
    """PIDs whose environment holds `needle` (only this user's processes can be read: ours)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                out.append(int(entry.name))
        except OSError:
            continue
    return out


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG), so that no lighthouse or torchrun outlives it; elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _end_session(proc: subprocess.Popen | None) -> None:
    """SIGKILL what is left of a session this launcher started (a killed torchrun's orphaned workers)."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(timeout=10)


def say(msg: str) -> None:
    print(f"ddp_kit: launch ft: {msg}", file=sys.stderr, flush=True)

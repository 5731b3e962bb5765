"""torchft's lighthouse for one `python -m ddp_kit.launch ft` job (launch/ft.py): where its binary is, the
timeouts it is started with, its command, and its start, watch and restart on the same port."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .ft_procs import _die_with_parent, _end_session, _exit_name, say


def lighthouse_binary() -> str:
    found = shutil.which("torchft_lighthouse") or shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    if not found:
        raise UserError("torchft_lighthouse is not installed (it comes with torchft)", "pip install 'ddp_kit[ft]'")
    return found


def quorum_timeout_s(environ: Mapping[str, str] = os.environ) -> float:
    """The groups' quorum timeout (DDP_KIT_FT_QUORUM_TIMEOUT_S, 60 s: parallel/ft.py's Timeouts.quorum_s)."""
    raw = environ.get("DDP_KIT_FT_QUORUM_TIMEOUT_S", "").strip()
    try:
        return float(raw) if raw else 60.0
    except ValueError:
        raise UserError(f"DDP_KIT_FT_QUORUM_TIMEOUT_S={raw!r} is not a number of seconds",
                        "set it to e.g. 120, or unset it (60)") from None


def join_timeout(join_timeout_ms: int | None, environ: Mapping[str, str] = os.environ) -> int:
    """The lighthouse's join timeout: how long a quorum that a majority of the groups asked for waits for
    a group that is alive (heartbeats) but has not asked yet. It matters with 3 or more groups (with 2,
    no quorum forms without both while both live), when one group is late, by a checkpoint write slower
    than the others', an evaluation, a long step: a group left out then takes the whole state live at the
    next quorum, or, near the end, misses the job's end. So by default it is as long as it can be: half
    the groups' quorum timeout (30 of 60 s), so that the groups waiting for a late one do not time out
    first. (ddp_kit's own checkpoints are followed by a stop check across the groups, which waits for
    the slowest writer up to DDP_KIT_FT_TIMEOUT_S.) Groups later than that: raise
    DDP_KIT_FT_QUORUM_TIMEOUT_S (the join timeout follows)."""
    quorum_ms = quorum_timeout_s(environ) * 1000
    if join_timeout_ms is None:
        return int(quorum_ms / 2)
    if join_timeout_ms >= quorum_ms:
        raise UserError(f"--join_timeout_ms {join_timeout_ms} is not below the groups' quorum timeout ({quorum_ms:.0f} ms, "
                        f"DDP_KIT_FT_QUORUM_TIMEOUT_S): groups waiting for a late one would time out first",
                        f"pass --join_timeout_ms below {quorum_ms:.0f}, or raise DDP_KIT_FT_QUORUM_TIMEOUT_S")
    return join_timeout_ms


def lighthouse_command(port: int, heartbeat_timeout_ms: int, join_timeout_ms: int) -> list[str]:
    """torchft's lighthouse for one job. min_replicas 1: a quorum forms with whatever groups are alive
    (a fresh start waits for all of them in ddp_kit itself, parallel/ft_steps.py, FtHooks.restore). The
    heartbeat timeout is how long the survivors pause when a group dies without a word; the join
    timeout how long a quorum waits for a group that heartbeats but has not asked yet (join_timeout)."""
    return [lighthouse_binary(), "--min_replicas", "1", "--bind", f"[::]:{port}",
            "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--join_timeout_ms", str(join_timeout_ms),
            "--quorum_tick_ms", "20"]


def wait_listening(port: int, proc: subprocess.Popen, log: Path | None = None, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            said = log.read_text(errors="replace").strip().splitlines()[-1:] if log is not None and log.exists() else []
            raise UserError(f"torchft's lighthouse exited with {proc.returncode} at startup (port {port})"
                            + (f": {said[0][:200]}" if said else ""),
                            "pass another --lighthouse_port, or check that torchft is installed whole")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise UserError(f"torchft's lighthouse did not listen on port {port} within {timeout_s:.0f}s",
                    "check that nothing else holds the port, or pass another --lighthouse_port")


@dataclass
class Lighthouse:
    """torchft's lighthouse for this job, watched by the launcher (supervise): when it dies, it is started
    again on the same port, and the groups' manager servers reconnect to it (their quorum requests retry,
    parallel/ft.py) and go on; at most `max_restarts` times, then the groups are stopped."""

    command: list[str]
    env: dict[str, str]
    port: int
    address: str
    log: Path  # its stderr (a pipe nobody reads would fill and stall it): its tail is shown when it fails to start
    restarts: int = 0
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command, env=self.env, start_new_session=True, preexec_fn=_die_with_parent,
                                         stdout=subprocess.DEVNULL, stderr=log)
        wait_listening(self.port, self.proc, self.log)

    def exited(self) -> int | None:
        """Its exit code once it has exited; None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def end(self) -> None:
        _end_session(self.proc)


def revive(house: Lighthouse, rc: int, max_restarts: int) -> bool:
    """The lighthouse exited: start it again (True), or say why not (False: the groups are to stop)."""
    lost = f"torchft's lighthouse at {house.address} exited ({_exit_name(rc)})"
    stop = ("stopping the replica groups (each checkpoints at its next agreed step and exits 75); rerun the same "
            "command to resume")
    if house.restarts >= max_restarts:
        say(f"{lost} after {house.restarts} restart(s) (--max_restarts {max_restarts}): {stop}")
        return False
    house.restarts += 1
    try:
        house.start()
    except UserError as err:
        say(f"{lost} and could not be started again: {err.message}; {stop}")
        return False
    say(f"{lost}: restarted it on the same port ({house.restarts} of {max_restarts}); the replica groups reconnect "
        f"and go on")
    return True

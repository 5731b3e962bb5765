"""Fail-fast across ranks: a rank that fails says so in the rendezvous store, and the others stop.

The first failure posted wins (compare-and-set), so the job prints its cause once. A thread per
rank polls the key from the moment the store exists (before the process group is formed, so a
rank that fails while the others wait in the rendezvous is seen) until teardown; it runs whether
or not the hang watchdog does. The store lives outside the process group (in torchrun's agent, or
a C++ thread of rank 0), so it still answers while a collective hangs.

A rank that fails before it has a store (its config file is missing on its node) connects to the
store as a client just to post the failure (`announce`), under the keys of its rendezvous round,
which it learns from rank 0 as every rank does (rounds.py).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as tdist

from ..env import poll_period
from ..env.facts import host_name
from ..errors import UserError
from ..exit_codes import EXIT_PEER_FAILED
from .rounds import round_prefix

FAILED_KEY = "ddp_kit/failed"
# How long the process hosting the store (rank 0 outside torchrun) stays after a failure is posted:
# once it exits the store is gone, and ranks that had not polled yet would see only a broken socket.
LINGER_S = 1.5
# A failure every rank reaches at once (a UserError marked verdict: a sync check's divergence, a
# startup disagreement) is printed by the rank that posted it. The others raise the same error a
# moment later and stay silent; their fail-fast thread gives them this long to get there before it
# says "stopping" itself, which would print the cause a second time.
ECHO_GRACE_S = 10.0


def post(store, rank: int, step: int, phase: str, err: BaseException) -> dict | None:
    """Post this rank's failure unless another is already posted; returns the failure that stands
    (this one, or the earlier one). Never raises: a broken store must not hide the error."""
    if store is None:
        return None
    mine = json.dumps({"rank": rank, "host": host_name(), "step": step, "phase": phase,
                       "error": _describe(err), "verdict": isinstance(err, UserError) and err.verdict})
    try:
        return json.loads(store.compare_set(FAILED_KEY, "", mine) or mine)
    except Exception:
        return None


def _describe(err: BaseException) -> str:
    text = err.message if hasattr(err, "message") else str(err)
    return f"{type(err).__name__}: {text.splitlines()[0][:300] if text else ''}"


def same_error(failed: dict, err: BaseException) -> bool:
    return failed.get("error") == _describe(err)


def posted_failure(store) -> dict | None:
    """The failure that stands for the job (any rank's, this one's included), if one was posted."""
    try:
        if store is not None and store.check([FAILED_KEY]):
            failed = json.loads(store.get(FAILED_KEY) or "null")
            return failed if isinstance(failed, dict) else None
    except Exception:
        pass
    return None


def peer_failure(store, rank: int) -> dict | None:
    """The failure another rank posted, if any."""
    try:
        if store is not None and store.check([FAILED_KEY]):
            failed = json.loads(store.get(FAILED_KEY) or "null")
            return failed if failed and failed["rank"] != rank else None
    except Exception:
        pass
    return None


def reporter(failed: dict) -> int:
    """The one surviving rank that says why the job stops: rank 0, or rank 1 when rank 0 failed."""
    return 1 if failed["rank"] == 0 else 0


def stop_line(rank: int, failed: dict) -> str:
    where = f" on {failed['host']}" if failed.get("host") else ""
    return (f"ddp_kit: [rank {rank}] stopping: rank {failed['rank']}{where} failed at step {failed['step']} "
            f"in {failed['phase']} ({failed['error']})")


_said = threading.Event()  # the stop line is printed at most once per process (two threads may see the failure)


def say_stop(rank: int, failed: dict) -> None:
    if rank == reporter(failed) and not _said.is_set():
        _said.set()
        print(stop_line(rank, failed), file=sys.stderr, flush=True)


class FailFast:
    """One daemon thread per rank: exits this process (code 1) once another rank posts a failure."""

    def __init__(self, connect, rank: int, world_size: int, poll_s: float = 0.5, linger_s: float = 0.0):
        """`connect()` returns this thread's own store connection (made in the thread: it may wait for
        rank 0 to open the store, and the main thread must not)."""
        # One store operation per poll (a check; a get only once a failure is posted).
        self.connect, self.rank, self.world_size = connect, rank, world_size
        self.poll_s = poll_period(world_size, poll_s, 1)
        self.linger_s = linger_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ddp_kit-failfast", daemon=True)
        # Called with the posted failure before this process exits as its follower; may return another
        # exit code (the run ledger's end line, the repeat rule: boundary/core.py).
        self.on_stop: Callable[[dict], int | None] | None = None

    def start(self) -> FailFast:
        if self.world_size > 1:
            self._thread.start()
        return self

    def quiet(self) -> None:
        """This process is handling a failure of its own: its exit code and message are already
        decided, so the thread must not end it as a follower of some other rank's failure."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        try:
            store = self.connect()
        except Exception:
            return  # no store to watch: the rendezvous itself reports why
        while not self._stop.wait(self.poll_s):
            try:
                failed = peer_failure(store, self.rank)
            except Exception:
                return  # the store went away: the job is ending anyway
            if failed and not self._stop.is_set():
                if failed.get("verdict") and self._stop.wait(ECHO_GRACE_S):
                    return  # this rank reached the same verdict and handles it itself
                say_stop(self.rank, failed)
                code = EXIT_PEER_FAILED
                if self.on_stop is not None:
                    try:
                        code = self.on_stop(failed) or code
                    except Exception:
                        pass  # the stop line is out; the exit must not wait on anything else
                time.sleep(self.linger_s)
                os._exit(code)


def announce(env, err: BaseException, timeout_s: float = 30.0) -> None:
    """Post a failure that happened before this rank joined (no store yet), so that the others
    stop within seconds instead of waiting out the rendezvous timeout. Best effort."""
    if env.world_size < 2 or not env.master_addr or not env.master_port:
        return
    try:
        socket.getaddrinfo(env.master_addr, env.master_port)
    except OSError:
        return  # no store can be reached there (the error may be just that): no 30 s of connect retries
    try:
        # A client only: rank 0 (or torchrun's agent) hosts the store; if nobody does, give up quietly.
        store = tdist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                               timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        prefix = round_prefix(store, env.rank, env.world_size, timeout_s)
        post(tdist.PrefixStore(prefix, store), env.rank, 0, "startup", err)
    except Exception:
        pass

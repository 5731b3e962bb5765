"""A bounded, quiet wait for the rendezvous host before anything connects to it.

On Kubernetes the master pod's name (its Service or pod DNS record) appears seconds after the
worker pods start, and the master's store listens only once its process is up. A single failed
lookup or connection is therefore no error: the operators' own init containers loop on nslookup
for this reason. Without a wait of our own, the first failed lookup is a hard error (a crash loop
under a restart policy), and torch's TCPStore client prints a warning per failed connection
attempt. So each rank waits here, with a backoff and no output, until the host resolves and (for a
rank that connects to a store another process hosts) its port accepts, or until the startup bound;
then one line names the host, what was tried and for how long.
"""
from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable

from ..env import DistEnv
from ..env.facts import host_name
from ..errors import UserError

# The backoff between tries: short at first (the usual case is a name that appears within a second
# or two), capped so that a long wait still notices the host within a couple of seconds.
FIRST_S, MAX_S = 0.1, 2.0
# One line (local rank 0) once the wait has lasted this long, so that a mistyped name is not a silent
# wait of init_timeout_s; nothing per try.
SAY_AFTER_S = 5.0


def wait_for_master(env: DistEnv, timeout_s: float, connects: bool, *, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep, say: Callable[[str], None] | None = None,
                    resolve: Callable[..., list] = socket.getaddrinfo) -> float:
    """Wait until `env.master_addr` resolves and, when `connects` (this rank is a client of a store
    hosted elsewhere), until `env.master_port` accepts a connection. Returns the seconds waited.
    Raises UserError after `timeout_s` (local rank 0 prints it: the lookup is the node's)."""
    host, port = env.master_addr, env.master_port
    if env.world_size == 1 or not host:
        return 0.0
    start = clock()
    delay, tries, last, said = FIRST_S, 0, "", False
    what = f"{host}:{port}" if connects else host
    while True:
        tries += 1
        last = _try(host, port if connects else None, resolve)
        if not last:
            return clock() - start
        waited = clock() - start
        if waited >= SAY_AFTER_S and not said and env.local_rank == 0:
            said = True
            (say or _say)(f"ddp_kit: waiting for master host {what}: {last}; retrying quietly until init_timeout_s "
                          f"{timeout_s:g}s")
        if waited + delay > timeout_s:
            break
        sleep(delay)
        delay = min(delay * 2, MAX_S)
    raise UserError(f"master host {what} ({env.launcher}) was not reachable from {host_name()} within "
                    f"init_timeout_s {timeout_s:g}s ({tries} tries; last: {last})",
                    "check that MASTER_ADDR names the first node/pod (its Service or pod DNS record exists) and that "
                    "rank 0 started, or raise init_timeout_s",
                    rank=env.rank if env.local_rank == 0 else None)


def _try(host: str, port: int | None, resolve: Callable[..., list]) -> str:
    """'' when `host` resolves (and `port` accepts, when given); else what failed, in a few words."""
    try:
        infos = resolve(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"does not resolve ({exc.strerror or exc})"
    if port is None:
        return ""
    reason = "no address"
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(2.0)
                sock.connect(addr)
                return ""
        except OSError as exc:
            reason = f"port {port} refuses connections ({exc.strerror or exc})"
    return reason


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

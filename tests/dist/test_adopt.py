"""An existing process group (Ray Train's, a framework's, the user's own init_process_group) is adopted
by ddp_kit.init(), not refused: its rank and world size stand, every reliability feature works on it,
and ddp_kit leaves it to its owner at exit. Also the bounded wait for the rendezvous host (reach.py)."""
from __future__ import annotations

import json
import socket

import pytest

from conftest import HELPERS, ok, torchrun
from ddp_kit.dist.reach import wait_for_master
from ddp_kit.env import DistEnv
from ddp_kit.errors import UserError


@pytest.mark.integration
def test_a_group_the_script_made_is_adopted_and_a_killed_run_resumes_bit_identical(tmp_path):
    """The script calls init_process_group itself, then ddp_kit.init(): checkpoints, the watchdog and
    the peer-loss diagnosis work on that group; after a SIGKILL of rank 1, running the command again
    (a new group on a new store, as Ray's restart of its worker group is) resumes bit-identically."""
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    ok(torchrun([str(HELPERS / "adopted.py"), str(whole)]))
    res = torchrun([str(HELPERS / "adopted.py"), str(broken), "7"])
    assert res.returncode != 0 and "rank 1 stopped without a word" in res.stderr, res.stderr[-3000:]
    again = ok(torchrun([str(HELPERS / "adopted.py"), str(broken)]))
    assert "resumed from" in again.stdout + again.stderr and "step_5" in again.stdout + again.stderr
    a, b = (json.loads((d / "final.json").read_text()) for d in (whole, broken))
    assert a["group_alive"] and b["group_alive"], (a, b)  # ddp_kit did not destroy a group it did not make
    assert a["sha"] == b["sha"], (a, b)


def _env(host: str, port: int) -> DistEnv:
    return DistEnv(rank=1, world_size=2, master_addr=host, master_port=port, launcher="env")


def no_dns(host, port, **kw):
    """A name that never resolves, without asking a DNS server (tests reach loopback only)."""
    if host == "127.0.0.1":
        return socket.getaddrinfo(host, port, **kw)
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


class FakeClock:
    """Time that moves only when the code under test sleeps: the wait's bound without waiting."""

    def __init__(self):
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_a_name_that_never_resolves_is_one_line_at_the_bound_after_quiet_retries():
    clock, said = FakeClock(), []
    with pytest.raises(UserError) as err:
        wait_for_master(_env("no-such-host.invalid", 29500), 30.0, connects=False, clock=clock, sleep=clock.sleep,
                        say=said.append, resolve=no_dns)
    line = err.value.line()
    assert "no-such-host.invalid" in line and "does not resolve" in line and "30s" in line, line
    assert 25.0 <= clock.now <= 30.0 and len(clock.slept) >= 10 and max(clock.slept) <= 2.0, clock.slept
    assert len(said) <= 1  # one "waiting" line at most, never one per try (rank 1 is not local rank 0 here)


def test_a_port_that_refuses_is_retried_and_one_that_listens_ends_the_wait():
    with socket.socket() as probe:  # a port nobody listens on: bound, never listened
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
        clock = FakeClock()
        with pytest.raises(UserError) as err:
            wait_for_master(_env("127.0.0.1", closed), 5.0, connects=True, clock=clock, sleep=clock.sleep,
                            say=lambda _: None)
        assert f"127.0.0.1:{closed}" in err.value.line() and "refuses" in err.value.line()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        clock = FakeClock()
        assert wait_for_master(_env("127.0.0.1", server.getsockname()[1]), 5.0, connects=True, clock=clock,
                               sleep=clock.sleep) == 0.0 and not clock.slept


def test_local_rank_0_says_once_that_it_waits():
    clock, said = FakeClock(), []
    env = DistEnv(rank=0, world_size=2, master_addr="no-such-host.invalid", master_port=1, launcher="env")
    with pytest.raises(UserError):
        wait_for_master(env, 20.0, connects=False, clock=clock, sleep=clock.sleep, say=said.append, resolve=no_dns)
    assert len(said) == 1 and "waiting for master host no-such-host.invalid" in said[0], said



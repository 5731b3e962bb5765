"""What detection may read, as one frozen value: the environment, this host's name, and the files a
scheduler names in it (IBM LSF's rank file $LSB_DJOB_RANKFILE, a host file).

A `Facts` is the environment itself as a Mapping, so a launcher's `detect(environ)` reads it as it
would read `os.environ`, and callers that pass a plain dict keep working; a launcher that needs more
asks `facts_of(environ)` for the host name or a file. Both are read only when asked, and nothing is
written: tests pass a Facts with fakes (`Facts(env, hostname=lambda: "n1", read_file=files.__getitem__)`).
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass


def read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


@dataclass(frozen=True, eq=False)
class Facts(Mapping[str, str]):
    """The environment (as a Mapping), with `hostname()` and `read_file(path)` read on demand."""

    environ: Mapping[str, str]
    hostname: Callable[[], str] = socket.gethostname
    read_file: Callable[[str], str] = read_text

    def __getitem__(self, key: str) -> str:
        return self.environ[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.environ)

    def __len__(self) -> int:
        return len(self.environ)


def host_name(environ: Mapping[str, str] | None = None) -> str:
    """This host as its scheduler names it: SLURM's NodeName (SLURMD_NODENAME, what ExcNodeList and
    --exclude take) where SLURM runs the job, else the host name. NodeName may differ from the host name
    (node1 beside node1.cluster, a cloud instance's name, two nodes of one machine): every record that
    names a host (the ledger's start and end lines, a failure's verdict, the health gate) uses this one
    name, so that the ledger's memory matches the hosts the gate sees."""
    env = os.environ if environ is None else environ
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def facts_of(environ: Mapping[str, str] | None = None) -> Facts:
    """`environ` as Facts: a Facts as it is, a plain mapping with this host's name and files, None
    as os.environ with them."""
    if isinstance(environ, Facts):
        return environ
    return Facts(os.environ if environ is None else environ)

"""What the health gate measured: one Result per check per host (or per GPU, per link), and the report
that gathers them. Torch-free: the doctor's JSON, the run ledger and `status` read the same fields."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Result:
    check: str  # storage, shm, clock, network, gpu_health, gpu_memory_held, gpu_matmul, gpu_slow, history
    host: str  # the host it is about (a link: the sending host; `detail` names both)
    ok: bool
    measured: str = ""  # what was measured, in words with units
    expected: str = ""  # what a healthy host shows
    detail: str = ""  # which part: a path, "GPU 3", "nodec -> nodea"
    value: float | None = None  # a number compared across peers (matmul seconds, link MB/s, clock offset)
    seconds: float = 0.0  # what the check cost
    skipped: bool = False  # not applicable here (no GPU, one node): ok, and `measured` says why
    shared: bool = False  # a failure of storage the hosts share (a network file system): not the host's own

    def line(self) -> str:
        """The one line a failure prints: host, check, what was measured, what was expected."""
        part = f" ({self.detail})" if self.detail else ""
        return (f"health check failed on {self.host}: {self.check}{part}: {self.measured}"
                + (f" (expected {self.expected})" if self.expected else ""))

    def as_dict(self) -> dict[str, Any]:
        """The fields that say something: `ok` always, a flag only when set, every number (a clock offset of
        0.0 is the median host's own: `v in (None, "", False)` would drop it, 0.0 == False)."""
        return {k: v for k, v in asdict(self).items() if k == "ok" or not (v is None or v == "" or v is False)}


@dataclass(frozen=True)
class Report:
    """Every host's results, the same on every rank once gathered."""
    mode: str
    results: tuple[Result, ...] = ()
    seconds: float = 0.0  # the gate's wall time on this rank
    hosts: tuple[str, ...] = ()  # every rank's host, in rank order

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if not r.ok]

    @property
    def bad_hosts(self) -> list[str]:
        """The hosts a failure names, in job order; a slow link names its sender (the receivers' links
        from elsewhere are fine: that is how the gate tells which end is slow)."""
        named = {r.host for r in self.failed}
        return [h for h in dict.fromkeys(self.hosts) if h in named] + sorted(named - set(self.hosts))

    def per_host(self) -> dict[str, dict[str, Any]]:
        """{host: {"ok": bool, "failed": [lines]}}: what the run ledger keeps of a gate."""
        out: dict[str, dict[str, Any]] = {}
        for h in dict.fromkeys([*self.hosts, *(r.host for r in self.results)]):
            mine = [r for r in self.results if r.host == h]
            out[h] = {"ok": all(r.ok for r in mine), "failed": [r.line() for r in mine if not r.ok]}
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "healthy": not self.failed, "seconds": round(self.seconds, 3),
                "hosts": self.per_host(), "results": [r.as_dict() for r in self.results]}

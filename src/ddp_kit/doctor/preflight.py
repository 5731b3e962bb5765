"""`python -m ddp_kit.doctor --preflight`: the health gate alone, on one node or across an allocation
(under torchrun or srun), for a SLURM prolog or a Kubernetes init container. It probes the folders it is
given (--run_dir, --ckpt_dir) and no other (the table says run_dir was not checked). Exit 0: every host
healthy; 2: a check failed (each failure one line naming the host, the check, what was measured and expected)."""
from __future__ import annotations

import json
import sys
from dataclasses import replace

from ..exit_codes import EXIT_USER_ERROR
from ..preflight.results import Report, Result


def preflight(mode: str, run_dir: str | None, ckpt_dir: str | None, shm_mb: float | None
              ) -> tuple[Report | None, bool, int]:
    """(the report, the same on every rank; whether this rank prints it (rank 0); the exit code)."""
    from ..checkpoint.storage_registry import scheme_of
    from ..dist import distributed
    from ..errors import UserError
    from ..preflight.gate import MODES, Plan, run

    if mode not in MODES[1:]:
        print(f"ddp_kit: error: unknown preflight mode {mode!r} (hint: --mode quick or --mode thorough)", file=sys.stderr)
        return None, False, EXIT_USER_ERROR
    folders = tuple((name, path, 0) for name, path in (("run_dir", run_dir), ("checkpoints", ckpt_dir))
                    if path is not None and not scheme_of(path))
    url = ckpt_dir if ckpt_dir is not None and scheme_of(ckpt_dir) else None
    plan = Plan(mode, folders, url, None if shm_mb is None else int(shm_mb * 2**20))
    try:
        with distributed(timeout_s=120, fail_fast=True) as ctx:
            report = run(ctx, plan)
            main = ctx.is_main
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return None, False, EXIT_USER_ERROR
    if run_dir is None:  # an init container's working folder may be read-only: only a folder named is probed
        report = replace(report, results=tuple(Result("run_dir", h, True, "not checked: no --run_dir given",
                                                      skipped=True) for h in dict.fromkeys(report.hosts))
                         + report.results)
    return report, main, EXIT_USER_ERROR if report.failed else 0


def show(report: Report, json_out: bool) -> None:
    if json_out:
        print(json.dumps(report.as_dict(), indent=1))
        return
    hosts = report.per_host()
    print(f"ddp_kit preflight ({report.mode}): {len(hosts)} host(s), {report.seconds:.2f}s")
    for r in report.results:
        mark = "--  " if r.skipped else ("ok  " if r.ok else "FAIL")
        part = f" ({r.detail})" if r.detail else ""
        print(f"  [{mark}] {r.host:<16} {r.check + part:<34} {r.measured}" +
              (f" (expected {r.expected})" if not r.ok and r.expected else ""))
    bad = [h for h, v in hosts.items() if not v["ok"]]
    print("  healthy" if not bad else f"  unhealthy: {', '.join(bad)}")

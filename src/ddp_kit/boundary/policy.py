"""What the step boundary does, and how often: the keywords of `ddp_kit.init()` beyond its own.

The boundary's own settings are Policy's fields; every service's settings (services/: the run ledger's,
the trackers', the memory tier's, ...) are declared in the service's own file and held in `settings`,
read as attributes too (policy.trackers). `Policy(**keywords)` takes both kinds by name."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import service_registry as services
from ..checkpoint.backend import scheme_of
from ..errors import UserError
from ..options import auto_or, every_or_auto


@dataclass(frozen=True, init=False)
class Policy:
    """What the step boundary does, and how often. Every field, and every service setting, is a keyword of `ddp_kit.init()`."""

    run_dir: str | None = None  # checkpoints, metrics.jsonl, hang reports; None: no checkpoints
    # where checkpoints go instead of run_dir/checkpoints: a folder every rank mounts, or a URL
    # (s3://bucket/prefix, gs://, az://, file:///path); run_dir then stays local to each node
    ckpt_dir: str | None = None
    resume: str = "auto"  # auto: the newest valid checkpoint in run_dir; never; or a step_<N> folder
    ckpt_every: int | str = 0  # optimizer steps between checkpoints (0: by time only; "auto": services/cadence.py)
    ckpt_every_s: float = 1800.0  # seconds between checkpoints (0: by steps only); checked every preempt_check_every
    keep_last: int = 3  # checkpoints kept (0: all)
    async_ckpt: bool = False  # write checkpoints in a background thread
    ckpt_upload_timeout_s: float = 1800.0  # ckpt_dir a URL: stop when no checkpoint has committed for this long (0: never)
    hang_timeout_s: float = 180.0  # no progress on a rank for this long: report the lagging rank, exit 3 (0: off)
    peer_timeout_s: float = 30.0  # a rank's heartbeat silent this long: it is named as gone, every rank exits (0: off)
    collective_timeout_s: float = 300.0  # every collective's timeout after step 1
    preempt_check_every: int = 10  # steps between the ranks' agreement on a stop signal
    sync_check_every: int = 100  # steps between cross-rank checksum comparisons (0: off)
    # steps between replay checks: run.forward_backward computes the step again and compares (0: off; docs/sdc.md)
    sdc_check_every: int = 0
    # on divergence: rollback (3+ ranks: the majority names the corrupt rank, every rank rolls back to the last
    # checkpoint the ranks agreed on; 2 ranks: as error), error, or broadcast rank 0's weights (docs/sdc.md)
    sync_fix: str = "rollback"
    log_every: int = 50  # steps between metrics.jsonl records (0: off)
    rank_metrics: bool = True  # each record holds every rank's time split; stragglers are named
    rank_records_max: int = 64  # above this world size a record holds median/max/argmax per field instead
    straggler_margin: float = 0.2  # a rank this much slower than the median, twice in a row, is named
    ckpt_write_delay_s: float = 0.0  # test hook: slow every checkpoint write down
    settings: Mapping[str, Any] = field(default_factory=dict, hash=False)  # every service's settings (services.settings)

    def __init__(self, **given: Any) -> None:
        own = {f.name: f for f in dataclasses.fields(self) if f.name != "settings"}
        for name, f in own.items():
            object.__setattr__(self, name, given.pop(name, f.default))
        given = {**given.pop("settings", {}), **given}  # dataclasses.replace passes the settings back whole
        object.__setattr__(self, "settings", services.settings(given, self.run_dir))
        self._check()

    def __getattr__(self, name: str) -> Any:
        settings = self.__dict__.get("settings", {})
        if name in settings:
            return settings[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def keywords(cls) -> tuple[str, ...]:
        """Every keyword Policy takes: the boundary's own, then every service's settings."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "settings") + tuple(
            o.name for o in services.options())

    def _check(self) -> None:
        object.__setattr__(self, "ckpt_every", auto_or(self.ckpt_every))  # "Auto" is "auto" (options.auto_or)
        every_or_auto("ckpt_every")(self.ckpt_every)
        if not isinstance(self.sdc_check_every, int) or self.sdc_check_every < 0:
            raise UserError(f"sdc_check_every must be a whole number >= 0; got {self.sdc_check_every!r}",
                            "pass sdc_check_every=0 (off) or the steps between replay checks, e.g. 1000")
        if self.sync_fix not in ("rollback", "error", "broadcast"):
            raise UserError(f"sync_fix {self.sync_fix!r} is not one of rollback, error, broadcast",
                            "pass sync_fix=\"rollback\" (the default), \"error\" or \"broadcast\"")
        if self.run_dir is not None and scheme_of(str(self.run_dir)):
            raise UserError(f"run_dir {str(self.run_dir)!r} is a URL; run_dir is a local folder (metrics.jsonl, "
                            f"summary.json, hang reports), and checkpoints go to a URL through ckpt_dir",
                            f"pass ckpt_dir={str(self.run_dir)!r} (--ckpt_dir) and a local folder as run_dir")
        if self.ckpt_dir is not None:
            object.__setattr__(self, "ckpt_dir", str(self.ckpt_dir))  # a Path is welcome too
            if self.run_dir is None:
                raise UserError(f"ckpt_dir {self.ckpt_dir!r} was given without a run_dir",
                                'pass a local run_dir too (metrics.jsonl, summary.json): ddp_kit.init(run_dir="runs/my_run", '
                                'ckpt_dir=...)')
